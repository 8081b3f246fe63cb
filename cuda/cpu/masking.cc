#include "masking.h"

#include <algorithm>
#include <cmath>

#include "jfa/mask_packing.h"
#include "jfa/philox.h"
#include "jfa/score_mod.h"

namespace jfa::cpu {

namespace {

// The kind from positions and segment ids.
TileKind policy_kind(const AttentionParams& p, const SequenceBounds& s, const TileCoords& t) {
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
  return kind;
}

TileKind as_tile_kind(MaskTileKind kind) {
  return kind == MaskTileKind::kEmpty ? TileKind::kSkip
         : kind == MaskTileKind::kFull ? TileKind::kFull : TileKind::kPartial;
}

// The keys of a tile inside one chunk of keys: the chunk, the tile's first key within it, and per
// word the bits of the tile's keys.
struct ChunkKeys {
  int64_t chunk;
  int lo;
  uint32_t in_range[kMaskChunkWords];

  explicit ChunkKeys(const TileCoords& t)
      : chunk(t.j0 / kMaskChunkKeys), lo(static_cast<int>(t.j0 - chunk * kMaskChunkKeys)) {
    for (int w = 0; w < kMaskChunkWords; ++w) in_range[w] = mask_bits_between(w, lo, lo + t.cols);
  }
};

// The packed mask's kind over a tile inside one chunk of keys: the summaries of the row blocks it
// covers, and where those are partial, the tile's own bits (a CPU tile is half a chunk wide, and a
// chunk that is partial may be empty or full over the half a tile covers).
TileKind packed_mask_kind(const PackedMaskView& m, const TileCoords& t) {
  const ChunkKeys keys(t);
  bool any = false, all = true;
  for (int64_t rb = t.i0 / kMaskTileRows; rb <= (t.i0 + t.rows - 1) / kMaskTileRows; ++rb) {
    const MaskTileKind kind = m.tile(t.b, t.n, rb, keys.chunk);
    any = any || kind != MaskTileKind::kEmpty;
    all = all && kind == MaskTileKind::kFull;
  }
  if (!any) return TileKind::kSkip;
  if (all) return TileKind::kFull;
  MaskTileSummary summary;
  for (int r = 0; r < t.rows; ++r) {
    const uint32_t* words = m.row(t.b, t.n, t.i0 + r) + keys.chunk * kMaskChunkWords;
    for (int w = 0; w < kMaskChunkWords; ++w) summary.add(words[w], keys.in_range[w]);
  }
  return as_tile_kind(summary.kind());
}

// Calls hide(r, c) for each element of a tile inside one chunk of keys whose bit is 0: word by
// word over the cleared bits alone, so a mostly visible tile costs little.
template <typename Hide>
void for_each_hidden_element(const PackedMaskView& m, const TileCoords& t, Hide hide) {
  const ChunkKeys keys(t);
  for (int r = 0; r < t.rows; ++r) {
    const uint32_t* words = m.row(t.b, t.n, t.i0 + r) + keys.chunk * kMaskChunkWords;
    for (int w = 0; w < kMaskChunkWords; ++w)
      for (uint32_t hidden = ~words[w] & keys.in_range[w]; hidden != 0; hidden &= hidden - 1)
        hide(r, mask_key_of_bit(w, __builtin_ctz(hidden)) - keys.lo);
  }
}

}  // namespace

TileMasks tile_masks(const AttentionParams& p, const SequenceBounds& s, const TileCoords& t) {
  const TileKind policies = policy_kind(p, s, t);
  if (policies == TileKind::kSkip || !p.mask.packed_mask.present())
    return TileMasks{policies, policies == TileKind::kPartial, false};
  const TileKind bits = packed_mask_kind(p.mask.packed_mask, t);
  if (bits == TileKind::kSkip) return TileMasks{TileKind::kSkip, false, false};
  const bool partial = policies == TileKind::kPartial || bits == TileKind::kPartial;
  return TileMasks{partial ? TileKind::kPartial : TileKind::kFull, policies == TileKind::kPartial,
                   bits == TileKind::kPartial};
}

void prepare_scores(const AttentionParams& p, const SequenceBounds& s, const TileCoords& t,
                    const TileMasks& masks, float* scores, int ld, bool transposed, float* softcap_grad) {
  const bool modify = p.mask.has_score_mod();
  // Element (r, c) = query i0 + r, key j0 + c, in either layout.
  auto at = [&](float* x, int r, int c) -> float& {
    return transposed ? x[static_cast<int64_t>(c) * ld + r] : x[static_cast<int64_t>(r) * ld + c];
  };
  if (!transposed)
    for (int r = 0; r < t.rows; ++r) std::fill(scores + static_cast<int64_t>(r) * ld + t.cols,
                                               scores + static_cast<int64_t>(r + 1) * ld, -INFINITY);
  if (masks.kind == TileKind::kFull && !modify) {
    if (softcap_grad != nullptr)
      for (int r = 0; r < t.rows; ++r)
        for (int c = 0; c < t.cols; ++c) at(softcap_grad, r, c) = 1.f;
    return;
  }
  const bool partial = masks.kind == TileKind::kPartial;
  if (partial && !masks.test_positions && !modify && softcap_grad == nullptr) {
    // Only the mask's bits decide, and nothing else changes a score.
    for_each_hidden_element(p.mask.packed_mask, t, [&](int r, int c) { at(scores, r, c) = -INFINITY; });
    return;
  }
  for (int r = 0; r < t.rows; ++r) {
    const int64_t i = t.i0 + r;
    const uint32_t* bits = partial && masks.test_bits ? p.mask.packed_mask.row(t.b, t.n, i) : nullptr;
    for (int c = 0; c < t.cols; ++c) {
      const int64_t j = t.j0 + c;
      float& x = at(scores, r, c);
      if (partial && ((masks.test_positions && !visible(p, s, t.b, t.n, i, j)) ||
                      (bits != nullptr && !mask_row_has_key(bits, j)))) {
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
  const int64_t query0 = p.mask.query_position0(t.b), key0 = p.mask.key_position0(t.b);
  for (int r = 0; r < t.rows; ++r) {
    const auto i = static_cast<uint32_t>(query0 + t.i0 + r);
    for (int c = 0; c < t.cols; c += static_cast<int>(kDropoutKeysPerCall)) {
      // One Philox call gives the uniforms of 8 neighbouring keys (tiles start at multiples of 8,
      // and so does key0).
      const auto j = static_cast<uint32_t>(key0 + t.j0 + c);
      const Philox4 words = philox4x32_10(Philox4{{j >> 3, i, n, seed[2]}}, seed[0], seed[1]);
      for (int w = 0; w < static_cast<int>(kDropoutKeysPerCall) && c + w < t.cols; ++w) {
        float& x = transposed ? probs[static_cast<int64_t>(c + w) * ld + r]
                              : probs[static_cast<int64_t>(r) * ld + c + w];
        x = dropout_half(words, j + w) < threshold ? 0.f : x * keep_scale;
      }
    }
  }
}

void multiply_tiles(float* a, const float* b, int rows, int cols, int ld) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) a[static_cast<int64_t>(r) * ld + c] *= b[static_cast<int64_t>(r) * ld + c];
}

}  // namespace jfa::cpu
