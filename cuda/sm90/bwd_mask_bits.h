// The bit-packed mask's bits of one backward step (a query block against the CTA's key block), for
// the element pass of a partial tile (bwd_general.h). The words are loaded before the step's
// GEMMs and turned into one bit per accumulator element once Sᵀ has landed: tested in the pass
// itself, each column pair of a thread waited there for its own load (the step's query rows change
// every step, so from L2), one round trip after another.
//
// Layouts:
// - Queries in columns (Sᵀ, a warpgroup's 64 keys in rows): the bits by key (bwd_mask_columns.h),
//   one word per row: a thread's row-r key j0 + 8·r holds its columns' queries in word lane % 4 of
//   the step's 128-query chunk, column c at bit c (plus 16 for the chunk's upper 64 queries).
// - Queries in rows (S, the split-head layout; jfa/packed_mask.h: key x of a 128-key chunk is bit
//   2·(x / 8) + x % 2 of word (x % 8) / 2): a thread's columns are keys j0 + 8·i + e, all in word
//   (j0 / 2) % 4 of its rows at bits bit(j0) + 2·i + e, so one word per row.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "jfa/packed_mask.h"
#include "jfa/params.h"

namespace jfa::sm90 {

using namespace cute;

// Bit position of key j inside its word (jfa::mask_row_has_key's shifts).
__forceinline__ __device__ int mask_key_bit(int j) { return ((j >> 2) & 30) | (j & 1); }

// kCols: a thread's columns of the step's accumulator (kBlockM / 4 queries in columns, keys in
// rows). test(c, e) answers for element e of column pair c in BwdKeepBits' order: (row 0, c),
// (row 0, c + 1), (row 1, c), (row 1, c + 1).
template <bool kQueriesInColumns, int kBlockM, int kCols>
struct BwdStepMask {
  static_assert(kCols % 2 == 0);
  static_assert(!kQueriesInColumns || ((kBlockM == 64 || kBlockM == 128) && kCols == kBlockM / 4),
                "queries in columns: a thread's columns are bits of one 128-query word per key");

  // A thread's two rows' words: queries in columns, its keys' (bits by key); in rows, its queries'.
  // Shifted by `shift` once loaded, column c of row r is bit c of bits[r].
  uint32_t bits[2];
  int shift = 0;
  bool loaded = false;

  // Issues the loads of the step whose first query is query0 (batch, head of block b; the key
  // block's first key key0). Rows past T (queries in rows) read row T − 1: the positions hide them.
  template <typename Coords>
  __forceinline__ __device__ void load(const AttentionParams& p, int batch, int head, int query0, int key0,
                                       Coords const& coords) {
    const PackedMaskView& m = p.mask.packed_mask;
    loaded = true;
    if constexpr (kQueriesInColumns) {
      const int lane = int(threadIdx.x % 32);
      const int j0 = key0 + get<0>(coords(0, 0));  // this thread's row-0 key; row 1 is j0 + 8
      const int64_t word = (query0 / kMaskChunkKeys) * kMaskChunkWords + lane % 4;
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) bits[r] = __ldg(m.key_row(batch, head, j0 + 8 * r) + word);
      shift = query0 % kMaskChunkKeys == 0 ? 0 : 16;  // a 64-query step in its chunk's upper half
    } else {
      const uint32_t* plane = m.row(batch, head, 0);
      const int last_row = int(p.T) - 1;
      const int j0 = key0 + get<1>(coords(0, 0));
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int q = min(query0 + get<0>(coords(r, 0)), last_row);
        bits[r] = __ldg(plane + int64_t(q) * m.words + (((j0 >> 7) << 2) | ((j0 >> 1) & 3)));
      }
      shift = mask_key_bit(j0);
    }
  }

  // After the loads have landed (under the step's dP GEMM).
  __forceinline__ __device__ void finish() {
    bits[0] >>= shift;
    bits[1] >>= shift;
  }

  // Element e of column pair c in BwdKeepBits' order: (row 0, c), (row 0, c + 1), (row 1, c),
  // (row 1, c + 1).
  __forceinline__ __device__ bool test(int c, int e) const { return (bits[e >> 1] >> (c + (e & 1))) & 1u; }
};

// The kernels without a boolean mask.
struct BwdNoStepMask {
  static constexpr bool loaded = false;
  __forceinline__ __device__ bool test(int, int) const { return true; }
};

}  // namespace jfa::sm90
