// Backward of top-k sparse attention, in three steps:
//   1. softmax_d: D = rowsum(dO∘O) − dLSE per (query, head), one warp each;
//   2. the gradients: on tensor cores where backward_tensor_cores.cu takes the call (dQ with P and
//      scale·dS into the workspace, then dK/dV from them: backward_key_rows.cu); else on CUDA
//      cores, dQ per (query, head) CTA, and dK/dV scattered into float32 accumulators, by the same
//      CTA with atomics or, when deterministic, by the CTA that owns each key row
//      (backward_ordered.cuh);
//   3. convert: the accumulators rounded into dk and dv.
#include <cmath>

#include "sparse/backward_ordered.cuh"
#include "sparse/device_common.cuh"
#include "sparse/sparse_gpu.h"

namespace jfa::sparse_gpu {
namespace {

template <typename Elem>
__global__ void __launch_bounds__(kThreads) softmax_d_kernel(SparseParams p, float* softmax_d) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;  // b·T·N + t·N + n
  if (row >= p.B * p.T * p.N) return;
  const Elem* o = static_cast<const Elem*>(p.o) + row * p.Hv;
  const Elem* dout = static_cast<const Elem*>(p.dout) + row * p.Hv;
  float sum = 0.f;
  for (int64_t d = threadIdx.x % 32; d < p.Hv; d += 32) sum += to_float(o[d]) * to_float(dout[d]);
  sum = warp_sum(sum);
  if (threadIdx.x % 32 == 0) softmax_d[row] = sum - p.dlse[row];
}

struct SlotGradients {
  int32_t rows[kChunk];
  float probs[kChunk];    // P of each slot (0 when invalid)
  float dscores[kChunk];  // scale · dS = scale · P · (dO·v − D) (0 when invalid)
};

// P and scale·dS of the chunk's slots for query row (b, t, n), one warp per slot.
template <typename Elem>
__device__ void slot_gradients(const SparseParams& p, int64_t b, int64_t t, int64_t n, const float* q,
                               const float* dout, float softmax_d, int count, SlotGradients& chunk) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t kh = n / p.group_size();
  const float lse_log2 = p.lse[p.stat(b, t, n)] * kLog2e;
  const Elem* k = static_cast<const Elem*>(p.k);
  const Elem* values = p.v ? static_cast<const Elem*>(p.v) : k;
  for (int j = warp; j < count; j += kWarps) {
    const int32_t s = chunk.rows[j];
    float prob = 0.f, dscore = 0.f;
    if (s >= 0) {
      const float logit = warp_dot(q, k + p.k_row(b, s, kh), p.H);
      const float dprob = warp_dot(dout, values + value_row(p, b, s, kh), p.Hv);
      prob = exp2f(logit * p.scale * kLog2e - lse_log2);
      dscore = p.scale * prob * (dprob - softmax_d);
    }
    if (lane == 0) {
      chunk.probs[j] = prob;
      chunk.dscores[j] = dscore;
    }
  }
}

// Adds the chunk's slots into dK (scale·dS·q) and dV (P·dO) with float atomics; with v null, dV
// lands in dK's first Hv columns.
__device__ void scatter_slots(const SparseParams& p, int64_t b, int64_t kh, const float* q, const float* dout,
                              int count, const SlotGradients& chunk, const SparseBackwardWorkspace& ws) {
  for (int j = 0; j < count; ++j) {
    const int32_t s = chunk.rows[j];
    if (s < 0) continue;
    float* dk = ws.dk_accum + p.k_row(b, s, kh);
    float* dv = p.v ? ws.dv_accum + p.v_row(b, s, kh) : dk;
    for (int64_t d = threadIdx.x; d < p.H; d += kThreads) atomicAdd(dk + d, chunk.dscores[j] * q[d]);
    for (int64_t d = threadIdx.x; d < p.Hv; d += kThreads) atomicAdd(dv + d, chunk.probs[j] * dout[d]);
  }
}

// dQ of query row (b, t, n); with kScatter also its dK/dV contributions (atomics).
template <typename Elem, bool kScatter>
__global__ void __launch_bounds__(kThreads) query_kernel(SparseParams p, SparseBackwardWorkspace ws) {
  extern __shared__ float row_smem[];
  float* q = row_smem;                 // [H]
  float* dout = q + p.H;               // [Hv]
  float* dq = dout + p.Hv;             // [H], owned per thread
  __shared__ SlotGradients chunk;
  const int64_t item = blockIdx.x;
  const int64_t n = item % p.N, t = item / p.N % p.T, b = item / (p.N * p.T);
  const int64_t kh = n / p.group_size();
  const Elem* k = static_cast<const Elem*>(p.k);
  load_row(static_cast<const Elem*>(p.q) + p.q_row(b, t, n), p.H, 1.f, q);
  load_row(static_cast<const Elem*>(p.dout) + p.o_row(b, t, n), p.Hv, 1.f, dout);
  for (int64_t d = threadIdx.x; d < p.H; d += kThreads) dq[d] = 0.f;
  const float softmax_d = ws.softmax_d[p.stat(b, t, n)];
  for (int64_t c0 = 0; c0 < p.topk; c0 += kChunk) {
    const int count = static_cast<int>(p.topk - c0 < kChunk ? p.topk - c0 : kChunk);
    __syncthreads();  // q, dout loaded; the previous chunk is done
    load_chunk_rows(p, b, t, kh, c0, count, chunk.rows);
    __syncthreads();
    slot_gradients<Elem>(p, b, t, n, q, dout, softmax_d, count, chunk);
    __syncthreads();
    for (int64_t d = threadIdx.x; d < p.H; d += kThreads) {
      float sum = dq[d];
      for (int j = 0; j < count; ++j)
        if (chunk.rows[j] >= 0) sum += chunk.dscores[j] * to_float(k[p.k_row(b, chunk.rows[j], kh) + d]);
      dq[d] = sum;
    }
    if (kScatter) scatter_slots(p, b, kh, q, dout, count, chunk, ws);
  }
  Elem* dq_out = static_cast<Elem*>(p.dq) + p.q_row(b, t, n);
  for (int64_t d = threadIdx.x; d < p.H; d += kThreads) dq_out[d] = from_float<Elem>(dq[d]);
}

template <typename Elem>
__global__ void convert_kernel(const float* accum, Elem* out, int64_t count) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = from_float<Elem>(accum[i]);
}

unsigned convert_grid(int64_t count) {
  const int64_t blocks = (count + 255) / 256;
  return static_cast<unsigned>(blocks < 65536 ? blocks : 65536);
}

}  // namespace

cudaError_t backward(const SparseParams& p, const SparseBackwardWorkspace& ws, cudaStream_t stream,
                     BackwardKernels kernels, BackwardPasses passes) {
  const bool tensor_cores = kernels != BackwardKernels::kCudaCores && backward_tensor_cores_takes(p, ws);
  if (kernels == BackwardKernels::kTensorCores && !tensor_cores) return cudaErrorNotSupported;
  const unsigned rows_grid = grid_of((p.B * p.T * p.N + kWarps - 1) / kWarps);
  const unsigned query_grid = grid_of(p.B * p.T * p.N);
  if (rows_grid == 0 || query_grid == 0) return cudaErrorInvalidConfiguration;
  const int64_t dk_count = p.B * p.S * p.K * p.H, dv_count = p.v ? p.B * p.S * p.K * p.Hv : 0;
  if (cudaError_t e = cudaMemsetAsync(ws.dk_accum, 0, sizeof(float) * dk_count, stream); e != cudaSuccess) return e;
  if (dv_count)
    if (cudaError_t e = cudaMemsetAsync(ws.dv_accum, 0, sizeof(float) * dv_count, stream); e != cudaSuccess) return e;
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using Elem = decltype(tag);
    softmax_d_kernel<Elem><<<rows_grid, kThreads, 0, stream>>>(p, ws.softmax_d);
    const size_t smem = sizeof(float) * (2 * p.H + p.Hv);
    if (p.deterministic) {
      query_kernel<Elem, false><<<query_grid, kThreads, smem, stream>>>(p, ws);
      if (cudaError_t e = launch_ordered_backward<Elem>(p, ws, stream); e != cudaSuccess) return e;
    } else if (tensor_cores) {
      if (cudaError_t e = backward_tensor_cores(p, ws, stream, passes); e != cudaSuccess) return e;
    } else {
      query_kernel<Elem, true><<<query_grid, kThreads, smem, stream>>>(p, ws);
    }
    if (dk_count)
      convert_kernel<Elem><<<convert_grid(dk_count), 256, 0, stream>>>(ws.dk_accum, static_cast<Elem*>(p.dk), dk_count);
    if (dv_count)
      convert_kernel<Elem><<<convert_grid(dv_count), 256, 0, stream>>>(ws.dv_accum, static_cast<Elem*>(p.dv), dv_count);
    return cudaGetLastError();
  });
}

}  // namespace jfa::sparse_gpu
