// Forward of top-k sparse attention on CUDA cores, for the calls the tensor-core kernel does not
// take (float32, odd head dims): one CTA per (query position, head). It streams the selected slots
// in chunks of kChunk: each warp computes the logits of its slots, then an online-softmax step
// (log2 domain) rescales the output row, which each thread owns a strided part of, and adds the
// chunk's P·V with coalesced reads of the value rows.
#include <cmath>

#include "sparse/device_common.cuh"
#include "sparse/sparse_gpu.h"

namespace jfa::sparse_gpu {
namespace {

struct ChunkState {
  int32_t rows[kChunk];
  float logits[kChunk];  // scale·log2(e)·q·k, then P·exp2(−m) of the step; -inf / 0 when invalid
};

// logits[j] of the chunk's slots, one warp per slot.
template <typename Elem>
__device__ void chunk_logits(const SparseParams& p, const Elem* k, int64_t b, int64_t kh, const float* q,
                             int count, ChunkState& chunk) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int j = warp; j < count; j += kWarps) {
    const int32_t s = chunk.rows[j];
    const float logit = s < 0 ? -INFINITY : warp_dot(q, k + p.k_row(b, s, kh), p.H);
    if (lane == 0) chunk.logits[j] = logit;
  }
}

// One online-softmax step over the chunk: updates the running max m and sum l (the same in every
// thread), turns logits into probabilities, rescales acc by exp2(m_old − m_new) and adds P·V.
template <typename Elem>
__device__ void softmax_step(const SparseParams& p, const Elem* values, int64_t b, int64_t kh, int count,
                             ChunkState& chunk, float& m, float& l, float* acc) {
  float chunk_max = -INFINITY;
  for (int j = 0; j < count; ++j) chunk_max = fmaxf(chunk_max, chunk.logits[j]);
  const float m_new = fmaxf(m, chunk_max);
  if (m_new == -INFINITY) return;  // no valid slot yet: nothing to add
  const float correction = exp2f(m - m_new);  // 0 on the first valid chunk (m = -inf)
  __syncthreads();  // every thread has read the logits before they become probabilities
  for (int j = threadIdx.x; j < count; j += kThreads)
    chunk.logits[j] = chunk.rows[j] < 0 ? 0.f : exp2f(chunk.logits[j] - m_new);
  __syncthreads();
  float chunk_sum = 0.f;
  for (int j = 0; j < count; ++j) chunk_sum += chunk.logits[j];
  l = l * correction + chunk_sum;
  m = m_new;
  for (int64_t d = threadIdx.x; d < p.Hv; d += kThreads) {
    float sum = acc[d] * correction;
    for (int j = 0; j < count; ++j) {
      const int32_t s = chunk.rows[j];
      if (s >= 0) sum += chunk.logits[j] * to_float(values[value_row(p, b, s, kh) + d]);
    }
    acc[d] = sum;
  }
}

template <typename Elem>
__global__ void __launch_bounds__(kThreads) sparse_forward_kernel(SparseParams p) {
  extern __shared__ float row_smem[];
  float* q = row_smem;        // [H], times scale·log2(e)
  float* acc = row_smem + p.H;  // [Hv], unnormalized output
  __shared__ ChunkState chunk;
  const int64_t item = blockIdx.x;
  const int64_t n = item % p.N, t = item / p.N % p.T, b = item / (p.N * p.T);
  const int64_t kh = n / p.group_size();
  const Elem* k = static_cast<const Elem*>(p.k);
  const Elem* values = p.v ? static_cast<const Elem*>(p.v) : k;
  load_row(static_cast<const Elem*>(p.q) + p.q_row(b, t, n), p.H, p.scale * kLog2e, q);
  for (int64_t d = threadIdx.x; d < p.Hv; d += kThreads) acc[d] = 0.f;
  float m = -INFINITY, l = 0.f;
  for (int64_t c0 = 0; c0 < p.topk; c0 += kChunk) {
    const int count = static_cast<int>(p.topk - c0 < kChunk ? p.topk - c0 : kChunk);
    __syncthreads();  // the previous step is done with the chunk
    load_chunk_rows(p, b, t, kh, c0, count, chunk.rows);
    __syncthreads();
    chunk_logits(p, k, b, kh, q, count, chunk);
    __syncthreads();
    softmax_step(p, values, b, kh, count, chunk, m, l, acc);
  }
  Elem* o = static_cast<Elem*>(p.o) + p.o_row(b, t, n);
  const float inv = l > 0.f ? 1.f / l : 0.f;
  for (int64_t d = threadIdx.x; d < p.Hv; d += kThreads) o[d] = from_float<Elem>(acc[d] * inv);
  if (threadIdx.x == 0) p.lse[p.stat(b, t, n)] = l > 0.f ? (m + log2f(l)) * kLn2 : -INFINITY;
}

}  // namespace

cudaError_t forward_cuda_cores(const SparseParams& p, cudaStream_t stream) {
  const unsigned grid = grid_of(p.B * p.T * p.N);
  if (grid == 0) return cudaErrorInvalidConfiguration;
  const size_t smem = sizeof(float) * (p.H + p.Hv);
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using Elem = decltype(tag);
    sparse_forward_kernel<Elem><<<grid, kThreads, smem, stream>>>(p);
    return cudaGetLastError();
  });
}

cudaError_t forward(const SparseParams& p, cudaStream_t stream) {
  const cudaError_t e = forward_tensor_cores(p, stream);
  return e == cudaErrorNotSupported ? forward_cuda_cores(p, stream) : e;
}

}  // namespace jfa::sparse_gpu
