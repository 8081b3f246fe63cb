// Host side of the Hopper top-k sparse forward (sparse_fwd_kernel.h): which calls it takes, and the
// launch (one CTA per query position, key head and 64 of its query heads).
#include <cuda_runtime_api.h>

#include "sm90/api.h"
#include "sm90/sparse_fwd_kernel.h"
#include "sm90/sparse_launch.h"

namespace jfa::sm90 {

bool can_implement_sparse_forward(const SparseParams& p) {
  using Traits = sparse::SparseForwardTraits<cutlass::bfloat16_t>;
  return sparse::takes_sparse_shape<Traits>(p) && p.Hv == Traits::kDimV && p.v == nullptr &&
         sparse::aligned_16(p.o);
}

cudaError_t sparse_forward(const SparseParams& p, cudaStream_t stream) {
  if (!can_implement_sparse_forward(p)) return cudaErrorNotSupported;
  if (p.dtype == DType::kBFloat16) {
    using Traits = sparse::SparseForwardTraits<cutlass::bfloat16_t>;
    return sparse::launch_per_query_tile<Traits>(sparse::sparse_forward_kernel<Traits>, p, stream);
  }
  using Traits = sparse::SparseForwardTraits<cutlass::half_t>;
  return sparse::launch_per_query_tile<Traits>(sparse::sparse_forward_kernel<Traits>, p, stream);
}

}  // namespace jfa::sm90
