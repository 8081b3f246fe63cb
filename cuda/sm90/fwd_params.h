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
// n_end - 1 down to n_begin, FwdBlockWalk): every block of S (causal: up to the diagonal), or on
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

// The key blocks a tile visits, walked down from n_end - 1 by every lane of the producer warp:
// every block of [n_begin, n_end), or on the kernels of the boolean mask those whose summaries over
// the tile's rows show a visible key, and n_begin (it holds one, or the tile sees no key and visits
// it fully masked, which writes O = 0 and LSE = -inf the usual way). The lanes read the summaries of
// 32 blocks at once into two ballots, so the walk costs one summary read per 32 blocks; the
// producer hands each block's facts to the consumers with its K stage (FwdBlockInfo), so that they
// read none: a dependent L2 read per block in their loop outlasted the block's GEMMs.
template <typename Traits, int kPolicies>
struct FwdBlockWalk {
  static constexpr bool kMask = (kPolicies & kPolicyBoolMask) != 0;
  static constexpr int kRowBlocks = (Traits::kBlockM + kMaskTileRows - 1) / kMaskTileRows;
  MaskRowSummaries summaries;
  int n_begin;
  int top = 0;           // the window's highest block: bit i of the ballots stands for block top - i
  uint32_t visible = 0;  // the window's blocks that the tile visits
  uint32_t full = 0;     // the window's blocks whose summaries show every key of the tile visible

  __forceinline__ __device__ FwdBlockWalk(const MaskRowSummaries& s, const TileWork& w)
      : summaries(s), n_begin(w.n_begin) {
    if constexpr (kMask) load_window(w.n_end - 1);
  }

  // Whether block n (of the current window) hides keys from some of the tile's rows, so that its
  // elements are tested. Without a mask the summaries have no rows and every block reads as full.
  __forceinline__ __device__ bool partial(int n) const {
    if constexpr (kMask) return ((full >> (top - n)) & 1u) == 0;
    return false;
  }

  // The block visited after block n (of the current window), if visits() says it is one.
  __forceinline__ __device__ int prev(int n) {
    if constexpr (!kMask) {
      return n - 1;
    } else {
      // The window's bits past block n's (2u << 31 wraps to 0: none).
      uint32_t below = visible & ~((2u << (top - n)) - 1u);
#pragma unroll 1
      while (below == 0) {
        if (top - 31 <= n_begin) return -1;
        load_window(top - 32);
        below = visible;
      }
      return top - (__ffs(int(below)) - 1);
    }
  }
  // Whether prev() gave a block: none after n_begin.
  __forceinline__ __device__ bool visits(int block) const {
    if constexpr (kMask) return block >= 0;
    return block >= n_begin;
  }

 private:
  __forceinline__ __device__ void load_window(int new_top) {
    const int n = new_top - int(threadIdx.x % 32);
    const MaskTileKind kind = n >= n_begin ? summaries.template block_kind<kRowBlocks>(n * Traits::kBlockN, Traits::kBlockN)
                                           : MaskTileKind::kEmpty;
    visible = __ballot_sync(0xffffffffu, n == n_begin || (n > n_begin && kind != MaskTileKind::kEmpty));
    full = __ballot_sync(0xffffffffu, n >= n_begin && kind == MaskTileKind::kFull);
    top = new_top;
  }
};

// A key block as the producer hands it to the consumers beside its K stage on the kernels of the
// boolean mask (FwdSharedStorage::block_info): its number, whether its elements are tested, and
// whether the tile visits another block after it.
struct FwdBlockInfo {
  static constexpr int kPartial = 1 << 30, kMore = 1 << 29, kBlock = kMore - 1;
  int word;
  __forceinline__ __device__ int block() const { return word & kBlock; }
  __forceinline__ __device__ bool partial() const { return (word & kPartial) != 0; }
  __forceinline__ __device__ bool more() const { return (word & kMore) != 0; }
};

// The slot of a K stage's block info: two per stage, by the stage's phase, so that the producer
// writes a stage's next block before it waits for the consumers to free the stage (they read the
// slot of its use before the previous one, which they freed before the producer's previous wait)
// and the write precedes the producer's arrive on the stage's full barrier, which the consumers'
// wait on it acquires. The producer's states start at the opposite phase (cutlass
// make_producer_start_state).
template <typename Storage, typename State>
__forceinline__ __device__ int& block_info_slot(Storage& ss, const State& st, bool producer) {
  return ss.block_info[st.phase() ^ uint32_t(producer)][st.index()];
}

// The producer's word on the block of the consumers' K stage `read`, after their wait on it.
template <typename Storage, typename State>
__forceinline__ __device__ FwdBlockInfo handed_block(Storage& ss, const State& read) {
  asm volatile("" ::: "memory");
  const FwdBlockInfo info{*reinterpret_cast<const volatile int*>(&block_info_slot(ss, read, /*producer=*/false))};
  asm volatile("" ::: "memory");
  return info;
}

// The producer's side: block n's word in stage `write`'s slot, written by one thread before the
// stage's acquire.
template <typename Storage, typename State>
__forceinline__ __device__ void hand_block(Storage& ss, const State& write, int n, bool partial, bool more) {
  asm volatile("" ::: "memory");
  *reinterpret_cast<volatile int*>(&block_info_slot(ss, write, /*producer=*/true)) =
      n | (partial ? FwdBlockInfo::kPartial : 0) | (more ? FwdBlockInfo::kMore : 0);
  asm volatile("" ::: "memory");
}

// The boolean mask's summaries of tile t's rows, taken once per tile for the producer's walk;
// none on kernels without the mask.
template <typename Traits, int kPolicies>
__forceinline__ __device__ MaskRowSummaries fwd_tile_summaries(const AttentionParams& p, const TileCoord& t) {
  if constexpr ((kPolicies & kPolicyBoolMask) != 0)
    return p.mask.packed_mask.row_summaries(t.batch, t.head, int64_t(t.m_block) * Traits::kBlockM, Traits::kBlockM);
  return MaskRowSummaries{};
}

}  // namespace jfa::sm90
