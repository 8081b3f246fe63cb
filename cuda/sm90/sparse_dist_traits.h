// attn_dist on Hopper (sparse_dist_kernel.h): the sparse forward's tiles, gathering and Q·Kᵀ
// (sparse_fwd_traits.h) without P·V, so its shared memory holds Q, the pair's two key blocks and
// the warps' column sums of P in place of P and the softmax statistics.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "sm90/sparse_fwd_traits.h"

namespace jfa::sm90::sparse {

using namespace cute;

template <typename Element_>
struct SparseDistTraits : SparseForwardTraits<Element_> {
  using Base = SparseForwardTraits<Element_>;
  using Element = Element_;
  template <int n>
  using RowTiles = typename Base::template RowTiles<n>;

  struct SharedStorage {
    array_aligned<Element, cosize_v<RowTiles<Base::kTiles>>, 1024> q;
    array_aligned<Element, cosize_v<RowTiles<Base::kTiles>>, 1024> k[2];  // the pair's blocks
    // Per consumer warpgroup, two buffers (alternate pairs, so one meeting per block suffices):
    // each warp's sums of P over its 16 rows, per slot of the block.
    float column_sums[2][2][4][Base::kBlockKeys];
    uint8_t slot_valid[2][Base::kBlockKeys];  // per block buffer: 1 where the slot selects a key
    cutlass::arch::ClusterBarrier q_ready;
    cutlass::arch::ClusterBarrier k_ready[2][2], k_free[2][2];
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  // Each consumer warpgroup releases its whole block after Q·Kᵀ: the gatherer refills block by block.
  static constexpr bool kRefillByBlock = true;
  static_assert(kSmemBytes <= 227 * 1024, "one CTA per SM within an H100's 227 KiB");
};

}  // namespace jfa::sm90::sparse
