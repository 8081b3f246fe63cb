// The Hopper backward's element-wise work of a step: the probabilities from the saved LSE, and dS,
// for either orientation of the score accumulator (keys as rows: bwd_mainloop.h; queries as rows:
// bwd_mainloop_split_head.h). Row statistics (LSE·log2 e, D) come per query from smem.
#pragma once

#include <cmath>

#include <utility>

#include <cute/tensor.hpp>

#include "utils.h"

namespace jfa::sm90 {

using namespace cute;

// Whether block (key0, m_block) crosses S, or, top-left causal, holds a key after one of its queries.
template <typename Traits, bool kCausal>
__forceinline__ __device__ bool bwd_block_needs_mask(int key0, int m_block, int S) {
  return key0 + Traits::kBlockN > S || (kCausal && key0 + Traits::kBlockN - 1 > m_block * Traits::kBlockM);
}

// The query of element (r, c) of a (rows, cols) view and its key, from the coordinates.
template <bool kQueriesInColumns, typename Coords>
__forceinline__ __device__ int2 bwd_query_key(Coords const& coords, int i) {
  const int row = get<0>(coords(i)), col = get<1>(coords(i));
  return kQueriesInColumns ? make_int2(col, row) : make_int2(row, col);
}

// This thread's row statistics (`stats`: one float per query in smem) for the queries of its
// columns (kQueriesInColumns: in pairs of neighbours, one 8-byte load each) or of its rows.
template <bool kQueriesInColumns, int kCount, typename Coords>
__forceinline__ __device__ void bwd_load_stats(float (&out)[kCount], Coords const& coords, const float* stats) {
  CUTE_UNROLL
  for (int i = 0; i < kCount; i += kQueriesInColumns ? 2 : 1) {
    if constexpr (kQueriesInColumns) {
      const float2 pair = *reinterpret_cast<const float2*>(stats + get<1>(coords(0, i)));
      out[i] = pair.x;
      out[i + 1] = pair.y;
    } else {
      out[i] = stats[get<0>(coords(i, 0))];
    }
  }
}

// The number of statistics a thread needs for a (rows, cols) view: one per column or per row.
template <bool kQueriesInColumns, typename View>
inline constexpr int kStatCount = kQueriesInColumns ? int(decltype(size<1>(std::declval<View>()))::value)
                                                    : int(decltype(size<0>(std::declval<View>()))::value);

// Keys past S and, top-left causal, keys after their query get the score −inf (P = 0).
template <bool kCausal, bool kQueriesInColumns, typename Scores, typename Coords>
__forceinline__ __device__ void bwd_mask_scores(Scores& s, Coords const& coords, int key0, int query0, int S) {
  CUTE_UNROLL
  for (int i = 0; i < size(s); ++i) {
    const int2 qk = bwd_query_key<kQueriesInColumns>(coords, i);
    const int key = key0 + qk.y;
    if (key >= S || (kCausal && key > query0 + qk.x)) s(i) = -INFINITY;
  }
}

// P = exp2(S·scale_log2 − LSE·log2 e) in place of the scores `s` ((rows, cols) view), with this
// thread's LSE·log2 e already loaded (bwd_load_stats).
template <bool kQueriesInColumns, typename Scores, int kCount>
__forceinline__ __device__ void bwd_probabilities(Scores& s, const float (&lse)[kCount], float scale_log2) {
  static_assert(kCount == kStatCount<kQueriesInColumns, Scores>);
  CUTE_UNROLL
  for (int r = 0; r < size<0>(s); ++r) {
    CUTE_UNROLL
    for (int c = 0; c < size<1>(s); ++c) s(r, c) = exp2f(fmaf(s(r, c), scale_log2, -lse[kQueriesInColumns ? c : r]));
  }
}

// dS = P∘(dP − D) in place of dP, with this thread's D already loaded (bwd_load_stats).
template <bool kQueriesInColumns, typename Grads, typename Probs, int kCount>
__forceinline__ __device__ void bwd_score_grads(Grads& dp, Probs const& prob, const float (&dsum)[kCount]) {
  static_assert(kCount == kStatCount<kQueriesInColumns, Grads>);
  CUTE_UNROLL
  for (int r = 0; r < size<0>(dp); ++r) {
    CUTE_UNROLL
    for (int c = 0; c < size<1>(dp); ++c) dp(r, c) = prob(r, c) * (dp(r, c) - dsum[kQueriesInColumns ? c : r]);
  }
}

// The start of a step: issues S (or Sᵀ) = a_s·b_s and dP (or dPᵀ) = a_dp·b_dp as each operand's
// stage lands; calls on_s_issued() once S is issued (its stage's row statistics have landed with
// Q: loaded there, they are in registers when S lands); once S has landed calls on_scores(S), once
// dP has too on_grads(S, dP), both as (rows, cols) views, which turn them into P and dS in place.
template <typename Mma, typename Pipeline, typename State, typename AS, typename BS, typename ADP, typename BDP,
          typename Acc, typename OnSIssued, typename OnScores, typename OnGrads>
__forceinline__ __device__ void bwd_step_scores(Mma& mma, Pipeline& pipeline_q, Pipeline& pipeline_do, State const& read,
                                                AS const& a_s, BS const& b_s, ADP const& a_dp, BDP const& b_dp,
                                                Acc& tSrS, Acc& tdPrdP, OnSIssued&& on_s_issued, OnScores&& on_scores,
                                                OnGrads&& on_grads) {
  pipeline_q.consumer_wait(read);
  gemm</*zero_init=*/true, /*wait=*/-1>(mma, a_s, b_s, tSrS);
  on_s_issued();
  pipeline_do.consumer_wait(read);
  gemm</*zero_init=*/true, /*wait=*/-1>(mma, a_dp, b_dp, tdPrdP);
  warpgroup_wait<1>();
  Tensor scores = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
  on_scores(scores);
  warpgroup_wait<0>();
  Tensor grads = make_tensor(tdPrdP.data(), scores.layout());
  on_grads(scores, grads);
}

}  // namespace jfa::sm90
