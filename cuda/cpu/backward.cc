// FlashAttention-2 backward on the CPU, deterministic and without atomics:
//   pass 0, per (b, n, query block): D = rowsum(dO∘O) - dLSE and lse2 = lse·log2(e) (O(B·N·T) floats);
//   pass 1, per (b, kv head, key block): dK, dV summed over the G query heads and all query blocks;
//   pass 2, per (b, n, query block): dQ summed over key blocks;
//   pass 3, only with a bias: d(bias) in the bias's broadcast shape (bias_grad.cc).
// With ALiBi, pass 2 also sums dS·|pos_i - j| per (b, n, query block) for the slopes' gradient;
// the blocks' sums are added up in order afterwards (deterministic like the rest).
// Masks skip whole tiles in every pass (masking.h). Dropout regenerates the forward's mask:
// dV uses the dropped P, and dP = dO·Vᵀ is scaled by keep / (1 - rate) before dS. Soft-capping
// multiplies dS by 1 - tanh² before dQ and dK; d(bias) is dS itself.
// Both passes recompute P = exp2(q·kᵀ·scale_log2 - lse2) tile by tile instead of storing it, and
// dS = P∘(dP - D) with dP = dO·Vᵀ (dLSE enters through D since d lse / d logits = P).
#include <algorithm>
#include <cmath>
#include <vector>

#include "attention_cpu.h"
#include "backward_stats.h"
#include "kernels.h"
#include "masking.h"
#include "parallel_for.h"
#include "tiles.h"

namespace jfa::cpu {
namespace {

// Pass 1 scratch. The item's K and V are converted once, transposed (kt times scale_log2); the
// query-side tiles are read in place when possible, and Pᵀ / dSᵀ are read transposed by gemm_at.
struct KeyBlockScratch {
  KeyBlockScratch(int H, int Hv)
      : kt(static_cast<size_t>(H) * kBc), vt(static_cast<size_t>(Hv) * kBc),
        q(static_cast<size_t>(kBr) * round_up_columns(H)), dout(static_cast<size_t>(kBr) * round_up_columns(Hv)),
        s(kBr * kBc), dp(kBr * kBc), pd(kBr * kBc), sg(kBr * kBc), dk(static_cast<size_t>(kBc) * round_up_columns(H)),
        dv(static_cast<size_t>(kBc) * round_up_columns(Hv)), lse2(kBr), d(kBr) {}
  std::vector<float> kt, vt;     // [H][kBc] (times scale_log2), [Hv][kBc]
  std::vector<float> q, dout;    // conversion space for query-side rows
  std::vector<float> s, dp;      // [kBr][kBc]: P, and dP -> dS
  std::vector<float> pd, sg;     // [kBr][kBc]: P after dropout, softcap derivative
  std::vector<float> dk, dv;     // [kBc][H padded], [kBc][Hv padded]
  std::vector<float> lse2, d;    // [kBr]
};

void key_block_item(const AttentionParams& p, const RowStats& stats, int64_t b, int64_t kv_head, int64_t j0,
                    KeyBlockScratch& w) {
  const int H = static_cast<int>(p.H), Hv = static_cast<int>(p.Hv);
  const int Hp = round_up_columns(H), Hvp = round_up_columns(Hv);
  const int keys = static_cast<int>(std::min<int64_t>(kBc, p.S - j0));
  load_rows_transposed(head_view(p.k, p.dtype, p.k_strides, b, kv_head), j0, keys, H, p.scale_log2, w.kt.data(), kBc);
  load_rows_transposed(head_view(p.v, p.dtype, p.v_strides, b, kv_head), j0, keys, Hv, 1.f, w.vt.data(), kBc);
  std::fill(w.dk.begin(), w.dk.end(), 0.f);
  std::fill(w.dv.begin(), w.dv.end(), 0.f);

  const int64_t G = p.group_size();
  const SequenceBounds bounds = sequence_bounds(p, b);
  const bool softcap = p.mask.softcap > 0.f, dropout = p.mask.has_dropout();
  for (int64_t n = kv_head * G; n < (kv_head + 1) * G; ++n) {
    const HeadView q = head_view(p.q, p.dtype, p.q_strides, b, n);
    const HeadView dout = head_view(p.dout, p.dtype, p.do_strides, b, n);
    for (int64_t i0 = 0; i0 < p.T; i0 += kBr) {
      const int rows = static_cast<int>(std::min<int64_t>(kBr, p.T - i0));
      const TileCoords tile{b, n, i0, rows, j0, keys};
      const TileMasks masks = tile_masks(p, bounds, tile);
      if (masks.kind == TileKind::kSkip) continue;
      const FloatRows qb = rows_as_float(q, i0, rows, H, Hp, w.q.data());
      const FloatRows db = rows_as_float(dout, i0, rows, Hv, Hvp, w.dout.data());
      load_stats(stats, b, n, p.N, i0, rows, w.lse2.data(), w.d.data());

      gemm(rows, kBc, H, qb.data, qb.ld, w.kt.data(), kBc, w.s.data(), kBc, false);  // S (log2 units)
      prepare_scores(p, bounds, tile, masks, w.s.data(), kBc, /*transposed=*/false,
                     softcap ? w.sg.data() : nullptr);
      exp2_minus_row(w.s.data(), rows, kBc, kBc, w.lse2.data());                      // P
      const float* pv = w.s.data();
      if (dropout) {
        std::copy_n(w.s.data(), static_cast<size_t>(rows) * kBc, w.pd.data());
        apply_dropout(p, tile, w.pd.data(), kBc, /*transposed=*/false);
        pv = w.pd.data();
      }
      gemm_at(keys, Hvp, rows, pv, kBc, db.data, db.ld, w.dv.data(), Hvp, true);   // dV += Pᵀ·dO
      gemm(rows, kBc, Hv, db.data, db.ld, w.vt.data(), kBc, w.dp.data(), kBc, false);  // dP = dO·Vᵀ
      if (dropout) apply_dropout(p, tile, w.dp.data(), kBc, /*transposed=*/false);
      ds_from_dp_row(w.dp.data(), w.s.data(), rows, kBc, kBc, w.d.data());             // dS
      if (softcap) multiply_tiles(w.dp.data(), w.sg.data(), rows, keys, kBc);
      gemm_at(keys, Hp, rows, w.dp.data(), kBc, qb.data, qb.ld, w.dk.data(), Hp, true);    // dK += dSᵀ·Q
    }
  }
  store_rows(p.dk, p.dtype, p.dk_strides, b, kv_head, j0, keys, H, p.scale, w.dk.data(), Hp);
  store_rows(p.dv, p.dtype, p.dv_strides, b, kv_head, j0, keys, Hv, 1.f, w.dv.data(), Hvp);
}

// Pass 2 scratch: the query block is converted once, transposed (qt times scale_log2, dOᵀ); K/V
// blocks are read in place when possible; the scores tile is transposed, st[key][query].
struct QueryBlockScratch {
  QueryBlockScratch(int H, int Hv)
      : qt(static_cast<size_t>(H) * kBr), doutt(static_cast<size_t>(Hv) * kBr),
        k(static_cast<size_t>(kBc) * round_up_columns(H)), v(static_cast<size_t>(kBc) * Hv), st(kBc * kBr),
        dpt(kBc * kBr), sgt(kBc * kBr), dq(static_cast<size_t>(kBr) * round_up_columns(H)), lse2(kBr), d(kBr) {}
  std::vector<float> qt, doutt;  // [H][kBr] (times scale_log2), [Hv][kBr]
  std::vector<float> k, v;       // conversion space for K/V rows
  std::vector<float> st, dpt;    // [kBc][kBr]: Pᵀ, and dPᵀ -> dSᵀ
  std::vector<float> sgt;        // [kBc][kBr]: softcap derivative
  std::vector<float> dq;         // [kBr][H padded]
  std::vector<float> lse2, d;    // [kBr]
};

// sum over a dSᵀ tile (keys x rows, ld kBr) of dS_ij · |pos_i - j|: this tile's share of
// -d(loss)/d(slope). Hidden elements have P = 0, so dS = 0 there.
double alibi_distance_dot(const float* dst, int keys, int rows, int64_t pos0, int64_t j0) {
  double sum = 0.0;
  for (int c = 0; c < keys; ++c) {
    const float* col = dst + static_cast<size_t>(c) * kBr;
    float acc = 0.f;
    for (int r = 0; r < rows; ++r) {
      const int64_t d = pos0 + r - (j0 + c);
      acc += col[r] * static_cast<float>(d < 0 ? -d : d);
    }
    sum += acc;
  }
  return sum;
}

// dQ of one query block; returns its share of -d(loss)/d(slope) with ALiBi (else 0).
double query_block_item(const AttentionParams& p, const RowStats& stats, int64_t b, int64_t n, int64_t i0,
                        QueryBlockScratch& w) {
  const int H = static_cast<int>(p.H), Hv = static_cast<int>(p.Hv), Hp = round_up_columns(H);
  const int rows = static_cast<int>(std::min<int64_t>(kBr, p.T - i0));
  const int64_t kv_head = n / p.group_size();
  const HeadView k = head_view(p.k, p.dtype, p.k_strides, b, kv_head);
  const HeadView v = head_view(p.v, p.dtype, p.v_strides, b, kv_head);
  load_rows_transposed(head_view(p.q, p.dtype, p.q_strides, b, n), i0, rows, H, p.scale_log2, w.qt.data(), kBr);
  load_rows_transposed(head_view(p.dout, p.dtype, p.do_strides, b, n), i0, rows, Hv, 1.f, w.doutt.data(), kBr);
  load_stats(stats, b, n, p.N, i0, rows, w.lse2.data(), w.d.data());
  std::fill(w.dq.begin(), w.dq.end(), 0.f);

  const SequenceBounds bounds = sequence_bounds(p, b);
  const KeyRange range = key_range(p, bounds, i0, rows);
  const bool softcap = p.mask.softcap > 0.f;
  const bool slopes = p.mask.dslopes != nullptr;
  double slope_dot = 0.0;
  for (int64_t j0 = range.begin / kBc * kBc; j0 < range.end; j0 += kBc) {
    const int keys = static_cast<int>(std::min<int64_t>(kBc, p.S - j0));
    const TileCoords tile{b, n, i0, rows, j0, keys};
    const TileMasks masks = tile_masks(p, bounds, tile);
    if (masks.kind == TileKind::kSkip) continue;
    const FloatRows kb = rows_as_float(k, j0, keys, H, Hp, w.k.data());
    const FloatRows vb = rows_as_float(v, j0, keys, Hv, Hv, w.v.data());

    gemm(keys, kBr, H, kb.data, kb.ld, w.qt.data(), kBr, w.st.data(), kBr, false);  // Sᵀ
    prepare_scores(p, bounds, tile, masks, w.st.data(), kBr, /*transposed=*/true,
                   softcap ? w.sgt.data() : nullptr);
    exp2_minus_col(w.st.data(), keys, kBr, kBr, w.lse2.data());                      // Pᵀ
    gemm(keys, kBr, Hv, vb.data, vb.ld, w.doutt.data(), kBr, w.dpt.data(), kBr, false);  // dPᵀ
    if (p.mask.has_dropout()) apply_dropout(p, tile, w.dpt.data(), kBr, /*transposed=*/true);
    ds_from_dp_col(w.dpt.data(), w.st.data(), keys, kBr, kBr, w.d.data());           // dSᵀ
    if (slopes) slope_dot += alibi_distance_dot(w.dpt.data(), keys, rows, i0 + bounds.offset, j0);
    if (softcap) multiply_tiles(w.dpt.data(), w.sgt.data(), keys, rows, kBr);
    gemm_at(rows, Hp, keys, w.dpt.data(), kBr, kb.data, kb.ld, w.dq.data(), Hp, true);  // dQ += dS·K
  }
  store_rows(p.dq, p.dtype, p.dq_strides, b, n, i0, rows, H, p.scale, w.dq.data(), Hp);
  return slope_dot;
}

}  // namespace

void backward(const AttentionParams& p) {
  if (p.B == 0 || p.N == 0) return;
  const int H = static_cast<int>(p.H), Hv = static_cast<int>(p.Hv);
  const RowStats stats = row_stats(p);

  // Pass 1: dK, dV. Under a causal mask the first key blocks see the most queries: natural order is
  // longest first. With S == 0 there is nothing to write.
  const int64_t k_blocks = (p.S + kBc - 1) / kBc;
  const int64_t key_items = p.B * p.K * k_blocks;
  {
    std::vector<KeyBlockScratch> scratch(num_threads_for(key_items), KeyBlockScratch(H, Hv));
    parallel_for(key_items, [&](int thread, int64_t item) {
      const int64_t jb = item % k_blocks, bk = item / k_blocks;
      key_block_item(p, stats, bk / p.K, bk % p.K, jb * kBc, scratch[thread]);
    });
  }

  // Pass 2: dQ, last query blocks first (they see the most keys under a causal mask).
  const int64_t q_blocks = (p.T + kBr - 1) / kBr;
  const int64_t query_items = p.B * p.N * q_blocks;
  std::vector<QueryBlockScratch> scratch(num_threads_for(query_items), QueryBlockScratch(H, Hv));
  std::vector<double> slope_dots(p.mask.dslopes != nullptr ? query_items : 0);
  parallel_for(query_items, [&](int thread, int64_t item) {
    const int64_t qb = q_blocks - 1 - item % q_blocks, bn = item / q_blocks;
    const double dot = query_block_item(p, stats, bn / p.N, bn % p.N, qb * kBr, scratch[thread]);
    if (!slope_dots.empty()) slope_dots[item] = dot;
  });
  // d(slope) = -sum dS·|pos_i - j| (the ALiBi term is -slope·|pos_i - j|), one slot per (b, n).
  for (int64_t bn = 0; p.mask.dslopes != nullptr && bn < p.B * p.N; ++bn) {
    double sum = 0.0;
    for (int64_t qb = 0; qb < q_blocks; ++qb) sum += slope_dots[bn * q_blocks + qb];
    p.mask.dslopes[bn * p.mask.dslope_slots] = static_cast<float>(-sum);
  }

  if (p.mask.bias != nullptr) bias_gradient(p, stats);
}

}  // namespace jfa::cpu
