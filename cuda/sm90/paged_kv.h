// Paged key/value caches in the Hopper forward. The producer looks up the pages of each key tile
// and loads it from them (load_paged_block). The consumers' side: a sequence's last key block may
// end inside a page, whose rows past the sequence's length hold whatever the page held before
// (another sequence's rows, NaN). Their probabilities are 0, but 0 · NaN is NaN in P·V, so each consumer warpgroup
// zeroes those rows of the block's V in smem before its P·V reads them, as vLLM's paged kernels
// zero them in registers.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "api.h"
#include "jfa/mask.h"
#include "jfa/params.h"
#include "mask_policies.h"
#include "named_barriers.h"
#include "tma.h"

namespace jfa::sm90 {

// Whether a forward kernel takes paged calls: the general path's kernels on two consumers' 128 x 128
// or 128 x 64 tiles, which fwd_launch.h gives them, of the positions, ALiBi and all-policies sets
// (a paged call with data masks runs on the last; none has dropout). The others carry none of the
// code below: their registers are tighter (H 64's three consumers, the data masks' set) and no
// paged call reaches them.
template <typename Traits, int kPolicies>
constexpr bool reads_pages() {
  return kPolicies != 0 && (kPolicies & kPolicyDropout) == 0 &&
         ((kPolicies & kPolicyData) == 0 || kPolicies == kPolicyAll) && Traits::kBlockN % kPagedPageRows == 0 &&
         Traits::kNumMmaWarpGroups == 2;
}

// Entry `entry` of batch element b's row of the block table, clamped into the pool. In 32 bits
// (can_implement bounds the sizes): the producer that calls it runs on 24 registers.
__forceinline__ __device__ int table_page(const PagedKV& paged, int b, int entry) {
  const int id = paged.table[int64_t(b) * paged.table_stride + entry];
  return min(max(id, 0), int(paged.num_pages) - 1);
}

// Pages smaller than a key tile are loaded in chunks that each lie inside one page: of
// kPagedWideChunkRows rows where the page size allows it, else of kPagedPageRows. Every chunk is
// a TMA copy per 64 columns, issued by one thread, so small chunks make the producer the
// bottleneck of a memory-bound decode step; the wide ones take a quarter of the copies.
constexpr int kPagedWideChunkRows = 64;

template <int kBlockN>
__host__ __device__ constexpr bool paged_wide_chunks(int64_t page_size) {
  return kBlockN % kPagedWideChunkRows == 0 && page_size % kPagedWideChunkRows == 0;
}

// Key block n of batch element b, K/V head kv_head, in chunks of kChunkRows rows (each inside
// one page) into the smem tile `s`. Lane c looks up chunk c's page, so that the block's lookups take
// one round trip, not one per chunk; lane 0 issues the copies. Rows past the table's last entry (a
// block that ends past S) come from that entry's page: their keys are masked and their values
// zeroed like any rows past a length (zero_rows_from).
template <int kChunkRows, int kBlockN, int kHeadDim, typename ChunkTma, typename STensor>
__forceinline__ __device__ void load_paged_chunks(const PagedKV& paged, ChunkTma const& tma, GmemShape shape,
                                                  STensor s, int b, int kv_head, int n, uint64_t& bar) {
  constexpr int kChunks = kBlockN / kChunkRows;
  static_assert(kBlockN % kChunkRows == 0 && kChunks <= 32);
  const int lane = threadIdx.x % 32, page_size = int(paged.page_size);
  const int chunk_row = n * kBlockN + min(lane, kChunks - 1) * kChunkRows;
  const int page = table_page(paged, b, min(chunk_row / page_size, int(paged.table_stride) - 1));
  const int first = chunk_row % page_size;
  Tensor m = tma.get_tma_tensor(shape);
#pragma unroll 1
  for (int c = 0; c < kChunks; ++c) {
    const int chunk_page = __shfl_sync(0xffffffffu, page, c), chunk_first = __shfl_sync(0xffffffffu, first, c);
    if (lane == 0)
      tma_load_tile<kChunkRows, kHeadDim>(tma, m, kv_head, chunk_page, chunk_first / kChunkRows,
                                          local_tile(s, Shape<Int<kChunkRows>, Int<kHeadDim>>{}, make_coord(c, _0{})),
                                          bar);
  }
}

// Key block n of batch element b, K/V head kv_head, from the page pool into the smem tile `s`
// (kBlockN x kHeadDim), completing on `bar`; called by the producer warp's 32 lanes. A block
// inside one page (page_size a multiple of kBlockN) is one copy (tma over the pool); otherwise
// load_paged_chunks with the wide chunks' copy or the narrow ones'.
template <int kBlockN, int kHeadDim, typename Tma, typename NarrowTma, typename WideTma, typename MTensor,
          typename STensor>
__forceinline__ __device__ void load_paged_block(const PagedKV& paged, Tma const& tma, NarrowTma const& narrow,
                                                 WideTma const& wide, MTensor const& m, GmemShape shape, STensor s,
                                                 int b, int kv_head, int n, uint64_t& bar) {
  const int row = n * kBlockN, page_size = int(paged.page_size);
  if (page_size % kBlockN == 0) {
    const int entry = row / page_size;
    if (threadIdx.x % 32 == 0)
      tma_load_tile<kBlockN, kHeadDim>(tma, m, kv_head, table_page(paged, b, entry), (row - entry * page_size) / kBlockN,
                                       s, bar);
    return;
  }
  if constexpr (kBlockN % kPagedWideChunkRows == 0)
    if (paged_wide_chunks<kBlockN>(page_size))
      return load_paged_chunks<kPagedWideChunkRows, kBlockN, kHeadDim>(paged, wide, shape, s, b, kv_head, n, bar);
  load_paged_chunks<kPagedPageRows, kBlockN, kHeadDim>(paged, narrow, shape, s, b, kv_head, n, bar);
}

// The rows of key block n_block inside batch element b's keys: kBlockN where the block is whole or
// the call not paged (only a paged cache's rows past a length can hold anything).
template <int kBlockN>
__forceinline__ __device__ int paged_block_rows(const AttentionParams& p, int b, int n_block) {
  if (!p.paged.present()) return kBlockN;
  const int64_t rows = clamp_length(p.mask.kv_lengths, b, p.S) - int64_t(n_block) * kBlockN;
  return rows >= kBlockN ? kBlockN : rows < 0 ? 0 : int(rows);
}

// Zeroes rows [rows, kBlockN) of stage `stage` of the (kBlockN, H, stages) smem tensor `sV` with
// the 128 threads of a consumer warpgroup (wg_tid its thread), 16 bytes per store (8 elements stay
// contiguous under the 128-byte swizzle), and makes them visible to the warpgroup's wgmma (the
// async proxy) before it goes on.
// Every consumer warpgroup zeroes the same rows before its own P·V: a warpgroup may still be
// reading them when another writes, but only zeros over zeros.
template <int kBlockN, int kHeadDim, typename STensor>
__forceinline__ __device__ void zero_rows_from(STensor const& sV, int stage, int rows, int wg_tid, int warpgroup_bar) {
  constexpr int kPieces = kHeadDim / 8;
#pragma unroll 1
  for (int i = wg_tid; i < (kBlockN - rows) * kPieces; i += 128)
    *reinterpret_cast<uint4*>(&sV(rows + i / kPieces, (i % kPieces) * 8, stage)) = make_uint4(0u, 0u, 0u, 0u);
  cutlass::arch::fence_view_async_shared();
  bar_sync(warpgroup_bar, 128);
}

}  // namespace jfa::sm90
