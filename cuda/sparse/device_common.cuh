// Device helpers shared by the sparse-attention kernels: element conversion, reductions, the
// chunk of selected rows a CTA works on, and the dtype dispatch of the launchers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "jfa/sparse_params.h"

namespace jfa::sparse_gpu {

inline constexpr int kThreads = 128;               // threads per CTA: 4 warps
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kChunk = 64;                  // selected slots a CTA handles per step
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename Elem>
__device__ __forceinline__ Elem from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// The sum of x over the CTA, returned to every thread; `scratch` holds kWarps floats.
__device__ __forceinline__ float block_sum(float x, float* scratch) {
  x = warp_sum(x);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch may still be read from the previous call
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < kWarps; ++w) total += scratch[w];
  return total;
}

// dst[d] = mul * src[d] for d < dim, spread over the CTA's threads.
template <typename Elem>
__device__ __forceinline__ void load_row(const Elem* src, int64_t dim, float mul, float* dst) {
  for (int64_t d = threadIdx.x; d < dim; d += kThreads) dst[d] = mul * to_float(src[d]);
}

// The key rows of slots [c0, c0 + count) of query (b, t), key/value head kh: rows[j] = the row's
// index s, or -1 for an invalid slot (never read). Indices past topk are never loaded.
__device__ __forceinline__ void load_chunk_rows(const SparseParams& p, int64_t b, int64_t t, int64_t kh,
                                                int64_t c0, int count, int32_t* rows) {
  const int32_t* indices = p.indices + p.index_row(b, t, kh);
  for (int j = threadIdx.x; j < count; j += kThreads) {
    const int32_t s = indices[c0 + j];
    rows[j] = sparse_index_valid(p, t, s) ? s : -1;
  }
}

// Offset of value row s of head kh: in v, or in k (whose first Hv columns are V) when v is null.
__device__ __forceinline__ int64_t value_row(const SparseParams& p, int64_t b, int64_t s, int64_t kh) {
  return p.v ? p.v_row(b, s, kh) : p.k_row(b, s, kh);
}

// Warp-wide dot product of x (float, shared memory) with dim elements of row y; every lane gets it.
template <typename Elem>
__device__ __forceinline__ float warp_dot(const float* x, const Elem* y, int64_t dim) {
  float sum = 0.f;
  for (int64_t d = threadIdx.x % 32; d < dim; d += 32) sum += x[d] * to_float(y[d]);
  return warp_sum(sum);
}

// Calls launch(Elem{}) with the element type of `dtype` (a generic lambda reads it as decltype).
template <typename Launch>
cudaError_t dispatch_dtype(DType dtype, Launch&& launch) {
  switch (dtype) {
    case DType::kFloat32: return launch(float{});
    case DType::kFloat16: return launch(__half{});
    case DType::kBFloat16: return launch(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

// A 1-D grid of `ctas` CTAs, or 0 when it exceeds what gridDim.x takes.
inline unsigned grid_of(int64_t ctas) { return ctas > 0 && ctas <= 0x7fffffff ? static_cast<unsigned>(ctas) : 0u; }

}  // namespace jfa::sparse_gpu
