// What the Hopper forward's kernel reads: the TMA descriptors of Q, K, V (loads) and O (stores),
// built on the host per call, the LSE's place, and the call itself; and the tile a CTA works on.
#pragma once

#include <cute/tensor.hpp>

#include "api.h"
#include "fwd_traits.h"
#include "jfa/params.h"
#include "mask_policies.h"
#include "paged_kv.h"
#include "tile_scheduler.h"
#include "tma.h"

namespace jfa::sm90 {

using namespace cute;

template <typename Traits>
struct FwdParams {
  using Element = typename Traits::Element;
  TmaLoad<Element, Traits::kBlockM, Traits::kHeadDim, typename Traits::SmemLayoutQ> tma_q;
  TmaLoad<Element, Traits::kBlockN, Traits::kHeadDim, typename Traits::SmemLayoutK> tma_k, tma_v;
  // A paged call with pages smaller than a key tile: K and V in chunks of pages (paged_kv.h,
  // load_paged_chunks), narrow or wide; built only for the calls that use them.
  template <int kRows>
  using ChunkLoad = TmaLoad<Element, kRows, Traits::kHeadDim, SmemLayoutRows<Element, kRows, Traits::kHeadDim>>;
  ChunkLoad<kPagedPageRows> tma_k_narrow, tma_v_narrow;
  ChunkLoad<kPagedWideChunkRows> tma_k_wide, tma_v_wide;
  TmaStoreBox<Element> tma_o;
  GmemShape shape_q, shape_kv;  // (T, H, N, B) and kv_shape's; O has Q's shape
  float* lse;
  int64_t lse_batch, lse_row, lse_head;
  float scale_log2;
  int T, S, group;  // group = N / K query heads per K/V head
  int num_tiles;
  AttentionParams attn;  // the whole call: the general path reads its masks and modifiers here
};

template <typename Traits>
FwdParams<Traits> make_fwd_params(const AttentionParams& p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  using LayoutK = typename Traits::SmemLayoutK;
  const int num_m_blocks = int((p.T + kBlockM - 1) / kBlockM);
  const bool chunked = p.paged.present() && p.paged.page_size % kBlockN != 0;
  const bool wide = chunked && paged_wide_chunks<kBlockN>(p.paged.page_size);
  // The chunks' copies where this call uses them, else empty descriptors.
  auto chunk_load = [&](auto rows, bool used, const void* pool, const Strides& strides) {
    constexpr int kRows = decltype(rows)::value;
    using Load = typename FwdParams<Traits>::template ChunkLoad<kRows>;
    return used ? make_tma_load<kRows, kHeadDim, SmemLayoutRows<Element, kRows, kHeadDim>>(
                      kv_tensor<Element>(p, pool, strides))
                : Load{};
  };
  return FwdParams<Traits>{
      make_tma_load<kBlockM, kHeadDim, typename Traits::SmemLayoutQ>(query_tensor<Element>(p, p.q, p.q_strides)),
      make_tma_load<kBlockN, kHeadDim, LayoutK>(kv_tensor<Element>(p, p.k, p.k_strides)),
      make_tma_load<kBlockN, kHeadDim, LayoutK>(kv_tensor<Element>(p, p.v, p.v_strides)),
      chunk_load(Int<kPagedPageRows>{}, chunked && !wide, p.k, p.k_strides),
      chunk_load(Int<kPagedPageRows>{}, chunked && !wide, p.v, p.v_strides),
      chunk_load(Int<kPagedWideChunkRows>{}, wide, p.k, p.k_strides),
      chunk_load(Int<kPagedWideChunkRows>{}, wide, p.v, p.v_strides),
      make_tma_store_box<Element>(query_tensor<Element>(p, p.o, p.o_strides)),
      query_shape(p),
      kv_shape(p),
      p.lse,
      p.lse_strides.batch,
      p.lse_strides.row,
      p.lse_strides.head,
      p.scale_log2,
      int(p.T),
      int(p.S),
      int(p.N / p.K),
      int(num_m_blocks * p.N * p.B),
      p};
}

// Tile `tile` with its coordinates and the key blocks [n_begin, n_end) it visits (walked from
// n_end - 1 down to n_begin, fwd_prev_block): every block of S (causal: up to the diagonal), or on
// the general path those of its position range that may share a segment with it and that the
// boolean mask leaves a visible key in (mask_policies.h, general_block_range).
template <typename Traits, bool kCausal, int kPolicies, typename Scheduler>
__forceinline__ __device__ TileWork fwd_tile_work(const FwdParams<Traits>& p, const Scheduler& sched, int tile) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  TileWork w{tile, {0, 0, 0}, 0, 1};
  if (tile >= p.num_tiles) return w;
  w.coord = sched.get(tile);
  if constexpr (kPolicies != 0) {
    const int2 r = general_block_range<kBlockM, kBlockN>(p.attn, w.coord.batch, w.coord.head, w.coord.m_block);
    w.n_begin = r.x;
    w.n_end = r.y;
  } else {
    w.n_end = (p.S + kBlockN - 1) / kBlockN;
    if constexpr (kCausal) w.n_end = min(w.n_end, (w.coord.m_block * kBlockM + kBlockM + kBlockN - 1) / kBlockN);
  }
  return w;
}

// The key block the tile visits after n_block (walking down): n_block - 1, or on the kernels of the
// boolean mask the next lower one whose tile summaries are not all empty (n_begin at the latest:
// it holds a visible key). The producer and the consumers walk the same blocks with it, so a block
// that no row of the tile sees is neither loaded nor computed. Every lane of the calling warp takes
// part: past an empty block the lanes test 32 blocks at once, so a run of empty blocks costs one
// summary read per 32 rather than one dependent read each.
template <typename Traits, int kPolicies>
__forceinline__ __device__ int fwd_prev_block(const MaskRowSummaries& summaries, const TileWork& w, int n_block) {
  constexpr int kRowBlocks = (Traits::kBlockM + kMaskTileRows - 1) / kMaskTileRows;
  const int prev = n_block - 1;
  if constexpr ((kPolicies & kPolicyBoolMask) == 0) {
    return prev;
  } else {
    // Without a mask the summaries have no rows and every block reads as full.
    if (prev <= w.n_begin ||
        summaries.template block_kind<kRowBlocks>(prev * Traits::kBlockN, Traits::kBlockN) != MaskTileKind::kEmpty)
      return prev;
    const int lane = int(threadIdx.x % 32);
#pragma unroll 1
    for (int top = prev - 1;; top -= 32) {
      const int n = top - lane;
      const unsigned stop = __ballot_sync(
          0xffffffffu, n <= w.n_begin || summaries.template block_kind<kRowBlocks>(n * Traits::kBlockN, Traits::kBlockN) !=
                                             MaskTileKind::kEmpty);
      if (stop != 0) return top - (__ffs(stop) - 1);
    }
  }
}

// The boolean mask's summaries of tile w's rows, taken once per tile for fwd_prev_block and the
// consumers' tests; none on kernels without the mask.
template <typename Traits, int kPolicies>
__forceinline__ __device__ MaskRowSummaries fwd_tile_summaries(const AttentionParams& p, const TileCoord& t) {
  if constexpr ((kPolicies & kPolicyBoolMask) != 0)
    return p.mask.packed_mask.row_summaries(t.batch, t.head, int64_t(t.m_block) * Traits::kBlockM, Traits::kBlockM);
  return MaskRowSummaries{};
}

}  // namespace jfa::sm90
