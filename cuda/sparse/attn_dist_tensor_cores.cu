// attn_dist on tensor cores: the forward's tiles without P·V. Per step each pair's logits become
// probabilities against the rows' saved LSE; each warp sums its 16 rows for half of the step's keys
// (a fixed shuffle tree), the row groups' sums are added in order through shared memory, and the
// CTA adds the result to its group's output row. A group spans at most two CTAs, and 0 + a + b is
// b + a exactly, so the output does not depend on which CTA adds first.
#include <cmath>

#include "sparse/device_common.cuh"
#include "sparse/sparse_gpu.h"
#include "sparse/tensor_core_tiles.cuh"

namespace jfa::sparse_gpu {
namespace tc {
namespace {

// The LSE of the rows a thread holds, in log2 units; +inf for rows past the block or that saw no
// key, so that their probabilities are exp2(x − inf) = 0.
template <typename Shape>
__device__ __forceinline__ void row_lse_log2(const SparseParams& p, const TileItem& it, const WarpRole<Shape>& role,
                                             float (&lse)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t n = it.n0 + role.row_group * 16 + role.lane / 4 + 8 * r;
    const float value = n < it.n_end ? p.lse[p.stat(it.b, it.t, n)] : -INFINITY;
    lse[r] = value == -INFINITY ? INFINITY : value * kLog2e;
  }
}

// Sums of P over this warp's 16 rows for its half of the step's keys, into column_sums[row group].
template <typename Shape>
__device__ __forceinline__ void column_sums(const WarpRole<Shape>& role, const float (&s)[Shape::kKeyTiles][4],
                                            float* column_sums) {
  constexpr int kTilesPerHalf = Shape::kKeyTiles / 2;
#pragma unroll
  for (int nt = 0; nt < Shape::kKeyTiles; ++nt) {
    if (nt / kTilesPerHalf != role.half) continue;  // (a runtime index would put s in local memory)
    float lo = s[nt][0] + s[nt][2], hi = s[nt][1] + s[nt][3];
#pragma unroll
    for (int offset = 4; offset < 32; offset <<= 1) {
      lo += __shfl_xor_sync(0xffffffffu, lo, offset);
      hi += __shfl_xor_sync(0xffffffffu, hi, offset);
    }
    if (role.lane < 4) {
      column_sums[role.row_group * Shape::kKeys + fragment_key(nt, 0, role.lane)] = lo;
      column_sums[role.row_group * Shape::kKeys + fragment_key(nt, 1, role.lane)] = hi;
    }
  }
}

template <typename Shape, typename Elem>
__global__ void __launch_bounds__(Shape::kThreads, 1) attn_dist_tc_kernel(SparseParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  using Plan = SmemPlan<Shape, Elem>;
  Elem* sq = reinterpret_cast<Elem*>(smem + Plan::kQ);
  Elem* sk = reinterpret_cast<Elem*>(smem + Plan::kK);
  float* exchange = reinterpret_cast<float*>(smem + Plan::exchange(false));
  uint8_t* valid = smem + Plan::valid(false);
  __shared__ float sums[Shape::kRowGroups * Shape::kKeys];
  constexpr int kKBuffer = Shape::kKeys * Shape::kQStride;

  const TileItem it = tile_item<Shape>(p);
  const WarpRole<Shape> role;
  const float scale_log2 = p.scale * kLog2e;
  float lse[2];
  row_lse_log2<Shape>(p, it, role, lse);
  const int64_t groups = p.N / p.head_group;
  float* dist = p.dist + ((it.b * groups + it.n0 / p.head_group) * p.T + it.t) * p.topk;
  for_each_step<Shape>(p, it, sq, sk, static_cast<Elem*>(nullptr), valid, nullptr, [&](int64_t step, int buf) {
    float s[Shape::kKeyTiles][4];
    step_logits<Shape>(role, sq, sk + buf * kKBuffer, exchange, s);
    const uint8_t* step_valid = valid + buf * Shape::kKeys;
#pragma unroll
    for (int nt = 0; nt < Shape::kKeyTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        s[nt][e] = step_valid[fragment_key(nt, e, role.lane)] ? exp2f(s[nt][e] * scale_log2 - lse[e / 2]) : 0.f;
    column_sums<Shape>(role, s, sums);
    __syncthreads();  // (the next step's __syncthreads keeps the sums until they are read)
    const int64_t slot = step * Shape::kKeys + threadIdx.x;
    if (threadIdx.x < Shape::kKeys && slot < p.topk) {
      float total = 0.f;
      for (int g = 0; g < Shape::kRowGroups; ++g) total += sums[g * Shape::kKeys + threadIdx.x];
      atomicAdd(dist + slot, total);
    }
  });
}

template <typename Shape, typename Elem>
cudaError_t launch_attn_dist(const SparseParams& p, int max_smem, cudaStream_t stream) {
  const size_t smem = SmemPlan<Shape, Elem>::bytes(false);
  if (smem + sizeof(float) * Shape::kRowGroups * Shape::kKeys > static_cast<size_t>(max_smem))
    return cudaErrorNotSupported;
  const unsigned grid = grid_of(p.B * p.T * p.K * (p.group_size() / Shape::kRows));
  if (grid == 0) return cudaErrorInvalidConfiguration;
  auto kernel = attn_dist_tc_kernel<Shape, Elem>;
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
      e != cudaSuccess)
    return e;
  const int64_t total = p.B * (p.N / p.head_group) * p.T * p.topk;
  if (cudaError_t e = cudaMemsetAsync(p.dist, 0, sizeof(float) * total, stream); e != cudaSuccess) return e;
  kernel<<<grid, Shape::kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

// Rows per CTA: 64 or 16 query heads, dividing both the key head's group (a CTA's heads share their
// indices) and the output's head group, which then spans one or two CTAs. 0: none fits.
int attn_dist_rows(const SparseParams& p) {
  for (int rows : {64, 16})
    if (p.group_size() % rows == 0 && p.head_group % rows == 0 && p.head_group / rows <= 2) return rows;
  return 0;
}

}  // namespace
}  // namespace tc

cudaError_t attn_dist_tensor_cores(const SparseParams& p, cudaStream_t stream) {
  const int rows = tc::attn_dist_rows(p);
  if (!tc::tensor_core_shapes(p, /*reads_values=*/false) || rows == 0) return cudaErrorNotSupported;
  const int max_smem = tc::max_dynamic_smem();
  return tc::dispatch_half_dtype(p.dtype, [&](auto tag) {
    using Elem = decltype(tag);
    return tc::dispatch_qk_dim(p.H, [&](auto qk) {
      // (The value dims are unused: attn_dist reads no values.) Three stages where they fit.
      auto launch = [&](auto shape) {
        return tc::launch_attn_dist<decltype(shape), Elem>(p, max_smem, stream);
      };
      if (rows == 64)
        return tc::first_taken([&] { return launch(tc::TileShape<qk(), qk(), 4, 3>{}); },
                               [&] { return launch(tc::TileShape<qk(), qk(), 4, 2>{}); });
      return tc::first_taken([&] { return launch(tc::TileShape<qk(), qk(), 1, 3>{}); },
                             [&] { return launch(tc::TileShape<qk(), qk(), 1, 2>{}); });
    });
  });
}

}  // namespace jfa::sparse_gpu
