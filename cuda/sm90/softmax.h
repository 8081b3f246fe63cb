// Online softmax of one consumer thread's rows, in the log2 domain (exp2 with the scale folded
// into one FFMA per score), and the masks. A thread owns kRows rows of S and O; the 4 threads of
// a quad share each row, so row reductions are two shuffles.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "utils.h"

namespace jfa::sm90 {

using namespace cute;

// The running max is kept stale until a block raises it by more than this (log2 units): the
// probabilities are then exp2 of at most this, 256 (exact in bf16/fp16, and the row sums and O
// stay far from overflow), and O needs no rescale on blocks that do not raise it, which after
// the first blocks of a row are nearly all. The final normalisation and the LSE use the same
// stale max, so the result is the softmax's, not an approximation of it (FlashAttention-4's
// rescaling threshold). Rescaling O costs one FMUL per O accumulator per block: at H 128 as
// many as the softmax's exp2s, at H 256 three times as many (S 40, O 128 floats per thread).
constexpr float kMaxGrowthLog2 = 8.f;

template <int kRows>
struct OnlineSoftmax {
  float row_max[kRows];
  float row_sum[kRows];  // this thread's partial sums; the quad reduces them once, in finalize

  // Turns the scores (a (rows, cols) view) into unnormalised probabilities relative to the
  // running max and writes, per row, the factor the output accumulated so far must be scaled by;
  // returns whether any of them differs from 1 (the caller then rescales O). A row whose max is
  // still -inf (every key so far masked) uses 0 as its max, so exp2 gives 0 instead of NaN.
  template <bool kFirst, typename Scores>
  __forceinline__ __device__ bool update(Scores& s, float scale_log2, float (&o_scale)[kRows]) {
    const float no_shift[kRows] = {};
    return update_impl<kFirst, false>(s, scale_log2, o_scale, no_shift);
  }
  // The same for scores that stand for s + shift[r] (per row, this thread's elements of the
  // block): the general path's ALiBi moves a per-block term out of the per-element work
  // (mask_policies.h, apply_policy). Two more instructions per row and block.
  template <bool kFirst, typename Scores>
  __forceinline__ __device__ bool update(Scores& s, float scale_log2, float (&o_scale)[kRows],
                                         const float (&shift)[kRows]) {
    return update_impl<kFirst, true>(s, scale_log2, o_scale, shift);
  }

  template <bool kFirst, bool kShifted, typename Scores>
  __forceinline__ __device__ bool update_impl(Scores& s, float scale_log2, float (&o_scale)[kRows],
                                              const float (&shift)[kRows]) {
    bool rescale = false;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float m = kFirst || kShifted ? -INFINITY : row_max[r];
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) m = fmaxf(m, s(r, c));
      if constexpr (kShifted) m += shift[r];  // the shift differs between the threads of a row
      m = quad_max(m);
      if constexpr (kFirst) {
        o_scale[r] = 1.f;
        row_max[r] = m;
      } else {
        // From a max of -inf any finite max grows ((m + inf) · scale = inf), -inf to -inf does not
        // (NaN compares false). Needs scale > 0: jax_flashattn/autodiff.py never passes 0 (it
        // passes q = 0 with scale 1 instead; masked -inf times 0 would be NaN in the exp2 too).
        const bool grow = (m - row_max[r]) * scale_log2 > kMaxGrowthLog2;
        const float m_new_scaled = m == -INFINITY ? 0.f : m * scale_log2;
        o_scale[r] = grow ? exp2f(row_max[r] * scale_log2 - m_new_scaled) : 1.f;
        row_max[r] = grow ? m : row_max[r];
        rescale |= grow;
      }
      const float m_scaled = row_max[r] == -INFINITY ? 0.f : row_max[r] * scale_log2;
      const float offset = kShifted ? fmaf(shift[r], scale_log2, -m_scaled) : -m_scaled;
      float sum = 0.f;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        s(r, c) = exp2f(fmaf(s(r, c), scale_log2, offset));
        sum += s(r, c);
      }
      row_sum[r] = kFirst ? sum : fmaf(row_sum[r], o_scale[r], sum);
    }
    return rescale;
  }

  // Final per-row output scale 1/sum and the natural-log LSE (−inf for a row that saw no key).
  __forceinline__ __device__ void finalize(float scale_log2, float (&o_scale)[kRows], float (&lse)[kRows]) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float sum = quad_sum(row_sum[r]);
      const bool empty = sum == 0.f || sum != sum;
      o_scale[r] = empty ? 0.f : 1.f / sum;
      lse[r] = empty ? -INFINITY : (row_max[r] * scale_log2 + __log2f(sum)) * float(M_LN2);
    }
  }
};

template <int kRows, typename Acc>
__forceinline__ __device__ void scale_rows(Acc& acc_rc, const float (&scale)[kRows]) {
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    CUTE_UNROLL
    for (int c = 0; c < size<1>(acc_rc); ++c) acc_rc(r, c) *= scale[r];
  }
}

// Masks (applied only to the tiles that need them): key positions >= S, and for causal
// (top-left alignment) keys after the query. `coords` is the identity tensor partitioned like the
// scores; (m0, n0) is the tile origin.
template <bool kCausal, bool kSeqlenMask, typename Scores, typename Coords>
__forceinline__ __device__ void apply_mask(Scores& s, Coords const& coords, int m0, int n0, int S) {
  CUTE_UNROLL
  for (int i = 0; i < size(s); ++i) {
    const int row = m0 + get<0>(coords(i));
    const int col = n0 + get<1>(coords(i));
    if ((kSeqlenMask && col >= S) || (kCausal && col > row)) s(i) = -INFINITY;
  }
}

}  // namespace jfa::sm90
