// The general (masked) path of the sm90 forward: the semantics of jfa::row_policy / row_logit
// (shared with the sm80 kernels, jfa/row_policy.cuh) applied to one consumer thread's scores of a
// key block, restructured for speed: every feature test is made once per block, outside the
// per-element loops, and the per-element work is branch-free (selects, clamped loads). A per-
// element chain of `if`s costs the consumers more than the masking itself (reconvergence per
// element; measured: 5-6x slower than plain causal on an H200).
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "jfa/mask.h"
#include "jfa/params.h"
#include "jfa/row_policy.cuh"

namespace jfa::sm90 {

using namespace cute;

// tanh on the MUFU unit (max relative error ~2^-11), as FlashAttention-3's soft-capping.
__forceinline__ __device__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The units apply_policy leaves the logits in, as the factor the softmax multiplies them by to get
// log2 units: with soft-capping they are already in log2 units (the cap needs the scaled logit);
// otherwise they stay raw q·k, so that the softmax folds the scale into its one FFMA per element
// as on the plain path, and the additive terms are divided by the scale instead.
__forceinline__ __device__ float policy_logit_scale(const AttentionParams& p) {
  return p.mask.softcap > 0.f ? 1.f : p.scale_log2;
}

// One consumer thread's rows of a tile as the general path needs them in every key block, read
// once per tile: the per-block work then issues no load on the softmax's critical path except
// those of the data masks themselves (bias, segment ids, boolean mask, on blocks that need them).
template <int kRows>
struct TileRows {
  int lo[kRows], hi[kRows];  // keys [lo, hi) visible by position; empty past q_len and T
  int pos[kRows];            // the key-aligned position (ALiBi)
  int seg[kRows];            // the segment id (with segment ids)
  int seg_begin, seg_end;    // keys that share the segment of every row of the tile (maybe none)
  float slope;               // the head's ALiBi slope (0 without)
};

template <int kRows, int kTileRowsM, typename Coords>
__forceinline__ __device__ TileRows<kRows> tile_rows(const AttentionParams& p, int batch, int head, int m0,
                                                    Coords const& coords) {
  const SequenceBounds bounds = sequence_bounds(p, batch);
  TileRows<kRows> rows;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int i = m0 + get<0>(coords(r, 0));
    const bool in_t = i < int(p.T);
    const RowPolicy row = row_policy(p, bounds, batch, head, in_t ? i : int(p.T) - 1);
    rows.lo[r] = in_t ? row.lo : 0;
    rows.hi[r] = in_t ? row.hi : 0;
    rows.pos[r] = i + int(bounds.offset);
    rows.seg[r] = row.seg;
    rows.slope = row.slope;
  }
  // With segment ids: if the tile's queries hold one id, the keys of the run of one-id kv chunks
  // with that id where its key span starts (or one chunk later, when the segment does not start
  // on a chunk): blocks inside it need no segment test. Packed sequences give the whole sequence.
  rows.seg_begin = rows.seg_end = 0;
  const MaskParams& m = p.mask;
  if (m.q_segment_chunks != nullptr) {
    const SegmentIds q = segment_ids(m.q_segment_chunks, batch, int(p.T), m0, kTileRowsM);
    if (q.uniform()) {
      const SegmentChunk* qc = segment_chunk_row(m.q_segment_chunks, batch, int(p.T));
      const SegmentChunk* kc = segment_chunk_row(m.kv_segment_chunks, batch, int(p.S));
      const int num_kc = (int(p.S) + kSegmentChunk - 1) / kSegmentChunk;
      const int first = __ldg(&qc[m0 / kSegmentChunk].ids_span.z) / kSegmentChunk;
      CUTE_UNROLL
      for (int k = first; k <= first + 1; ++k) {
        if (k >= num_kc) break;
        const int4 ids = __ldg(&kc[k].ids_span);
        if (ids.x == q.lo && ids.y == q.lo) {
          const int4 run = __ldg(&kc[k].run);
          rows.seg_begin = run.x;
          rows.seg_end = run.y;
          break;
        }
      }
    }
  }
  return rows;
}

// Which per-element tests this thread's elements of key block [n0, n0 + bn) need, as a set of
// kNeeds* bits: positions, when a row does not see the whole block by position; segments, when
// the block is not inside the tile's one-segment key run (tile_rows); the boolean mask, always when
// given. Per thread: each thread masks only its own elements. No loads: it runs between a
// block's GEMMs and the wait for its scores.
enum : int { kNeedsPositions = 1, kNeedsSegments = 2, kNeedsMask = 4 };

template <int kRows>
__forceinline__ __device__ int block_needs(const AttentionParams& p, const TileRows<kRows>& rows, int n0, int bn) {
  int needs = p.mask.mask != nullptr ? kNeedsMask : 0;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r)
    if (rows.lo[r] > n0 || rows.hi[r] < n0 + bn) needs |= kNeedsPositions;
  if (p.mask.q_segment_ids != nullptr && !(n0 >= rows.seg_begin && min(n0 + bn, int(p.S)) <= rows.seg_end))
    needs |= kNeedsSegments;
  return needs;
}

// Raw q·k scores of the key block at n0 to logits in the units of policy_logit_scale: soft-capping,
// bias and ALiBi on every element, then -inf where an element fails a test of `needs`
// (block_needs). `scores` and `coords` are (row, col) views of the accumulator and of the identity tensor
// partitioned the same way; `coords0` is the same partition for thread 0. A wgmma accumulator
// fragment is thread 0's translated by a per-thread offset, so a column is that offset plus a
// compile-time constant: ALiBi's distances and the position tests then cost one add or compare
// per element, with no int-to-float conversion (which would share the MUFU pipe with exp2). Loads
// use indices clamped into [0, S): elements outside are hidden anyway, and the clamp keeps them in
// bounds without a branch. kScoreMods = false compiles the tests only (no softcap, bias or ALiBi):
// the kernel calls that copy for blocks that need tests when the call has no score modifier.
template <bool kScoreMods, int kRows, typename Scores, typename Coords, typename Coords0>
__forceinline__ __device__ void apply_policy(Scores& scores, Coords const& coords, Coords0 const& coords0,
                                             const AttentionParams& p, const TileRows<kRows>& rows, int batch,
                                             int head, int m0, int n0, int needs) {
  const MaskParams& m = p.mask;
  const bool has_softcap = kScoreMods && m.softcap > 0.f;
  // Additive terms (natural units) to the logits' units: log2 e, over the scale when raw.
  const float add_scale = kLog2eF / (has_softcap ? 1.f : p.scale_log2);
  const float softcap2 = m.softcap * kLog2eF;  // the cap in log2 units (see jfa/score_mod.h)
  const float softcap_in = has_softcap ? p.scale_log2 / softcap2 : 0.f;
  const int last_key = int(p.S) - 1, last_query = int(p.T) - 1;
  const int col_shift = n0 + get<1>(coords(0, 0)) - get<1>(coords0(0, 0));  // column = col_shift + c0
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int64_t i = min(m0 + get<0>(coords(r, 0)), last_query);
    if (has_softcap) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) scores(r, c) = softcap2 * fast_tanh(scores(r, c) * softcap_in);
    }
    if (kScoreMods && m.bias != nullptr) {
      const Strides4& st = m.bias_strides;
      const float* bias = m.bias + batch * st.batch + head * st.head + i * st.row;
      const int col = int(st.col);
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) {
        const int j = min(col_shift + get<1>(coords0(r, c)), last_key);
        scores(r, c) = fmaf(bias[j * col], add_scale, scores(r, c));
      }
    }
    if (kScoreMods && m.alibi_slopes != nullptr) {
      // -slope * |pos - j| with pos - j = (pos - col_shift) - c0.
      const float slope = -rows.slope * add_scale, d0 = float(rows.pos[r] - col_shift);
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c)
        scores(r, c) = fmaf(slope, fabsf(d0 - float(get<1>(coords0(r, c)))), scores(r, c));
    }
    if (needs & kNeedsPositions) {
      // Visible by position iff lo <= j < hi, i.e. lo - col_shift <= c0 < hi - col_shift.
      const int lo = rows.lo[r] - col_shift, hi = rows.hi[r] - col_shift;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) {
        const int c0 = get<1>(coords0(r, c));
        if (c0 < lo || c0 >= hi) scores(r, c) = -INFINITY;
      }
    }
    if (needs & kNeedsSegments) {
      const int32_t* kv_seg = m.kv_segment_ids + int64_t(batch) * p.S;
      const int seg = rows.seg[r];
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c)
        if (kv_seg[min(col_shift + get<1>(coords0(r, c)), last_key)] != seg) scores(r, c) = -INFINITY;
    }
    if (needs & kNeedsMask) {
      const Strides4& st = m.mask_strides;
      const uint8_t* mask = m.mask + batch * st.batch + head * st.head + i * st.row;
      const int col = int(st.col);
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c)
        if (mask[min(col_shift + get<1>(coords0(r, c)), last_key) * col] == 0) scores(r, c) = -INFINITY;
    }
  }
}

}  // namespace jfa::sm90
