// Second pass of the top-k sparse backward on Hopper (sparse_key_rows_kernel.h): the tile, the
// shared-memory layouts and the warpgroup MMA of MLA's shape (576-column key rows whose first 512
// columns are V, so that dK and dV of a selected row are one sum).
//
// A CTA takes one (query position, key head) item, 192 of the 576 columns (a part: three 64-column
// tiles, one per consumer warpgroup) and kHeads of the key head's query heads. For a block of 64
// slots, warpgroup c forms the transposed sum of both products over its column tile,
//   accᵀ[column][slot] = Σ_heads Q[head][column]·scale·dS[head][slot] + dO[head][column]·P[head][slot],
// with the heads as the inner dimension: the columns are the MMA's M (64 per warpgroup, as wgmma
// wants), the slots its N. Both operands are the workspace's and the inputs' rows as they lie in
// memory (columns or slots contiguous): MN-major tiles, which wgmma reads for 16-bit types.
// The sum then goes through shared memory, one 256-byte row per slot, to a bulk reduce-add into
// the selected row of the float32 accumulator.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "sm90/sparse_mla.h"
#include "sm90/utils.h"

namespace jfa::sm90::sparse {

using namespace cute;

template <typename Element_, int kHeads_>
struct SparseKeyRowsTraits : MlaRows {
  using Element = Element_;  // cutlass::bfloat16_t or cutlass::half_t
  static constexpr int kHeads = kHeads_;  // query heads per CTA: the MMA's K (64 or 128)
  static constexpr int kSlots = 64;       // slots per block: the MMA's N
  static constexpr int kConsumers = 3;    // consumer warpgroups, one 64-column tile each
  static constexpr int kPartColumns = 64 * kConsumers;
  static constexpr int kParts = kDimQK / kPartColumns;
  static constexpr int kThreads = (kConsumers + 1) * 128;  // and the loading warpgroup
  // A staged row of the sum: 64 floats, padded so that the accumulator's stores (8 columns by
  // 4 slot pairs per warp) fall in 32 distinct banks. 272 bytes keeps each row 16-byte aligned for
  // the bulk copy.
  static constexpr int kStageStride = 64 + 4;
  // No register reallocation: a consumer holds a 64 x 64 float sum (32 registers) and addresses,
  // within the 128 a thread of a 512-thread CTA gets.
  static_assert(kDimQK % kPartColumns == 0, "whole parts");
  static_assert(kHeads % 64 == 0, "whole 8-head atoms, and the loader's 16-head groups");

  // A 64 x kHeads operand: 64 columns (or slots) contiguous per head, in the 128-byte swizzle of
  // wgmma's MN-major operands.
  using OperandTile = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{}, Shape<_64, Int<kHeads>>{}));

  // accᵀ (64 columns x 64 slots) over the kHeads heads.
  using RowsMma = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kSlots>, Int<kHeads>>, GMMA::Major::MN,
                           GMMA::Major::MN>(),
      Layout<Shape<_1, _1, _1>>{}));

  // Product 0 is P with dO's columns, product 1 scale·dS with Q's (the workspace's second axis).
  struct SharedStorage {
    array_aligned<Element, cosize_v<OperandTile>, 1024> columns[2][kConsumers];  // [product][tile]
    array_aligned<Element, cosize_v<OperandTile>, 1024> weights[2][2];           // [buffer][product]
    float staged[kConsumers][kSlots][kStageStride];
    // mbarriers: the columns copied; per weight buffer, loaded / released by every consumer thread.
    cutlass::arch::ClusterBarrier columns_ready;
    cutlass::arch::ClusterBarrier weights_ready[2], weights_free[2];
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "one CTA per SM within an H100's 227 KiB");
};

}  // namespace jfa::sm90::sparse
