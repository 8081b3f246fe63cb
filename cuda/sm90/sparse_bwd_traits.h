// First pass of the top-k sparse backward on Hopper (sparse_bwd_kernel.h): the tile, the
// shared-memory layouts and the warpgroup MMAs of MLA's shape (576-column key rows whose first 512
// columns are V).
//
// A CTA takes one query position and 64 query heads of one key head, with Q and dO resident and the
// selected rows gathered in blocks of 32 into two buffers (64-row blocks would leave room for one).
// Per block, warpgroup 0 computes S = Q·Kᵀ while warpgroup 1 computes dP = dO·Vᵀ and hands it over
// in shared memory; warpgroup 0 forms P and scale·dS, writes both to the workspace and dS to shared
// memory, where both warpgroups read it as the A operand of dQ += dS·K over their columns (0-255
// and 256-575: the split that gives each the same work). The gatherer leaves a flag per slot next
// to the block's rows, so that the consumers wait on no global load per block.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "sm90/sparse_mla.h"
#include "sm90/utils.h"

namespace jfa::sm90::sparse {

using namespace cute;

template <typename Element_>
struct SparseBackwardTraits : MlaRows {
  using Element = Element_;  // cutlass::bfloat16_t or cutlass::half_t
  static constexpr int kHeads = 64;      // query heads per CTA: the MMAs' M
  static constexpr int kBlockKeys = 32;  // gathered rows per block
  static constexpr int kDq0Tiles = 4;          // warpgroup 0's dQ columns; warpgroup 1 takes the rest
  static constexpr int kThreads = 3 * 128;     // two consumer warpgroups and the gathering one
  static constexpr int kGatherThreads = 128;
  // Gathering threads that also write slot flags: the first of each row's eight copying threads.
  static constexpr int kFlagWriters = 16;
  // Registers per thread after setmaxnreg: dQ's columns (128 or 160 floats) and a 64 x 32 tile of
  // logits or dP (16) in the consumers; row offsets and indices in the gatherer.
  static constexpr int kConsumerRegs = 224;
  static constexpr int kProducerRegs = 56;

  // (kRows rows, 64·kColumnTiles columns): column tiles one after the other, each kRows rows of 128
  // bytes in the 128-byte swizzle of wgmma's K-major operands.
  template <int kRows, int kColumnTiles>
  using RowTiles = decltype(coalesce(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                                   Shape<Int<kRows>, Int<64 * kColumnTiles>>{}, Step<_1, _2>{}),
                                     Shape<_1, _1>{}));
  // A block's rows viewed as (64·kColumnTiles columns, 32 rows): dQ's B operand (key columns by
  // slots, MN-major).
  template <int kColumnTiles>
  using BlockColumns = decltype(composition(RowTiles<kBlockKeys, kColumnTiles>{},
                                            Layout<Shape<Int<64 * kColumnTiles>, Int<kBlockKeys>>,
                                                   Stride<Int<kBlockKeys>, _1>>{}));
  // scale·dS of a block (64 heads x 32 slots, 64-byte rows): dQ's A operand.
  using DsTile = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<Element>{}, Shape<Int<kHeads>, Int<kBlockKeys>>{}));

  // S and dP (64 x 32) over one 64-column tile per call.
  using ScoreMma = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockKeys>, _64>, GMMA::Major::K,
                           GMMA::Major::K>(),
      Layout<Shape<_1, _1, _1>>{}));
  // dQ's columns += dS·K over the block's 32 slots, 256 or 64 columns per call.
  template <int kColumns>
  using DqMma = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kColumns>, Int<kBlockKeys>>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      Layout<Shape<_1, _1, _1>>{}));

  struct SharedStorage {
    array_aligned<Element, cosize_v<RowTiles<kHeads, kTiles>>, 1024> q;
    array_aligned<Element, cosize_v<RowTiles<kHeads, kVTiles>>, 1024> dout;
    array_aligned<Element, cosize_v<RowTiles<kBlockKeys, kTiles>>, 1024> k[2];
    array_aligned<Element, cosize_v<DsTile>, 1024> ds;
    float dp[16][128];  // warpgroup 1's dP in fragment order: [element][thread]
    uint8_t slot_valid[2][kBlockKeys];  // per block buffer: 1 where the slot selects a key
    // mbarriers: Q and dO copied; per block buffer, gathered (the copies and the slot flags) /
    // released by both consumers.
    cutlass::arch::ClusterBarrier q_ready;
    cutlass::arch::ClusterBarrier k_ready[2], k_free[2];
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "one CTA per SM within an H100's 227 KiB");
};

}  // namespace jfa::sm90::sparse
