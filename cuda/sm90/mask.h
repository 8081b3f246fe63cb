// The general (masked) path of the sm90 forward: jfa::row_policy / row_logit (shared with the sm80
// kernels) applied to one consumer thread's scores of a key block.
#pragma once

#include <cute/tensor.hpp>

#include "jfa/mask.h"
#include "jfa/params.h"
#include "jfa/row_policy.cuh"

namespace jfa::sm90 {

using namespace cute;

// Raw q·k scores of key block n0 to logits in log2 units: soft-capping, bias and ALiBi on every
// element, and -inf where the element is hidden (checked only when `partial`). `scores` and
// `coords` are (row, col) views of the accumulator and of the identity tensor partitioned the same
// way; the row policy is rebuilt per block rather than kept, to leave the registers to the GEMMs.
template <typename Scores, typename Coords>
__forceinline__ __device__ void apply_policy(Scores& scores, Coords const& coords, const AttentionParams& p,
                                             const SequenceBounds& bounds, int batch, int head, int m0, int n0,
                                             bool partial) {
  CUTE_UNROLL
  for (int r = 0; r < size<0>(scores); ++r) {
    const RowPolicy row = row_policy(p, bounds, batch, head, m0 + get<0>(coords(r, 0)));
    CUTE_UNROLL
    for (int c = 0; c < size<1>(scores); ++c)
      scores(r, c) = row_logit(p, row, n0 + get<1>(coords(r, c)), scores(r, c), partial, nullptr);
  }
}

}  // namespace jfa::sm90
