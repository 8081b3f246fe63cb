// The bit-packed mask's bits of one backward step (a query block against the CTA's key block), for
// the element pass of a partial tile (bwd_general.h). The words are loaded before the step's
// GEMMs and turned into one bit per accumulator element once Sᵀ has landed: tested in the pass
// itself, each column pair of a thread waited there for its own load (the step's query rows change
// every step, so from L2), one round trip after another.
//
// Layouts (jfa/packed_mask.h: key x of a 128-key chunk is bit 2·(x / 8) + x % 2 of word (x % 8) / 2):
// - Queries in columns (Sᵀ, a warpgroup's 64 keys in rows): the 16 keys of a warp are 4 bits
//   (a nibble) of each of the chunk's 4 words of a query row. Lane l loads the 4 words of queries
//   2l, 2l + 1 (and 64 + 2l, 65 + 2l with 128 queries), keeps the warp's nibbles, 16 bits per query,
//   and each lane takes its columns' values from the lane that loaded them (one shuffle per column
//   pair and 64 queries).
// - Queries in rows (S, the split-head layout): a thread's columns are keys j0 + 8·i + e, all in
//   word (j0 / 2) % 4 of its rows at bits bit(j0) + 2·i + e, so one word per row.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>

#include "jfa/packed_mask.h"
#include "jfa/params.h"

namespace jfa::sm90 {

using namespace cute;

// The 4 words at `words` (a chunk of one query row): one 16-byte load where aligned.
__forceinline__ __device__ uint4 load_chunk_words(const uint32_t* words, bool aligned) {
  if (aligned) return __ldg(reinterpret_cast<const uint4*>(words));
  return make_uint4(__ldg(words), __ldg(words + 1), __ldg(words + 2), __ldg(words + 3));
}

// Bit position of key j inside its word (jfa::mask_row_has_key's shifts).
__forceinline__ __device__ int mask_key_bit(int j) { return ((j >> 2) & 30) | (j & 1); }

// kCols: a thread's columns of the step's accumulator (kBlockM / 4 queries in columns, keys in
// rows). test(c, e) answers for element e of column pair c in BwdKeepBits' order: (row 0, c),
// (row 0, c + 1), (row 1, c), (row 1, c + 1).
template <bool kQueriesInColumns, int kBlockM, int kCols>
struct BwdStepMask {
  static_assert(kCols % 2 == 0);
  static constexpr int kQueryPairs = kBlockM / 64;  // pairs of queries (32-bit words) per lane, in columns
  static_assert(!kQueriesInColumns || (kBlockM % 64 == 0 && kCols == kBlockM / 4),
                "queries in columns: each lane loads two queries of every 64");
  static constexpr int kLoads = kQueriesInColumns ? 2 * kQueryPairs : 2;
  using Words = std::conditional_t<kQueriesInColumns, uint4, uint32_t>;

  Words words[kLoads];
  uint32_t bits[kQueriesInColumns ? (2 * kCols + 31) / 32 : 2];
  bool loaded = false;

  // Issues the loads of the step whose first query is query0 (batch, head of block b; the key
  // block's first key key0). Rows past T read row T − 1: the positions hide them.
  template <typename Coords>
  __forceinline__ __device__ void load(const AttentionParams& p, int batch, int head, int query0, int key0,
                                       Coords const& coords) {
    const PackedMaskView& m = p.mask.packed_mask;
    const uint32_t* plane = m.row(batch, head, 0);
    const int last_row = int(p.T) - 1;
    loaded = true;
    if constexpr (kQueriesInColumns) {
      const int lane = int(threadIdx.x % 32);
      const uint32_t* chunk = plane + (key0 >> 7) * kMaskChunkWords;
      const bool aligned = (reinterpret_cast<uintptr_t>(chunk) & 15) == 0 && (m.words & 3) == 0;
      CUTE_UNROLL
      for (int k = 0; k < kLoads; ++k) {
        const int q = min(query0 + 64 * (k / 2) + 2 * lane + k % 2, last_row);
        words[k] = load_chunk_words(chunk + int64_t(q) * m.words, aligned);
      }
    } else {
      const int j0 = key0 + get<1>(coords(0, 0));
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int q = min(query0 + get<0>(coords(r, 0)), last_row);
        words[r] = __ldg(plane + int64_t(q) * m.words + (((j0 >> 7) << 2) | ((j0 >> 1) & 3)));
      }
    }
  }

  // After the loads have landed (under the step's dP GEMM): this thread's bits. Every lane of the
  // warp takes part (queries in columns).
  template <typename Coords>
  __forceinline__ __device__ void finish(int key0, Coords const& coords) {
    if constexpr (kQueriesInColumns) {
      const int lane = int(threadIdx.x % 32);
      const int j0 = key0 + get<0>(coords(0, 0));  // this thread's row-0 key; row 1 is j0 + 8
      // The warp's 16 keys hold bits [nibble, nibble + 4) of each word; within a query's 16 bits
      // (word w at 4·w), this thread's row-0 key is bit `at`, its row-1 key at + 2.
      const int nibble = mask_key_bit(j0) & ~3;
      const int at = 4 * ((j0 >> 1) & 3) + (mask_key_bit(j0) & 3);
      uint32_t pairs[kQueryPairs];
      CUTE_UNROLL
      for (int k = 0; k < kQueryPairs; ++k) {
        uint32_t v[2];
        CUTE_UNROLL
        for (int e = 0; e < 2; ++e) {
          const uint4 w = words[2 * k + e];
          v[e] = (w.x >> nibble & 15u) | (w.y >> nibble & 15u) << 4 | (w.z >> nibble & 15u) << 8 |
                 (w.w >> nibble & 15u) << 12;
        }
        pairs[k] = v[0] | v[1] << 16;
      }
      CUTE_UNROLL
      for (int i = 0; i < (2 * kCols + 31) / 32; ++i) bits[i] = 0;
      // Column pair c (c even) holds queries 8·(c / 2) + 2·(lane % 4) + {0, 1}: query pair
      // 4·(c / 2) + lane % 4, in word (c / 2) / 8 of lane (4·(c / 2) + lane % 4) % 32.
      CUTE_UNROLL
      for (int c = 0; c < kCols; c += 2) {
        const uint32_t got = __shfl_sync(0xffffffffu, pairs[(c / 2) / 8], (4 * (c / 2) + lane % 4) % 32);
        const uint32_t four = (got >> at & 1u) | (got >> (16 + at) & 1u) << 1 | (got >> (at + 2) & 1u) << 2 |
                              (got >> (16 + at + 2) & 1u) << 3;
        bits[(2 * c) / 32] |= four << ((2 * c) % 32);
      }
    } else {
      const int shift = mask_key_bit(key0 + get<1>(coords(0, 0)));
      bits[0] = words[0] >> shift;
      bits[1] = words[1] >> shift;
    }
  }

  __forceinline__ __device__ bool test(int c, int e) const {
    if constexpr (kQueriesInColumns) return (bits[(2 * c + e) / 32] >> ((2 * c + e) % 32)) & 1u;
    else return (bits[e >> 1] >> (c + (e & 1))) & 1u;
  }
};

// The kernels without a boolean mask.
struct BwdNoStepMask {
  static constexpr bool loaded = false;
  __forceinline__ __device__ bool test(int, int) const { return true; }
};

}  // namespace jfa::sm90
