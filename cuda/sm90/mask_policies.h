// The general (masked) path of the sm90 forward: the semantics of jfa::row_policy / row_logit
// (shared with the sm80 kernels, jfa/row_policy.cuh) applied to one consumer thread's scores of a
// key block, restructured for speed: every feature test is made once per block, outside the
// per-element loops, and the per-element work is branch-free (selects, clamped loads): a per-
// element chain of `if`s costs the consumers more than the masking itself (reconvergence per
// element).
#pragma once

#include <climits>
#include <cmath>

#include <cute/tensor.hpp>

#include "jfa/mask.h"
#include "jfa/params.h"
#include "jfa/row_policy.cuh"

namespace jfa::sm90 {

using namespace cute;

// The policies a general-path kernel compiles code for (fwd_kernel's kPolicies, a bit set).
// Positions (causal with either alignment, window, valid lengths) always; ALiBi; the other score
// modifiers (soft-capping, bias: kPolicyScore, two bits that the forward's sets take together and
// the backward's apart); the data masks (segment ids, boolean mask). fwd_launch.h picks
// the smallest compiled set that covers a call: one kernel with every feature has a hot loop that
// spans the code of every feature's per-element loops, and misses the instruction cache.
// Dropout (dropout.h) is a set of its own, kPolicyAll | kPolicyDropout: one kernel, on tiles of its
// own (fwd_launch.h, DropoutFwdConfig), compiled in a translation unit of its own.
// Segment ids alone (with positions) are a set of their own too: without the boolean mask's code
// H 64 fits them on plain causal's 192 x 128 tile (fwd_launch.h).
enum : int {
  kPolicyPositions = 1, kPolicyAlibi = 2, kPolicySoftcap = 4, kPolicySegments = 8, kPolicyDropout = 16,
  kPolicyBoolMask = 32, kPolicyBias = 64
};
enum : int { kPolicyScore = kPolicySoftcap | kPolicyBias, kPolicyData = kPolicySegments | kPolicyBoolMask };
enum : int { kPolicyAll = kPolicyPositions | kPolicyAlibi | kPolicyScore | kPolicyData };

// Whether a kernel of policy set `policies` takes ALiBi's term on the tensor cores, as a k prefix of
// Q·Kᵀ (fwd_mainloop.h, kAlibiPrefix): the positions-and-ALiBi set's. Soft-capping must see the
// logits without it (so not with the score modifiers), and the sets with more features keep the
// per-element term (their registers and smem are spoken for).
constexpr bool alibi_on_tensor_cores(int policies) { return policies == (kPolicyPositions | kPolicyAlibi); }

// The policies a call needs besides dropout.
inline int policies_needed(const MaskParams& m) {
  int set = kPolicyPositions;
  if (m.alibi_slopes != nullptr) set |= kPolicyAlibi;
  if (m.softcap > 0.f) set |= kPolicySoftcap;
  if (m.bias != nullptr) set |= kPolicyBias;
  if (m.q_segment_ids != nullptr) set |= kPolicySegments;
  if (m.packed_mask.present()) set |= kPolicyBoolMask;
  return set;
}

// The Hopper backward's general-path kernels, besides kPolicyAll and kPolicyAll | kPolicyDropout:
// positions and segment ids (windows, lengths, causal with either alignment, packed sequences);
// positions and the boolean mask; positions and ALiBi; positions and soft-capping; positions with
// dropout. The backward holds dK and dV in registers beside the step's scores, so the code of each
// feature a kernel leaves out is registers the others keep (ptxas spills: docs/performance.md);
// ALiBi and soft-capping are sets apart because one kernel for both runs either at the speed of
// both, and so is the boolean mask (with segment ids, that kernel spilled 120 bytes at H 128
// where the positions set spills 16). The bias (with d(bias): per-element loads and atomics)
// stays with the kernel of every feature.
enum : int {
  kBwdPositionsSet = kPolicyPositions | kPolicySegments,
  kBwdMaskSet = kPolicyPositions | kPolicyBoolMask,
  kBwdAlibiSet = kPolicyPositions | kPolicyAlibi,
  kBwdSoftcapSet = kPolicyPositions | kPolicySoftcap,
  kBwdDropoutPositionsSet = kPolicyPositions | kPolicyDropout,
};

// The smallest of the backward's compiled sets that covers a call of the general path.
inline int bwd_policy_set(const MaskParams& m) {
  const int needed = policies_needed(m);
  if (m.has_dropout()) return needed == kPolicyPositions ? kBwdDropoutPositionsSet : (kPolicyAll | kPolicyDropout);
  if ((needed & ~kBwdPositionsSet) == 0) return kBwdPositionsSet;
  if ((needed & ~kBwdMaskSet) == 0) return kBwdMaskSet;
  if ((needed & ~kBwdAlibiSet) == 0) return kBwdAlibiSet;
  if ((needed & ~kBwdSoftcapSet) == 0) return kBwdSoftcapSet;
  return kPolicyAll;
}

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
  int pos0;                  // that of the tile's first row: ALiBi's reference (apply_policy)
  float slope;               // the head's ALiBi slope (0 without)
  // Key blocks [lo, hi] (inclusive; empty when lo > hi) that need no position test for any of
  // this thread's rows, and those inside the tile's one-segment key run (with segment ids: keys
  // that share the segment of every row of the tile), for block_needs: two compares per block
  // and test instead of a chain per row and block.
  int pos_free_lo, pos_free_hi;
  int seg_free_lo, seg_free_hi;
  // With ALiBi on the tensor cores: the first key block with a key right of one of this thread's
  // rows that the row sees (INT_MAX: none), from which on blocks need ALiBi's |·| (block_needs).
  int alibi_abs_from;
};

template <int kPolicies, int kRows, int kTileRowsM, int kBlockN, typename Coords>
__forceinline__ __device__ TileRows<kRows> tile_rows(const AttentionParams& p, int batch, int head, int m0,
                                                    Coords const& coords) {
  const SequenceBounds bounds = sequence_bounds(p, batch);
  TileRows<kRows> rows;
  rows.pos0 = m0 + int(bounds.offset);
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int i = m0 + get<0>(coords(r, 0));
    const bool in_t = i < int(p.T);
    const RowPolicy row = row_policy(p, bounds, batch, head, in_t ? i : int(p.T) - 1);
    rows.lo[r] = in_t ? row.lo : 0;
    rows.hi[r] = in_t ? row.hi : 0;
    rows.pos[r] = i + int(bounds.offset);
    rows.slope = row.slope;
  }
  // With segment ids, first what they hide from this thread's rows, which the kernel needs tested
  // per element only where positions cannot say it.
  // 1. Its own rows' ids as key positions: a warp's rows of a wgmma accumulator are 16
  //    consecutive ones, one summary chunk. If the chunk holds one id and every key with that id
  //    lies in the chunk's match run (its key span, a superset of those keys, is that run, whose
  //    keys all hold the id: jax_flashattn/_segment_chunks.py), the segment is the key range
  //    [match begin, match end), and it joins the rows' position bounds: no block of this thread
  //    then needs a segment test, and a 4096-key sequence's boundary inside a 192-row tile costs
  //    the warps on either side a position test on their blocks at its edge. Packed sequences
  //    fold where their keys start and end on 16-key chunks (the summaries' grain); one that
  //    starts or ends inside a chunk leaves that chunk mixed, its span wider than its run, and
  //    its rows to 2.
  // 2. Otherwise, if the tile's queries hold one id (the run of one-id chunks around its first
  //    chunk covers it), the keys [seg_begin, seg_end) of the run of one-id kv chunks with that id
  //    where its key span starts (the chunk's match run): blocks inside it (n0 >= seg_begin,
  //    min(n0 + kBlockN, S) <= seg_end) need no segment test. One load: worked out here from the
  //    kv summaries it was a chain of three dependent loads, which each tile waited out before its
  //    first block (the first block's tests need it).
  int seg_begin = 0, seg_end = 0;
  const MaskParams& m = p.mask;
  if ((kPolicies & kPolicySegments) && m.q_segment_chunks != nullptr) {
    const SegmentChunk* q_chunks = segment_chunk_row(m.q_segment_chunks, batch, int(p.T));
    const int own_chunk = min(m0 + get<0>(coords(0, 0)), int(p.T) - 1) / kSegmentChunk;
    const bool one_chunk = own_chunk == min(m0 + get<0>(coords(kRows - 1, 0)), int(p.T) - 1) / kSegmentChunk;
    const int4 own_ids = __ldg(&q_chunks[own_chunk].ids_span), own_run = __ldg(&q_chunks[own_chunk].run);
    const int4 run = __ldg(&q_chunks[m0 / kSegmentChunk].run);
    if (one_chunk && own_ids.x == own_ids.y && own_run.z < own_run.w && own_ids.z == own_run.z &&
        own_ids.w == own_run.w) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        rows.lo[r] = max(rows.lo[r], own_run.z);
        rows.hi[r] = min(rows.hi[r], own_run.w);
      }
      seg_begin = 0;
      seg_end = int(p.S);
    } else if (run.x <= m0 && run.y >= min(m0 + kTileRowsM, int(p.T))) {
      seg_begin = run.z;
      seg_end = run.w;
    }
  }
  rows.seg_free_lo = (seg_begin + kBlockN - 1) / kBlockN;
  rows.seg_free_hi = seg_end >= int(p.S) ? INT_MAX : seg_end >= kBlockN ? (seg_end - kBlockN) / kBlockN : -1;
  // Blocks [n0, n0 + kBlockN) with lo <= n0 and n0 + kBlockN <= hi for every row (lo >= 0; rows
  // past T have hi = 0, so all their blocks are tested).
  int max_lo = 0, min_hi = INT_MAX;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    max_lo = max(max_lo, rows.lo[r]);
    min_hi = min(min_hi, rows.hi[r]);
  }
  rows.pos_free_lo = (max_lo + kBlockN - 1) / kBlockN;
  rows.pos_free_hi = min_hi >= kBlockN ? (min_hi - kBlockN) / kBlockN : -1;
  // Row r sees a key right of it in block n iff min(hi, n0 + kBlockN) - 1 > pos: it sees any
  // (hi - 1 > pos) and the block holds key pos + 1 or a later one, i.e. n >= (pos + 1) / kBlockN.
  rows.alibi_abs_from = INT_MAX;
  if (alibi_on_tensor_cores(kPolicies)) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r)
      if (rows.hi[r] - 1 > rows.pos[r])
        rows.alibi_abs_from = min(rows.alibi_abs_from, max(rows.pos[r] + 1, 0) / kBlockN);
  }
  return rows;
}

// Which per-element tests this thread's elements of key block n_block (of tile_rows' kBlockN keys)
// need, as a set of kNeeds* bits: positions, when a row does not see the whole block by position;
// segments, when the block is not inside the tile's one-segment key run; with ALiBi on the tensor
// cores (alibi_on_tensor_cores), its |·| where a row sees keys right of it in the block
// (apply_policy) (all three from tile_rows' block ranges). Per thread: each thread masks only its
// own elements. No loads: it runs between a block's GEMMs and the wait for its scores. The boolean
// mask's test is the tile's (FwdGeneralTile::needs: its summaries, the same for every thread).
enum : int { kNeedsPositions = 1, kNeedsSegments = 2, kNeedsMask = 4, kNeedsAlibiAbs = 8 };

template <int kPolicies, int kRows>
__forceinline__ __device__ int block_needs(const AttentionParams& p, const TileRows<kRows>& rows, int n_block) {
  constexpr bool kSegments = kPolicies & kPolicySegments;
  int needs = 0;
  if (n_block < rows.pos_free_lo || n_block > rows.pos_free_hi) needs |= kNeedsPositions;
  // (Without slopes, which the prefix kernel never runs, the flag would only cost time: apply_policy
  // adds no ALiBi term then.)
  if (alibi_on_tensor_cores(kPolicies) && n_block >= rows.alibi_abs_from) needs |= kNeedsAlibiAbs;
  if (kSegments && p.mask.q_segment_ids != nullptr && (n_block < rows.seg_free_lo || n_block > rows.seg_free_hi))
    needs |= kNeedsSegments;
  return needs;
}

// Hides the elements of row r of a thread's scores of the key block at n0 whose bit in `bits` (the
// row of the packed mask, jfa/packed_mask.h) is clear. A thread of a wgmma accumulator holds in
// each run of 8 keys the pair 2w, 2w + 1 of its quad lane w, and thread 0 the columns c0 = 8a + e:
// in a block inside one chunk of 128 keys (64 or 128 keys) the thread's columns are then bits
// shift + 2a + e of its word w, one load per row; blocks that straddle chunks (112 or 176 keys)
// test each element through mask_row_has_key.
template <typename Scores>
constexpr bool mask_block_in_one_word() {
  return kMaskChunkKeys % (4 * decltype(size<1>(std::declval<Scores>()))::value) == 0;  // two columns per 8 keys
}

// The word of row `bits` that holds a thread's columns of the key block at n0 (one chunk), for
// hide_masked_word. `column`: one of the thread's columns counted from n0 or from the block's
// chunk (those of quad lane w are 8a + 2w and 8a + 2w + 1: word w).
__forceinline__ __device__ uint32_t mask_block_word(const uint32_t* bits, int n0, int column) {
  return __ldg(bits + (((n0 >> 7) << 2) | ((column >> 1) & 3)));
}

template <typename Scores, typename Coords0>
__forceinline__ __device__ void hide_masked_word(Scores& scores, Coords0 const& coords0, uint32_t word, int r, int n0) {
  const int shift = (n0 & 127) >> 2;
  CUTE_UNROLL
  for (int c = 0; c < size<1>(scores); ++c) {
    const int c0 = get<1>(coords0(r, c));
    if (((word >> (shift + ((c0 >> 2) & 30) + (c0 & 1))) & 1u) == 0) scores(r, c) = -INFINITY;
  }
}

template <typename Scores, typename Coords0>
__forceinline__ __device__ void hide_masked(Scores& scores, Coords0 const& coords0, const uint32_t* bits, int r, int n0,
                                            int col_shift, int last_key) {
  if constexpr (mask_block_in_one_word<Scores>()) {
    hide_masked_word(scores, coords0, mask_block_word(bits, n0, col_shift), r, n0);
  } else {
    CUTE_UNROLL
    for (int c = 0; c < size<1>(scores); ++c)
      if (!mask_row_has_key(bits, min(col_shift + get<1>(coords0(r, c)), last_key))) scores(r, c) = -INFINITY;
  }
}

// ALiBi's shift of block n0 for scores that hold slope·(j − n0) (the tensor cores' k prefix) and
// see only keys left of their rows: −slope·(pos − j) = slope·(j − n0) + slope·(n0 − pos0) − slope·
// (pos − pos0), whose last term alibi_lse_shift takes off the LSE. The same for every row.
// `slope` in the units of the raw scores.
template <int kRows>
__forceinline__ __device__ float alibi_shift(float slope, const TileRows<kRows>& rows, int n0) {
  return slope * float(n0 - rows.pos0);
}

// Raw q·k scores of the key block [n0, n0 + bn) to logits in the units of policy_logit_scale:
// soft-capping, bias and ALiBi on every element (ALiBi: unless in the scores already, below), then -inf where an element fails a test of
// `needs` (block_needs). `scores` and `coords` are (row, col) views of the accumulator and of the
// identity tensor partitioned the same way; `coords0` is the same partition for thread 0. A wgmma
// accumulator fragment is thread 0's translated by a per-thread offset, so a column is that offset
// plus a compile-time constant: ALiBi's distances and the position tests then cost one add or
// compare per element, with no int-to-float conversion (which would share the MUFU pipe with
// exp2). Loads use indices clamped into [0, S): elements outside are hidden anyway, and the clamp
// keeps them in bounds without a branch. Only the policies in kPolicies are compiled; the kernel
// calls a copy without the score modifiers for blocks that need tests when the call has none.
//
// ALiBi leaves part of its term in shift[r], which the softmax adds per row (OnlineSoftmax::
// update): the logits come out as l + slope·(pos_r − pos0) + shift[r], a per-row constant over
// the whole tile (pos0: the tile's first row), which the kernel takes off the LSE (alibi_lse_shift).
// Where the keys a row sees in this block all lie on one side of it (every block of a causal
// row), −slope·|pos − j| is linear in the column, and what varies per element is one FFMA with a
// compile-time column: slope·c0. Blocks that straddle a row keep the |·| (two instructions).
// With `alibi_in_scores` the scores arrive holding slope·(j − n0) already (the tensor cores' k
// prefix, fwd_mainloop.h): where every key a thread's rows see lies left of them (needs without
// kNeedsAlibiAbs), the shift is all that is left, slope·(n0 − pos0) for every row (alibi_shift:
// on a block without any test the kernel skips this function and sets it itself); otherwise
// three instructions per element (blocks right of a row too: one more than the per-element path).
template <int kPolicies, int kRows, typename Scores, typename Coords, typename Coords0>
__forceinline__ __device__ void apply_policy(Scores& scores, Coords const& coords, Coords0 const& coords0,
                                             const AttentionParams& p, const TileRows<kRows>& rows, int batch,
                                             int head, int m0, int n0, int bn, int needs, float (&shift)[kRows],
                                             bool alibi_in_scores = false, const uint32_t* mask_words = nullptr) {
  const MaskParams& m = p.mask;
  constexpr bool kScore = kPolicies & kPolicyScore, kAlibi = kPolicies & kPolicyAlibi;
  constexpr bool kSegments = kPolicies & kPolicySegments, kBoolMask = kPolicies & kPolicyBoolMask;
  const bool has_softcap = kScore && m.softcap > 0.f;
  // Additive terms (natural units) to the logits' units: log2 e, over the scale when raw.
  const float add_scale = kLog2eF / (has_softcap ? 1.f : p.scale_log2);
  const float softcap2 = m.softcap * kLog2eF;  // the cap in log2 units (see jfa/score_mod.h)
  const float softcap_in = has_softcap ? p.scale_log2 / softcap2 : 0.f;
  const int last_key = int(p.S) - 1, last_query = int(p.T) - 1;
  const int col_shift = n0 + get<1>(coords(0, 0)) - get<1>(coords0(0, 0));  // column = col_shift + c0
  // Segment ids: bit c of same_segment[r] says whether this thread's column c holds row r's id.
  // The ids are read in a loop of groups of 8 columns, not all at once: loads in flight each hold
  // a register, and with all 32 of a 128-key block's in flight H 64's segment-ids kernel spilled
  // more in its main loop on the 192 x 128 tile (ptxas: 132 bytes, 76 this way). The kernel runs
  // this only on blocks that tile_rows could not clear of segment tests.
  constexpr int kCols = decltype(size<1>(scores))::value;
  static_assert(kCols <= 32, "same_segment holds one bit per column of a row");
  uint32_t same_segment[kRows];
  if (kSegments && (needs & kNeedsSegments)) {
    // The rows' own ids are read here too, not kept from tile_rows: two registers fewer through
    // the whole loop, for a test that packed sequences never need.
    const int32_t* kv_seg = m.kv_segment_ids + int64_t(batch) * p.S;
    const int32_t* q_seg = m.q_segment_ids + int64_t(batch) * p.T;
    int seg[kRows];
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      same_segment[r] = 0u;
      seg[r] = q_seg[min(m0 + get<0>(coords(r, 0)), last_query)];
    }
#pragma unroll 1
    for (int c8 = 0; c8 < kCols; c8 += 8) {
      CUTE_UNROLL
      for (int k = 0; k < 8; ++k) {
        const int c = c8 + k;
        if (kCols % 8 == 0 || c < kCols) {
          const int id = kv_seg[min(col_shift + int(get<1>(coords0(0, c))), last_key)];
          CUTE_UNROLL
          for (int r = 0; r < kRows; ++r) same_segment[r] |= uint32_t(id == seg[r]) << c;
        }
      }
    }
  }
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    shift[r] = 0.f;
    const int64_t i = min(m0 + get<0>(coords(r, 0)), last_query);
    if (has_softcap) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) scores(r, c) = softcap2 * fast_tanh(scores(r, c) * softcap_in);
    }
    if (kScore && m.bias != nullptr) {
      const Strides4& st = m.bias_strides;
      const float* bias = m.bias + batch * st.batch + head * st.head + i * st.row;
      const int col = int(st.col);
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) {
        const int j = min(col_shift + get<1>(coords0(r, c)), last_key);
        scores(r, c) = fmaf(bias[j * col], add_scale, scores(r, c));
      }
    }
    if (kAlibi && m.alibi_slopes != nullptr) {
      // Relative to pos0: the row at P, this thread's first column at C, a key at C + c0.
      const float slope = rows.slope * add_scale;
      const int P = rows.pos[r] - rows.pos0, C = col_shift - rows.pos0;
      if (alibi_in_scores) {
        // The scores hold slope·(off + c0), off = col_shift − n0: this thread's first column.
        if (needs & kNeedsAlibiAbs) {
          // −slope·|P − C − c0| + slope·P, less what the scores hold.
          const int off = col_shift - n0;
          shift[r] = slope * float(P - off);
          const float d0 = float(P - C);
          CUTE_UNROLL
          for (int c = 0; c < size<1>(scores); ++c) {
            const float c0 = float(get<1>(coords0(r, c)));
            scores(r, c) = fmaf(-slope, fabsf(d0 - c0), fmaf(-slope, c0, scores(r, c)));
          }
        } else {
          shift[r] = alibi_shift(slope, rows, n0);
        }
      } else if (min(rows.hi[r], n0 + bn) - 1 <= rows.pos[r]) {
        // Keys left of the row: −slope·(P − C − c0) + slope·P = slope·C + slope·c0.
        shift[r] = slope * float(C);
        CUTE_UNROLL
        for (int c = 0; c < size<1>(scores); ++c) scores(r, c) = fmaf(slope, float(get<1>(coords0(r, c))), scores(r, c));
      } else if (max(rows.lo[r], n0) >= rows.pos[r]) {
        // Keys right of it: −slope·(C + c0 − P) + slope·P = slope·(2P − C) − slope·c0.
        shift[r] = slope * float(2 * P - C);
        CUTE_UNROLL
        for (int c = 0; c < size<1>(scores); ++c) scores(r, c) = fmaf(-slope, float(get<1>(coords0(r, c))), scores(r, c));
      } else {
        // −slope·|P − C − c0| + slope·P.
        shift[r] = slope * float(P);
        const float d0 = float(P - C);
        CUTE_UNROLL
        for (int c = 0; c < size<1>(scores); ++c)
          scores(r, c) = fmaf(-slope, fabsf(d0 - float(get<1>(coords0(r, c)))), scores(r, c));
      }
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
    if (kSegments && (needs & kNeedsSegments)) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c)
        if (((same_segment[r] >> c) & 1u) == 0) scores(r, c) = -INFINITY;
    }
    if (kBoolMask && (needs & kNeedsMask)) {
      // The words the caller loaded under the block's GEMM (FwdGeneralTile::load_mask_words), or
      // a load here.
      if (mask_block_in_one_word<Scores>() && mask_words != nullptr)
        hide_masked_word(scores, coords0, mask_words[r], r, n0);
      else
        hide_masked(scores, coords0, m.packed_mask.row(batch, head, i), r, n0, col_shift, last_key);
    }
  }
}

// The general path's key blocks [x, y) of query tile m_block of head `head`: those of its position
// range that may share a segment with it, from the first to the last that the boolean mask's
// summaries leave a visible key in; no key at all gives block 0, fully masked. Every lane of the
// calling warp takes part (the summaries are scanned 32 chunks at a time).
template <int kBlockM, int kBlockN>
__forceinline__ __device__ int2 general_block_range(const AttentionParams& p, int batch, int head, int m_block) {
  const int m0 = m_block * kBlockM;
  const KeyRange r = mask_narrowed_keys</*kWarp=*/true>(
      p, batch, head, m0, kBlockM,
      segment_narrowed(key_range(p, sequence_bounds(p, batch), m0, kBlockM), p.mask.q_segment_chunks, batch,
                       int(p.T), m0, kBlockM));
  if (r.end <= r.begin) return make_int2(0, 1);
  return make_int2(int(r.begin / kBlockN), int((r.end + kBlockN - 1) / kBlockN));
}

// What apply_policy's ALiBi left in the logits of row r over the whole tile, slope·(pos_r − pos0),
// in natural units: the LSE the softmax computes is this much too large.
template <int kRows>
__forceinline__ __device__ float alibi_lse_shift(const AttentionParams& p, const TileRows<kRows>& rows, int r) {
  return p.mask.alibi_slopes != nullptr ? rows.slope * float(rows.pos[r] - rows.pos0) : 0.f;
}

}  // namespace jfa::sm90
