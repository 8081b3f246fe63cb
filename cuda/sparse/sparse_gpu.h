// Top-k sparse attention and attn_dist on the GPU: the CUDA kernels behind jax_flashattn.sparse.
// Host-only declarations: includable from a .cc compiled by a plain C++ compiler.
//
// These are portable CUDA-core kernels (sm80 and later, float32/float16/bfloat16): one CTA per query
// row (per group of heads for attn_dist), for every size but far from tensor-core speed.
// Every index is tested with sparse_index_valid before the key or value row it names is read.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "jfa/sparse_params.h"

namespace jfa::sparse_gpu {

// Largest H (and Hv) the kernels take: a backward CTA keeps 2·H + Hv floats of rows in shared
// memory, which must stay under the 48 KB a launch gets without opting in to more.
inline constexpr int64_t kMaxHeadDim = 2048;

// Float32 scratch the backward needs, as extra FFI results (XLA allocates it; nothing here does).
struct SparseBackwardWorkspace {
  float* dk_accum = nullptr;   // [B, S, K, H]: dK (plus dV when v is null), zeroed by backward()
  float* dv_accum = nullptr;   // [B, S, K, Hv], or null when v is null
  float* softmax_d = nullptr;  // [B, T, N]: rowsum(dO∘O) − dLSE
};

// Writes o and lse.
cudaError_t forward(const SparseParams& p, cudaStream_t stream);

// Writes dq, dk, dv. With p.deterministic every key row's gradient is summed by one CTA in
// (query, slot, head) order; otherwise float atomics scatter it in whatever order CTAs run.
cudaError_t backward(const SparseParams& p, const SparseBackwardWorkspace& ws, cudaStream_t stream);

// Writes dist (deterministic: each CTA sums its group's heads in order).
cudaError_t attn_dist(const SparseParams& p, cudaStream_t stream);

}  // namespace jfa::sparse_gpu
