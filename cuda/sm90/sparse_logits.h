// What both Hopper top-k sparse kernels (sparse_fwd_kernel.h, sparse_dist_kernel.h) compute per
// block of 64 gathered rows in a consumer warpgroup: S = Q·Kᵀ over all 576 columns with wgmma from
// shared memory, and the validity of each slot, from the flags the gatherer writes beside the rows.
// The backward's first pass (sparse_bwd_kernel.h) shares the GEMM and the wait for gathered rows.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "jfa/sparse_params.h"
#include "sm90/sparse_gatherer.h"
#include "sm90/utils.h"

namespace jfa::sm90::sparse {

using namespace cute;

inline constexpr float kLog2e = 1.4426950408889634f;

// The pointer, as a value the compiler cannot see through: the wgmma descriptors derived from it
// are then computed where they are used. Otherwise they are loop-invariant, and the compiler kept
// all 72 of Q·Kᵀ's (64-bit each) in registers across the loop, spilling O.
template <typename T>
__forceinline__ __device__ T* opaque(T* ptr) {
  asm volatile("" : "+l"(ptr));
  return ptr;
}

// Waits until a gatherer's cp.async copies behind `ready` have landed. They are generic-proxy
// writes and wgmma reads through the async proxy: the proxy fence orders the two.
__forceinline__ __device__ void wait_gathered(cutlass::arch::ClusterBarrier& ready, int phase) {
  ready.wait(phase);
  cutlass::arch::fence_view_async_shared();
}

// Issues acc (+)= A·Bᵀ over the 64-column tiles [kFirst, kLast) of A and B, each stored as
// consecutive K-major tiles of layout TileA / TileB (no arrive or commit): the logits' GEMM of the
// forward, attn_dist and the backward's first pass. The first product overwrites acc where
// mma.accumulate_ says so on entry; the rest add.
template <typename TileA, typename TileB, int kFirst, int kLast, typename TiledMma, typename Element, typename Acc>
__forceinline__ __device__ void accumulate_row_tiles(TiledMma& mma, int tid, Element* a, Element* b, Acc& acc) {
  auto thr = mma.get_slice(tid);
  CUTE_UNROLL
  for (int c = kFirst; c < kLast; ++c) {
    Tensor fa = thr.partition_fragment_A(make_tensor(make_smem_ptr(a + c * size(TileA{})), TileA{}));
    Tensor fb = thr.partition_fragment_B(make_tensor(make_smem_ptr(b + c * size(TileB{})), TileB{}));
    CUTE_UNROLL
    for (int k = 0; k < size<2>(fa); ++k) {
      cute::gemm(mma, fa(_, _, k), fb(_, _, k), acc);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
  }
}

// Bit 2·i + e of the result (e < 2): the gatherer's flag of slot 8·i + 2·(tid % 4) + e of a block
// (flags: one byte per slot), i.e. whether the column of accumulator element 4·i + e of a thread of
// a 64-row wgmma accumulator selects a key. The two flags of a column pair are one 16-bit load.
template <int kBlockKeys>
__forceinline__ __device__ uint32_t valid_slot_bits(const uint8_t* flags, int tid) {
  uint32_t bits = 0;
  CUTE_UNROLL
  for (int i = 0; i < kBlockKeys / 8; ++i) {
    const uint32_t pair = *reinterpret_cast<const uint16_t*>(flags + 8 * i + 2 * (tid % 4));
    bits |= (pair & 1u) << (2 * i) | (pair >> 8 & 1u) << (2 * i + 1);
  }
  return bits;
}

// A consumer warpgroup's view of the CTA and its logits tile S (64 heads x 64 slots), shared by
// the forward's and attn_dist's consumers.
template <typename Traits>
struct BlockLogits {
  using Element = typename Traits::Element;
  using QkMma = typename Traits::QkMma;
  template <int n>
  using RowTiles = typename Traits::template RowTiles<n>;

  const SparseParams& p;
  const SparseTile& tile;
  typename Traits::SharedStorage& smem;
  const int wg;   // consumer warpgroup: 0 takes the even blocks of a pair, 1 the odd ones
  const int tid;  // thread in the warpgroup
  const float scale_log2;

  decltype(partition_fragment_C(QkMma{}, Shape<_64, _64>{})) s;

  __forceinline__ __device__ BlockLogits(const SparseParams& p_, const SparseTile& tile_,
                                         typename Traits::SharedStorage& smem_, int wg_)
      : p(p_), tile(tile_), smem(smem_), wg(wg_), tid(threadIdx.x % 128), scale_log2(p_.scale * kLog2e) {}

  // Issues S (+)= Q·Kᵀ over tiles [kFirst, kLast) of block buffer j (no commit).
  template <int kFirst, int kLast>
  __forceinline__ __device__ void issue_qk(int j, bool zero_init) {
    QkMma mma;
    warpgroup_fence_operand(s);
    warpgroup_arrive();
    mma.accumulate_ = zero_init ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
    accumulate_row_tiles<RowTiles<1>, RowTiles<1>, kFirst, kLast>(mma, tid, opaque(smem.q.data()),
                                                                  opaque(smem.k[j].data()), s);
    warpgroup_fence_operand(s);
  }

  // Accumulator element e of this thread: row (e / 2) % 2 of its two, column 8·(e / 4) + 2·(tid % 4) + e % 2.
  __forceinline__ __device__ static int fragment_column(int e, int tid) { return 8 * (e / 4) + 2 * (tid % 4) + e % 2; }
  __forceinline__ __device__ static int fragment_row(int r, int tid) { return tid / 32 * 16 + r * 8 + tid % 32 / 4; }

  // Bit 2·(e / 4) + e % 2 of the result: whether the slot of this thread's column
  // fragment_column(e) of the block in buffer j selects a key, from the gatherer's flags (read
  // after the buffer's first half has landed, before any warpgroup releases that half).
  __forceinline__ __device__ uint32_t valid_slots(int j) const {
    return valid_slot_bits<Traits::kBlockKeys>(smem.slot_valid[j], tid);
  }

  // S in log2 units (scale·log2(e)·q·k), −inf at the slots not gathered. Scaled before the max,
  // so that any scale, 0 and negative ones included, keeps the masked slots at −inf.
  __forceinline__ __device__ void scale_and_mask(uint32_t valid) {
    CUTE_UNROLL
    for (int e = 0; e < size(s); ++e) s(e) = (valid >> (2 * (e / 4) + e % 2)) & 1u ? s(e) * scale_log2 : -INFINITY;
  }
};

}  // namespace jfa::sm90::sparse
