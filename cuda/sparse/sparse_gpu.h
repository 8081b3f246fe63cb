// Top-k sparse attention and attn_dist on the GPU: the CUDA kernels behind jax_flashattn.sparse.
// Host-only declarations: includable from a .cc compiled by a plain C++ compiler.
//
// forward() and attn_dist() run tensor-core kernels (sm80 mma.sync) where they take the call:
// float16/bfloat16, H and Hv multiples of 8 up to 576 and 512, the tiles within the device's shared
// memory (attn_dist: head groups of 16, 32, 64 or 128 within a key head's group). Other calls run
// portable CUDA-core kernels (float32 too, any size). The backward has tensor-core kernels for
// deterministic=False on the forward's shapes (two passes: per query position dQ, P and scale·dS;
// then dK and dV of the selected rows, added into float32 accumulators with atomics) and CUDA-core
// kernels for the rest; jax_flashattn runs the latter for deterministic=True, and computes the
// gradients of deterministic=False calls the tensor-core kernels do not take with XLA
// (_sparse_xla_backward.py).
// On Hopper, the FFI handler first offers the forward and attn_dist to cuda/sm90's wgmma kernels
// (sm90/api.h, can_implement_sparse_forward / can_implement_attn_dist: MLA's shape); what they do
// not take comes here.
// Every index is tested with sparse_index_valid before the key or value row it names is read.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "jfa/sparse_params.h"

namespace jfa::sparse_gpu {

// Largest H (and Hv) the kernels take: a backward CTA keeps 2·H + Hv floats of rows in shared
// memory, which must stay under the 48 KB a launch gets without opting in to more.
inline constexpr int64_t kMaxHeadDim = 2048;

using jfa::weight_row_slots;

// Scratch the backward needs, as extra FFI results (XLA allocates it; nothing here does).
struct SparseBackwardWorkspace {
  float* dk_accum = nullptr;   // [B, S, K, H]: dK (plus dV when v is null), zeroed by backward()
  float* dv_accum = nullptr;   // [B, S, K, Hv], or null when v is null
  float* softmax_d = nullptr;  // [B, T, N]: rowsum(dO∘O) − dLSE
  // The tensor-core backward's P and scale·dS, in the call's dtype: [weight_items, 2, N / K,
  // weight_row_slots(topk)] for weight_items (query position, key head) items at a time, the
  // items taken in that many at once (0 items: the tensor-core kernels do not take the call).
  void* weights = nullptr;
  int64_t weight_items = 0;
};

// Writes o and lse.
cudaError_t forward(const SparseParams& p, cudaStream_t stream);
// The two kernels forward() chooses between; the tensor-core one returns cudaErrorNotSupported,
// launching nothing, for calls it does not take.
cudaError_t forward_tensor_cores(const SparseParams& p, cudaStream_t stream);
cudaError_t forward_cuda_cores(const SparseParams& p, cudaStream_t stream);

// Which kernels compute the gradients: kAuto the tensor-core one for the calls it takes
// (deterministic off, its dtypes and head dims within the device's shared memory), else the
// CUDA-core ones; the others force one of the two (tests/cuda/sparse_check.cu runs each), and
// kTensorCores returns cudaErrorNotSupported, launching nothing, for a call it does not take.
enum class BackwardKernels { kAuto, kTensorCores, kCudaCores };

// Another first pass of the tensor-core backward (dQ, and P and scale·dS into the weights) for the
// items [first_item, first_item + count), run in place of backward_tensor_cores.cu's: the FFI
// handler passes cuda/sm90's wgmma one (sm90/api.h, sparse_backward_weights) for the calls it
// takes. cudaErrorNotSupported (nothing launched) runs the mma.sync kernel for that chunk.
using FirstPass = cudaError_t (*)(const SparseParams& p, const float* softmax_d, void* weights, int64_t first_item,
                                  int64_t count, cudaStream_t stream);
// Another second pass (dK and dV of the selected rows, added into ws.dk_accum from the chunk's
// weights) for the same items, run in place of backward_key_rows.cu's: cuda/sm90's wgmma one
// (sm90/api.h, sparse_key_rows). cudaErrorNotSupported (nothing launched) runs the mma.sync kernel.
using SecondPass = cudaError_t (*)(const SparseParams& p, const void* weights, float* accum, int64_t first_item,
                                   int64_t count, cudaStream_t stream);
struct BackwardPasses {
  FirstPass first = nullptr;
  SecondPass second = nullptr;
};

// Writes dq, dk, dv. With p.deterministic every key row's gradient is summed by one CTA in
// (query, slot, head) order; otherwise float atomics scatter it in whatever order CTAs run.
cudaError_t backward(const SparseParams& p, const SparseBackwardWorkspace& ws, cudaStream_t stream,
                     BackwardKernels kernels = BackwardKernels::kAuto, BackwardPasses passes = {});
// The tensor-core gradients kernels (backward_tensor_cores.cu, backward_key_rows.cu): whether they
// take a call with this workspace, and the launches, which read ws.softmax_d, fill ws.weights
// and add into the zeroed accumulators.
bool backward_tensor_cores_takes(const SparseParams& p, const SparseBackwardWorkspace& ws);
cudaError_t backward_tensor_cores(const SparseParams& p, const SparseBackwardWorkspace& ws, cudaStream_t stream,
                                  BackwardPasses passes = {});

// Writes dist (deterministic: every element is summed in the same order on every run).
cudaError_t attn_dist(const SparseParams& p, cudaStream_t stream);
cudaError_t attn_dist_tensor_cores(const SparseParams& p, cudaStream_t stream);
cudaError_t attn_dist_cuda_cores(const SparseParams& p, cudaStream_t stream);

}  // namespace jfa::sparse_gpu
