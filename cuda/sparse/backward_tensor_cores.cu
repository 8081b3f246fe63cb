// Backward of top-k sparse attention on tensor cores (sm80 mma.sync; also what Hopper runs), for
// deterministic=False. The tiles of tensor_core_tiles.cuh: a CTA per query position and block of
// query heads of one key/value head, the selected rows streamed through a ring. Per step:
//   1. each pair of warps: logits = Q·Kᵀ and dP = dO·Vᵀ for its 16 heads (the pair splits the head
//      dims), P = exp(scale·logits − LSE) and scale·dS = scale·P∘(dP − D), D = rowsum(dO∘O) − dLSE;
//   2. dQ += scale·dS·K in registers, each warp of a pair half of the columns;
//   3. P and scale·dS of all the CTA's heads go to shared memory, and the warps share out the columns
//      of dK = scale·dSᵀ·Q and dV = Pᵀ·dO for the step's rows: summed over the CTA's heads on the
//      tensor cores, then added into the float32 accumulators with atomics (16-byte reductions on
//      Hopper), so that a selected row takes one add per element per CTA rather than one per head.
#include <cmath>

#include "sparse/device_common.cuh"
#include "sparse/sparse_gpu.h"
#include "sparse/tensor_core_tiles.cuh"

namespace jfa::sparse_gpu {
namespace tc {
namespace {

// Where a backward CTA's shared memory goes (byte offsets; each region a multiple of 16 bytes).
template <typename Shape, typename Elem>
struct BackwardSmem {
  static constexpr int kPStride = Shape::kKeys + 8;  // P and dS rows, padded as Q's are
  static constexpr size_t kExchangeFloats = Shape::kWarps * Shape::kKeyTiles * 4 * 32;
  static constexpr size_t kQ = 0;
  static constexpr size_t kDout = kQ + sizeof(Elem) * Shape::kRows * Shape::kQStride;
  static constexpr size_t kProbs = kDout + sizeof(Elem) * Shape::kRows * Shape::kVStride;
  static constexpr size_t kDscores = kProbs + sizeof(Elem) * Shape::kRows * kPStride;
  // One exchange for the logits' and dP's partial sums in turn (a second costs as much again).
  static constexpr size_t kExchange = kDscores + sizeof(Elem) * Shape::kRows * kPStride;
  static constexpr size_t kRowsOf = kExchange + sizeof(float) * kExchangeFloats;
  static constexpr size_t kK = kRowsOf + sizeof(int32_t) * Shape::kStages * Shape::kKeys;
  static constexpr size_t kV = kK + sizeof(Elem) * Shape::kStages * Shape::kKeys * Shape::kQStride;
  __host__ __device__ static size_t valid(bool separate_v) {
    return kV + (separate_v ? sizeof(Elem) * Shape::kStages * Shape::kKeys * Shape::kVStride : 0);
  }
  __host__ __device__ static size_t bytes(bool separate_v) { return valid(separate_v) + Shape::kStages * Shape::kKeys; }
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

// s (logits) becomes P and dp becomes scale·dS; invalid slots give 0 in both.
template <typename Shape>
__device__ __forceinline__ void probs_and_dscores(const SparseParams& p, const RowTerms& terms, const uint8_t* valid,
                                                  int lane, float (&s)[Shape::kKeyTiles][4],
                                                  float (&dp)[Shape::kKeyTiles][4]) {
  const float scale_log2 = p.scale * kLog2e;
#pragma unroll
  for (int nt = 0; nt < Shape::kKeyTiles; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e / 2;
      const bool ok = valid[fragment_key(nt, e, lane)];
      const float prob = ok ? exp2f(s[nt][e] * scale_log2 - terms.lse_log2[r]) : 0.f;
      s[nt][e] = prob;
      dp[nt][e] = ok ? p.scale * prob * (dp[nt][e] - terms.d[r]) : 0.f;
    }
}

// The pair's rows of w (16 x kKeys, fragment layout) into the CTA's [kRows, kPStride] tile.
template <typename Shape, typename Elem, int kPStride>
__device__ __forceinline__ void store_rows(const WarpRole<Shape>& role, const float (&w)[Shape::kKeyTiles][4],
                                           Elem* tile) {
  const int lane = role.lane;
#pragma unroll
  for (int nt = 0; nt < Shape::kKeyTiles; ++nt)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      *reinterpret_cast<uint32_t*>(tile + (role.row_group * 16 + lane / 4 + 8 * r) * kPStride + nt * 8 + lane % 4 * 2) =
          mma::pack2<Elem>(w[nt][2 * r], w[nt][2 * r + 1]);
}

// Adds a lane's accumulator fragment of one n8 tile (rows g and g + 8 of the m16 tile, g = lane / 4,
// at row offsets row_offset[0] and [1], −1 for an invalid slot; columns col and col + 1) into `out`.
// On Hopper as one 16-byte reduction per lane: the even lane of each pair takes row g's four
// columns (its two and its neighbour's), the odd lane row g + 8's. Elsewhere as float atomics.
__device__ __forceinline__ void add_fragment(float* out, const int64_t (&row_offset)[2], int col, const float (&v)[4],
                                             int lane) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const bool even = lane % 2 == 0;
  const float got0 = __shfl_xor_sync(0xffffffffu, even ? v[2] : v[0], 1);
  const float got1 = __shfl_xor_sync(0xffffffffu, even ? v[3] : v[1], 1);
  const int64_t row = even ? row_offset[0] : row_offset[1];  // (a select: an index would put the array in local memory)
  if (row >= 0)
    atomicAdd(reinterpret_cast<float4*>(out + row + (col & ~3)),
              even ? make_float4(v[0], v[1], got0, got1) : make_float4(got0, got1, v[2], v[3]));
#else
#pragma unroll
  for (int h = 0; h < 2; ++h)
    if (row_offset[h] >= 0) {
      atomicAdd(out + row_offset[h] + col, v[2 * h]);
      atomicAdd(out + row_offset[h] + col + 1, v[2 * h + 1]);
    }
#endif
}

// For the step's rows: out[row(key)][c] += Σ_heads W[head][key] · X[head][c] over the CTA's heads,
// W the [kRows, kPStride] tile (P or scale·dS), X the CTA's [kRows, kXStride] rows (dO or Q). The
// warps take 16-column slices in turn; columns at or past `width` and invalid slots are not added.
// out_row(s) is the accumulator offset of selected row s.
template <typename Shape, typename Elem, int kColumns, int kXStride, int kPStride, typename OutRow>
__device__ __forceinline__ void scatter_weighted_rows(const WarpRole<Shape>& role, const Elem* weights, const Elem* x,
                                                      const int32_t* rows, int64_t width, float* out,
                                                      OutRow out_row) {
  constexpr int kMTiles = Shape::kKeys / 16, kKSteps = Shape::kRows / 16;
  const int lane = role.lane;
  // A fragments of Wᵀ (keys x heads) for every m16 tile of keys and k16 step of heads, from the
  // [head][key] tile through transposing loads.
  uint32_t a[kMTiles][kKSteps][4];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks)
      mma::ldmatrix_x4_trans(a[mt][ks], weights + (ks * 16 + lane / 16 * 8 + lane % 8) * kPStride + mt * 16 +
                                            lane / 8 % 2 * 8);
  int64_t row_offset[kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int32_t s = rows[mt * 16 + lane / 4 + 8 * h];
      row_offset[mt][h] = s < 0 ? -1 : out_row(s);
    }
  const Elem* x_row = x + (lane % 8 + lane / 8 % 2 * 8) * kXStride + lane / 16 * 8;
#pragma unroll 1
  for (int slice = role.warp; slice < kColumns / 16; slice += Shape::kWarps) {
    float acc[kMTiles][2][4] = {};
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      uint32_t b[4];
      mma::ldmatrix_x4_trans(b, x_row + ks * 16 * kXStride + slice * 16);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        mma::mma_16816<Elem>(acc[mt][0], a[mt][ks], b[0], b[1]);
        mma::mma_16816<Elem>(acc[mt][1], a[mt][ks], b[2], b[3]);
      }
    }
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = slice * 16 + j * 8 + lane % 4 * 2;
        // Width is a multiple of 8, so the test is the same for the whole warp (add_fragment shuffles).
        if (col >= width) continue;
        add_fragment(out, row_offset[mt], col, acc[mt][j], lane);
      }
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
    sparse_backward_tc_kernel(SparseParams p, SparseBackwardWorkspace ws) {
  extern __shared__ __align__(16) unsigned char smem[];
  using Plan = BackwardSmem<Shape, Elem>;
  constexpr int kPStride = Plan::kPStride;
  const bool separate_v = p.v != nullptr;
  Elem* sq = reinterpret_cast<Elem*>(smem + Plan::kQ);
  Elem* sdout = reinterpret_cast<Elem*>(smem + Plan::kDout);
  Elem* sprobs = reinterpret_cast<Elem*>(smem + Plan::kProbs);
  Elem* sdscores = reinterpret_cast<Elem*>(smem + Plan::kDscores);
  float* exchange = reinterpret_cast<float*>(smem + Plan::kExchange);
  int32_t* rows = reinterpret_cast<int32_t*>(smem + Plan::kRowsOf);
  Elem* sk = reinterpret_cast<Elem*>(smem + Plan::kK);
  Elem* sv = separate_v ? reinterpret_cast<Elem*>(smem + Plan::kV) : nullptr;
  uint8_t* valid = smem + Plan::valid(separate_v);
  constexpr int kKBuffer = Shape::kKeys * Shape::kQStride, kVBuffer = Shape::kKeys * Shape::kVStride;

  const TileItem it = tile_item<Shape>(p);
  const WarpRole<Shape> role;
  const RowTerms terms = row_terms<Shape>(p, ws, it, role);
  // dO joins the first step's copies (for_each_step's first wait covers it).
  load_head_rows<Shape, Shape::kDimV, Shape::kVStride>(
      it, static_cast<const Elem*>(p.dout), p.Hv, [&](int64_t n) { return p.o_row(it.b, it.t, n); }, sdout);
  float* dk_accum = ws.dk_accum;
  // With v null, dV lands in the first Hv columns of dK's accumulator (K and V are one buffer).
  float* dv_accum = separate_v ? ws.dv_accum : ws.dk_accum;
  auto k_row = [&](int32_t s) { return p.k_row(it.b, s, it.kh); };
  auto v_row = [&](int32_t s) { return separate_v ? p.v_row(it.b, s, it.kh) : p.k_row(it.b, s, it.kh); };

  float dq[Shape::kDimQK / 16][4] = {};
  for_each_step<Shape>(p, it, sq, sk, sv, valid, rows, [&](int64_t, int buf) {
    const Elem* keys = sk + buf * kKBuffer;
    const Elem* values = separate_v ? sv + buf * kVBuffer : keys;
    const int v_stride = separate_v ? Shape::kVStride : Shape::kQStride;
    float s[Shape::kKeyTiles][4], dp[Shape::kKeyTiles][4];
    step_logits<Shape>(role, sq, keys, exchange, s);
    role.pair_barrier();  // the partner has read the logits' partials before dP's overwrite them
    pair_products<Shape, Shape::kDimV, Shape::kVStride>(role, sdout, values, v_stride, exchange, dp);
    probs_and_dscores<Shape>(p, terms, valid + buf * Shape::kKeys, role.lane, s, dp);
    accumulate_half_columns<Shape, Shape::kDimQK>(role, dp, keys, Shape::kQStride, dq);
    if (role.half == 0) {  // both warps of a pair hold the same P and dS
      store_rows<Shape, Elem, kPStride>(role, s, sprobs);
      store_rows<Shape, Elem, kPStride>(role, dp, sdscores);
    }
    __syncthreads();  // every pair's P and dS are in
    const int32_t* step_rows = rows + buf * Shape::kKeys;
    scatter_weighted_rows<Shape, Elem, Shape::kDimQK, Shape::kQStride, kPStride>(role, sdscores, sq, step_rows, p.H,
                                                                                dk_accum, k_row);
    scatter_weighted_rows<Shape, Elem, Shape::kDimV, Shape::kVStride, kPStride>(role, sprobs, sdout, step_rows, p.Hv,
                                                                               dv_accum, v_row);
    // The next step's barrier (for_each_step) keeps P and dS until every warp has read them.
  });
  write_dq<Shape, Elem>(p, it, role, dq);
}

// Launches the kernel of `Shape` where its shared memory fits (with `launch` false: only says
// whether it would).
template <typename Shape, typename Elem>
cudaError_t launch_backward(const SparseParams& p, const SparseBackwardWorkspace& ws, int max_smem, bool launch,
                            cudaStream_t stream) {
  const size_t smem = BackwardSmem<Shape, Elem>::bytes(p.v != nullptr);
  if (smem > static_cast<size_t>(max_smem)) return cudaErrorNotSupported;
  const int64_t blocks = (p.group_size() + Shape::kRows - 1) / Shape::kRows;
  const unsigned grid = grid_of(p.B * p.T * p.K * blocks);
  if (grid == 0) return cudaErrorInvalidConfiguration;
  if (!launch) return cudaSuccess;
  auto kernel = sparse_backward_tc_kernel<Shape, Elem>;
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
      e != cudaSuccess)
    return e;
  kernel<<<grid, Shape::kThreads, smem, stream>>>(p, ws);
  return cudaGetLastError();
}

// 64 heads per CTA where the group has more than 32 and they fit in shared memory (at MLA's 576/512
// they do not), else 32, else 16: the atomics per selected row fall with the heads a CTA sums over.
cudaError_t dispatch_backward(const SparseParams& p, const SparseBackwardWorkspace& ws, bool launch,
                              cudaStream_t stream) {
  if (p.deterministic || !tensor_core_shapes(p, /*reads_values=*/true)) return cudaErrorNotSupported;
  const int max_smem = max_dynamic_smem();
  const int64_t group = p.group_size();
  return dispatch_half_dtype(p.dtype, [&](auto tag) {
    using Elem = decltype(tag);
    return dispatch_dims(p.H, p.Hv, [&](auto qk, auto v) {
      auto try_shape = [&](auto shape, bool wanted) {
        return wanted ? launch_backward<decltype(shape), Elem>(p, ws, max_smem, launch, stream)
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

bool backward_tensor_cores_takes(const SparseParams& p) {
  return tc::dispatch_backward(p, SparseBackwardWorkspace{}, /*launch=*/false, nullptr) == cudaSuccess;
}

cudaError_t backward_tensor_cores(const SparseParams& p, const SparseBackwardWorkspace& ws, cudaStream_t stream) {
  return tc::dispatch_backward(p, ws, /*launch=*/true, stream);
}

}  // namespace jfa::sparse_gpu
