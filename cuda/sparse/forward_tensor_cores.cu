// Forward of top-k sparse attention on tensor cores (sm80 mma.sync; also what Hopper runs): the
// tiles of tensor_core_tiles.cuh, then per step an online softmax of the pair's logits in the log2
// domain and O += P·V, P taken from the logits' registers (their fragment layout is the A operand's)
// and V from the gathered rows (the key rows themselves when V is the first Hv columns of K).
#include <cmath>

#include "sparse/device_common.cuh"
#include "sparse/sparse_gpu.h"
#include "sparse/tensor_core_tiles.cuh"

namespace jfa::sparse_gpu {
namespace tc {
namespace {

// Running softmax statistics of the two rows a thread holds (lane / 4 and lane / 4 + 8).
struct RowStats {
  float max[2] = {-INFINITY, -INFINITY};  // in units of scale·log2(e)·q·k
  float sum[2] = {0.f, 0.f};              // this thread's share; the quad's total at the end
};

// Turns the step's logits into probabilities under the updated running max and rescales the
// output rows accordingly. Invalid slots become 0.
template <typename Shape>
__device__ __forceinline__ void softmax_step(float scale_log2, const uint8_t* valid, int lane,
                                             float (&s)[Shape::kKeyTiles][4], RowStats& stats,
                                             float (&o)[Shape::kDimV / 16][4]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float step_max = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < Shape::kKeyTiles; ++nt)
#pragma unroll
      for (int e = 2 * r; e < 2 * r + 2; ++e) {
        s[nt][e] = valid[fragment_key(nt, e, lane)] ? s[nt][e] * scale_log2 : -INFINITY;
        step_max = fmaxf(step_max, s[nt][e]);
      }
    step_max = fmaxf(step_max, __shfl_xor_sync(0xffffffffu, step_max, 1));
    step_max = fmaxf(step_max, __shfl_xor_sync(0xffffffffu, step_max, 2));
    const float new_max = fmaxf(stats.max[r], step_max);
    // Subtracting 0 while no slot was valid keeps exp2(−inf − max) at 0 instead of NaN.
    const float base = new_max == -INFINITY ? 0.f : new_max;
    const float correction = exp2f(stats.max[r] - base);
    stats.max[r] = new_max;
    float step_sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < Shape::kKeyTiles; ++nt)
#pragma unroll
      for (int e = 2 * r; e < 2 * r + 2; ++e) {
        s[nt][e] = exp2f(s[nt][e] - base);
        step_sum += s[nt][e];
      }
    stats.sum[r] = stats.sum[r] * correction + step_sum;
#pragma unroll
    for (int nt = 0; nt < Shape::kDimV / 16; ++nt) {
      o[nt][2 * r] *= correction;
      o[nt][2 * r + 1] *= correction;
    }
  }
}

// Normalizes and writes this warp's output columns, and (half 0) the LSE of its rows.
template <typename Shape, typename Elem>
__device__ __forceinline__ void write_output(const SparseParams& p, const TileItem& it, const WarpRole<Shape>& role,
                                             RowStats& stats, float (&o)[Shape::kDimV / 16][4]) {
  const int lane = role.lane;
  Elem* out = static_cast<Elem*>(p.o);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = stats.sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int64_t n = it.n0 + role.row_group * 16 + lane / 4 + 8 * r;
    if (n >= it.n_end) continue;
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    Elem* row = out + p.o_row(it.b, it.t, n);
#pragma unroll
    for (int nt = 0; nt < Shape::kDimV / 16; ++nt) {
      const int col = role.half * (Shape::kDimV / 2) + nt * 8 + lane % 4 * 2;
      if (col < p.Hv)
        *reinterpret_cast<uint32_t*>(row + col) = mma::pack2<Elem>(o[nt][2 * r] * inv, o[nt][2 * r + 1] * inv);
    }
    if (role.half == 0 && lane % 4 == 0)
      p.lse[p.stat(it.b, it.t, n)] = sum > 0.f ? (stats.max[r] + log2f(sum)) * kLn2 : -INFINITY;
  }
}

template <typename Shape, typename Elem>
__global__ void __launch_bounds__(Shape::kThreads, 1) sparse_forward_tc_kernel(SparseParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  using Plan = SmemPlan<Shape, Elem>;
  const bool separate_v = p.v != nullptr;
  Elem* sq = reinterpret_cast<Elem*>(smem + Plan::kQ);
  Elem* sk = reinterpret_cast<Elem*>(smem + Plan::kK);
  Elem* sv = separate_v ? reinterpret_cast<Elem*>(smem + Plan::kV) : nullptr;
  float* exchange = reinterpret_cast<float*>(smem + Plan::exchange(separate_v));
  uint8_t* valid = smem + Plan::valid(separate_v);
  constexpr int kKBuffer = Shape::kKeys * Shape::kQStride, kVBuffer = Shape::kKeys * Shape::kVStride;

  const TileItem it = tile_item<Shape>(p);
  const WarpRole<Shape> role;
  const float scale_log2 = p.scale * kLog2e;
  float o[Shape::kDimV / 16][4];
#pragma unroll
  for (int nt = 0; nt < Shape::kDimV / 16; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[nt][e] = 0.f;
  RowStats stats;
  for_each_step<Shape>(p, it, sq, sk, sv, valid, nullptr, [&](int64_t, int buf) {
    float s[Shape::kKeyTiles][4];
    step_logits<Shape>(role, sq, sk + buf * kKBuffer, exchange, s);
    softmax_step<Shape>(scale_log2, valid + buf * Shape::kKeys, role.lane, s, stats, o);
    if (separate_v)
      accumulate_half_columns<Shape, Shape::kDimV>(role, s, sv + buf * kVBuffer, Shape::kVStride, o);
    else
      accumulate_half_columns<Shape, Shape::kDimV>(role, s, sk + buf * kKBuffer, Shape::kQStride, o);
  });
  write_output<Shape, Elem>(p, it, role, stats, o);
}

template <typename Shape, typename Elem>
cudaError_t launch_forward(const SparseParams& p, int max_smem, cudaStream_t stream) {
  const size_t smem = SmemPlan<Shape, Elem>::bytes(p.v != nullptr);
  if (smem > static_cast<size_t>(max_smem)) return cudaErrorNotSupported;
  const int64_t blocks = (p.group_size() + Shape::kRows - 1) / Shape::kRows;
  const unsigned grid = grid_of(p.B * p.T * p.K * blocks);
  if (grid == 0) return cudaErrorInvalidConfiguration;
  auto kernel = sparse_forward_tc_kernel<Shape, Elem>;
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
      e != cudaSuccess)
    return e;
  kernel<<<grid, Shape::kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace
}  // namespace tc

cudaError_t forward_tensor_cores(const SparseParams& p, cudaStream_t stream) {
  if (!tc::tensor_core_shapes(p, /*reads_values=*/true)) return cudaErrorNotSupported;
  const int max_smem = tc::max_dynamic_smem();
  // 64 heads per CTA where the group has more than 16, else (or where 64 do not fit in shared
  // memory: a separate V on an A100) 16; three stages where they fit, else two.
  const bool wide = p.group_size() > 16;
  return tc::dispatch_half_dtype(p.dtype, [&](auto tag) {
    using Elem = decltype(tag);
    return tc::dispatch_dims(p.H, p.Hv, [&](auto qk, auto v) {
      auto launch = [&](auto shape) {
        return tc::launch_forward<decltype(shape), Elem>(p, max_smem, stream);
      };
      auto if_wide = [&](auto shape) { return wide ? launch(shape) : cudaErrorNotSupported; };
      return tc::first_taken([&] { return if_wide(tc::TileShape<qk(), v(), 4, 3>{}); },
                             [&] { return if_wide(tc::TileShape<qk(), v(), 4, 2>{}); },
                             [&] { return launch(tc::TileShape<qk(), v(), 1, 3>{}); },
                             [&] { return launch(tc::TileShape<qk(), v(), 1, 2>{}); });
    });
  });
}

}  // namespace jfa::sparse_gpu
