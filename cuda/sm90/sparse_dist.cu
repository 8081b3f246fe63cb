// Host side of the Hopper attn_dist (sparse_dist_kernel.h): which calls it takes, and the launch
// (the output zeroed, then one CTA per query position, key head and 64 of its query heads).
#include <cuda_runtime_api.h>

#include "sm90/api.h"
#include "sm90/sparse_dist_kernel.h"
#include "sm90/sparse_launch.h"

namespace jfa::sm90 {

bool can_implement_attn_dist(const SparseParams& p) {
  using Traits = sparse::SparseDistTraits<cutlass::bfloat16_t>;
  // A head group is one CTA's 64 heads or two CTAs' 128 (whose adds commute exactly).
  return sparse::takes_sparse_shape<Traits>(p) && p.dist != nullptr &&
         (p.head_group == Traits::kHeads || p.head_group == 2 * Traits::kHeads) && p.N % p.head_group == 0;
}

cudaError_t attn_dist(const SparseParams& p, cudaStream_t stream) {
  if (!can_implement_attn_dist(p)) return cudaErrorNotSupported;
  // Both dtypes' storage has the same size: one check before the output is zeroed.
  if (cudaError_t e = sparse::fits_per_query_tile<sparse::SparseDistTraits<cutlass::bfloat16_t>>(p); e != cudaSuccess)
    return e;
  const int64_t outputs = p.B * (p.N / p.head_group) * p.T * p.topk;
  if (cudaError_t e = cudaMemsetAsync(p.dist, 0, sizeof(float) * outputs, stream); e != cudaSuccess) return e;
  if (p.dtype == DType::kBFloat16) {
    using Traits = sparse::SparseDistTraits<cutlass::bfloat16_t>;
    return sparse::launch_per_query_tile<Traits>(sparse::sparse_dist_kernel<Traits>, p, stream);
  }
  using Traits = sparse::SparseDistTraits<cutlass::half_t>;
  return sparse::launch_per_query_tile<Traits>(sparse::sparse_dist_kernel<Traits>, p, stream);
}

}  // namespace jfa::sm90
