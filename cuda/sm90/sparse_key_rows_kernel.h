// Second pass of the top-k sparse backward on Hopper (sparse_key_rows_traits.h has the tile): dK
// and dV of the selected rows from the P and scale·dS the first pass left in the workspace, for
// MLA's shared rows (V the first 512 columns of K), one sum per row:
//   accum[row(slot)] += Σ_heads scale·dS[head][slot]·Q[head] + P[head][slot]·dO[head].
// Warpgroup 3 loads Q's and dO's columns of the CTA's part once, then each block of 64 slots of
// both weights into two buffers. Consumer warpgroup c, per block: the sum over its 64 columns on
// wgmma, staged in shared memory one row per slot, then one bulk reduce-add (the TMA unit's
// float32 add into L2) per selected row, which runs while the next block's MMA does.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "jfa/sparse_params.h"
#include "sm90/named_barriers.h"
#include "sm90/sparse_gatherer.h"
#include "sm90/sparse_key_rows_traits.h"
#include "sm90/utils.h"

namespace jfa::sm90::sparse {

using namespace cute;

// The CTA's work: a (query position, key head) item of the chunk (its index in the chunk: local),
// a part of the columns and a block of the key head's query heads. Parts vary fastest, so that the
// three CTAs reading an item's weights run together and share them through L2.
struct KeyRowsItem {
  int64_t b, t, kh, local, h0;
  int part;
  template <typename Traits>
  __forceinline__ __device__ static KeyRowsItem of(const SparseParams& p, int64_t first_item, int64_t cta) {
    KeyRowsItem it;
    it.part = int(cta % Traits::kParts);
    cta /= Traits::kParts;
    const int64_t head_blocks = p.group_size() / Traits::kHeads;
    it.h0 = cta % head_blocks * Traits::kHeads;
    it.local = cta / head_blocks;
    int64_t item = first_item + it.local;  // (b·T + t)·K + kh
    it.kh = item % p.K;
    item /= p.K;
    it.t = item % p.T;
    it.b = item / p.T;
    return it;
  }
};

// Adds `bytes` (a multiple of 16) of float32 from shared memory into global memory, element by
// element, through the TMA unit; completion is tracked per thread in bulk groups.
__forceinline__ __device__ void bulk_reduce_add(float* dst, const float* src, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(cast_smem_ptr_to_uint(src)), "r"(bytes)
               : "memory");
}
__forceinline__ __device__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until this thread's bulk operations have read their shared memory (it may be written again).
__forceinline__ __device__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// Until they have completed (their writes performed).
__forceinline__ __device__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// ---------------------------------------------------------------------------------------------
// Loading warpgroup: 16-byte chunks of 64-element rows (a head's 64 columns or 64 slots), chunk
// i % 8 of head i / 8 for i = tid, tid + 128, ...

template <typename Traits>
struct KeyRowsLoader {
  using Element = typename Traits::Element;
  static constexpr int kChunks = Traits::kHeads * 8;  // per 64 x kHeads operand

  const SparseParams& p;
  const KeyRowsItem& it;
  typename Traits::SharedStorage& smem;
  const void* weights;
  int tid;

  __forceinline__ __device__ static Element* at(Element* tile, int index, int head) {
    Tensor s = make_tensor(make_smem_ptr(tile), typename Traits::OperandTile{});
    return &s(index, head);
  }

  // dO's (product 0) and Q's (product 1) columns of the part for the CTA's heads, then
  // columns_ready. dO has no columns past Hv: those tiles are never read.
  __forceinline__ __device__ void copy_columns() {
    const int64_t n0 = it.kh * p.group_size() + it.h0;
    CUTE_UNROLL
    for (int product = 0; product < 2; ++product)
      CUTE_UNROLL
      for (int c = 0; c < Traits::kConsumers; ++c) {
        const int64_t column = int64_t(it.part * Traits::kConsumers + c) * 64;
        if (product == 0 && column >= p.Hv) continue;
        const Element* src = static_cast<const Element*>(product == 0 ? p.dout : p.q) + column;
        for (int i = tid; i < kChunks; i += 128) {
          const int head = i / 8, chunk = i % 8;
          const int64_t row = product == 0 ? p.o_row(it.b, it.t, n0 + head) : p.q_row(it.b, it.t, n0 + head);
          copy_16b(at(smem.columns[product][c].data(), chunk * 8, head), src + row + chunk * 8, true);
        }
      }
    cutlass::arch::cpasync_barrier_arrive_noinc(reinterpret_cast<uint64_t*>(&smem.columns_ready));
  }

  // Slots [64·block, 64·block + 64) of both weights of the CTA's heads into buffer j, then
  // weights_ready[j]. Workspace rows are whole 64-slot blocks long, so no read leaves its row.
  __forceinline__ __device__ void copy_weights(int block, int j) {
    const int64_t G = p.group_size(), row_slots = weight_row_slots(p.topk);
    const Element* item_weights = static_cast<const Element*>(weights) + it.local * 2 * G * row_slots;
    CUTE_UNROLL
    for (int product = 0; product < 2; ++product)
      for (int i = tid; i < kChunks; i += 128) {
        const int head = i / 8, chunk = i % 8;
        const Element* src =
            item_weights + (product * G + it.h0 + head) * row_slots + int64_t(block) * Traits::kSlots + chunk * 8;
        copy_16b(at(smem.weights[j][product].data(), chunk * 8, head), src, true);
      }
    cutlass::arch::cpasync_barrier_arrive_noinc(reinterpret_cast<uint64_t*>(&smem.weights_ready[j]));
  }

  __forceinline__ __device__ void run(int blocks) {
    copy_columns();
    for (int block = 0; block < blocks; ++block) {
      const int j = block % 2;
      // A fresh barrier's preceding phase counts as complete: each buffer's first wait passes.
      smem.weights_free[j].wait(((block / 2) & 1) ^ 1);
      copy_weights(block, j);
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Consumer warpgroup c: the sum over column tile c of the part.

template <typename Traits>
struct KeyRowsConsumer {
  using Element = typename Traits::Element;
  using RowsMma = typename Traits::RowsMma;
  using OperandTile = typename Traits::OperandTile;

  const SparseParams& p;
  const KeyRowsItem& it;
  typename Traits::SharedStorage& smem;
  float* accum;
  const int c, tid;
  const int64_t first_column;  // of the tile in a row
  const bool with_values;      // whether the tile has dO's columns (those before Hv)

  decltype(partition_fragment_C(RowsMma{}, Shape<_64, Int<Traits::kSlots>>{})) acc;  // [column][slot]

  __forceinline__ __device__ KeyRowsConsumer(const SparseParams& p_, const KeyRowsItem& it_,
                                             typename Traits::SharedStorage& smem_, float* accum_, int c_)
      : p(p_),
        it(it_),
        smem(smem_),
        accum(accum_),
        c(c_),
        tid(threadIdx.x % 128),
        first_column(int64_t(it_.part * Traits::kConsumers + c_) * 64),
        with_values(first_column < p_.Hv) {}

  // acc (+)= columnsᵀ·weights over the kHeads heads (no commit); the first product of a block
  // overwrites acc.
  __forceinline__ __device__ void issue_product(Element* columns, Element* weights, bool first) {
    RowsMma mma;
    auto thr = mma.get_slice(tid);
    Tensor fa = thr.partition_fragment_A(make_tensor(make_smem_ptr(columns), OperandTile{}));
    Tensor fb = thr.partition_fragment_B(make_tensor(make_smem_ptr(weights), OperandTile{}));
    mma.accumulate_ = first ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(fa); ++k) {
      cute::gemm(mma, fa(_, _, k), fb(_, _, k), acc);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
  }

  // The accumulator row (column of the sum) and column (slot) of this thread's element e, as in
  // the first pass: row tid / 32 · 16 + tid % 32 / 4, plus 8 for (e / 2) odd; column
  // 8·(e / 4) + 2·(tid % 4) + e % 2.
  __forceinline__ __device__ int column_of(int e) const { return tid / 32 * 16 + (e / 2) % 2 * 8 + tid % 32 / 4; }
  __forceinline__ __device__ int slot_of(int e) const { return 8 * (e / 4) + 2 * (tid % 4) + e % 2; }

  // Where slot `tid` of block `block` adds its row (this tile's columns of it), or null for a slot
  // past topk or one whose index selects nothing. Threads from 64 on hold no slot.
  __forceinline__ __device__ float* target_row(int block) const {
    const int64_t slot = int64_t(block) * Traits::kSlots + tid;
    if (tid >= Traits::kSlots || slot >= p.topk) return nullptr;
    const int32_t key = __ldg(p.indices + p.index_row(it.b, it.t, it.kh) + slot);
    return sparse_index_valid(p, it.t, key) ? accum + p.k_row(it.b, key, it.kh) + first_column : nullptr;
  }

  // The tiles with and without dO's columns run apart, so that no branch splits a block's wgmma
  // chain (ptxas would serialize it).
  __forceinline__ __device__ void run(int blocks) {
    if (with_values)
      run_blocks<true>(blocks);
    else
      run_blocks<false>(blocks);
  }

  template <bool kWithValues>
  __forceinline__ __device__ void run_blocks(int blocks) {
    auto& staged = smem.staged[c];
    smem.columns_ready.wait(0);
    for (int block = 0; block < blocks; ++block) {
      const int j = block % 2;
      float* target = target_row(block);
      smem.weights_ready[j].wait((block / 2) & 1);
      // The loader's cp.async writes are generic-proxy ones; wgmma reads through the async proxy.
      cutlass::arch::fence_view_async_shared();
      warpgroup_fence_operand(acc);
      warpgroup_arrive();
      issue_product(smem.columns[1][c].data(), smem.weights[j][1].data(), true);
      if constexpr (kWithValues) issue_product(smem.columns[0][c].data(), smem.weights[j][0].data(), false);
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc);
      smem.weights_free[j].arrive();
      // The last block's reductions have read their rows before anyone overwrites them.
      if (tid < Traits::kSlots) bulk_wait_read();
      bar_sync(kSparseKeyRowsBarStagedFirst + c, 128);
      CUTE_UNROLL
      for (int e = 0; e < size(acc); ++e) staged[slot_of(e)][column_of(e)] = acc(e);
      // The rows' generic-proxy stores before the bulk copies read them through the async proxy.
      cutlass::arch::fence_view_async_shared();
      bar_sync(kSparseKeyRowsBarStagedFirst + c, 128);
      if (tid < Traits::kSlots) {
        if (target != nullptr) bulk_reduce_add(target, &staged[tid][0], 64 * int(sizeof(float)));
        bulk_commit();
      }
    }
    if (tid < Traits::kSlots) bulk_wait();
  }
};

template <typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    sparse_key_rows_kernel(const __grid_constant__ SparseParams p, const void* weights, float* accum,
                           int64_t first_item) {
  extern __shared__ __align__(1024) unsigned char smem_bytes[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_bytes);
  if (threadIdx.x == 0) {
    smem.columns_ready.init(128);
    for (int j = 0; j < 2; ++j) {
      smem.weights_ready[j].init(128);                          // every loading thread's cp.async arrival
      smem.weights_free[j].init(128 * Traits::kConsumers);  // every consumer thread
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  const KeyRowsItem it = KeyRowsItem::of<Traits>(p, first_item, blockIdx.x);
  const int blocks = int((p.topk + Traits::kSlots - 1) / Traits::kSlots);
  const int wg = cutlass::canonical_warp_group_idx();
  if (wg == Traits::kConsumers) {
    KeyRowsLoader<Traits>{p, it, smem, weights, int(threadIdx.x % 128)}.run(blocks);
    return;
  }
  KeyRowsConsumer<Traits>(p, it, smem, accum, wg).run(blocks);
}

}  // namespace jfa::sm90::sparse
