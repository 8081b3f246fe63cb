// FlashAttention-2 forward on the CPU: one work item = (batch, query head, block of kBr query rows).
//
// The query block is converted once per item, transposed and times scale_log2 (qt[H][kBr]); K/V
// blocks of kBc keys then stream past. Scores are kept transposed, st[key][query] = K·qt, so that
// K and V are read in place (float32) or converted row by row, never transposed per query block;
// the online softmax runs per query column in the log2 domain, and acc += stᵀ·V. At the end
// o = acc / l and lse = ln 2 · (m + log2 l). Scratch per thread is O(kBr·(H + Hv) + kBc·(H + Hv + kBr)).
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

constexpr int kBr = 64;  // query rows per item (tile columns); a multiple of kColumnMultiple
constexpr int kBc = 64;  // keys per block: st (16 KiB) and the K/V tiles stay in L1/L2
static_assert(kMaskChunkKeys % kBc == 0, "a key block must lie inside one chunk of the packed mask");

struct ForwardScratch {
  ForwardScratch(int H, int Hv)
      : qt(static_cast<size_t>(H) * kBr), k(static_cast<size_t>(kBc) * round_up_columns(H)),
        v(static_cast<size_t>(kBc) * round_up_columns(Hv)), st(kBc * kBr),
        acc(static_cast<size_t>(kBr) * round_up_columns(Hv)), m(kBr), l(kBr) {}
  std::vector<float> qt;    // [H][kBr]: q transposed, times scale_log2
  std::vector<float> k, v;  // conversion space for K/V blocks that cannot be read in place
  std::vector<float> st;    // [kBc][kBr]: scores, then probabilities
  std::vector<float> acc;   // [kBr][Hv padded]: unnormalized output
  std::vector<float> m, l;  // per query: running max (log2 units) and sum of exp2
};

void forward_item(const AttentionParams& p, int64_t b, int64_t n, int64_t i0, ForwardScratch& w) {
  const int H = static_cast<int>(p.H), Hv = static_cast<int>(p.Hv), Hvp = round_up_columns(Hv);
  const int rows = static_cast<int>(std::min<int64_t>(kBr, p.T - i0));
  const int64_t kv_head = n / p.group_size();
  const HeadView k = head_view(p.k, p.dtype, p.k_strides, b, kv_head);
  const HeadView v = head_view(p.v, p.dtype, p.v_strides, b, kv_head);

  load_rows_transposed(head_view(p.q, p.dtype, p.q_strides, b, n), i0, rows, H, p.scale_log2, w.qt.data(), kBr);
  std::fill(w.acc.begin(), w.acc.end(), 0.f);
  std::fill(w.m.begin(), w.m.end(), -INFINITY);
  std::fill(w.l.begin(), w.l.end(), 0.f);

  // Only the key blocks that the policies let some row of this block see (causal triangle,
  // window band, lengths); skipped tiles inside that range are ones without a shared segment.
  const SequenceBounds bounds = sequence_bounds(p, b);
  const KeyRange range = key_range(p, bounds, i0, rows);
  for (int64_t j0 = range.begin / kBc * kBc; j0 < range.end; j0 += kBc) {
    const int keys = static_cast<int>(std::min<int64_t>(kBc, p.S - j0));
    const TileCoords tile{b, n, i0, rows, j0, keys};
    const TileMasks masks = tile_masks(p, bounds, tile);
    if (masks.kind == TileKind::kSkip) continue;
    const FloatRows kb = rows_as_float(k, j0, keys, H, H, w.k.data());
    const FloatRows vb = rows_as_float(v, j0, keys, Hv, Hvp, w.v.data());
    gemm(keys, kBr, H, kb.data, kb.ld, w.qt.data(), kBr, w.st.data(), kBr, false);
    prepare_scores(p, bounds, tile, masks, w.st.data(), kBr, /*transposed=*/true, nullptr);
    softmax_step_transposed(w.st.data(), keys, kBr, kBr, w.m.data(), w.l.data(), w.acc.data(), Hvp, Hvp);
    // Dropout after the softmax statistics: l sums the undropped P, so lse is dropout-free.
    if (p.mask.has_dropout()) apply_dropout(p, tile, w.st.data(), kBr, /*transposed=*/true);
    gemm_at(rows, Hvp, keys, w.st.data(), kBr, vb.data, vb.ld, w.acc.data(), Hvp, true);
  }

  // A row that saw no key (l == 0) gives o = 0 and lse = -inf.
  for (int r = 0; r < rows; ++r) {
    const float l = w.l[r];
    const float inv_l = l > 0.f ? 1.f / l : 0.f;
    float* acc = w.acc.data() + static_cast<size_t>(r) * Hvp;
    for (int c = 0; c < Hv; ++c) acc[c] *= inv_l;
    const float lse = l > 0.f ? (w.m[r] + std::log2(l)) * 0.6931471805599453f : -INFINITY;
    p.lse[b * p.lse_strides.batch + (i0 + r) * p.lse_strides.row + n * p.lse_strides.head] = lse;
  }
  store_rows(p.o, p.dtype, p.o_strides, b, n, i0, rows, Hv, 1.f, w.acc.data(), Hvp);
}

}  // namespace

void forward(const AttentionParams& p) {
  if (p.B == 0 || p.T == 0 || p.N == 0) return;
  const int64_t q_blocks = (p.T + kBr - 1) / kBr;
  const int64_t items = p.B * p.N * q_blocks;
  std::vector<ForwardScratch> scratch(num_threads_for(items), ForwardScratch(static_cast<int>(p.H), static_cast<int>(p.Hv)));
  parallel_for(items, [&](int thread, int64_t item) {
    // Last query blocks first: under a causal mask they see the most keys (longest first balances).
    const int64_t qb = q_blocks - 1 - item % q_blocks;
    const int64_t bn = item / q_blocks;
    forward_item(p, bn / p.N, bn % p.N, qb * kBr, scratch[thread]);
  });
}

}  // namespace jfa::cpu
