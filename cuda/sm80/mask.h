// Masks of the sm80 kernels. The plain path: key positions past S, and causal (top-left: query i
// sees keys j <= i), applied only on boundary/diagonal tiles. The general path: see below.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "jfa/mask.h"
#include "jfa/params.h"
#include "jfa/philox.h"
#include "jfa/score_mod.h"

namespace jfa::sm80 {

using namespace cute;

// Whether the [m0, m0+bm) x [n0, n0+bn) tile has an element that must be masked.
template <bool kCausal>
__forceinline__ __device__ bool tile_needs_mask(int m0, int n0, int bn, int S) {
  return n0 + bn > S || (kCausal && n0 + bn - 1 > m0);
}

// Set masked scores to -inf. `scores` and `coords` are (row, col) views of an accumulator and of
// the identity tensor partitioned the same way; (m0, n0) is the tile origin.
template <bool kCausal, typename Scores, typename Coords>
__forceinline__ __device__ void apply_mask(Scores& scores, Coords const& coords, int m0, int n0, int S) {
  CUTE_UNROLL
  for (int i = 0; i < size(scores); ++i) {
    const int row = m0 + get<0>(coords(i));
    const int col = n0 + get<1>(coords(i));
    if (col >= S || (kCausal && col > row)) scores(i) = -INFINITY;
  }
}

}  // namespace jfa::sm80

// ---------------------------------------------------------------------------------------------
// The general path (kGeneral kernels, taken when p.mask.active()): every masking feature of
// jax_flashattn through the shared policies of jfa/mask.h, jfa/score_mod.h and jfa/philox.h.
//   * per tile: the key range of a query block (forward) or the query range of a key block
//     (backward) is the trip count, so tiles outside it never run; a tile inside it is "partial"
//     unless position_tile_kind proves it full and no data-dependent mask (segment ids, boolean
//     mask) exists. (Segment ids do not skip tiles on the GPU yet: every tile with segments is
//     partial, which is correct but pays the predicate.)
//   * per element: visible() on partial tiles only, then the score modifiers; logits leave in
//     log2 units (the plain path folds scale_log2 into the softmax instead).
namespace jfa::sm80 {

// Whether the [m0, m0 + bm) x [n0, n0 + bn) tile needs the per-element predicate.
__forceinline__ __device__ bool general_tile_partial(const AttentionParams& p, const SequenceBounds& s, int m0,
                                                     int bm, int n0, int bn) {
  return position_tile_kind(p, s, m0, bm, n0, bn) != TileKind::kFull || p.mask.q_segment_ids != nullptr ||
         p.mask.mask != nullptr;
}

// jfa::visible and jfa::modify_score for one query row, with what depends only on the row
// (position bounds from jfa::key_lo / key_hi, the segment id, row pointers into the mask and the
// bias, the ALiBi slope) computed once, in 32-bit where it fits: the per-element work of a thread's
// rows stays a few compares and loads. Same semantics as the shared functions (tests/cuda/
// sm80_check.cu compares against a reference that calls jfa::visible itself).
struct RowPolicy {
  int lo, hi;       // keys [lo, hi) visible by position; empty past the valid query length
  int seg;          // the row's segment id (with segment ids)
  int pos;          // i + offset: the row's key-aligned position (ALiBi)
  float slope;      // ALiBi slope (0 without)
  const int32_t* kv_seg;  // this batch element's kv segment ids, or null
  const uint8_t* mask;    // the row of the boolean mask, or null
  const float* bias;      // the row of the bias, or null
  int mask_col, bias_col;  // column strides: 1, or 0 on a broadcast key axis (packed operands)
};

__forceinline__ __device__ RowPolicy row_policy(const AttentionParams& p, const SequenceBounds& s, int64_t b,
                                                int64_t n, int i) {
  const MaskParams& m = p.mask;
  RowPolicy r;
  const bool valid = i < s.q_len;
  r.lo = valid ? int(key_lo(p, s, i)) : 0;
  r.hi = valid ? int(key_hi(p, s, i)) : 0;
  r.pos = int(i + s.offset);
  r.kv_seg = m.q_segment_ids != nullptr ? m.kv_segment_ids + b * p.S : nullptr;
  r.seg = m.q_segment_ids != nullptr && valid ? m.q_segment_ids[b * p.T + i] : 0;
  r.mask = m.mask != nullptr ? m.mask + b * m.mask_strides.batch + n * m.mask_strides.head +
                                   int64_t(i) * m.mask_strides.row
                             : nullptr;
  r.mask_col = int(m.mask_strides.col);
  r.bias = m.bias != nullptr ? m.bias + b * m.bias_strides.batch + n * m.bias_strides.head +
                                   int64_t(i) * m.bias_strides.row
                             : nullptr;
  r.bias_col = int(m.bias_strides.col);
  r.slope = m.alibi_slopes != nullptr ? m.alibi_slopes[b * m.alibi_batch_stride + n] : 0.f;
  return r;
}

// jfa::visible(p, s, b, n, i, j) for the row of r (rows past T are outside [lo, hi) too).
__forceinline__ __device__ bool row_visible(const RowPolicy& r, int j) {
  if (j < r.lo || j >= r.hi) return false;
  if (r.kv_seg != nullptr && r.kv_seg[j] != r.seg) return false;
  if (r.mask != nullptr && r.mask[j * r.mask_col] == 0) return false;
  return true;
}

// Final logit (log2 units) of key j from the raw q·k; -inf if hidden (checked on partial tiles
// only). grad (may be null) receives d(final)/d(raw · scale_log2): 1 - tanh² with soft-capping,
// else 1 (0 when hidden). The arithmetic of jfa::modify_score / additive_bias, in its order.
__forceinline__ __device__ float row_logit(const AttentionParams& p, const RowPolicy& r, int j, float raw,
                                           bool partial, float* grad) {
  if (partial && !row_visible(r, j)) {
    if (grad != nullptr) *grad = 0.f;
    return -INFINITY;
  }
  float x = raw * p.scale_log2;
  if (grad != nullptr) *grad = 1.f;
  if (p.mask.softcap > 0.f) {
    const float c2 = p.mask.softcap * kLog2eF;
    const float t = tanhf(x / c2);
    x = c2 * t;
    if (grad != nullptr) *grad = 1.f - t * t;
  }
  if (r.bias != nullptr || p.mask.alibi_slopes != nullptr) {
    float add = 0.f;
    if (r.bias != nullptr) add += r.bias[j * r.bias_col];
    if (p.mask.alibi_slopes != nullptr) {
      const int d = r.pos - j;
      add -= r.slope * float(d < 0 ? -d : d);
    }
    x += add * kLog2eF;
  }
  return x;
}

// Dropout of one batch element: the Philox key and stream coordinate, and the keep scale.
struct DropoutStream {
  uint32_t k0, k1, batch, threshold;
  float keep_scale;
};

__forceinline__ __device__ DropoutStream dropout_stream(const AttentionParams& p, int64_t b) {
  const uint32_t* seed = p.mask.dropout_seeds + 3 * b;
  return DropoutStream{seed[0], seed[1], seed[2], dropout_threshold(p.mask.dropout_rate),
                       1.f / (1.f - p.mask.dropout_rate)};
}

// Multipliers (0 if dropped, else 1 / (1 - rate)) of keys j and j + 1 (j even) of query i, head n:
// one Philox call covers both (the counter is key / 4), the same words jfa::dropout_word gives.
__forceinline__ __device__ float2 dropout_pair(const DropoutStream& d, int n, int i, int j) {
  const Philox4 r = philox4x32_10(Philox4{{uint32_t(j) >> 2, uint32_t(i), uint32_t(n), d.batch}}, d.k0, d.k1);
  const uint32_t w0 = r.x[uint32_t(j) & 3u], w1 = r.x[uint32_t(j + 1) & 3u];
  return make_float2(w0 < d.threshold ? 0.f : d.keep_scale, w1 < d.threshold ? 0.f : d.keep_scale);
}

}  // namespace jfa::sm80
