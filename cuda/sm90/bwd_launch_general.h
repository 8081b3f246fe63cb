// The Hopper backward's general path (bwd_general.h): one kernel per (dtype, head dim) with every
// mask and score modifier, and one with dropout too, in translation units of their own
// (cuda/generate_instantiations.py) so that they compile in parallel with run_bwd's kernels. Not
// included where run_bwd is instantiated: there run.h's declarations make them external references.
#pragma once

#include "bwd_launch.h"

namespace jfa::sm90 {

template <typename Element, int kHeadDim>
cudaError_t run_bwd_general(const AttentionParams& p, cudaStream_t stream) {
  return detail::launch_bwd<typename BwdConfig<Element, kHeadDim>::Traits, false, kPolicyAll>(p, stream);
}

template <typename Element, int kHeadDim>
cudaError_t run_bwd_dropout(const AttentionParams& p, cudaStream_t stream) {
  return detail::launch_bwd<typename BwdConfig<Element, kHeadDim>::Traits, false, kPolicyAll | kPolicyDropout>(p,
                                                                                                                 stream);
}

}  // namespace jfa::sm90
