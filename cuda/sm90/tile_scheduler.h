// Tile order of the Hopper kernels. The forward is persistent: the grid is one CTA per SM; CTA c
// starts with tile c and then takes the next unclaimed tile from a global counter (dynamic: a CTA
// that drew short tiles takes more of them, which a static c, c + grid, ... split cannot do). A
// tile is (query block, head, batch), and the order of tile indices matters twice:
// - causal and masked tiles run longest first (the last query blocks see the most keys), so the
//   short ones fill the tail of the last wave instead of leaving a long tile running alone;
// - the CTAs running at the same time should read the same K/V so that it stays in L2. Non-causal:
//   the query blocks of one head are adjacent. Causal: longest first over all heads would spread
//   the running tiles over every head; so heads go in sections whose K/V fits in L2 together, and
//   only within a section do tiles run longest first (FlashAttention-3's order).
// The backward launches a CTA per tile (BwdTileOrder below). docs/performance.md ("Hopper forward:
// scheduling") has the measurements behind these choices.
#pragma once

#include <cstdint>

namespace jfa::sm90 {

struct TileCoord {
  int m_block, head, batch;
};

// A tile as the consumers start it: its index (>= num_tiles: none), coordinates and key blocks
// [n_begin, n_end). The producer works it out while the previous tile runs and hands it over
// (fwd_producer.h), so that the consumers' tile start waits on no integer division (three of them
// in get(): about 100 instructions on the critical path of every tile) nor on the general path's
// block range (segment summaries read from global memory).
struct TileWork {
  int tile;
  TileCoord coord;
  int n_begin, n_end;
};

// The order of longest-first tiles: tiles in sections of `section_bh` (batch, head) pairs, and
// within a section by length rank (0: the longest), the pairs of one rank adjacent. Returns
// (rank, pair).
__forceinline__ __device__ int2 longest_first_order(int tile, int num_blocks, int num_bh, int section_bh) {
  const int section_tiles = section_bh * num_blocks;
  const int section = tile / section_tiles;
  const int r = tile - section * section_tiles;
  const int heads_here = min(section_bh, num_bh - section * section_bh);
  return make_int2(r / heads_here, section * section_bh + r % heads_here);
}

template <bool kLongestFirst>
struct TileScheduler {
  int num_m_blocks;
  int num_heads;     // N
  int num_bh;        // B · N
  int section_bh;    // (batch, head) pairs per L2 section (kLongestFirst only)
  int* counter;      // tiles claimed beyond the first gridDim.x, zeroed by the launcher; null: static

  __forceinline__ __device__ TileCoord get(int tile) const {
    int m_block, bh;
    if constexpr (kLongestFirst) {
      const int2 order = longest_first_order(tile, num_m_blocks, num_bh, section_bh);
      m_block = num_m_blocks - 1 - order.x;  // the last query blocks see the most keys
      bh = order.y;
    } else {
      m_block = tile % num_m_blocks;
      bh = tile / num_m_blocks;
    }
    return {m_block, bh % num_heads, bh / num_heads};
  }

  // The tile after `tile` for this CTA (called by one thread, the producer).
  __forceinline__ __device__ int next(int tile) const {
    return counter != nullptr ? int(gridDim.x) + atomicAdd(counter, 1) : tile + int(gridDim.x);
  }
};

// The backward's tiles: a CTA per (key block, K/V head, batch), one grid of them, issued in index
// order. A key block's CTA walks every query block that sees it, so with top-left causal the first
// key blocks are the longest: they go first (longest-first sections, as above). Without causality
// all of a head's key blocks are adjacent, so the CTAs running together share its Q and dO in L2.
// `head` of the TileCoord is the K/V head times the launcher's head chunks plus the chunk (the
// query heads of the group a CTA walks: bwd_params.h), `m_block` the key block.
template <bool kLongestFirst>
struct BwdTileOrder {
  int num_n_blocks;
  int num_kv_heads;  // K · head chunks
  int num_bk;        // B · K · head chunks
  int section_bk;    // (batch, K/V head, chunk) units per L2 section (kLongestFirst only)

  __forceinline__ __device__ TileCoord get(int tile) const {
    int n_block, bk;
    if constexpr (kLongestFirst) {
      const int2 order = longest_first_order(tile, num_n_blocks, num_bk, section_bk);
      n_block = order.x;
      bk = order.y;
    } else {
      n_block = tile % num_n_blocks;
      bk = tile / num_n_blocks;
    }
    return {n_block, bk % num_kv_heads, bk / num_kv_heads};
  }
};

// The smem words through which the forward's producer hands out tiles: the tile meetings (named
// barriers, named_barriers.h) order the accesses between the producer and the consumers, __syncwarp
// the producer lanes' read back of lane 0's write, for the hardware; the volatile accesses and
// compiler fences do it for the compiler (CUTLASS's barrier asm declares no memory clobber).
__forceinline__ __device__ void publish_work(TileWork& slot, const TileWork& w) {
  asm volatile("" ::: "memory");
  volatile int* words = reinterpret_cast<volatile int*>(&slot);
  words[0] = w.tile;
  words[1] = w.coord.m_block;
  words[2] = w.coord.head;
  words[3] = w.coord.batch;
  words[4] = w.n_begin;
  words[5] = w.n_end;
  asm volatile("" ::: "memory");
}
__forceinline__ __device__ TileWork announced_work(const TileWork& slot) {
  asm volatile("" ::: "memory");
  const volatile int* words = reinterpret_cast<const volatile int*>(&slot);
  const TileWork w{words[0], {words[1], words[2], words[3]}, words[4], words[5]};
  asm volatile("" ::: "memory");
  return w;
}

// Query (batch, head) pairs whose K and V fit together in `l2_bytes` (at least one).
inline int l2_section_bh(int64_t S, int64_t H, int64_t element_bytes, int64_t group, int64_t l2_bytes) {
  const int64_t kv_bytes = 2 * S * H * element_bytes;  // K and V of one K/V head
  const int64_t heads = l2_bytes / kv_bytes * group;   // query heads share their group's K/V
  return int(heads < 1 ? 1 : (heads > (1 << 30) ? (1 << 30) : heads));
}

// (batch, K/V head) pairs of the backward whose Q, dO (element_bytes each) and float32 dQ partial
// sums, over the `group` query heads of each, fit together in `l2_bytes` (at least one).
inline int l2_section_bk(int64_t T, int64_t H, int64_t element_bytes, int64_t group, int64_t l2_bytes) {
  const int64_t bytes = group * T * H * (2 * element_bytes + 4);
  const int64_t pairs = l2_bytes / bytes;
  return int(pairs < 1 ? 1 : (pairs > (1 << 30) ? (1 << 30) : pairs));
}

}  // namespace jfa::sm90
