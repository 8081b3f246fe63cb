// Dropout of P on the Hopper forward (the dropout kernel, launch.h): the keep mask of every other
// path, jfa::dropout_word's (one Philox4x32-10 call per query and 4 neighbouring keys), regenerated
// from the key here as it is in the backward and on the CPU, never stored.
//
// The Philox calls are the cost (about 40 instructions each, 20 of them 64-bit multiplies, on the
// integer multiply pipe: 10 per score against the softmax's ~5), so none is made twice. In a wgmma accumulator the 4 keys of a Philox call sit with two threads of a
// quad (lanes 2q and 2q + 1 hold keys 4g, 4g + 1 and 4g + 2, 4g + 3 of key group g, in each of
// their two rows r0 and r0 + 8): the even lane draws the words of row r0, the odd lane those of
// r0 + 8, and they swap the two words the other holds keys for. One call and two shuffles per 4
// scores, where a call per thread and row would make two.
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
  uint32_t query;      // the row this lane draws for: its first row if even, its second if odd
  uint32_t threshold;  // dropped when the word is below it (jfa::dropout_threshold)
  bool odd;            // odd lane of its pair: keys 4g + 2 and 4g + 3 of each group
};

// `coords` is the accumulator's identity tensor as (row, col), partitioned for this thread.
template <typename Coords>
__forceinline__ __device__ DropoutTile dropout_tile(const AttentionParams& p, int batch, int head, int m0,
                                                    Coords const& coords) {
  static_assert(decltype(size<0>(coords))::value == 2, "one 64-row wgmma atom per consumer warpgroup");
  const uint32_t* seed = p.mask.dropout_seeds + 3 * int64_t(batch);
  const bool odd = (threadIdx.x & 1) != 0;
  return DropoutTile{__ldg(seed), __ldg(seed + 1), __ldg(seed + 2), uint32_t(head),
                     uint32_t(m0 + get<0>(coords(odd ? 1 : 0, 0))), dropout_threshold(p.mask.dropout_rate), odd};
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
    const uint32_t group = uint32_t(col_shift + get<1>(coords0(0, c))) >> 2;
    const Philox4 x = philox4x32_10(Philox4{{group, d.query, d.head, d.batch}}, d.k0, d.k1);
    // Words 0, 1 are the even lane's keys, 2, 3 the odd lane's; each keeps its own of the row it
    // drew and hands the other two over.
    const uint32_t own0 = d.odd ? x.x[2] : x.x[0], own1 = d.odd ? x.x[3] : x.x[1];
    const uint32_t give0 = d.odd ? x.x[0] : x.x[2], give1 = d.odd ? x.x[1] : x.x[3];
    const uint32_t got0 = __shfl_xor_sync(0xffffffffu, give0, 1), got1 = __shfl_xor_sync(0xffffffffu, give1, 1);
    const uint32_t first0 = d.odd ? got0 : own0, first1 = d.odd ? got1 : own1;   // row r0
    const uint32_t second0 = d.odd ? own0 : got0, second1 = d.odd ? own1 : got1;  // row r0 + 8
    if (first0 < d.threshold) probs(0, c) = 0.f;
    if (first1 < d.threshold) probs(0, c + 1) = 0.f;
    if (second0 < d.threshold) probs(1, c) = 0.f;
    if (second1 < d.threshold) probs(1, c + 1) = 0.f;
  }
}

}  // namespace jfa::sm90
