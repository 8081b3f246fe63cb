// Per-row mask and score-modifier policy of the CUDA kernels' general paths (sm80 forward and
// backward, sm90 forward): jfa::visible and jfa::modify_score (mask.h, score_mod.h) with what
// depends only on the query row hoisted out of the per-element loop; and the reads of the
// segment-id summaries that narrow a tile's loop. Device code only.
#pragma once

#include <cmath>
#include <cstdint>

#include "jfa/mask.h"
#include "jfa/params.h"
#include "jfa/score_mod.h"

namespace jfa {

// The segment-id chunk summaries (MaskParams::q_segment_chunks, kv_segment_chunks; two int4s per
// chunk, [B, ceil(len / 16)]) of positions [x0, x0 + count) of one side. 32-bit index math: the
// Hopper producer narrows its key range with them and runs with 24 registers. Without summaries:
// ids unknown (never uniform) and the range not narrowed.
struct SegmentChunk {
  int4 ids_span;  // (min id, max id, begin, end)
  int4 run;       // (run begin, run end, match begin, match end)
};

__forceinline__ __device__ const SegmentChunk* segment_chunk_row(const int32_t* chunks, int64_t b, int len) {
  return reinterpret_cast<const SegmentChunk*>(chunks) + b * ((len + kSegmentChunk - 1) / kSegmentChunk);
}

// The range of the ids.
struct SegmentIds {
  int lo = 1, hi = 0;  // lo > hi: unknown
  __forceinline__ __device__ bool uniform() const { return lo == hi; }
};

__forceinline__ __device__ SegmentIds segment_ids(const int32_t* chunks, int64_t b, int len, int x0, int count) {
  SegmentIds s;
  const int last = min(x0 + count, len) - 1;
  if (chunks == nullptr || last < x0) return s;
  const SegmentChunk* c = segment_chunk_row(chunks, b, len);
  s = SegmentIds{INT32_MAX, INT32_MIN};
  for (int k = x0 / kSegmentChunk; k <= last / kSegmentChunk; ++k) {
    const int4 v = __ldg(&c[k].ids_span);
    s.lo = min(s.lo, v.x);
    s.hi = max(s.hi, v.y);
  }
  return s;
}

// `r` (positions of the other side, from key_range / query_range) narrowed to those that may share
// an id with positions [x0, x0 + count): [begin of the first chunk, end of the last) (two loads).
__forceinline__ __device__ KeyRange segment_narrowed(KeyRange r, const int32_t* chunks, int64_t b, int len, int x0,
                                                     int count) {
  const int last = min(x0 + count, len) - 1;
  if (chunks == nullptr || last < x0) return r;
  const SegmentChunk* c = segment_chunk_row(chunks, b, len);
  const int begin = __ldg(&c[x0 / kSegmentChunk].ids_span.z), end = __ldg(&c[last / kSegmentChunk].ids_span.w);
  const int64_t lo = r.begin > begin ? r.begin : begin, hi = r.end < end ? r.end : end;
  return KeyRange{lo, hi > lo ? hi : lo};
}

// Whether the [m0, m0 + bm) x [n0, n0 + bn) tile of (batch b, head n) needs the per-element
// predicate for its positions or the boolean mask (tiles its summaries do not prove full).
// Segment ids add segments_split below.
__forceinline__ __device__ bool general_tile_partial(const AttentionParams& p, const SequenceBounds& s, int64_t b,
                                                     int64_t n, int m0, int bm, int n0, int bn) {
  const PackedMaskView& mask = p.mask.packed_mask;
  return (mask.present() && mask.block_kind(b, n, m0, bm, n0, bn) != MaskTileKind::kFull) ||
         position_tile_kind(p, s, m0, bm, n0, bn) != TileKind::kFull;
}

// Whether segment ids may differ inside a tile whose query and key blocks the summaries describe
// (false without segment ids): only one id on both sides proves every element visible.
__forceinline__ __device__ bool segments_split(const AttentionParams& p, const SegmentIds& a, const SegmentIds& b) {
  return p.mask.q_segment_ids != nullptr && !(a.uniform() && b.uniform() && a.lo == b.lo);
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
  const uint32_t* mask;   // the row of the bit-packed mask (jfa/packed_mask.h), or null
  const float* bias;      // the row of the bias, or null
  int bias_col;           // column stride: 1, or 0 on a broadcast key axis (packed operands)
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
  r.mask = m.packed_mask.present() ? m.packed_mask.row(b, n, valid ? i : 0) : nullptr;
  r.bias = m.bias != nullptr ? m.bias + b * m.bias_strides.batch + n * m.bias_strides.head +
                                   int64_t(i) * m.bias_strides.row
                             : nullptr;
  r.bias_col = int(m.bias_strides.col);
  r.slope = m.alibi_slopes != nullptr ? m.alibi_slope(b, n) : 0.f;
  return r;
}

// jfa::visible(p, s, b, n, i, j) for the row of r (rows past T are outside [lo, hi) too).
__forceinline__ __device__ bool row_visible(const RowPolicy& r, int j) {
  if (j < r.lo || j >= r.hi) return false;
  if (r.kv_seg != nullptr && r.kv_seg[j] != r.seg) return false;
  if (r.mask != nullptr && !mask_row_has_key(r.mask, j)) return false;
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

}  // namespace jfa
