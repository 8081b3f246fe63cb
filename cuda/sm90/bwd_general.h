// The Hopper backward's general path: masks (positions with either causal alignment, windows,
// valid lengths, segment ids, the boolean mask), score modifiers (soft-capping, bias, ALiBi) and
// dropout, with the gradients they add: d(bias) and d(ALiBi slopes). The semantics are those of
// every other path: jfa::visible and jfa::additive_bias (jfa/mask.h, jfa/score_mod.h), soft-capping
// as the Hopper forward computes it (mask_policies.h, fast_tanh), and jfa::dropout_uniform's stream
// (dropout.h).
//
// Per key block: the query blocks that may see it (query_range, narrowed by the segment
// summaries). Per step: whether the (query block, key block) tile needs the per-element predicate.
// Per element, in one pass over a step's score and dP accumulators (either orientation):
//   x = logit in log2 units (soft-capped: g = 1 − tanh², else g = 1; plus bias and ALiBi),
//   P = exp2(x − LSE·log2 e) (0 where hidden), z = the dropout multiplier (0 or 1 / (1 − rate)),
//   d(logit) = P∘(dP·z − D) — d(bias) itself, and −|i + offset − j| times it summed is d(slope) —,
//   then P·z for dV and d(logit)·g as dS.
#pragma once

#include <cmath>
#include <cstdint>

#include <type_traits>
#include <utility>

#include <cute/tensor.hpp>

#include "dropout.h"
#include "jfa/mask.h"
#include "jfa/params.h"
#include "jfa/philox.h"
#include "jfa/row_policy.cuh"
#include "jfa/score_mod.h"  // kLog2eF
#include "bwd_mask_bits.h"
#include "bwd_softmax.h"
#include "mask_policies.h"
#include "utils.h"

namespace jfa::sm90 {

using namespace cute;

// Query blocks [begin, end) that may see key block n_block of K/V head kv_head: by position
// (jfa::query_range), then narrowed to the queries that may share a segment id with its keys and
// to those that the boolean mask lets some query head of the group see them. Empty: (0, 0).
// kWarpScan: every lane of the calling warp takes part, and the mask's summaries are scanned 32
// row blocks at a time.
template <int kBlockM, int kBlockN, int kPolicies, bool kWarpScan = false>
__forceinline__ __device__ int2 bwd_general_m_blocks(const AttentionParams& p, int batch, int kv_head, int n_block) {
  const int key0 = n_block * kBlockN;
  KeyRange r = query_range(p, sequence_bounds(p, batch), key0, kBlockN);
  if constexpr ((kPolicies & kPolicySegments) != 0)
    r = segment_narrowed(r, p.mask.kv_segment_chunks, batch, int(p.S), key0, kBlockN);
  if constexpr ((kPolicies & kPolicyBoolMask) != 0) {
    const int group = int(p.N / p.K);
    r = mask_narrowed_queries<kWarpScan>(p, batch, int64_t(kv_head) * group, group, key0, kBlockN, r);
  }
  if (r.end <= r.begin) return make_int2(0, 0);
  return make_int2(int(r.begin / kBlockM), int((r.end + kBlockM - 1) / kBlockM));
}

// What every step of a CTA's key block shares.
struct BwdGeneralBlock {
  SequenceBounds bounds;
  int full_rows_begin, full_rows_end;  // the query rows of tiles full by position (jfa::full_query_rows)
  SegmentIds kv_ids;  // the key block's segment summary (unknown without segment ids)
  int batch, key0;
  uint32_t k0, k1, stream_batch, threshold;  // dropout: the Philox key, batch coordinate, threshold
  uint32_t stream_query0, stream_key0;       // and the coordinates of query row 0 and key 0
  float keep_scale;                          // 1 / (1 − rate)
};

template <int kBlockN, int kPolicies>
__forceinline__ __device__ BwdGeneralBlock bwd_general_block(const AttentionParams& p, int batch, int n_block) {
  BwdGeneralBlock b{};
  b.bounds = sequence_bounds(p, batch);
  b.batch = batch;
  b.key0 = n_block * kBlockN;
  const KeyRange full = full_query_rows(p, b.bounds, b.key0, kBlockN);  // within [0, valid length]
  b.full_rows_begin = int(full.begin);
  b.full_rows_end = int(full.end);
  if constexpr ((kPolicies & kPolicySegments) != 0)
    b.kv_ids = segment_ids(p.mask.kv_segment_chunks, batch, int(p.S), b.key0, kBlockN);
  b.keep_scale = 1.f;
  if constexpr ((kPolicies & kPolicyDropout) != 0) {
    const uint32_t* seed = p.mask.dropout_seeds + 3 * int64_t(batch);
    b.k0 = __ldg(seed);
    b.k1 = __ldg(seed + 1);
    b.stream_batch = __ldg(seed + 2);
    b.threshold = dropout_threshold(p.mask.dropout_rate);
    b.stream_query0 = uint32_t(p.mask.query_position0(batch));
    b.stream_key0 = uint32_t(p.mask.key_position0(batch));
    b.keep_scale = 1.f / (1.f - p.mask.dropout_rate);
  }
  return b;
}

// The block of a CTA as the plain path needs it (batch and first key only), or the general path.
template <int kPolicies, int kBlockN>
__forceinline__ __device__ BwdGeneralBlock bwd_block(const AttentionParams& p, int batch, int n_block) {
  if constexpr (kPolicies != 0) return bwd_general_block<kBlockN, kPolicies>(p, batch, n_block);
  BwdGeneralBlock b{};
  b.batch = batch;
  b.key0 = n_block * kBlockN;
  return b;
}

// Which per-element test the tile of query block m_block needs: none (full), the mask's bits alone
// (positions and segment ids prove the tile full, only the boolean mask is partial), or the whole
// predicate (positions, segment ids, the boolean mask). mask_full: whether the mask's summaries
// prove the tile full, where the walk read them ahead (BwdStep::mask_full); -1: they are looked up
// here, and a partial tile takes the whole predicate.
enum class BwdTileTest { kNone, kMaskBits, kElements };

template <int kBlockM, int kBlockN, int kPolicies>
__forceinline__ __device__ BwdTileTest bwd_general_tile_test(const AttentionParams& p, const BwdGeneralBlock& b,
                                                             int head, int m_block, int mask_full) {
  const int query0 = m_block * kBlockM;
  // position_tile_kind's answer, from the rows computed once per key block: per step, its 64-bit
  // bounds stood before the step's first GEMM.
  const bool positions_full = query0 >= b.full_rows_begin && query0 + kBlockM <= b.full_rows_end;
  if (!positions_full) return BwdTileTest::kElements;
  if constexpr ((kPolicies & kPolicySegments) != 0)
    if (segments_split(p, segment_ids(p.mask.q_segment_chunks, b.batch, int(p.T), query0, kBlockM), b.kv_ids))
      return BwdTileTest::kElements;
  // The mask's summaries only in the kernels that read a mask (the call's policy set has one
  // whenever a mask is present): the test's code otherwise costs the others registers.
  if constexpr ((kPolicies & kPolicyBoolMask) != 0) {
    if (mask_full == 0) return BwdTileTest::kMaskBits;
    if (mask_full < 0 && general_tile_partial(p, b.bounds, b.batch, head, query0, kBlockM, b.key0, kBlockN))
      return BwdTileTest::kElements;
  }
  return BwdTileTest::kNone;
}

// Dropout's keep bits of a thread's elements of one step, bit 2c + e for element e of column pair
// c: (row 0, c), (row 0, c + 1), (row 1, c), (row 1, c + 1). Queries in columns: the transposed
// layout (jfa::dropout_uniforms_transposed); in rows: the forward's (jfa::dropout_uniforms_rows).
// Column pairs go two at a time (the calls' exchange); an odd last pair goes with itself. The
// mainloops make the next step's while the current step's last GEMM runs, when the score and dP
// accumulators are dead: made in the element pass, the Philox calls' registers would spill the
// dK and dV accumulators.
template <int kCols>
struct BwdKeepBits {
  uint32_t bits[(2 * kCols + 31) / 32];
  __forceinline__ __device__ bool kept(int c, int e) const { return (bits[(2 * c + e) / 32] >> ((2 * c + e) % 32)) & 1u; }
};

template <bool kQueriesInColumns, typename Coords>
__forceinline__ __device__ BwdKeepBits<decltype(size<1>(std::declval<Coords>()))::value> bwd_keep_bits(
    const BwdGeneralBlock& b, int head, int m_block, int block_m, Coords const& coords) {
  constexpr int kCols = decltype(size<1>(coords))::value;
  static_assert(kCols % 2 == 0);
  const uint32_t query0 = b.stream_query0 + uint32_t(m_block * block_m), key0 = b.stream_key0 + uint32_t(b.key0);
  BwdKeepBits<kCols> keep{};
  CUTE_UNROLL
  for (int c = 0; c < kCols; c += 4) {
    const int cb = c + 2 < kCols ? c + 2 : c;
    uint4 u;
    if constexpr (kQueriesInColumns) {
      u = dropout_uniforms_transposed(b.k0, b.k1, b.stream_batch, uint32_t(head), query0 + uint32_t(get<1>(coords(0, c))),
                                      query0 + uint32_t(get<1>(coords(0, cb))), key0 + uint32_t(get<0>(coords(0, c))));
    } else {
      u = dropout_uniforms_rows(b.k0, b.k1, b.stream_batch, uint32_t(head), query0 + uint32_t(get<0>(coords(0, c))),
                                query0 + uint32_t(get<0>(coords(1, c))), key0 + uint32_t(get<1>(coords(0, c))),
                                key0 + uint32_t(get<1>(coords(0, cb))));
    }
    // u: (row 0, c), (row 1, c), (row 0, cb), (row 1, cb), two columns each.
    const uint32_t pair_a = dropout_keep_pair(u.x, b.threshold) | dropout_keep_pair(u.y, b.threshold) << 2;
    keep.bits[(2 * c) / 32] |= pair_a << ((2 * c) % 32);
    if (cb != c) {
      const uint32_t pair_b = dropout_keep_pair(u.z, b.threshold) | dropout_keep_pair(u.w, b.threshold) << 2;
      keep.bits[(2 * cb) / 32] |= pair_b << ((2 * cb) % 32);
    }
  }
  return keep;
}

// One query's terms of the element pass: the keys [lo, hi) it sees by position (jfa::key_lo,
// key_hi; empty past its valid length), its segment id and index. Four registers: with the data
// masks' and the bias's rows addressed per element from the index, two of them cost the dK and dV
// accumulators no spill, where two RowPolicy did.
struct BwdQuery {
  int lo, hi, seg, i;
};

template <bool kSegments>
__forceinline__ __device__ BwdQuery bwd_query(const AttentionParams& p, const BwdGeneralBlock& b, int i) {
  const bool valid = i < b.bounds.q_len;
  BwdQuery q;
  q.lo = valid ? int(key_lo(p, b.bounds, i)) : 0;
  q.hi = valid ? int(key_hi(p, b.bounds, i)) : 0;
  q.seg = kSegments && valid && p.mask.q_segment_ids != nullptr ? p.mask.q_segment_ids[int64_t(b.batch) * p.T + i] : 0;
  q.i = i;
  return q;
}

// What a step's tile needs of the element pass, from the cheapest: kPlain, the plain path's work
// (with dropout's multiplier); kModified, soft-capping and ALiBi on a tile every element of which
// is visible; kMaskBits, kModified with the mask's bit as the only test (BwdTileTest::kMaskBits);
// kGeneral, the per-element predicate (partial tiles) and the bias. bwd_step picks the cheapest
// that covers the tile: most tiles of a windowed, segmented or length-limited call are full and
// take kPlain, as they would on the plain kernel, and the partial tiles of a boolean mask alone
// skip the positions' per-query bounds.
enum class BwdTilePass { kPlain, kModified, kMaskBits, kGeneral };

// The element pass (the header's comment) for the kernel of policy set kPolicies (mask_policies.h: the
// features it compiles code for; the call's pointers say which of them it uses) over a step's
// scores `s` (raw Q·Kᵀ, becomes P·z) and
// `dp` (becomes dS), (rows, cols) views with the coordinates `coords` of the same shape; lse_log2
// and d: the step's row statistics per query (smem). kGeneral adds d(bias) into p.mask.dbias
// (float32 atomics) and tests visibility where `partial`. keep: dropout's keep bits
// (bwd_keep_bits; read with kDropout only); mask: the bit-packed mask's bits of a partial step
// (BwdStepMask, tested where loaded). Returns this thread's share of
// Σ d(logit)·|i + offset − j| (d(slope) is minus the sum; 0 on kPlain).
template <BwdTilePass kPass, int kPolicies, bool kQueriesInColumns, typename Scores, typename Grads, typename Coords,
          typename Keep, typename StepMask>
__forceinline__ __device__ float bwd_tile_elements(Scores& s, Grads& dp, Coords const& coords, const float* lse_log2,
                                                   const float* d, const AttentionParams& p, const BwdGeneralBlock& b,
                                                   int head, int query0, bool partial, const Keep& keep,
                                                   const StepMask& mask) {
  static_assert(decltype(size<0>(s))::value == 2, "a 64-row wgmma atom: two rows per thread");
  constexpr int kCols = decltype(size<1>(s))::value;
  static_assert(kCols % 2 == 0);
  constexpr bool kGeneral = kPass == BwdTilePass::kGeneral, kModified = kPass != BwdTilePass::kPlain;
  constexpr bool kDropout = (kPolicies & kPolicyDropout) != 0, kSoftcap = (kPolicies & kPolicySoftcap) != 0;
  constexpr bool kBias = (kPolicies & kPolicyBias) != 0;
  constexpr bool kAlibi = (kPolicies & kPolicyAlibi) != 0, kSegments = (kPolicies & kPolicySegments) != 0;
  constexpr bool kBoolMask = (kPolicies & kPolicyBoolMask) != 0;
  const MaskParams& m = p.mask;
  const bool softcap = kSoftcap && kModified && m.softcap > 0.f;
  const float softcap2 = m.softcap * kLog2eF, softcap_in = softcap ? p.scale_log2 / softcap2 : 0.f;
  // ALiBi's term in log2 units; d(slope) needs |i + offset − j| = |pos0 + query − key| per element.
  const float slope_log2 =
      kAlibi && kModified && m.alibi_slopes != nullptr ? m.alibi_slope(b.batch, head) * kLog2eF : 0.f;
  const int pos0 = query0 + int(b.bounds.offset) - b.key0;
  constexpr bool kMaskBits = kPass == BwdTilePass::kMaskBits;
  const bool mask_test = kBoolMask && (kGeneral || kMaskBits) && partial && mask.loaded;
  // This (batch, head)'s planes of the bias and d(bias) (null: none).
  const float* bias = kBias && kGeneral && m.bias != nullptr
                          ? m.bias + b.batch * m.bias_strides.batch + head * m.bias_strides.head : nullptr;
  float* dbias = kBias && kGeneral && m.dbias != nullptr
                     ? m.dbias + b.batch * m.dbias_strides.batch + head * m.dbias_strides.head : nullptr;
  const int32_t* kv_seg =
      kSegments && kGeneral && m.q_segment_ids != nullptr ? m.kv_segment_ids + int64_t(b.batch) * p.S : nullptr;
  float slope_dot = 0.f;
  // The row statistics of the two queries at hand (columns c, c + 1, or rows 0, 1), read from smem
  // as needed: held for every query of the thread, they would spill the dK and dV accumulators.
  auto stats_of = [&](const float* stats, int c) {
    const int q = kQueriesInColumns ? get<1>(coords(0, c)) : 0;
    return kQueriesInColumns ? *reinterpret_cast<const float2*>(stats + q)
                             : make_float2(stats[get<0>(coords(0, 0))], stats[get<0>(coords(1, 0))]);
  };
  // kGeneral, partial tiles: the two queries at hand, made per column pair where queries are
  // columns, once where rows.
  BwdQuery row_queries[2];
  if (kGeneral && !kQueriesInColumns && partial) {
    row_queries[0] = bwd_query<kSegments>(p, b, query0 + get<0>(coords(0, 0)));
    row_queries[1] = bwd_query<kSegments>(p, b, query0 + get<0>(coords(1, 0)));
  }
  CUTE_UNROLL
  for (int c = 0; c < kCols; c += 2) {
    const float2 lse = stats_of(lse_log2, c), dsum = stats_of(d, c);
    BwdQuery col_queries[2];
    if (kGeneral && kQueriesInColumns && partial) {
      col_queries[0] = bwd_query<kSegments>(p, b, query0 + get<1>(coords(0, c)));
      col_queries[1] = bwd_query<kSegments>(p, b, query0 + get<1>(coords(0, c)) + 1);
    }
    CUTE_UNROLL
    for (int e = 0; e < 4; ++e) {
      const int r = e >> 1, cc = c + (e & 1);
      // The query's index among the two at hand: the column's (queries in columns) or the row's.
      const int at = kQueriesInColumns ? (e & 1) : r;
      const int qk_query = kQueriesInColumns ? get<1>(coords(r, cc)) : get<0>(coords(r, cc));
      const int qk_key = kQueriesInColumns ? get<0>(coords(r, cc)) : get<1>(coords(r, cc));
      const float lse_i = at == 0 ? lse.x : lse.y, dsum_i = at == 0 ? dsum.x : dsum.y;
      float prob, g = 1.f;
      int abs_dist = 0;
      if constexpr (!kModified) {
        prob = exp2f(fmaf(s(r, cc), p.scale_log2, -lse_i));
      } else {
        const int dist = pos0 + qk_query - qk_key;
        abs_dist = dist < 0 ? -dist : dist;
        // jfa::visible, on partial tiles only. Hidden elements read nothing more: their queries
        // may lie past T, their keys past S.
        bool visible_here = true;
        const int i = query0 + qk_query, j = b.key0 + qk_key;
        if (kGeneral && partial) {
          const BwdQuery& q = kQueriesInColumns ? col_queries[at] : row_queries[at];
          visible_here = j >= q.lo && j < q.hi;
          if (kv_seg != nullptr) visible_here = visible_here && kv_seg[j] == q.seg;
          if (mask_test) visible_here = visible_here && mask.test(c, e);
        } else if (kMaskBits) {
          visible_here = mask.test(c, e);  // bwd_step takes this pass only with the step's bits loaded
        }
        float x = s(r, cc) * p.scale_log2;
        if (softcap) {
          const float t = fast_tanh(s(r, cc) * softcap_in);
          x = softcap2 * t;
          g = 1.f - t * t;
        }
        // jfa::additive_bias: ALiBi's −slope·|i + offset − j|, and the bias.
        if constexpr (kAlibi) x = fmaf(-slope_log2, float(abs_dist), x);
        if (bias != nullptr && visible_here)
          x = fmaf(bias[int64_t(i) * m.bias_strides.row + int64_t(j) * m.bias_strides.col], kLog2eF, x);
        if constexpr (kMaskBits) {
          // The exponential of every element, then a select: predicated per element, ptxas
          // reloaded the scale from the constant bank for each one.
          const float every = exp2f(x - lse_i);
          prob = visible_here ? every : 0.f;
        } else {
          prob = visible_here ? exp2f(x - lse_i) : 0.f;
        }
        (void)i;
      }
      float z = 1.f;
      if constexpr (kDropout) z = keep.kept(c, e) ? b.keep_scale : 0.f;
      const float dlogit = prob * (dp(r, cc) * z - dsum_i);
      if constexpr (kGeneral && kBias) {
        if (dbias != nullptr && dlogit != 0.f)
          red_add_f32(dbias + int64_t(query0 + qk_query) * m.dbias_strides.row +
                          int64_t(b.key0 + qk_key) * m.dbias_strides.col,
                      dlogit);
      }
      if constexpr (kModified && kAlibi) slope_dot = fmaf(dlogit, float(abs_dist), slope_dot);
      s(r, cc) = prob * z;
      dp(r, cc) = dlogit * g;
    }
  }
  return slope_dot;
}

// d(ALiBi slopes): slot (batch, head, 64-key group) of p.mask.dslopes receives minus the step's
// Σ d(logit)·|i + offset − j| over its keys, added by one thread in a fixed order (deterministic,
// no atomics). A slot's keys are kSlotWarps MMA warps' (one warpgroup's Sᵀ rows, or both
// warpgroups' S columns in the split-head layout). Each warp leaves its sum in `sums` (this step's
// parity of the two) before the step's dS barrier; after it the slot's first thread adds them.
// The parity keeps the next step's sums from overwriting these before they are read: that step's
// barrier waits for the reader.
__forceinline__ __device__ void bwd_stage_slope_dot(float v, float (&sums)[8], int mma_tid) {
  CUTE_UNROLL
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if (mma_tid % 32 == 0) sums[mma_tid / 32] = v;
}

template <int kSlotWarps>
__forceinline__ __device__ void bwd_add_slope_dot(const AttentionParams& p, const float (&sums)[8], int mma_tid,
                                                  int batch, int head, int first_key) {
  if (mma_tid % (kSlotWarps * 32) != 0 || first_key >= p.S) return;  // (a slot past S has no slot)
  float total = 0.f;
  CUTE_UNROLL
  for (int w = 0; w < kSlotWarps; ++w) total += sums[mma_tid / 32 + w];
  p.mask.dslopes[(int64_t(batch) * p.N + head) * p.mask.dslope_slots + first_key / kDslopeKeys] -= total;
}

// A step's GEMMs S and dP and their element work (bwd_step_scores), on the plain path (kPolicies
// == 0: P and dS with the top-left causal mask of kCausal, bwd_softmax.h) or on the general path
// (the features of policy set kPolicies, the kPolicyDropout bit compiling dropout in, with the
// step's keep bits); with ALiBi it also leaves the step's d(slope) sums in slope_sums
// (bwd_stage_slope_dot).
template <typename Traits, bool kCausal, int kPolicies, bool kQueriesInColumns, typename Mma, typename Pipeline,
          typename State, typename AS, typename BS, typename ADP, typename BDP, typename Acc, typename Coords,
          typename Keep>
__forceinline__ __device__ void bwd_step(Mma& mma, Pipeline& pipeline_q, Pipeline& pipeline_do, State const& read,
                                         AS const& a_s, BS const& b_s, ADP const& a_dp, BDP const& b_dp, Acc& tSrS,
                                         Acc& tdPrdP, Coords const& coords, const float* lse_log2, const float* d,
                                         const AttentionParams& p, const BwdGeneralBlock& block, int head, int m_block,
                                         int mask_full, const Keep& keep, float (&slope_sums)[8]) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  const int query0 = m_block * kBlockM;
  if constexpr (kPolicies == 0) {
    const bool masked = bwd_block_needs_mask<Traits, kCausal>(block.key0, m_block, int(p.S));
    // Loaded ahead (the LSE while S runs, D while dP does), a step's statistics hide their
    // shared-memory latency but stay live across the GEMMs: worth it only where a thread holds few
    // (the split-head kernel's query rows); with 20 or more (queries in columns) the kernel spills
    // and the step is slower (docs/performance.md, "Row statistics ahead of their GEMMs").
    constexpr int kStats = kStatCount<kQueriesInColumns, Coords>;  // coords: the scores' (rows, cols) shape
    constexpr bool kStatsAhead = kStats <= 8;
    float lse[kStats], dsum[kStats];
    bwd_step_scores(
        mma, pipeline_q, pipeline_do, read, a_s, b_s, a_dp, b_dp, tSrS, tdPrdP,
        [&] {
          if constexpr (kStatsAhead) bwd_load_stats<kQueriesInColumns>(lse, coords, lse_log2);
        },
        [&](auto& scores) {
          if (masked) bwd_mask_scores<kCausal, kQueriesInColumns>(scores, coords, block.key0, query0, int(p.S));
          if constexpr (!kStatsAhead) bwd_load_stats<kQueriesInColumns>(lse, coords, lse_log2);
          bwd_probabilities<kQueriesInColumns>(scores, lse, p.scale_log2);
          if constexpr (kStatsAhead) bwd_load_stats<kQueriesInColumns>(dsum, coords, d);
        },
        [&](auto& scores, auto& grads) {
          if constexpr (!kStatsAhead) bwd_load_stats<kQueriesInColumns>(dsum, coords, d);
          bwd_score_grads<kQueriesInColumns>(grads, scores, dsum);
        });
  } else {
    const BwdTileTest test = bwd_general_tile_test<kBlockM, kBlockN, kPolicies>(p, block, head, m_block, mask_full);
    const bool partial = test != BwdTileTest::kNone;
    const MaskParams& m = p.mask;
    constexpr bool kSoftcap = (kPolicies & kPolicySoftcap) != 0, kAlibi = (kPolicies & kPolicyAlibi) != 0;
    constexpr bool kBias = (kPolicies & kPolicyBias) != 0, kBoolMask = (kPolicies & kPolicyBoolMask) != 0;
    // The mask's words of a partial step load while its GEMMs run; kernels without a mask keep none.
    std::conditional_t<kBoolMask, BwdStepMask<kQueriesInColumns, kBlockM, decltype(size<1>(coords))::value>,
                       BwdNoStepMask>
        step_mask;
    if constexpr (kBoolMask)
      if (partial && m.packed_mask.present()) step_mask.load(p, block.batch, head, query0, block.key0, coords);
    bwd_step_scores(
        mma, pipeline_q, pipeline_do, read, a_s, b_s, a_dp, b_dp, tSrS, tdPrdP, [] {},
        [&](auto&) {
          if constexpr (kBoolMask)
            if (step_mask.loaded) step_mask.finish();
        },
        [&](auto& scores, auto& grads) {
          float slope_dot = 0.f;
          auto pass = [&](auto kind) {
            return bwd_tile_elements<decltype(kind)::value, kPolicies, kQueriesInColumns>(
                scores, grads, coords, lse_log2, d, p, block, head, query0, partial, keep, step_mask);
          };
          using Pass = BwdTilePass;
          const bool bias = kBias && m.bias != nullptr;
          bool mask_bits_only = false;
          if constexpr (kBoolMask)
            mask_bits_only = test == BwdTileTest::kMaskBits && !bias && step_mask.loaded;
          if (mask_bits_only) {
            if constexpr (kBoolMask) slope_dot = pass(std::integral_constant<Pass, Pass::kMaskBits>{});
          } else if (partial || bias) {
            slope_dot = pass(std::integral_constant<Pass, Pass::kGeneral>{});
          } else if constexpr (kSoftcap || kAlibi) {
            if (m.softcap > 0.f || m.alibi_slopes != nullptr)
              slope_dot = pass(std::integral_constant<Pass, Pass::kModified>{});
            else
              pass(std::integral_constant<Pass, Pass::kPlain>{});
          } else {
            pass(std::integral_constant<Pass, Pass::kPlain>{});
          }
          if (kAlibi && m.dslopes != nullptr) bwd_stage_slope_dot(slope_dot, slope_sums, int(threadIdx.x) - 128);
        });
  }
}

}  // namespace jfa::sm90
