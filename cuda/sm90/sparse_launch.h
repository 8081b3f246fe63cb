// Host side shared by the Hopper top-k sparse kernels (sparse_fwd.cu, sparse_dist.cu): their grid
// (a CTA per query position, key head and 64 of its query heads) and the launch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "jfa/sparse_params.h"

namespace jfa::sm90::sparse {

inline bool aligned_16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Whether the call has the shape both kernels take: float16/bfloat16, MLA's 576-column key rows,
// a multiple of 64 query heads per key head, 16-byte aligned q and k.
template <typename Traits>
bool takes_sparse_shape(const SparseParams& p) {
  return (p.dtype == DType::kBFloat16 || p.dtype == DType::kFloat16) && p.H == Traits::kDimQK && p.K > 0 &&
         p.N % p.K == 0 && p.group_size() % Traits::kHeads == 0 && p.topk > 0 && p.B > 0 && p.T > 0 && p.S > 0 &&
         aligned_16(p.q) && aligned_16(p.k);
}

// The shared memory a block on the current device may opt in to, into *bytes.
inline cudaError_t block_smem_limit(int* bytes) {
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  return cudaDeviceGetAttribute(bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
}

// Raises `kernel`'s dynamic shared memory to smem_bytes; cudaErrorNotSupported (nothing changed)
// where the device cannot give a block that much.
template <typename Kernel>
cudaError_t allow_shared_memory(Kernel kernel, int smem_bytes) {
  int max_smem = 0;
  if (cudaError_t e = block_smem_limit(&max_smem); e != cudaSuccess) return e;
  if (max_smem < smem_bytes) return cudaErrorNotSupported;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
}

template <typename Traits>
int64_t ctas_per_query_tile(const SparseParams& p) {
  return p.B * p.T * p.K * (p.group_size() / Traits::kHeads);
}

// cudaSuccess where the device has Traits' shared memory and the grid fits; cudaErrorNotSupported
// where not (checked before anything is written).
template <typename Traits>
cudaError_t fits_per_query_tile(const SparseParams& p) {
  int max_smem = 0;
  if (cudaError_t e = block_smem_limit(&max_smem); e != cudaSuccess) return e;
  const int64_t ctas = ctas_per_query_tile<Traits>(p);
  return max_smem < Traits::kSmemBytes || ctas <= 0 || ctas > 0x7fffffff ? cudaErrorNotSupported : cudaSuccess;
}

// Launches `kernel` over the grid with Traits' threads and shared memory; cudaErrorNotSupported
// (nothing launched) where fits_per_query_tile says so.
template <typename Traits>
cudaError_t launch_per_query_tile(void (*kernel)(SparseParams), const SparseParams& p, cudaStream_t stream) {
  if (cudaError_t e = fits_per_query_tile<Traits>(p); e != cudaSuccess) return e;
  const int64_t ctas = ctas_per_query_tile<Traits>(p);
  if (cudaError_t e = allow_shared_memory(kernel, Traits::kSmemBytes); e != cudaSuccess) return e;
  kernel<<<unsigned(ctas), Traits::kThreads, Traits::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jfa::sm90::sparse
