// The first kernel of every CUDA backward: per query row, D = rowsum(dO∘O) − dLSE (the LSE's
// cotangent stays exact: ∂LSE_i/∂S_ij = P_ij, so dS = P∘(dP − D) takes it in), and, for the Hopper
// backward, LSE·log2 e, the form its exp2 subtracts. Both into [B, N, dq_accum_rows()] rows
// (params.h); rows past T get D = 0 and LSE·log2 e = +inf (probability 0), and a row that saw no
// key (LSE = −inf) gets +inf too. Device code shared by the sm80 and sm90 libraries.
#pragma once

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>

#include "jfa/params.h"

namespace jfa {

// kLanesPerRow threads read one (b, t, n) row with 16-byte loads; rows are ordered (b, t, n), n
// fastest, so that a block reads contiguous O and dO. kHeadDim is the kernel's; the call's p.H
// (a multiple of 8) may be smaller where the Hopper backward runs it on a wider kernel.
template <int kHeadDim>
struct RowStatsShape {
  static constexpr int kElems = 8;
  static constexpr int kThreadsPerRow = kHeadDim / kElems;  // 4, 8, 12, 16, 24 or 32
  static constexpr int kLanesPerRow = kThreadsPerRow <= 4 ? 4 : kThreadsPerRow <= 8 ? 8 : kThreadsPerRow <= 16 ? 16 : 32;
  static constexpr int kThreads = 256;
  static constexpr int kRowsPerBlock = kThreads / kLanesPerRow;
  static int64_t blocks(const AttentionParams& p) {
    const int64_t rows = p.B * p.dq_accum_rows() * p.N;
    return (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  }
};

template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(256) bwd_row_stats_kernel(const AttentionParams p) {
  using Rows = RowStatsShape<kHeadDim>;
  constexpr int kElems = Rows::kElems, kLanesPerRow = Rows::kLanesPerRow;
  const int lane_in_row = threadIdx.x % kLanesPerRow;
  const int64_t t_rows = p.dq_accum_rows();
  const int64_t row = int64_t(blockIdx.x) * Rows::kRowsPerBlock + threadIdx.x / kLanesPerRow;  // over (b, t, n)
  const int64_t rows = p.B * t_rows * p.N;
  const int64_t n = row % p.N;
  const int64_t t = (row / p.N) % t_rows;
  const int64_t b = row / (p.N * t_rows);
  const bool valid = row < rows && t < p.T;
  float acc = 0.f;
  if (valid && lane_in_row * kElems < p.H) {
    const Element* o = static_cast<const Element*>(p.o) + b * p.o_strides.batch + t * p.o_strides.row + n * p.o_strides.head;
    const Element* d = static_cast<const Element*>(p.dout) + b * p.do_strides.batch + t * p.do_strides.row + n * p.do_strides.head;
    const uint4 ov = reinterpret_cast<const uint4*>(o)[lane_in_row];
    const uint4 dv = reinterpret_cast<const uint4*>(d)[lane_in_row];
    const Element* oe = reinterpret_cast<const Element*>(&ov);
    const Element* de = reinterpret_cast<const Element*>(&dv);
#pragma unroll
    for (int i = 0; i < kElems; ++i) acc += float(oe[i]) * float(de[i]);
  }
#pragma unroll
  for (int offset = kLanesPerRow / 2; offset > 0; offset /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  if (row < rows && lane_in_row == 0) {
    const int64_t lse_at = b * p.lse_strides.batch + t * p.lse_strides.row + n * p.lse_strides.head;
    if (valid && p.dlse != nullptr) acc -= p.dlse[lse_at];
    const int64_t out = (b * p.N + n) * t_rows + t;
    p.softmax_d[out] = acc;
    if (p.lse_log2 != nullptr) {
      const float lse = valid ? p.lse[lse_at] : -INFINITY;
      p.lse_log2[out] = lse == -INFINITY ? INFINITY : lse * float(M_LOG2E);
    }
  }
}

// The start every CUDA backward shares: d(bias) and d(slopes) zeroed (float atomics add into the
// first, and each slot of the second sums the steps of its key block, some of which never run),
// then the row statistics of kHeadDim-wide kernels (the call's p.H may be narrower).
template <typename Element, int kHeadDim>
cudaError_t launch_bwd_row_stats(const AttentionParams& p, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  if (p.mask.dbias != nullptr) {
    const int64_t* d = p.mask.dbias_dims;
    err = cudaMemsetAsync(p.mask.dbias, 0, size_t(d[0] * d[1] * d[2] * d[3]) * sizeof(float), stream);
    if (err != cudaSuccess) return err;
  }
  if (p.mask.dslopes != nullptr) {
    err = cudaMemsetAsync(p.mask.dslopes, 0, size_t(p.B * p.N * p.mask.dslope_slots) * sizeof(float), stream);
    if (err != cudaSuccess) return err;
  }
  using Rows = RowStatsShape<kHeadDim>;
  bwd_row_stats_kernel<Element, kHeadDim><<<dim3(unsigned(Rows::blocks(p))), Rows::kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jfa
