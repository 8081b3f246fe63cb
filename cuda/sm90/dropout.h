// Dropout of P on the Hopper forward (the dropout kernel, fwd_launch.h): the keep mask of every other
// path, jfa::dropout_word's (one Philox4x32-10 call per query and 4 neighbouring keys), regenerated
// from the key here as it is in the backward and on the CPU, never stored.
//
// The Philox calls are the cost (about 40 instructions each, 20 of them 64-bit multiplies, on the
// integer multiply pipe: 10 per score against the softmax's ~5), so none is made twice: the two
// lanes of a quad that share a call's 4 keys draw one row each and swap words
// (jfa::dropout_words_2x2).
//
// The row sums (and so the LSE) stay dropout-free; the kernel folds 1 / (1 - rate) into the final
// scale of O instead of multiplying each kept P.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "jfa/params.h"
#include "jfa/philox.h"

namespace jfa::sm90 {

using namespace cute;

// A consumer thread's share of one tile's dropout stream.
struct DropoutTile {
  uint32_t k0, k1, batch;  // the Philox key and the stream's batch coordinate (params.h)
  uint32_t head;
  uint32_t query;      // the row this thread draws for (jfa::dropout_words_2x2): r0 or r0 + 8
  uint32_t threshold;  // dropped when the word is below it (jfa::dropout_threshold)
};

// `coords` is the accumulator's identity tensor as (row, col), partitioned for this thread.
template <typename Coords>
__forceinline__ __device__ DropoutTile dropout_tile(const AttentionParams& p, int batch, int head, int m0,
                                                    Coords const& coords) {
  static_assert(decltype(size<0>(coords))::value == 2, "one 64-row wgmma atom per consumer warpgroup");
  const uint32_t* seed = p.mask.dropout_seeds + 3 * int64_t(batch);
  // The lanes whose keys start a group of 4 (even lanes: column 2 · (lane % 4) of 8) draw row r0.
  const int drawn = threadIdx.x & 1;
  return DropoutTile{__ldg(seed), __ldg(seed + 1), __ldg(seed + 2), uint32_t(head),
                     uint32_t(m0 + get<0>(coords(drawn, 0))), dropout_threshold(p.mask.dropout_rate)};
}

// Zeroes the dropped probabilities of this thread's elements of a key block. `probs` is a
// (row, col) view of the accumulator, whose columns come in pairs of neighbouring keys (col 2k and
// 2k + 1 are keys j, j + 1 with j even); the key of column c is col_shift + coords0(0, c), coords0
// being thread 0's partition (compile-time columns, as in mask.h's apply_policy).
template <typename Probs, typename Coords0>
__forceinline__ __device__ void apply_dropout(Probs& probs, const DropoutTile& d, int col_shift,
                                              Coords0 const& coords0) {
  constexpr int kCols = decltype(size<1>(probs))::value;
  static_assert(kCols % 2 == 0);
  CUTE_UNROLL
  for (int c = 0; c < kCols; c += 2) {
    const uint4 w = dropout_words_2x2(d.k0, d.k1, d.batch, d.head, d.query, uint32_t(col_shift + get<1>(coords0(0, c))));
    if (w.x < d.threshold) probs(0, c) = 0.f;
    if (w.y < d.threshold) probs(0, c + 1) = 0.f;
    if (w.z < d.threshold) probs(1, c) = 0.f;
    if (w.w < d.threshold) probs(1, c + 1) = 0.f;
  }
}

}  // namespace jfa::sm90
