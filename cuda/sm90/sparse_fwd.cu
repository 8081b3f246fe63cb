// Host side of the Hopper top-k sparse forward (sparse_fwd_kernel.h): which calls it takes, and the
// launch (one CTA per query position, key head and 64 of its query heads).
#include <cuda_runtime_api.h>

#include <cstdint>

#include "sm90/api.h"
#include "sm90/sparse_fwd_kernel.h"

namespace jfa::sm90 {
namespace {

bool aligned_16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

template <typename Element>
cudaError_t launch_sparse_forward(const SparseParams& p, cudaStream_t stream) {
  using Traits = sparse::SparseForwardTraits<Element>;
  int device = 0, max_smem = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (cudaError_t e = cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
      e != cudaSuccess)
    return e;
  if (max_smem < Traits::kSmemBytes) return cudaErrorNotSupported;
  const int64_t ctas = p.B * p.T * p.K * (p.group_size() / Traits::kHeads);
  if (ctas <= 0 || ctas > 0x7fffffff) return cudaErrorNotSupported;
  auto kernel = sparse::sparse_forward_kernel<Traits>;
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
      e != cudaSuccess)
    return e;
  kernel<<<unsigned(ctas), Traits::kThreads, Traits::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

bool can_implement_sparse_forward(const SparseParams& p) {
  using Traits = sparse::SparseForwardTraits<cutlass::bfloat16_t>;
  return (p.dtype == DType::kBFloat16 || p.dtype == DType::kFloat16) && p.H == Traits::kDimQK &&
         p.Hv == Traits::kDimV && p.v == nullptr && p.K > 0 && p.N % p.K == 0 &&
         p.group_size() % Traits::kHeads == 0 && p.topk > 0 && p.B > 0 && p.T > 0 && p.S > 0 && aligned_16(p.q) &&
         aligned_16(p.k) && aligned_16(p.o);
}

cudaError_t sparse_forward(const SparseParams& p, cudaStream_t stream) {
  if (!can_implement_sparse_forward(p)) return cudaErrorNotSupported;
  if (p.dtype == DType::kBFloat16) return launch_sparse_forward<cutlass::bfloat16_t>(p, stream);
  return launch_sparse_forward<cutlass::half_t>(p, stream);
}

}  // namespace jfa::sm90
