// Pass 3 of the CPU backward: d(bias) = dS (the gradient of the final logits, natural units),
// summed over the bias's broadcast axes, written in the bias's own shape [Bb, Nb, Tb, Sb].
//
// One work item per output tile: (b', n', query block if Tb = T, key block if Sb = S). An item
// recomputes dS for every tile that broadcasts into it, in a fixed order, and sums into its own
// float32 accumulator, so the result is deterministic, needs no atomics, and no [B, N, T, S]
// tensor exists when the bias is smaller. Recomputing dS costs two tile GEMMs per tile.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backward_stats.h"
#include "kernels.h"
#include "masking.h"
#include "parallel_for.h"
#include "tiles.h"

namespace jfa::cpu {
namespace {

struct BiasGradScratch {
  BiasGradScratch(int H, int Hv)
      : q(static_cast<size_t>(kBr) * round_up_columns(H)), dout(static_cast<size_t>(kBr) * round_up_columns(Hv)),
        kt(static_cast<size_t>(H) * kBc), vt(static_cast<size_t>(Hv) * kBc), s(kBr * kBc),
        dp(kBr * kBc), acc(kBr * kBc), lse2(kBr), d(kBr) {}
  std::vector<float> q, dout;  // [kBr][H padded] (times scale_log2), [kBr][Hv padded]
  std::vector<float> kt, vt;   // [H][kBc], [Hv][kBc]
  std::vector<float> s, dp;    // [kBr][kBc]: P, and dP -> dS
  std::vector<float> acc;      // [rows or 1][keys or 1] of this item's output tile, ld kBc
  std::vector<float> lse2, d;  // [kBr]
};

// dS of one tile into w.dp (row layout, ld kBc); false if the tile is skipped (dS = 0).
bool tile_ds(const AttentionParams& p, const RowStats& stats, const TileCoords& t, BiasGradScratch& w) {
  const SequenceBounds bounds = sequence_bounds(p, t.b);
  const TileMasks masks = tile_masks(p, bounds, t);
  if (masks.kind == TileKind::kSkip) return false;
  const int H = static_cast<int>(p.H), Hv = static_cast<int>(p.Hv);
  const int64_t kv_head = t.n / p.group_size();
  load_rows(head_view(p.q, p.dtype, p.q_strides, t.b, t.n), t.i0, t.rows, H, p.scale_log2, w.q.data(),
            round_up_columns(H), t.rows);
  load_rows(head_view(p.dout, p.dtype, p.do_strides, t.b, t.n), t.i0, t.rows, Hv, 1.f, w.dout.data(),
            round_up_columns(Hv), t.rows);
  load_rows_transposed(head_view(p.k, p.dtype, p.k_strides, t.b, kv_head), t.j0, t.cols, H, 1.f, w.kt.data(), kBc);
  load_rows_transposed(head_view(p.v, p.dtype, p.v_strides, t.b, kv_head), t.j0, t.cols, Hv, 1.f, w.vt.data(), kBc);
  load_stats(stats, t.b, t.n, p.N, t.i0, t.rows, w.lse2.data(), w.d.data());

  gemm(t.rows, kBc, H, w.q.data(), round_up_columns(H), w.kt.data(), kBc, w.s.data(), kBc, false);
  prepare_scores(p, bounds, t, masks, w.s.data(), kBc, /*transposed=*/false, nullptr);
  exp2_minus_row(w.s.data(), t.rows, kBc, kBc, w.lse2.data());
  gemm(t.rows, kBc, Hv, w.dout.data(), round_up_columns(Hv), w.vt.data(), kBc, w.dp.data(), kBc, false);
  if (p.mask.has_dropout()) apply_dropout(p, t, w.dp.data(), kBc, /*transposed=*/false);
  ds_from_dp_row(w.dp.data(), w.s.data(), t.rows, kBc, kBc, w.d.data());
  return true;
}

}  // namespace

void bias_gradient(const AttentionParams& p, const RowStats& stats) {
  const int64_t* dims = p.mask.bias_dims;  // [Bb, Nb, Tb, Sb], each 1 (broadcast) or full
  const bool per_b = dims[0] != 1, per_n = dims[1] != 1, per_i = dims[2] != 1, per_j = dims[3] != 1;
  const int64_t q_blocks = (p.T + kBr - 1) / kBr, k_blocks = (p.S + kBc - 1) / kBc;
  const int64_t out_qb = per_i ? q_blocks : 1, out_kb = per_j ? k_blocks : 1;
  const int64_t items = dims[0] * dims[1] * out_qb * out_kb;
  std::vector<BiasGradScratch> scratch(num_threads_for(items),
                                       BiasGradScratch(static_cast<int>(p.H), static_cast<int>(p.Hv)));
  parallel_for(items, [&](int thread, int64_t item) {
    BiasGradScratch& w = scratch[thread];
    const int64_t kb_out = item % out_kb, qb_out = item / out_kb % out_qb;
    const int64_t n_out = item / (out_kb * out_qb) % dims[1], b_out = item / (out_kb * out_qb * dims[1]);
    // The output tile: rows [i_out, i_out + out_rows) and keys [j_out, j_out + out_cols).
    const int64_t i_out = qb_out * kBr, j_out = kb_out * kBc;
    const int out_rows = per_i ? static_cast<int>(std::min<int64_t>(kBr, p.T - i_out)) : 1;
    const int out_cols = per_j ? static_cast<int>(std::min<int64_t>(kBc, p.S - j_out)) : 1;
    std::fill(w.acc.begin(), w.acc.end(), 0.f);

    for (int64_t b = per_b ? b_out : 0; b < (per_b ? b_out + 1 : p.B); ++b)
      for (int64_t n = per_n ? n_out : 0; n < (per_n ? n_out + 1 : p.N); ++n)
        for (int64_t i0 = per_i ? i_out : 0; i0 < (per_i ? i_out + 1 : p.T); i0 += kBr)
          for (int64_t j0 = per_j ? j_out : 0; j0 < (per_j ? j_out + 1 : p.S); j0 += kBc) {
            const int rows = static_cast<int>(std::min<int64_t>(kBr, p.T - i0));
            const int cols = static_cast<int>(std::min<int64_t>(kBc, p.S - j0));
            if (!tile_ds(p, stats, TileCoords{b, n, i0, rows, j0, cols}, w)) continue;
            for (int r = 0; r < rows; ++r)
              for (int c = 0; c < cols; ++c)
                w.acc[(per_i ? r : 0) * kBc + (per_j ? c : 0)] += w.dp[static_cast<size_t>(r) * kBc + c];
          }

    const int64_t T_out = dims[2], S_out = dims[3];
    float* out = p.mask.dbias + ((b_out * dims[1] + n_out) * T_out + (per_i ? i_out : 0)) * S_out + (per_j ? j_out : 0);
    for (int r = 0; r < out_rows; ++r)
      std::copy_n(w.acc.data() + static_cast<size_t>(r) * kBc, out_cols, out + r * S_out);
  });
}

}  // namespace jfa::cpu
