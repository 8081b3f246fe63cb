// The Hopper forward with dropout (dropout.h): one kernel per (dtype, head dim), with every mask
// and score modifier, in translation units of their own (cuda/generate_instantiations.py) so that
// it compiles in parallel with run_fwd's kernels. Not included where run_fwd is instantiated:
// there run.h's declaration makes it an external reference.
#pragma once

#include "fwd_launch.h"

namespace jfa::sm90 {

template <typename Element, int kHeadDim>
cudaError_t run_fwd_dropout(const AttentionParams& p, cudaStream_t stream) {
  return detail::launch_fwd<typename DropoutFwdConfig<Element, kHeadDim>::Traits, false,
                            kPolicyAll | kPolicyDropout>(p, stream);
}

}  // namespace jfa::sm90
