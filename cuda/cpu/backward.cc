// FlashAttention-2 backward on the CPU, deterministic and without atomics:
//   pass 0, per (b, n, query block): D = rowsum(dO∘O) - dLSE and lse2 = lse·log2(e) (O(B·N·T) floats);
//   pass 1, per (b, kv head, key block): dK, dV summed over the G query heads and all query blocks;
//   pass 2, per (b, n, query block): dQ summed over key blocks.
// Both passes recompute P = exp2(q·kᵀ·scale_log2 - lse2) tile by tile instead of storing it, and
// dS = P∘(dP - D) with dP = dO·Vᵀ (dLSE enters through D since d lse / d logits = P).
#include <algorithm>
#include <cmath>
#include <vector>

#include "attention_cpu.h"
#include "kernels.h"
#include "masking.h"
#include "parallel_for.h"
#include "tiles.h"

namespace jfa::cpu {
namespace {

constexpr int kBr = 64;  // query rows per tile
constexpr int kBc = 64;  // keys per tile
constexpr float kLog2e = 1.4426950408889634f;

// Per-row softmax statistics of the forward pass, packed [B][N][T] so tiles read them contiguously.
struct RowStats {
  std::vector<float> lse2;  // lse·log2(e); +inf for rows that saw no key, so their P is exactly 0
  std::vector<float> d;     // rowsum(dO∘O) - dLSE
  int64_t T;
  const float* lse2_at(int64_t b, int64_t n, int64_t N, int64_t i) const { return lse2.data() + ((b * N + n) * T + i); }
  const float* d_at(int64_t b, int64_t n, int64_t N, int64_t i) const { return d.data() + ((b * N + n) * T + i); }
};

float at(const float* x, const Strides& st, int64_t b, int64_t t, int64_t n) {
  return x[b * st.batch + t * st.row + n * st.head];
}

RowStats row_stats(const AttentionParams& p) {
  RowStats stats{std::vector<float>(p.B * p.N * p.T), std::vector<float>(p.B * p.N * p.T), p.T};
  const int Hv = static_cast<int>(p.Hv);
  const int64_t q_blocks = (p.T + kBr - 1) / kBr;
  std::vector<std::vector<float>> scratch(num_threads_for(p.B * p.N * q_blocks),
                                          std::vector<float>(2 * static_cast<size_t>(kBr) * Hv));
  parallel_for(p.B * p.N * q_blocks, [&](int thread, int64_t item) {
    const int64_t qb = item % q_blocks, b = item / q_blocks / p.N, n = item / q_blocks % p.N;
    const int64_t i0 = qb * kBr;
    const int rows = static_cast<int>(std::min<int64_t>(kBr, p.T - i0));
    float* o = scratch[thread].data();
    float* dout = o + static_cast<size_t>(kBr) * Hv;
    load_rows(head_view(p.o, p.dtype, p.o_strides, b, n), i0, rows, Hv, 1.f, o, Hv, rows);
    load_rows(head_view(p.dout, p.dtype, p.do_strides, b, n), i0, rows, Hv, 1.f, dout, Hv, rows);
    for (int r = 0; r < rows; ++r) {
      float dot = 0.f;
      for (int c = 0; c < Hv; ++c) dot += o[r * Hv + c] * dout[r * Hv + c];
      const int64_t i = i0 + r, packed = (b * p.N + n) * p.T + i;
      const float lse = at(p.lse, p.lse_strides, b, i, n);
      stats.d[packed] = dot - (p.dlse ? at(p.dlse, p.lse_strides, b, i, n) : 0.f);
      stats.lse2[packed] = lse == -INFINITY ? INFINITY : lse * kLog2e;
    }
  });
  return stats;
}

// Copies the stats of query rows [i0, i0 + rows) into kBr-long tiles; padding rows get lse2 = +inf
// (P = 0) and D = 0, so they contribute nothing.
void load_stats(const RowStats& stats, int64_t b, int64_t n, int64_t N, int64_t i0, int rows, float* lse2,
                float* d) {
  std::copy_n(stats.lse2_at(b, n, N, i0), rows, lse2);
  std::copy_n(stats.d_at(b, n, N, i0), rows, d);
  std::fill(lse2 + rows, lse2 + kBr, INFINITY);
  std::fill(d + rows, d + kBr, 0.f);
}

// Pass 1 scratch. The item's K and V are converted once, transposed (kt times scale_log2); the
// query-side tiles are read in place when possible, and Pᵀ / dSᵀ are read transposed by gemm_at.
struct KeyBlockScratch {
  KeyBlockScratch(int H, int Hv)
      : kt(static_cast<size_t>(H) * kBc), vt(static_cast<size_t>(Hv) * kBc),
        q(static_cast<size_t>(kBr) * round_up_columns(H)), dout(static_cast<size_t>(kBr) * round_up_columns(Hv)),
        s(kBr * kBc), dp(kBr * kBc), dk(static_cast<size_t>(kBc) * round_up_columns(H)),
        dv(static_cast<size_t>(kBc) * round_up_columns(Hv)), lse2(kBr), d(kBr) {}
  std::vector<float> kt, vt;     // [H][kBc] (times scale_log2), [Hv][kBc]
  std::vector<float> q, dout;    // conversion space for query-side rows
  std::vector<float> s, dp;      // [kBr][kBc]: P, and dP -> dS
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
  const int64_t first_block = first_visible_query(p, j0) / kBr;
  for (int64_t n = kv_head * G; n < (kv_head + 1) * G; ++n) {
    const HeadView q = head_view(p.q, p.dtype, p.q_strides, b, n);
    const HeadView dout = head_view(p.dout, p.dtype, p.do_strides, b, n);
    for (int64_t i0 = first_block * kBr; i0 < p.T; i0 += kBr) {
      const int rows = static_cast<int>(std::min<int64_t>(kBr, p.T - i0));
      const FloatRows qb = rows_as_float(q, i0, rows, H, Hp, w.q.data());
      const FloatRows db = rows_as_float(dout, i0, rows, Hv, Hvp, w.dout.data());
      load_stats(stats, b, n, p.N, i0, rows, w.lse2.data(), w.d.data());

      gemm(rows, kBc, H, qb.data, qb.ld, w.kt.data(), kBc, w.s.data(), kBc, false);  // S (log2 units)
      mask_scores(p, i0, rows, j0, keys, w.s.data(), kBc, /*transposed=*/false);
      exp2_minus_row(w.s.data(), rows, kBc, kBc, w.lse2.data());                      // P
      gemm_at(keys, Hvp, rows, w.s.data(), kBc, db.data, db.ld, w.dv.data(), Hvp, true);   // dV += Pᵀ·dO
      gemm(rows, kBc, Hv, db.data, db.ld, w.vt.data(), kBc, w.dp.data(), kBc, false);  // dP = dO·Vᵀ
      ds_from_dp_row(w.dp.data(), w.s.data(), rows, kBc, kBc, w.d.data());             // dS
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
        dpt(kBc * kBr), dq(static_cast<size_t>(kBr) * round_up_columns(H)), lse2(kBr), d(kBr) {}
  std::vector<float> qt, doutt;  // [H][kBr] (times scale_log2), [Hv][kBr]
  std::vector<float> k, v;       // conversion space for K/V rows
  std::vector<float> st, dpt;    // [kBc][kBr]: Pᵀ, and dPᵀ -> dSᵀ
  std::vector<float> dq;         // [kBr][H padded]
  std::vector<float> lse2, d;    // [kBr]
};

void query_block_item(const AttentionParams& p, const RowStats& stats, int64_t b, int64_t n, int64_t i0,
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

  const int64_t key_end = visible_key_end(p, i0, rows);
  for (int64_t j0 = 0; j0 < key_end; j0 += kBc) {
    const int keys = static_cast<int>(std::min<int64_t>(kBc, p.S - j0));
    const FloatRows kb = rows_as_float(k, j0, keys, H, Hp, w.k.data());
    const FloatRows vb = rows_as_float(v, j0, keys, Hv, Hv, w.v.data());

    gemm(keys, kBr, H, kb.data, kb.ld, w.qt.data(), kBr, w.st.data(), kBr, false);  // Sᵀ
    mask_scores(p, i0, rows, j0, keys, w.st.data(), kBr, /*transposed=*/true);
    exp2_minus_col(w.st.data(), keys, kBr, kBr, w.lse2.data());                      // Pᵀ
    gemm(keys, kBr, Hv, vb.data, vb.ld, w.doutt.data(), kBr, w.dpt.data(), kBr, false);  // dPᵀ
    ds_from_dp_col(w.dpt.data(), w.st.data(), keys, kBr, kBr, w.d.data());           // dSᵀ
    gemm_at(rows, Hp, keys, w.dpt.data(), kBr, kb.data, kb.ld, w.dq.data(), Hp, true);  // dQ += dS·K
  }
  store_rows(p.dq, p.dtype, p.dq_strides, b, n, i0, rows, H, p.scale, w.dq.data(), Hp);
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
  parallel_for(query_items, [&](int thread, int64_t item) {
    const int64_t qb = q_blocks - 1 - item % q_blocks, bn = item / q_blocks;
    query_block_item(p, stats, bn / p.N, bn % p.N, qb * kBr, scratch[thread]);
  });
}

}  // namespace jfa::cpu
