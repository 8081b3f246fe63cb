// Host side of the Hopper first pass of the top-k sparse backward (sparse_bwd_kernel.h): which
// calls it takes, and the launch for one chunk of (query position, key head) items.
#include <cuda_runtime_api.h>

#include "sm90/api.h"
#include "sm90/sparse_bwd_kernel.h"
#include "sm90/sparse_launch.h"

namespace jfa::sm90 {
namespace {

template <typename Traits>
cudaError_t launch_weights(const SparseParams& p, const float* softmax_d, void* weights, int64_t first_item,
                           int64_t count, cudaStream_t stream) {
  const int64_t ctas = count * (p.group_size() / Traits::kHeads);
  if (count < 1 || ctas > 0x7fffffff) return cudaErrorNotSupported;
  auto kernel = sparse::sparse_backward_weights_kernel<Traits>;
  if (cudaError_t e = sparse::allow_shared_memory(kernel, Traits::kSmemBytes); e != cudaSuccess) return e;
  kernel<<<unsigned(ctas), Traits::kThreads, Traits::kSmemBytes, stream>>>(
      p, sparse::BackwardOutputs{softmax_d, weights, first_item});
  return cudaGetLastError();
}

}  // namespace

bool can_implement_sparse_backward_weights(const SparseParams& p) {
  using Traits = sparse::SparseBackwardTraits<cutlass::bfloat16_t>;
  return sparse::takes_sparse_shape<Traits>(p) && p.Hv == Traits::kDimV && p.v == nullptr && !p.deterministic &&
         sparse::aligned_16(p.dout) && sparse::aligned_16(p.dq);
}

cudaError_t sparse_backward_weights(const SparseParams& p, const float* softmax_d, void* weights, int64_t first_item,
                                    int64_t count, cudaStream_t stream) {
  if (!can_implement_sparse_backward_weights(p)) return cudaErrorNotSupported;
  if (p.dtype == DType::kBFloat16)
    return launch_weights<sparse::SparseBackwardTraits<cutlass::bfloat16_t>>(p, softmax_d, weights, first_item,
                                                                             count, stream);
  return launch_weights<sparse::SparseBackwardTraits<cutlass::half_t>>(p, softmax_d, weights, first_item, count,
                                                                       stream);
}

}  // namespace jfa::sm90
