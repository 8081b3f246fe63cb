// Dropout of P on the Hopper forward (the dropout kernel, fwd_launch.h) and backward (bwd_general.h):
// the keep mask of every other path, jfa::dropout_uniform's (one Philox4x32-10 call per query and 8
// neighbouring keys), regenerated from the key here as it is in the backward and on the CPU, never
// stored.
//
// The Philox calls are the cost (about 40 instructions each, 20 of them 64-bit multiplies, on the
// integer multiply pipe), so none is made twice: the four lanes of a quad make the four calls of
// two 8-column blocks and exchange words (jfa::dropout_uniforms_rows).
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
  uint32_t query;      // the stream's coordinate of this thread's first row (its second is query + 8)
  uint32_t threshold;  // dropped when the uniform is below it (jfa::dropout_threshold)
  uint32_t key0;       // the stream's coordinate of key 0 (MaskParams::positions)
};

// `coords` is the accumulator's identity tensor as (row, col), partitioned for this thread.
template <typename Coords>
__forceinline__ __device__ DropoutTile dropout_tile(const AttentionParams& p, int batch, int head, int m0,
                                                    Coords const& coords) {
  static_assert(decltype(size<0>(coords))::value == 2, "one 64-row wgmma atom per consumer warpgroup");
  const uint32_t* seed = p.mask.dropout_seeds + 3 * int64_t(batch);
  return DropoutTile{__ldg(seed), __ldg(seed + 1), __ldg(seed + 2), uint32_t(head),
                     uint32_t(p.mask.query_position0(batch) + m0 + get<0>(coords(0, 0))),
                     dropout_threshold(p.mask.dropout_rate), uint32_t(p.mask.key_position0(batch))};
}

// Zeroes the dropped probabilities of this thread's elements of a key block. `probs` is a
// (row, col) view of the accumulator, whose columns come in pairs of neighbouring keys (col 2k and
// 2k + 1 are keys j, j + 1 of one 8-column block); the key of column c is col_shift + coords0(0, c),
// coords0 being thread 0's partition (compile-time columns, as in mask_policies.h's apply_policy).
// Blocks go in pairs (the quad's four calls); an odd last block pairs with itself.
template <typename Probs, typename Coords0>
__forceinline__ __device__ void apply_dropout(Probs& probs, const DropoutTile& d, int col_shift,
                                              Coords0 const& coords0) {
  constexpr int kCols = decltype(size<1>(probs))::value;
  static_assert(kCols % 2 == 0);
  auto key = [&](int c) { return d.key0 + uint32_t(col_shift + get<1>(coords0(0, c))); };
  CUTE_UNROLL
  for (int c = 0; c < kCols; c += 4) {
    const int cb = c + 2 < kCols ? c + 2 : c;
    const uint4 u = dropout_uniforms_rows(d.k0, d.k1, d.batch, d.head, d.query, d.query + 8u, key(c), key(cb));
    const uint32_t words[4] = {u.x, u.y, u.z, u.w};
    CUTE_UNROLL
    for (int s = 0; s < 4; ++s) {
      const int row = s & 1, col = (s & 2) ? cb : c;
      if ((s & 2) && cb == c) continue;
      if ((words[s] & 0xFFFFu) < d.threshold) probs(row, col) = 0.f;
      if ((words[s] >> 16) < d.threshold) probs(row, col + 1) = 0.f;
    }
  }
}

}  // namespace jfa::sm90
