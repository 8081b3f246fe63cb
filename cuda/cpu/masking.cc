#include "masking.h"

#include <algorithm>
#include <cmath>

#include "jfa/philox.h"
#include "jfa/score_mod.h"

namespace jfa::cpu {

TileKind tile_kind(const AttentionParams& p, const SequenceBounds& s, const TileCoords& t) {
  TileKind kind = position_tile_kind(p, s, t.i0, t.rows, t.j0, t.cols);
  if (kind == TileKind::kSkip) return kind;
  const MaskParams& m = p.mask;
  if (m.q_segment_ids != nullptr) {
    // Ids of the valid rows and keys only: padding never decides a tile.
    const int64_t i_end = std::min<int64_t>(t.i0 + t.rows, s.q_len);
    const int64_t j_end = std::min<int64_t>(t.j0 + t.cols, s.kv_len);
    const int32_t* qs = m.q_segment_ids + t.b * p.T;
    const int32_t* ks = m.kv_segment_ids + t.b * p.S;
    const auto [q_min, q_max] = std::minmax_element(qs + t.i0, qs + i_end);
    const auto [k_min, k_max] = std::minmax_element(ks + t.j0, ks + j_end);
    kind = segment_tile_kind(kind, *q_min, *q_max, *k_min, *k_max);
  }
  if (kind == TileKind::kFull && m.has_element_mask()) kind = TileKind::kPartial;
  return kind;
}

void prepare_scores(const AttentionParams& p, const SequenceBounds& s, const TileCoords& t,
                    TileKind kind, float* scores, int ld, bool transposed, float* softcap_grad) {
  const bool modify = p.mask.has_score_mod();
  // Element (r, c) = query i0 + r, key j0 + c, in either layout.
  auto at = [&](float* x, int r, int c) -> float& {
    return transposed ? x[static_cast<int64_t>(c) * ld + r] : x[static_cast<int64_t>(r) * ld + c];
  };
  if (!transposed)
    for (int r = 0; r < t.rows; ++r) std::fill(scores + static_cast<int64_t>(r) * ld + t.cols,
                                               scores + static_cast<int64_t>(r + 1) * ld, -INFINITY);
  if (kind == TileKind::kFull && !modify) {
    if (softcap_grad != nullptr)
      for (int r = 0; r < t.rows; ++r)
        for (int c = 0; c < t.cols; ++c) at(softcap_grad, r, c) = 1.f;
    return;
  }
  for (int r = 0; r < t.rows; ++r) {
    const int64_t i = t.i0 + r;
    for (int c = 0; c < t.cols; ++c) {
      const int64_t j = t.j0 + c;
      float& x = at(scores, r, c);
      if (kind == TileKind::kPartial && !visible(p, s, t.b, t.n, i, j)) {
        x = -INFINITY;
        if (softcap_grad != nullptr) at(softcap_grad, r, c) = 0.f;
        continue;
      }
      float grad = 1.f;
      if (modify) x = modify_score(p, s, t.b, t.n, i, j, x, &grad);
      if (softcap_grad != nullptr) at(softcap_grad, r, c) = grad;
    }
  }
}

void apply_dropout(const AttentionParams& p, const TileCoords& t, float* probs, int ld, bool transposed) {
  const uint32_t* seed = p.mask.dropout_seeds + 3 * t.b;
  const uint32_t threshold = dropout_threshold(p.mask.dropout_rate);
  const float keep_scale = 1.f / (1.f - p.mask.dropout_rate);
  const auto n = static_cast<uint32_t>(t.n);
  for (int r = 0; r < t.rows; ++r) {
    const auto i = static_cast<uint32_t>(t.i0 + r);
    for (int c = 0; c < t.cols; c += 4) {
      // One Philox call gives the words of four neighbouring keys (tiles start at multiples of 4).
      const auto j = static_cast<uint32_t>(t.j0 + c);
      const Philox4 words = philox4x32_10(Philox4{{j >> 2, i, n, seed[2]}}, seed[0], seed[1]);
      for (int w = 0; w < 4 && c + w < t.cols; ++w) {
        float& x = transposed ? probs[static_cast<int64_t>(c + w) * ld + r]
                              : probs[static_cast<int64_t>(r) * ld + c + w];
        x = words.x[(j + w) & 3u] < threshold ? 0.f : x * keep_scale;
      }
    }
  }
}

void multiply_tiles(float* a, const float* b, int rows, int cols, int ld) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) a[static_cast<int64_t>(r) * ld + c] *= b[static_cast<int64_t>(r) * ld + c];
}

}  // namespace jfa::cpu
