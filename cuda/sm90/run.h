// Declarations of the per-variant launchers (defined in cuda/instantiations/sm90_*.cu). Light
// on purpose: api.cu includes this, not the kernel, so the dispatch compiles in seconds.
#pragma once

#include <cuda_runtime_api.h>
#include <cutlass/numeric_types.h>

#include "jfa/params.h"

namespace jfa::sm90 {

template <typename Element, int kHeadDim>
cudaError_t run_fwd(const AttentionParams& p, cudaStream_t stream);

// The dropout kernel (every mask and modifier too), instantiated in files of its own so that it
// compiles beside the others; run_fwd calls it for calls with dropout.
template <typename Element, int kHeadDim>
cudaError_t run_fwd_dropout(const AttentionParams& p, cudaStream_t stream);

// The backward (bwd_launch.h); for calls with masks, score modifiers or dropout it calls the
// general path's launcher of the smallest policy set that covers the call (bwd_launch_general.h,
// one set per instantiation file: mask_policies.h's kBwd*Set).
template <typename Element, int kHeadDim>
cudaError_t run_bwd(const AttentionParams& p, cudaStream_t stream);
template <typename Element, int kHeadDim, int kPolicies>
cudaError_t run_bwd_policies(const AttentionParams& p, cudaStream_t stream);

// Streaming multiprocessors of the current device (queried once per device).
int num_sms();

}  // namespace jfa::sm90
