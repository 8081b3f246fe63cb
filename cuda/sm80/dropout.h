// Dropout in the sm80 kernels: each batch element's Philox stream (the same as the CPU kernel's and
// the Hopper kernels', jfa/philox.h) and the keep bits of a thread's elements of a tile.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "jfa/params.h"
#include "jfa/philox.h"

namespace jfa::sm80 {

using namespace cute;

// Dropout of one batch element: the Philox key and stream coordinate, and the keep scale.
struct DropoutStream {
  uint32_t k0, k1, batch, threshold;
  float keep_scale;
  uint32_t query0, key0;  // the stream's coordinates of query row 0 and key 0 (MaskParams::positions)
};

__forceinline__ __device__ DropoutStream dropout_stream(const AttentionParams& p, int64_t b) {
  const uint32_t* seed = p.mask.dropout_seeds + 3 * b;
  return DropoutStream{seed[0], seed[1], seed[2], dropout_threshold(p.mask.dropout_rate),
                       1.f / (1.f - p.mask.dropout_rate), uint32_t(p.mask.query_position0(b)),
                       uint32_t(p.mask.key_position0(b))};
}

// Which of a thread's elements of a tile dropout keeps, one bit each (bit mi * kCols + ni of the
// (row, col) view `coords`, tile origin (m0, n0)): jfa::dropout_uniform's, made by the quads
// (jfa::dropout_uniforms_rows: the four calls of two 8-column blocks, one per lane, and a
// transpose of their words). Rows mi, mi + 1 (mi even) are an mma fragment's rows r and r + 8,
// columns ni, ni + 1 (ni even) its neighbouring keys; column pairs go two at a time, an odd last
// one with itself. Every lane of the warp calls it together.
template <int kRows, int kCols>
struct KeepBits {
  uint32_t words[(kRows * kCols + 31) / 32];
  __forceinline__ __device__ bool kept(int mi, int ni) const {
    const int i = mi * kCols + ni;
    return (words[i / 32] >> (i % 32)) & 1u;
  }
};

template <typename Coords>
__forceinline__ __device__ auto dropout_keep_bits(const DropoutStream& d, int n, int m0, int n0, Coords const& coords) {
  constexpr int kRows = decltype(size<0>(coords))::value, kCols = decltype(size<1>(coords))::value;
  static_assert(kRows % 2 == 0 && kCols % 2 == 0);
  KeepBits<kRows, kCols> keep;
  CUTE_UNROLL
  for (int i = 0; i < (kRows * kCols + 31) / 32; ++i) keep.words[i] = 0u;
  auto set = [&](int mi, int ni, uint32_t pair) {  // the keep bits of (mi, ni) and (mi, ni + 1)
    const int at = mi * kCols + ni;
    keep.words[at / 32] |= pair << (at % 32);
  };
  CUTE_UNROLL
  for (int mi = 0; mi < kRows; mi += 2) {
    CUTE_UNROLL
    for (int ni = 0; ni < kCols; ni += 4) {
      const int nb = ni + 2 < kCols ? ni + 2 : ni;
      const uint4 u = dropout_uniforms_rows(d.k0, d.k1, d.batch, uint32_t(n), d.query0 + uint32_t(m0 + get<0>(coords(mi, ni))),
                                            d.query0 + uint32_t(m0 + get<0>(coords(mi + 1, ni))),
                                            d.key0 + uint32_t(n0 + get<1>(coords(mi, ni))),
                                            d.key0 + uint32_t(n0 + get<1>(coords(mi, nb))));
      set(mi, ni, dropout_keep_pair(u.x, d.threshold));
      set(mi + 1, ni, dropout_keep_pair(u.y, d.threshold));
      if (nb != ni) {
        set(mi, nb, dropout_keep_pair(u.z, d.threshold));
        set(mi + 1, nb, dropout_keep_pair(u.w, d.threshold));
      }
    }
  }
  return keep;
}

}  // namespace jfa::sm80
