// The deterministic scatter of the sparse backward: one CTA per (batch, key/value head, block of
// kOwnedRows key rows) scans every query's indices, keeps the slots that select one of its rows
// (in slot order), and adds their dK/dV contributions one at a time in (query, slot, head) order.
// Each key row has one writer and each element one thread, so no atomics and a fixed order; the
// price is that every CTA reads all of its head's indices.
#pragma once

#include "sparse/device_common.cuh"
#include "sparse/sparse_gpu.h"

namespace jfa::sparse_gpu {

inline constexpr int64_t kOwnedRows = 64;

// Both sums over the CTA, returned to every thread; `scratch` holds 2 · kWarps floats.
__device__ __forceinline__ float2 block_sum2(float x, float y, float* scratch) {
  x = warp_sum(x);
  y = warp_sum(y);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) {
    scratch[warp] = x;
    scratch[kWarps + warp] = y;
  }
  __syncthreads();
  float2 total{0.f, 0.f};
  for (int w = 0; w < kWarps; ++w) {
    total.x += scratch[w];
    total.y += scratch[kWarps + w];
  }
  return total;
}

// Writes the slots j in [c0, c0 + kThreads) whose index is valid for query t and in [s0, s1) to
// hits[0 .. count) in increasing order; returns count (to every thread).
__device__ int collect_hits(const SparseParams& p, const int32_t* indices, int64_t t, int64_t c0, int64_t s0,
                            int64_t s1, int32_t* hits, int* warp_counts) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t j = c0 + threadIdx.x;
  bool hit = false;
  if (j < p.topk) {
    const int32_t s = indices[j];
    hit = s >= s0 && s < s1 && sparse_index_valid(p, t, s);
  }
  const unsigned ballot = __ballot_sync(0xffffffffu, hit);
  __syncthreads();  // the previous hits have been consumed
  if (lane == 0) warp_counts[warp] = __popc(ballot);
  __syncthreads();
  int offset = 0, count = 0;
  for (int w = 0; w < kWarps; ++w) {
    offset += w < warp ? warp_counts[w] : 0;
    count += warp_counts[w];
  }
  if (hit) hits[offset + __popc(ballot & ((1u << lane) - 1u))] = static_cast<int32_t>(j);
  __syncthreads();
  return count;
}

// Adds the contribution of query row (b, t, n) through key row s to dK and dV.
template <typename Elem>
__device__ void add_selection(const SparseParams& p, const SparseBackwardWorkspace& ws, int64_t b, int64_t t,
                              int64_t n, int64_t kh, int64_t s, float* scratch) {
  const Elem* q = static_cast<const Elem*>(p.q) + p.q_row(b, t, n);
  const Elem* dout = static_cast<const Elem*>(p.dout) + p.o_row(b, t, n);
  const Elem* key = static_cast<const Elem*>(p.k) + p.k_row(b, s, kh);
  const Elem* value = (p.v ? static_cast<const Elem*>(p.v) : static_cast<const Elem*>(p.k)) + value_row(p, b, s, kh);
  float logit = 0.f, dprob = 0.f;
  for (int64_t d = threadIdx.x; d < p.H; d += kThreads) logit += to_float(q[d]) * to_float(key[d]);
  for (int64_t d = threadIdx.x; d < p.Hv; d += kThreads) dprob += to_float(dout[d]) * to_float(value[d]);
  const float2 sums = block_sum2(logit, dprob, scratch);
  const int64_t stat = p.stat(b, t, n);
  const float prob = exp2f((sums.x * p.scale - p.lse[stat]) * kLog2e);
  const float dscore = p.scale * prob * (sums.y - ws.softmax_d[stat]);
  float* dk = ws.dk_accum + p.k_row(b, s, kh);
  float* dv = p.v ? ws.dv_accum + p.v_row(b, s, kh) : dk;
  for (int64_t d = threadIdx.x; d < p.H; d += kThreads) dk[d] += dscore * to_float(q[d]);
  for (int64_t d = threadIdx.x; d < p.Hv; d += kThreads) dv[d] += prob * to_float(dout[d]);
}

template <typename Elem>
__global__ void __launch_bounds__(kThreads) ordered_key_kernel(SparseParams p, SparseBackwardWorkspace ws) {
  __shared__ int32_t hits[kThreads];
  __shared__ int warp_counts[kWarps];
  __shared__ float scratch[2 * kWarps];
  const int64_t blocks = (p.S + kOwnedRows - 1) / kOwnedRows;
  const int64_t item = blockIdx.x;
  const int64_t block = item % blocks, kh = item / blocks % p.K, b = item / (blocks * p.K);
  const int64_t s0 = block * kOwnedRows, s1 = s0 + kOwnedRows < p.S ? s0 + kOwnedRows : p.S;
  // A causal query t sees key s only if s <= t + offset: queries before s0 − offset select none.
  const int64_t t_begin = p.is_causal && s0 - p.causal_offset > 0 ? s0 - p.causal_offset : 0;
  const int64_t G = p.group_size();
  for (int64_t t = t_begin; t < p.T; ++t) {
    const int32_t* indices = p.indices + p.index_row(b, t, kh);
    for (int64_t c0 = 0; c0 < p.topk; c0 += kThreads) {
      const int count = collect_hits(p, indices, t, c0, s0, s1, hits, warp_counts);
      for (int h = 0; h < count; ++h) {
        const int64_t s = indices[hits[h]];
        for (int64_t g = 0; g < G; ++g) add_selection<Elem>(p, ws, b, t, kh * G + g, kh, s, scratch);
      }
    }
  }
}

template <typename Elem>
cudaError_t launch_ordered_backward(const SparseParams& p, const SparseBackwardWorkspace& ws, cudaStream_t stream) {
  const unsigned grid = grid_of(p.B * p.K * ((p.S + kOwnedRows - 1) / kOwnedRows));
  if (grid == 0) return cudaErrorInvalidConfiguration;
  ordered_key_kernel<Elem><<<grid, kThreads, 0, stream>>>(p, ws);
  return cudaGetLastError();
}

}  // namespace jfa::sparse_gpu
