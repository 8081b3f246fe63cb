// Masks of the sm80 kernels: key positions past S, and causal (top-left: query i sees keys j <= i).
// Callers apply them only on boundary/diagonal tiles; interior tiles skip this code entirely.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

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
