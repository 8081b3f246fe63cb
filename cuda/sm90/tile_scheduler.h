// Static persistent tile scheduler: the grid is one CTA per SM and CTA c takes tiles c, c + grid,
// c + 2·grid, ... A tile is (query block, head, batch). The order matters twice:
// - causal: tiles run longest first (the last query blocks see the most keys), so the short ones
//   fill the tail of the last wave instead of leaving a long tile running alone;
// - non-causal: query blocks of one head are adjacent, so the CTAs running at the same time read
//   the same K/V and share them in L2.
#pragma once

namespace jfa::sm90 {

struct TileCoord {
  int m_block, head, batch;
};

template <bool kCausal>
struct TileScheduler {
  int num_m_blocks;
  int num_heads;  // N
  int num_bh;     // B · N

  __forceinline__ __device__ TileCoord get(int tile) const {
    int m_block, bh;
    if constexpr (kCausal) {
      m_block = num_m_blocks - 1 - tile / num_bh;
      bh = tile % num_bh;
    } else {
      m_block = tile % num_m_blocks;
      bh = tile / num_m_blocks;
    }
    return {m_block, bh % num_heads, bh / num_heads};
  }
};

}  // namespace jfa::sm90
