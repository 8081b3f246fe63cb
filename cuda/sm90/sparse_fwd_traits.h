// Top-k sparse attention forward on Hopper (sparse_fwd_kernel.h): the tile, the shared-memory
// layouts and the warpgroup MMAs of MLA's shape (576-column key rows whose first 512 columns are V).
//
// A CTA takes one query position and 64 query heads of one key head. The selected slots come in
// blocks of 64 gathered key rows; consumer warpgroup 0 computes the logits of the even blocks,
// warpgroup 1 those of the odd ones, each over the full 576 columns, and each accumulates half of
// O's 512 columns from both blocks of a pair (its own P from registers, the other warpgroup's P
// from shared memory). So every gathered row is read by wgmma straight from shared memory, once
// for Q·Kᵀ and once per warpgroup for P·V, and no partial logits are exchanged: only the row
// maxima (256 bytes) and P (8 KiB).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "sm90/sparse_mla.h"
#include "sm90/utils.h"

namespace jfa::sm90::sparse {

using namespace cute;

template <typename Element_>
struct SparseForwardTraits : MlaRows {
  using Element = Element_;  // cutlass::bfloat16_t or cutlass::half_t
  static constexpr int kHeads = 64;      // query heads per CTA: the MMAs' M
  static constexpr int kBlockKeys = 64;  // gathered rows per block
  static constexpr int kHalfVTiles = kDimV / 2 / 64;  // value tiles of one warpgroup's output columns
  static constexpr int kThreads = 3 * 128;          // two consumer warpgroups and the gathering one
  // Registers per thread after setmaxnreg: O's 256 columns (128 floats), the logits (32) and P
  // (16) in the consumers; the gatherer keeps row offsets and flags only.
  static constexpr int kConsumerRegs = 216;
  static constexpr int kProducerRegs = 72;
  // The gatherer's refill order (sparse_gatherer.h): by the halves the P·V warpgroups release.
  static constexpr bool kRefillByBlock = false;

  // (64 rows, 64·kTiles columns): kTiles column tiles one after the other, each 64 rows of 128
  // bytes in the 128-byte swizzle of wgmma's K-major operands. Rows 8 apart differ by 1 KiB and
  // tiles by 8 KiB, neither of which changes the swizzle, so a row's 16-byte chunk of one tile
  // moves to another row or tile by a plain offset.
  template <int kColumnTiles>
  using RowTiles = decltype(coalesce(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                                   Shape<_64, Int<64 * kColumnTiles>>{}, Step<_1, _2>{}),
                                     Shape<_1, _1>{}));
  // The same bytes viewed as (64·kColumnTiles columns, 64 rows): the key rows' first columns as
  // P·V's B operand (value columns by keys, MN-major).
  template <int kColumnTiles>
  using ColumnTiles =
      decltype(composition(RowTiles<kColumnTiles>{}, Layout<Shape<Int<64 * kColumnTiles>, _64>, Stride<_64, _1>>{}));

  using QkMma = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, _64, _64>, GMMA::Major::K, GMMA::Major::K>(),
      Layout<Shape<_1, _1, _1>>{}));
  // O's half (64 x 256) += P·V: P from this warpgroup's registers, or the other's from shared memory.
  using PvMmaOwnP = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, _256, _64>, GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<_1, _1, _1>>{}));
  using PvMmaOtherP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, _256, _64>, GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<_1, _1, _1>>{}));

  struct SharedStorage {
    array_aligned<Element, cosize_v<RowTiles<kTiles>>, 1024> q;
    array_aligned<Element, cosize_v<RowTiles<kTiles>>, 1024> k[2];  // the pair's blocks
    // Warpgroup 1's P; warpgroup 0's lies over block 0's rotary tile, which only warpgroup 0's
    // Q·Kᵀ reads, before it writes P there (228 KiB would not fit otherwise).
    array_aligned<Element, cosize_v<RowTiles<1>>, 1024> p1;
    float2 row_max[2][kHeads / 2];   // per warpgroup, its running max per quad (2 rows)
    float2 row_sum[2 * kHeads / 2];  // each warpgroup's softmax sums, for the final total
    // mbarriers: Q copied; per block and half (tiles 0-3, 4-8) gathered / released by its readers.
    uint8_t slot_valid[2][kBlockKeys];  // per block buffer: 1 where the slot selects a key
    cutlass::arch::ClusterBarrier q_ready;
    cutlass::arch::ClusterBarrier k_ready[2][2], k_free[2][2];
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "one CTA per SM within an H100's 227 KiB");
};

}  // namespace jfa::sm90::sparse
