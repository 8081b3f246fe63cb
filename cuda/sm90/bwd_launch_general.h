// The Hopper backward's general path (bwd_general.h): a kernel per (dtype, head dim, policy set of
// mask_policies.h's kBwd*Set), each in a translation unit of its own (cuda/generate_instantiations.py) so
// that they compile in parallel with run_bwd's kernels. Not included where run_bwd is
// instantiated: there run.h's declaration makes them external references.
#pragma once

#include "bwd_launch.h"

namespace jfa::sm90 {

template <typename Element, int kHeadDim, int kPolicies>
cudaError_t run_bwd_policies(const AttentionParams& p, cudaStream_t stream) {
  return detail::launch_bwd<typename BwdConfig<Element, kHeadDim>::Traits, false, kPolicies>(p, stream);
}

}  // namespace jfa::sm90
