// Host entry points of the portable (sm80+) attention kernels: mma.sync FlashAttention-2.
//
// Host-only: includable from a .cc compiled by a plain C++ compiler. The caller (FFI dispatch)
// checks the preconditions: dtype fp16/bf16, H == Hv == a built head dim, N % K == 0, last dims
// contiguous, rows 16-byte aligned. T and S may be any size >= 1. Both functions only enqueue
// work on `stream` (no allocation, no synchronization: CUDA-graph safe) and return the launch error.
#pragma once

#include <cuda_runtime_api.h>

#include "jfa/params.h"

namespace jfa::sm80 {

// Whether this build contains the kernels for (dtype, head_dim).
bool is_built(DType dtype, int head_dim);

// A human-readable list of the built variants, e.g. "fwd+bwd: bf16,fp16 x hdim 64,128".
const char* built_variants();

// Smallest built head dim >= head_dim (for any built dtype), or -1 if there is none.
int round_up_head_dim(int head_dim);

// Writes p.o and p.lse (float32, natural log).
cudaError_t forward(const AttentionParams& p, cudaStream_t stream);

// Writes p.dq, p.dk, p.dv. Uses p.softmax_d and p.dq_accum as workspace; p.dlse may be null.
cudaError_t backward(const AttentionParams& p, cudaStream_t stream);

}  // namespace jfa::sm80
