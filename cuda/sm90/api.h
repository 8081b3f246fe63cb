// Host entry points of the Hopper (sm90a) forward kernel: TMA + wgmma + warp specialization.
//
// Host-only: includable from a .cc compiled by a plain C++ compiler. Only the forward pass lives
// here; the backward pass stays on the portable kernels (sm80/api.h), which read the LSE this
// kernel writes (float32, natural log, [B,T,N] through lse_strides) exactly as their own forward
// writes it. forward() only enqueues work on `stream` (no allocation, no synchronization:
// CUDA-graph safe); call it only on a device of compute capability 9.0.
#pragma once

#include <cuda_runtime_api.h>

#include "jfa/params.h"

namespace jfa::sm90 {

// Whether this build contains the forward kernel for (dtype, head_dim).
bool is_built(DType dtype, int head_dim);

// Whether forward() takes this call: a built variant with H == Hv, T, S >= 1, and what TMA needs
// (16-byte aligned base pointers and row/head/batch strides, sizes below 2^31). Calls it rejects
// go to the portable kernel.
bool can_implement(const AttentionParams& p);

// Writes p.o and p.lse (float32, natural log). cudaErrorNotSupported where !can_implement(p).
cudaError_t forward(const AttentionParams& p, cudaStream_t stream);

}  // namespace jfa::sm90
