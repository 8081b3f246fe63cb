// Masks of the sm80 kernels (dropout: dropout.h). The plain path: key positions past S, and causal
// (top-left: query i sees keys j <= i), applied only on boundary/diagonal tiles. The general path:
// see below.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "jfa/mask.h"
#include "jfa/params.h"
#include "jfa/row_policy.cuh"
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
// jax_flashattn through the shared policies of jfa/mask.h, jfa/score_mod.h and dropout.h.
//   * per tile: the key range of a query block (forward) or the query range of a key block
//     (backward) is the trip count, so tiles outside it never run; a tile inside it is "partial"
//     unless position_tile_kind proves it full and no data-dependent mask (segment ids, boolean
//     mask) exists. (Segment ids do not skip tiles on the GPU yet: every tile with segments is
//     partial, which is correct but pays the predicate.)
//   * per element: visible() on partial tiles only, then the score modifiers (jfa/row_policy.cuh,
//     shared with the sm90 forward); logits leave in log2 units (the plain path folds scale_log2
//     into the softmax instead).
