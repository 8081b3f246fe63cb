// Backward of top-k sparse attention on tensor cores (sm80 mma.sync; also what Hopper runs), for
// deterministic=False, in two passes over chunks of (query position, key head) items:
//   1. here, the tiles of tensor_core_tiles.cuh: a CTA per query position and block of query heads
//      of one key/value head, the selected rows streamed through a ring. Per step each pair of
//      warps computes logits = Q·Kᵀ and dP = dO·Vᵀ for its 16 heads (the pair splits the head dims),
//      P = exp(scale·logits − LSE) and scale·dS = scale·P∘(dP − D), D = rowsum(dO∘O) − dLSE, and
//      adds scale·dS·K into dQ in registers (each warp of a pair half of the columns); one warp of
//      the pair writes P and the other scale·dS into the workspace (ws.weights);
//   2. backward_key_rows.cu: dK = scale·dSᵀ·Q and dV = Pᵀ·dO of the selected rows from those
//      weights, summed over all of a key head's query heads before the float32 atomics.
// Forming dK and dV here instead, from the CTA's block of heads only, left their GEMMs two k16 steps
// deep and reduced every selected row once per block: most of the time went there.
#include <cmath>

#include "sparse/backward_key_rows.h"
#include "sparse/device_common.cuh"
#include "sparse/sparse_gpu.h"
#include "sparse/tensor_core_tiles.cuh"

namespace jfa::sparse_gpu {
namespace tc {
namespace {

// Where a backward CTA's shared memory goes (byte offsets; each region a multiple of 16 bytes). No
// slot flags and no staging of P and dS: at MLA's 576/512 that is what lets 64 heads (Q, dO, the
// exchange and two 32-row key buffers: 227 KiB) fit on Hopper.
template <typename Shape, typename Elem>
struct BackwardSmem {
  static constexpr size_t kExchangeFloats = Shape::kWarps * Shape::kKeyTiles * 4 * 32;
  static constexpr size_t kQ = 0;
  static constexpr size_t kDout = kQ + sizeof(Elem) * Shape::kRows * Shape::kQStride;
  // One exchange for the logits' and dP's partial sums in turn (a second costs as much again).
  static constexpr size_t kExchange = kDout + sizeof(Elem) * Shape::kRows * Shape::kVStride;
  static constexpr size_t kK = kExchange + sizeof(float) * kExchangeFloats;
  static constexpr size_t kV = kK + sizeof(Elem) * Shape::kStages * Shape::kKeys * Shape::kQStride;
  __host__ __device__ static size_t bytes(bool separate_v) {
    return kV + (separate_v ? sizeof(Elem) * Shape::kStages * Shape::kKeys * Shape::kVStride : 0);
  }
};

// The LSE (log2 units; +inf for a head past the block or a row that saw no key, so that its P is 0)
// and D of the two rows a thread holds.
struct RowTerms {
  float lse_log2[2];
  float d[2];
};

template <typename Shape>
__device__ __forceinline__ RowTerms row_terms(const SparseParams& p, const SparseBackwardWorkspace& ws,
                                              const TileItem& it, const WarpRole<Shape>& role) {
  RowTerms terms;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t n = it.n0 + role.row_group * 16 + role.lane / 4 + 8 * r;
    const float lse = n < it.n_end ? p.lse[p.stat(it.b, it.t, n)] : -INFINITY;
    terms.lse_log2[r] = lse == -INFINITY ? INFINITY : lse * kLog2e;
    terms.d[r] = n < it.n_end ? ws.softmax_d[p.stat(it.b, it.t, n)] : 0.f;
  }
  return terms;
}

// Bit 2·nt + (e & 1) says whether the step's slot fragment_key(nt, e, lane) selects a key. Read
// from the index row (every warp reads the same row, so it stays in L1) instead of flags in shared
// memory, which the 64-head tile has no room for.
template <typename Shape>
__device__ __forceinline__ uint32_t slot_validity(const SparseParams& p, const TileItem& it, int64_t step, int lane) {
  const int32_t* indices = p.indices + p.index_row(it.b, it.t, it.kh);
  uint32_t bits = 0;
#pragma unroll
  for (int nt = 0; nt < Shape::kKeyTiles; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int64_t slot = step * Shape::kKeys + fragment_key(nt, e, lane);
      const int32_t s = slot < p.topk ? __ldg(indices + slot) : -1;
      bits |= uint32_t(sparse_index_valid(p, it.t, s)) << (2 * nt + e);
    }
  return bits;
}

// s (logits) becomes P and dp becomes scale·dS; invalid slots give 0 in both.
template <typename Shape>
__device__ __forceinline__ void probs_and_dscores(const SparseParams& p, const RowTerms& terms, uint32_t valid_bits,
                                                  float (&s)[Shape::kKeyTiles][4], float (&dp)[Shape::kKeyTiles][4]) {
  const float scale_log2 = p.scale * kLog2e;
#pragma unroll
  for (int nt = 0; nt < Shape::kKeyTiles; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e / 2;
      const bool ok = (valid_bits >> (2 * nt + (e & 1))) & 1u;
      const float prob = ok ? exp2f(s[nt][e] * scale_log2 - terms.lse_log2[r]) : 0.f;
      s[nt][e] = prob;
      dp[nt][e] = ok ? p.scale * prob * (dp[nt][e] - terms.d[r]) : 0.f;
    }
}

// The step's weights w (P for which = 0, scale·dS for 1) of the pair's heads, in the logits'
// fragment layout, into the item's rows of the workspace; heads past the block are skipped. Steps
// are kKeys long and kKeys divides 64, so every step ends within the padded row.
template <typename Shape, typename Elem>
__device__ __forceinline__ void store_weights(const SparseParams& p, const SparseBackwardWorkspace& ws,
                                              const TileItem& it, const WarpRole<Shape>& role, int64_t local_item,
                                              int64_t step, int which, const float (&w)[Shape::kKeyTiles][4]) {
  const int64_t G = p.group_size(), row_slots = weight_row_slots(p.topk);
  const int lane = role.lane;
  Elem* base = static_cast<Elem*>(ws.weights) + (local_item * 2 * G + which * G + (it.n0 - it.kh * G)) * row_slots +
               step * Shape::kKeys;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int head = role.row_group * 16 + lane / 4 + 8 * r;
    if (it.n0 + head >= it.n_end) continue;
    Elem* row = base + head * row_slots;
#pragma unroll
    for (int nt = 0; nt < Shape::kKeyTiles; ++nt)
      *reinterpret_cast<uint32_t*>(row + nt * 8 + lane % 4 * 2) = mma::pack2<Elem>(w[nt][2 * r], w[nt][2 * r + 1]);
  }
}

// Writes this warp's half of the dQ columns of the pair's heads.
template <typename Shape, typename Elem>
__device__ __forceinline__ void write_dq(const SparseParams& p, const TileItem& it, const WarpRole<Shape>& role,
                                         const float (&dq)[Shape::kDimQK / 16][4]) {
  const int lane = role.lane;
  Elem* out = static_cast<Elem*>(p.dq);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t n = it.n0 + role.row_group * 16 + lane / 4 + 8 * r;
    if (n >= it.n_end) continue;
    Elem* row = out + p.q_row(it.b, it.t, n);
#pragma unroll
    for (int nt = 0; nt < Shape::kDimQK / 16; ++nt) {
      const int col = role.half * (Shape::kDimQK / 2) + nt * 8 + lane % 4 * 2;
      if (col < p.H) *reinterpret_cast<uint32_t*>(row + col) = mma::pack2<Elem>(dq[nt][2 * r], dq[nt][2 * r + 1]);
    }
  }
}

template <typename Shape, typename Elem>
__global__ void __launch_bounds__(Shape::kThreads, 1)
    sparse_backward_tc_kernel(SparseParams p, SparseBackwardWorkspace ws, int64_t first_item) {
  extern __shared__ __align__(16) unsigned char smem[];
  using Plan = BackwardSmem<Shape, Elem>;
  const bool separate_v = p.v != nullptr;
  Elem* sq = reinterpret_cast<Elem*>(smem + Plan::kQ);
  Elem* sdout = reinterpret_cast<Elem*>(smem + Plan::kDout);
  float* exchange = reinterpret_cast<float*>(smem + Plan::kExchange);
  Elem* sk = reinterpret_cast<Elem*>(smem + Plan::kK);
  Elem* sv = separate_v ? reinterpret_cast<Elem*>(smem + Plan::kV) : nullptr;
  constexpr int kKBuffer = Shape::kKeys * Shape::kQStride, kVBuffer = Shape::kKeys * Shape::kVStride;

  const int64_t blocks = (p.group_size() + Shape::kRows - 1) / Shape::kRows;
  const TileItem it = tile_item<Shape>(p, first_item * blocks + blockIdx.x);
  const int64_t local_item = (it.b * p.T + it.t) * p.K + it.kh - first_item;
  const WarpRole<Shape> role;
  const RowTerms terms = row_terms<Shape>(p, ws, it, role);
  // dO joins the first step's copies (for_each_step's first wait covers it).
  load_head_rows<Shape, Shape::kDimV, Shape::kVStride>(
      it, static_cast<const Elem*>(p.dout), p.Hv, [&](int64_t n) { return p.o_row(it.b, it.t, n); }, sdout);

  float dq[Shape::kDimQK / 16][4] = {};
  for_each_step<Shape>(p, it, sq, sk, sv, static_cast<uint8_t*>(nullptr), nullptr, [&](int64_t step, int buf) {
    const Elem* keys = sk + buf * kKBuffer;
    const Elem* values = separate_v ? sv + buf * kVBuffer : keys;
    const int v_stride = separate_v ? Shape::kVStride : Shape::kQStride;
    // Read before the products, whose fragments leave no registers for eight index loads.
    const uint32_t valid_bits = slot_validity<Shape>(p, it, step, role.lane);
    float s[Shape::kKeyTiles][4], dp[Shape::kKeyTiles][4];
    step_logits<Shape>(role, sq, keys, exchange, s);
    role.pair_barrier();  // the partner has read the logits' partials before dP's overwrite them
    pair_products<Shape, Shape::kDimV, Shape::kVStride>(role, sdout, values, v_stride, exchange, dp);
    probs_and_dscores<Shape>(p, terms, valid_bits, s, dp);
    accumulate_half_columns<Shape, Shape::kDimQK>(role, dp, keys, Shape::kQStride, dq);
    // Both warps of a pair hold the same P and dS: each writes one.
    if (role.half == 0)
      store_weights<Shape, Elem>(p, ws, it, role, local_item, step, 0, s);
    else
      store_weights<Shape, Elem>(p, ws, it, role, local_item, step, 1, dp);
  });
  write_dq<Shape, Elem>(p, it, role, dq);
}

// Runs both passes with `Shape`'s first pass where its shared memory fits (with `launch` false: only
// says whether it would), ws.weight_items items at a time; `passes`, where given, run each chunk's
// first or second pass instead unless they decline.
template <typename Shape, typename Elem>
cudaError_t launch_backward(const SparseParams& p, const SparseBackwardWorkspace& ws, int max_smem, bool launch,
                            cudaStream_t stream, BackwardPasses passes) {
  const size_t smem = BackwardSmem<Shape, Elem>::bytes(p.v != nullptr);
  if (smem > static_cast<size_t>(max_smem) || !key_rows_take(p, max_smem)) return cudaErrorNotSupported;
  const int64_t blocks = (p.group_size() + Shape::kRows - 1) / Shape::kRows;
  const int64_t items = p.B * p.T * p.K, chunk = ws.weight_items < items ? ws.weight_items : items;
  if (items == 0 || grid_of(chunk * blocks) == 0) return cudaErrorInvalidConfiguration;
  if (!launch) return cudaSuccess;
  auto kernel = sparse_backward_tc_kernel<Shape, Elem>;
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
      e != cudaSuccess)
    return e;
  for (int64_t first = 0; first < items; first += chunk) {
    const int64_t count = items - first < chunk ? items - first : chunk;
    cudaError_t e = passes.first ? passes.first(p, ws.softmax_d, ws.weights, first, count, stream) : cudaErrorNotSupported;
    if (e == cudaErrorNotSupported) {
      kernel<<<grid_of(count * blocks), Shape::kThreads, smem, stream>>>(p, ws, first);
      e = cudaGetLastError();
    }
    if (e != cudaSuccess) return e;
    e = passes.second ? passes.second(p, ws.weights, ws.dk_accum, first, count, stream) : cudaErrorNotSupported;
    if (e == cudaErrorNotSupported) e = key_row_gradients(p, ws, first, count, stream);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

// 64 heads per CTA where the group has more than 32 and they fit in shared memory (at MLA's 576/512
// only with V inside K, on Hopper), else 32, else 16: each gathered row serves the CTA's heads. Calls without a weights
// workspace are not taken.
cudaError_t dispatch_backward(const SparseParams& p, const SparseBackwardWorkspace& ws, bool launch,
                              cudaStream_t stream, BackwardPasses passes) {
  if (p.deterministic || !tensor_core_shapes(p, /*reads_values=*/true) || ws.weights == nullptr ||
      ws.weight_items < 1)
    return cudaErrorNotSupported;
  const int max_smem = max_dynamic_smem();
  const int64_t group = p.group_size();
  return dispatch_half_dtype(p.dtype, [&](auto tag) {
    using Elem = decltype(tag);
    return dispatch_dims(p.H, p.Hv, [&](auto qk, auto v) {
      auto try_shape = [&](auto shape, bool wanted) {
        return wanted ? launch_backward<decltype(shape), Elem>(p, ws, max_smem, launch, stream, passes)
                      : cudaErrorNotSupported;
      };
      return first_taken([&] { return try_shape(TileShape<qk(), v(), 4, 2>{}, group > 32); },
                         [&] { return try_shape(TileShape<qk(), v(), 2, 2>{}, group > 16); },
                         [&] { return try_shape(TileShape<qk(), v(), 1, 2>{}, true); });
    });
  });
}

}  // namespace
}  // namespace tc

bool backward_tensor_cores_takes(const SparseParams& p, const SparseBackwardWorkspace& ws) {
  return tc::dispatch_backward(p, ws, /*launch=*/false, nullptr, {}) == cudaSuccess;
}

cudaError_t backward_tensor_cores(const SparseParams& p, const SparseBackwardWorkspace& ws, cudaStream_t stream,
                                  BackwardPasses passes) {
  return tc::dispatch_backward(p, ws, /*launch=*/true, stream, passes);
}

}  // namespace jfa::sparse_gpu
