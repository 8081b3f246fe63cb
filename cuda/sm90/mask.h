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

// Raw q·k scores of the key block at n0 to logits in log2 units: soft-capping, bias and ALiBi on
// every element, then -inf where the element is hidden (checked only when `partial`: a tile that
// position_tile_kind proves full, without segment ids or a boolean mask, sees every element).
// `scores` and `coords` are (row, col) views of the accumulator and of the identity tensor
// partitioned the same way. Loads use indices clamped into [0, T) x [0, S): elements outside are
// hidden anyway, and the clamp keeps them in bounds without a branch.
template <typename Scores, typename Coords>
__forceinline__ __device__ void apply_policy(Scores& scores, Coords const& coords, const AttentionParams& p,
                                             const SequenceBounds& bounds, int batch, int head, int m0, int n0,
                                             bool partial) {
  const MaskParams& m = p.mask;
  const float scale_log2 = p.scale_log2;
  const float softcap2 = m.softcap * kLog2eF;  // the cap in log2 units (see jfa/score_mod.h)
  const float inv_softcap2 = m.softcap > 0.f ? 1.f / softcap2 : 0.f;
  const bool has_softcap = m.softcap > 0.f, has_bias = m.bias != nullptr, has_alibi = m.alibi_slopes != nullptr;
  const bool has_segments = m.q_segment_ids != nullptr, has_mask = m.mask != nullptr;
  const int last_key = int(p.S) - 1, last_query = int(p.T) - 1;
  CUTE_UNROLL
  for (int r = 0; r < size<0>(scores); ++r) {
    const int i = m0 + get<0>(coords(r, 0));
    const RowPolicy row = row_policy(p, bounds, batch, head, min(i, last_query));
    const int lo = i <= last_query ? row.lo : 0, hi = i <= last_query ? row.hi : 0;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(scores); ++c) scores(r, c) *= scale_log2;
    if (has_softcap) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) scores(r, c) = softcap2 * fast_tanh(scores(r, c) * inv_softcap2);
    }
    if (has_bias) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) {
        const int j = min(n0 + get<1>(coords(r, c)), last_key);
        scores(r, c) += row.bias[j * row.bias_col] * kLog2eF;
      }
    }
    if (has_alibi) {
      const float slope2 = row.slope * kLog2eF;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) scores(r, c) -= slope2 * float(abs(row.pos - (n0 + get<1>(coords(r, c)))));
    }
    if (partial) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) {
        const int j = n0 + get<1>(coords(r, c));
        if (j < lo || j >= hi) scores(r, c) = -INFINITY;
      }
      if (has_segments) {
        CUTE_UNROLL
        for (int c = 0; c < size<1>(scores); ++c)
          if (row.kv_seg[min(n0 + get<1>(coords(r, c)), last_key)] != row.seg) scores(r, c) = -INFINITY;
      }
      if (has_mask) {
        CUTE_UNROLL
        for (int c = 0; c < size<1>(scores); ++c)
          if (row.mask[min(n0 + get<1>(coords(r, c)), last_key) * row.mask_col] == 0) scores(r, c) = -INFINITY;
      }
    }
  }
}

}  // namespace jfa::sm90
