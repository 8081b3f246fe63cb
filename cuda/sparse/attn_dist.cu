// attn_dist on CUDA cores, for the calls the tensor-core kernel does not take: one CTA per (query
// position, group of head_group heads). It takes the group's heads one after another, so each
// output element is summed in head order by the one lane that owns its slot (deterministic, no
// atomics), from P = exp2(scale·log2(e)·q·k − lse·log2(e)).
#include <cmath>

#include "sparse/device_common.cuh"
#include "sparse/sparse_gpu.h"

namespace jfa::sparse_gpu {
namespace {

// Adds head n's probabilities of slots [c0, c0 + count) to dist (a row of topk floats).
template <typename Elem>
__device__ void add_head_chunk(const SparseParams& p, int64_t b, int64_t n, const float* q, float lse_log2,
                               const int32_t* rows, int64_t c0, int count, float* dist) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t kh = n / p.group_size();
  const Elem* k = static_cast<const Elem*>(p.k);
  for (int j = warp; j < count; j += kWarps) {
    const int32_t s = rows[j];
    if (s < 0) continue;
    const float logit = warp_dot(q, k + p.k_row(b, s, kh), p.H);
    if (lane == 0) dist[c0 + j] += exp2f(logit - lse_log2);
  }
}

template <typename Elem>
__global__ void __launch_bounds__(kThreads) attn_dist_kernel(SparseParams p) {
  extern __shared__ float q[];  // [H], times scale·log2(e)
  __shared__ int32_t rows[kChunk];
  const int64_t groups = p.N / p.head_group;
  const int64_t item = blockIdx.x;
  const int64_t group = item % groups, t = item / groups % p.T, b = item / (groups * p.T);
  float* dist = p.dist + ((b * groups + group) * p.T + t) * p.topk;
  for (int64_t n = group * p.head_group; n < (group + 1) * p.head_group; ++n) {
    const float lse = p.lse[p.stat(b, t, n)];
    if (lse == -INFINITY) continue;  // the row saw no key: nothing to distribute
    __syncthreads();  // the previous head is done with q
    load_row(static_cast<const Elem*>(p.q) + p.q_row(b, t, n), p.H, p.scale * kLog2e, q);
    for (int64_t c0 = 0; c0 < p.topk; c0 += kChunk) {
      const int count = static_cast<int>(p.topk - c0 < kChunk ? p.topk - c0 : kChunk);
      __syncthreads();  // q is loaded; the previous chunk is done with rows
      load_chunk_rows(p, b, t, n / p.group_size(), c0, count, rows);
      __syncthreads();
      add_head_chunk<Elem>(p, b, n, q, lse * kLog2e, rows, c0, count, dist);
    }
  }
}

}  // namespace

cudaError_t attn_dist_cuda_cores(const SparseParams& p, cudaStream_t stream) {
  const unsigned grid = grid_of(p.B * p.T * (p.N / p.head_group));
  if (grid == 0) return cudaErrorInvalidConfiguration;
  const int64_t total = p.B * (p.N / p.head_group) * p.T * p.topk;
  if (cudaError_t e = cudaMemsetAsync(p.dist, 0, sizeof(float) * total, stream); e != cudaSuccess) return e;
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using Elem = decltype(tag);
    attn_dist_kernel<Elem><<<grid, kThreads, sizeof(float) * p.H, stream>>>(p);
    return cudaGetLastError();
  });
}

cudaError_t attn_dist(const SparseParams& p, cudaStream_t stream) {
  const cudaError_t e = attn_dist_tensor_cores(p, stream);
  return e == cudaErrorNotSupported ? attn_dist_cuda_cores(p, stream) : e;
}

}  // namespace jfa::sparse_gpu
