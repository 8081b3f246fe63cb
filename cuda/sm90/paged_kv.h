// Paged key/value caches in the Hopper forward. The producer looks up each key tile's page
// (fwd_producer.h, table_page); the consumers' side: a sequence's last key block may end inside a page,
// whose rows past the sequence's length hold whatever the page held before (another sequence's
// rows, NaN). Their probabilities are 0, but 0 · NaN is NaN in P·V, so each consumer warpgroup
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

namespace jfa::sm90 {

// Whether a forward kernel takes paged calls: the general path's kernels on two consumers' 128 x 128
// or 128 x 64 tiles, which fwd_launch.h gives them, of the positions, ALiBi and all-policies sets
// (a paged call with data masks runs on the last; none has dropout). The others carry none of the
// code below: their registers are tighter (H 64's three consumers, the data masks' set) and no
// paged call reaches them.
template <typename Traits, int kPolicies>
constexpr bool reads_pages() {
  return kPolicies != 0 && (kPolicies & kPolicyDropout) == 0 &&
         ((kPolicies & kPolicyData) == 0 || kPolicies == kPolicyAll) && kPagedPageRows % Traits::kBlockN == 0 &&
         Traits::kNumMmaWarpGroups == 2;
}

// Entry `entry` of batch element b's row of the block table, clamped into the pool. In 32 bits
// (can_implement bounds the sizes): the producer that calls it runs on 24 registers.
__forceinline__ __device__ int table_page(const PagedKV& paged, int b, int entry) {
  const int id = paged.table[int64_t(b) * paged.table_stride + entry];
  return min(max(id, 0), int(paged.num_pages) - 1);
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
