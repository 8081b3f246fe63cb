// Online softmax of the forward kernel, in registers, in the log2 domain.
//
// Each thread holds kNRows rows of the score tile (the quad of 4 lanes that shares a row reduces
// with two shuffles). Scores are raw q·k; `scale_log2` = softmax scale · log2(e) is folded into a
// single FFMA before exp2f. The running max is kept unscaled; a row whose scores are all -inf so
// far (masked) uses 0 as its max so that no (-inf) - (-inf) NaN appears.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "utils.h"

namespace jfa::sm80 {

using namespace cute;

template <int kNRows>
struct OnlineSoftmax {
  float row_max[kNRows];
  float row_sum[kNRows];  // per-thread partial sums; reduced over the quad only at the end

  __forceinline__ __device__ OnlineSoftmax() {
    CUTE_UNROLL
    for (int i = 0; i < kNRows; ++i) {
      row_max[i] = -INFINITY;
      row_sum[i] = 0.f;
    }
  }

  // scores: (rows, cols) view of S; acc_o: (rows, cols) view of the output accumulator.
  // On return scores holds P = exp2(S·scale_log2 − max·scale_log2) and acc_o is rescaled.
  template <typename Scores, typename AccO>
  __forceinline__ __device__ void update(Scores& scores, AccO& acc_o, float scale_log2) {
    static_assert(decltype(size<0>(scores))::value == kNRows);
    CUTE_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) {
      float m = row_max[mi];
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(scores); ++ni) m = fmaxf(m, scores(mi, ni));
      m = quad_allreduce_max(m);
      const float m_safe = m == -INFINITY ? 0.f : m;
      const float rescale = exp2f((row_max[mi] - m_safe) * scale_log2);
      row_max[mi] = m;
      row_sum[mi] *= rescale;
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(acc_o); ++ni) acc_o(mi, ni) *= rescale;
      const float m_scaled = m_safe * scale_log2;
      float sum = 0.f;
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(scores); ++ni) {
        scores(mi, ni) = exp2f(scores(mi, ni) * scale_log2 - m_scaled);
        sum += scores(mi, ni);
      }
      row_sum[mi] += sum;
    }
  }

  // Divide acc_o by the row sums; return each row's natural-log LSE (-inf for an empty row,
  // whose output is then 0).
  template <typename AccO>
  __forceinline__ __device__ void finalize(AccO& acc_o, float scale_log2, float (&lse)[kNRows]) {
    CUTE_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) {
      const float sum = quad_allreduce_sum(row_sum[mi]);
      const bool empty = sum == 0.f || sum != sum;
      const float inv = empty ? 0.f : 1.f / sum;
      lse[mi] = empty ? -INFINITY : (row_max[mi] * scale_log2 + __log2f(sum)) * float(M_LN2);
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(acc_o); ++ni) acc_o(mi, ni) *= inv;
    }
  }
};

}  // namespace jfa::sm80
