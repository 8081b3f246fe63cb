// Declarations of the per-variant launchers (defined in cuda/instantiations/sm80_*.cu). Light on
// purpose: api.cu includes this, not the kernels, so the dispatch compiles in seconds.
#pragma once

#include <cuda_runtime_api.h>
#include <cutlass/numeric_types.h>

#include "jfa/params.h"

namespace jfa::sm80 {

template <typename Element, int kHeadDim>
cudaError_t run_fwd(const AttentionParams& p, cudaStream_t stream);
template <typename Element, int kHeadDim>
cudaError_t run_bwd(const AttentionParams& p, cudaStream_t stream);

}  // namespace jfa::sm80
