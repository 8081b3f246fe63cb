// Host side of the Hopper second pass of the top-k sparse backward (sparse_key_rows_kernel.h):
// which calls it takes, and the launch for one chunk of (query position, key head) items.
#include <cuda_runtime_api.h>

#include "sm90/api.h"
#include "sm90/sparse_key_rows_kernel.h"
#include "sm90/sparse_launch.h"

namespace jfa::sm90 {
namespace {

template <typename Traits>
cudaError_t launch_key_rows(const SparseParams& p, const void* weights, float* accum, int64_t first_item,
                            int64_t count, cudaStream_t stream) {
  const int64_t ctas = count * Traits::kParts * (p.group_size() / Traits::kHeads);
  if (count < 1 || ctas > 0x7fffffff) return cudaErrorNotSupported;
  auto kernel = sparse::sparse_key_rows_kernel<Traits>;
  if (cudaError_t e = sparse::allow_shared_memory(kernel, Traits::kSmemBytes); e != cudaSuccess) return e;
  kernel<<<unsigned(ctas), Traits::kThreads, Traits::kSmemBytes, stream>>>(p, weights, accum, first_item);
  // cudaErrorNotSupported would make the caller run the mma.sync pass over the same items, adding
  // them twice: it only ever means nothing was launched.
  const cudaError_t e = cudaGetLastError();
  return e == cudaErrorNotSupported ? cudaErrorLaunchFailure : e;
}

// 128 heads per CTA where the group is a multiple of 128 (the GEMM's inner dimension twice as
// deep, each row reduced half as often), else 64.
template <typename Element>
cudaError_t dispatch_heads(const SparseParams& p, const void* weights, float* accum, int64_t first_item,
                           int64_t count, cudaStream_t stream) {
  if (p.group_size() % 128 == 0)
    return launch_key_rows<sparse::SparseKeyRowsTraits<Element, 128>>(p, weights, accum, first_item, count, stream);
  return launch_key_rows<sparse::SparseKeyRowsTraits<Element, 64>>(p, weights, accum, first_item, count, stream);
}

}  // namespace

bool can_implement_sparse_key_rows(const SparseParams& p) {
  using Traits = sparse::SparseKeyRowsTraits<cutlass::bfloat16_t, 64>;
  return sparse::takes_sparse_shape<Traits>(p) && p.Hv == Traits::kDimV && p.v == nullptr && !p.deterministic &&
         sparse::aligned_16(p.dout);
}

cudaError_t sparse_key_rows(const SparseParams& p, const void* weights, float* accum, int64_t first_item,
                            int64_t count, cudaStream_t stream) {
  if (!can_implement_sparse_key_rows(p) || !sparse::aligned_16(weights) || !sparse::aligned_16(accum))
    return cudaErrorNotSupported;
  if (p.dtype == DType::kBFloat16)
    return dispatch_heads<cutlass::bfloat16_t>(p, weights, accum, first_item, count, stream);
  return dispatch_heads<cutlass::half_t>(p, weights, accum, first_item, count, stream);
}

}  // namespace jfa::sm90
