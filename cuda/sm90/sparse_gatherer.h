// The gathering warpgroup of the Hopper top-k sparse kernels (sparse_fwd_kernel.h,
// sparse_dist_kernel.h): it copies Q and each pair's selected key rows with cp.async into the
// 128-byte-swizzled tiles wgmma reads (TMA has no row gather on sm90), zero-filling slots that
// select nothing, and signals each buffer half's mbarrier. Also where a CTA's work lies.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "jfa/sparse_params.h"

namespace jfa::sm90::sparse {

using namespace cute;

// Where a CTA's work lies: query (b, t), key head kh, query heads n0 … n0 + 63; tile `cta` of the
// grid's order (head block fastest, then key head, query position, batch), by default blockIdx.x.
struct SparseTile {
  int64_t b, t, kh, n0;
  __forceinline__ __device__ explicit SparseTile(const SparseParams& p) : SparseTile(p, blockIdx.x) {}
  __forceinline__ __device__ SparseTile(const SparseParams& p, int64_t cta) {
    const int64_t head_blocks = p.group_size() / 64;
    int64_t i = cta;
    const int64_t hb = i % head_blocks;
    i /= head_blocks;
    kh = i % p.K;
    i /= p.K;
    t = i % p.T;
    b = i / p.T;
    n0 = kh * p.group_size() + hb * 64;
  }
};

// Copies 16 bytes from global to shared memory, or writes 16 zero bytes when !read (src is then not
// dereferenced). L2::256B: a thread group reads 128 bytes of each of a row's nine tiles.
__forceinline__ __device__ void copy_16b(void* dst, const void* src, bool read) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(cast_smem_ptr_to_uint(dst)),
               "l"(src), "r"(read ? 16 : 0)
               : "memory");
}

// ---------------------------------------------------------------------------------------------
// Gathering warpgroup: thread (group g = tid / 8, chunk c = tid % 8) copies 16-byte chunk c of every
// 64-column tile of rows g, g + 16, g + 32, g + 48. The threads of chunk 0 (the flag writers) also
// write each slot's flag beside the block: the consumers read their masks from shared memory
// instead of loading indices behind the gatherer's copies, which share their memory pipeline.

inline constexpr int kGatherThreads = 128;
inline constexpr int kGatherFlagWriters = kGatherThreads / 8;

template <typename Traits>
struct Gatherer {
  using Element = typename Traits::Element;
  static constexpr int kRowsPerThread = Traits::kBlockKeys / 16;

  const SparseParams& p;
  const SparseTile& tile;
  typename Traits::SharedStorage& smem;
  int group, chunk;
  int32_t fetched[2][kRowsPerThread];  // the indices of the pair after the one being copied
  int32_t rows[2][kRowsPerThread];     // the pair's key rows this thread copies; -1: not gathered

  // Address of this thread's chunk of (row group, tile 0) in a 64-row buffer; rows 16 apart are
  // 16·64 elements apart and tiles 64·64 (sparse_fwd_traits.h).
  __forceinline__ __device__ Element* chunk_base(Element* buffer) const {
    Tensor s = make_tensor(make_smem_ptr(buffer), typename Traits::template RowTiles<Traits::kTiles>{});
    return &s(group, chunk * 8);
  }

  __forceinline__ __device__ void copy_queries() {
    const Element* q = static_cast<const Element*>(p.q) + p.q_row(tile.b, tile.t, tile.n0) + chunk * 8;
    Element* dst = chunk_base(smem.q.data());
    CUTE_UNROLL
    for (int r = 0; r < kRowsPerThread; ++r)
      CUTE_UNROLL
      for (int c = 0; c < Traits::kTiles; ++c)
        copy_16b(dst + r * 16 * 64 + c * 64 * 64, q + int64_t(group + 16 * r) * p.H + c * 64, true);
    cutlass::arch::cpasync_barrier_arrive_noinc(reinterpret_cast<uint64_t*>(&smem.q_ready));
  }

  __forceinline__ __device__ int64_t slot(int block, int j, int r) const {
    return int64_t(block + j) * Traits::kBlockKeys + group + 16 * r;
  }

  // Loads the indices of blocks `block` and `block + 1` a pair ahead of their copies, every load
  // before any use: one round trip, under the current pair's copies, instead of one per index in
  // front of them. Slots past topk read the last slot, in bounds; select_pair masks them.
  __forceinline__ __device__ void fetch_pair(int block) {
    const int32_t* indices = p.indices + p.index_row(tile.b, tile.t, tile.kh);
    CUTE_UNROLL
    for (int j = 0; j < 2; ++j)
      CUTE_UNROLL
      for (int r = 0; r < kRowsPerThread; ++r) fetched[j][r] = __ldg(indices + min(slot(block, j, r), p.topk - 1));
  }

  // The fetched pair's rows: slots past topk and indices that select nothing (sparse_index_valid)
  // are zero-filled and masked, never read.
  __forceinline__ __device__ void select_pair(int block) {
    CUTE_UNROLL
    for (int j = 0; j < 2; ++j)
      CUTE_UNROLL
      for (int r = 0; r < kRowsPerThread; ++r)
        rows[j][r] = slot(block, j, r) < p.topk && sparse_index_valid(p, tile.t, fetched[j][r]) ? fetched[j][r] : -1;
  }

  // Tiles [kFirst, kLast) of the pair's block j into buffer j, then the buffer half's barrier. The
  // first half also carries the slots' flags: their writers arrive once more on its barrier, and
  // that arrive orders their stores before the consumers' wait.
  template <int j, int kFirst, int kLast>
  __forceinline__ __device__ void copy_half(cutlass::arch::ClusterBarrier& ready) {
    const Element* k = static_cast<const Element*>(p.k) + chunk * 8;
    Element* dst = chunk_base(smem.k[j].data());
    CUTE_UNROLL
    for (int r = 0; r < kRowsPerThread; ++r) {
      const bool valid = rows[j][r] >= 0;
      const Element* src = k + (valid ? p.k_row(tile.b, rows[j][r], tile.kh) : 0);
      CUTE_UNROLL
      for (int c = kFirst; c < kLast; ++c) copy_16b(dst + r * 16 * 64 + c * 64 * 64, src + c * 64, valid);
      if (kFirst == 0 && chunk == 0) smem.slot_valid[j][group + 16 * r] = valid;
    }
    cutlass::arch::cpasync_barrier_arrive_noinc(reinterpret_cast<uint64_t*>(&ready));
    if (kFirst == 0 && chunk == 0) ready.arrive();
  }

  // Each half is refilled in the order its readers release it. The forward's (Traits::
  // kRefillByBlock false): block 0's value columns (wg 0's P·V), block 1's right half (wg 1's P·V),
  // block 0's right half (wg 1's P·V of block 0), block 1's value columns (wg 0's P·V of block 1).
  // attn_dist's: block by block, each warpgroup releasing its block's two halves after its Q·Kᵀ,
  // so that neither waits for the other.
  __forceinline__ __device__ void run(int pairs) {
    if (pairs > 0) fetch_pair(0);
    copy_queries();
    int phase = 1;  // a fresh barrier's preceding phase counts as complete: the first waits pass
    for (int pair = 0; pair < pairs; ++pair) {
      select_pair(2 * pair);
      if (pair + 1 < pairs) fetch_pair(2 * pair + 2);
      if constexpr (Traits::kRefillByBlock) {
        smem.k_free[0][0].wait(phase);
        copy_half<0, 0, 4>(smem.k_ready[0][0]);
        smem.k_free[0][1].wait(phase);
        copy_half<0, 4, Traits::kTiles>(smem.k_ready[0][1]);
        smem.k_free[1][0].wait(phase);
        copy_half<1, 0, 4>(smem.k_ready[1][0]);
        smem.k_free[1][1].wait(phase);
        copy_half<1, 4, Traits::kTiles>(smem.k_ready[1][1]);
        phase ^= 1;
        continue;
      }
      smem.k_free[0][0].wait(phase);
      copy_half<0, 0, 4>(smem.k_ready[0][0]);
      smem.k_free[1][1].wait(phase);
      copy_half<1, 4, Traits::kTiles>(smem.k_ready[1][1]);
      smem.k_free[0][1].wait(phase);
      copy_half<0, 4, Traits::kTiles>(smem.k_ready[0][1]);
      smem.k_free[1][0].wait(phase);
      copy_half<1, 0, 4>(smem.k_ready[1][0]);
      phase ^= 1;
    }
  }
};

// The gathering protocol's mbarriers, before any warpgroup starts (ends in __syncthreads).
template <typename SharedStorage>
__forceinline__ __device__ void init_gather_barriers(SharedStorage& smem) {
  if (threadIdx.x == 0) {
    smem.q_ready.init(kGatherThreads);
    for (int j = 0; j < 2; ++j)
      for (int h = 0; h < 2; ++h) {
        // Every gathering thread's cp.async arrival; on the first half, the flag writers' too.
        smem.k_ready[j][h].init(kGatherThreads + (h == 0 ? kGatherFlagWriters : 0));
        smem.k_free[j][h].init(128);  // every thread of the warpgroup that reads the half last
      }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
}

// Pairs of 64-slot blocks a CTA walks.
template <typename Traits>
__forceinline__ __device__ int pair_count(const SparseParams& p) {
  return int((p.topk + 2 * Traits::kBlockKeys - 1) / (2 * Traits::kBlockKeys));
}

// Warpgroup 2's part of a CTA: it hands registers to the consumers and gathers every pair.
template <typename Traits>
__forceinline__ __device__ void gather_pairs(const SparseParams& p, const SparseTile& tile,
                                             typename Traits::SharedStorage& smem, int pairs) {
  cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
  Gatherer<Traits> gatherer{p, tile, smem, int(threadIdx.x % 128) / 8, int(threadIdx.x % 8)};
  gatherer.run(pairs);
}

}  // namespace jfa::sm90::sparse
