// Dropout of P on the Hopper forward (the dropout kernel, fwd_launch.h) and backward (bwd_general.h):
// the keep mask of every other path, jfa::dropout_word's (one Philox4x32-10 call per query and 4 neighbouring keys), regenerated
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
  uint32_t key0;       // the stream's coordinate of key 0 (MaskParams::positions)
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
                     uint32_t(p.mask.query_position0(batch) + m0 + get<0>(coords(drawn, 0))),
                     dropout_threshold(p.mask.dropout_rate), uint32_t(p.mask.key_position0(batch))};
}

// Zeroes the dropped probabilities of this thread's elements of a key block. `probs` is a
// (row, col) view of the accumulator, whose columns come in pairs of neighbouring keys (col 2k and
// 2k + 1 are keys j, j + 1 with j even); the key of column c is col_shift + coords0(0, c), coords0
// being thread 0's partition (compile-time columns, as in mask_policies.h's apply_policy).
template <typename Probs, typename Coords0>
__forceinline__ __device__ void apply_dropout(Probs& probs, const DropoutTile& d, int col_shift,
                                              Coords0 const& coords0) {
  constexpr int kCols = decltype(size<1>(probs))::value;
  static_assert(kCols % 2 == 0);
  CUTE_UNROLL
  for (int c = 0; c < kCols; c += 2) {
    const uint4 w =
        dropout_words_2x2(d.k0, d.k1, d.batch, d.head, d.query, d.key0 + uint32_t(col_shift + get<1>(coords0(0, c))));
    if (w.x < d.threshold) probs(0, c) = 0.f;
    if (w.y < d.threshold) probs(0, c + 1) = 0.f;
    if (w.z < d.threshold) probs(1, c) = 0.f;
    if (w.w < d.threshold) probs(1, c + 1) = 0.f;
  }
}

// The words of jfa::dropout_word for the 2 x 2 elements a thread holds in a transposed wgmma
// accumulator (the backward's Sᵀ: keys as rows, queries as columns): keys `key` and key + 8 (its
// rows), queries `query` and query + 1 (query even), returned as (key, query), (key, query + 1),
// (key + 8, query), (key + 8, query + 1). A Philox call covers 4 neighbouring keys of one query;
// the keys of a group of 4 lie in 4 lanes (lane / 4 = 4m..4m+3, the same lane % 4, so the same
// queries), which together need exactly 4 calls: each lane makes one (query + (rr & 1), keys
// + 8·(rr >> 1), rr = lane / 4 % 4) and the four exchange the words by a 4 x 4 transpose (three
// shuffles). Every lane of the warp calls it together.
__forceinline__ __device__ uint4 dropout_words_2x2_transposed(uint32_t k0, uint32_t k1, uint32_t batch,
                                                              uint32_t head, uint32_t query, uint32_t key) {
  const int lane = threadIdx.x & 31, rr = (lane >> 2) & 3;
  const Philox4 x = philox4x32_10(Philox4{{(key + 8u * uint32_t(rr >> 1)) >> 2, query + uint32_t(rr & 1), head, batch}},
                                  k0, k1);
  auto word = [&](int i) { return i == 0 ? x.x[0] : i == 1 ? x.x[1] : i == 2 ? x.x[2] : x.x[3]; };
  // Round t: this lane reads the call of lane rr + t (mod 4), which sends the word of the reader's
  // key (index rr); got[t] is call (rr + t) & 3's word for this lane.
  uint32_t got[4];
  got[0] = word(rr);
  CUTE_UNROLL
  for (int t = 1; t < 4; ++t) {
    const int src = (rr + t) & 3;
    got[t] = __shfl_sync(0xffffffffu, word((rr - t) & 3), lane + 4 * (src - rr));
  }
  auto call = [&](int k) {  // call k's word for this lane: got[(k - rr) & 3]
    const int t = (k - rr) & 3;
    return t == 0 ? got[0] : t == 1 ? got[1] : t == 2 ? got[2] : got[3];
  };
  return make_uint4(call(0), call(1), call(2), call(3));
}

}  // namespace jfa::sm90
