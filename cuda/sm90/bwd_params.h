// What the Hopper backward's kernels read: the TMA descriptors of Q, dO, K, V (loads) and dK, dV
// (stores), built on the host per call, and the call itself.
#pragma once

#include <cute/tensor.hpp>

#include "bwd_general.h"
#include "bwd_traits.h"
#include "jfa/params.h"
#include "tile_scheduler.h"
#include "tma.h"

namespace jfa::sm90 {

using namespace cute;

template <typename Traits>
struct BwdParams {
  using Element = typename Traits::Element;
  TmaLoad<Element, Traits::kBlockM, Traits::kHeadDim, typename Traits::SmemLayoutQ> tma_q, tma_do;
  TmaLoad<Element, Traits::kBlockN, Traits::kHeadDim, typename Traits::SmemLayoutK> tma_k, tma_v;
  TmaStoreBox<Element> tma_dk, tma_dv;
  GmemShape shape_q, shape_kv;  // (T, H, N, B) and (S, H, K, B); dO has Q's shape, dK and dV K's
  int num_n_blocks, num_m_blocks, group;  // group = N / K query heads per K/V head
  // Set by the launcher (bwd_launch.h): CTAs per key block of a K/V head, the query heads each
  // walks (group / head_chunks: a parameter, so that the walk keeps no register for it), and
  // whether the walk runs down (BwdWalk::ordered).
  int head_chunks, heads;
  bool walk_down;
  AttentionParams attn;
};

template <typename Traits>
BwdParams<Traits> make_bwd_params(const AttentionParams& p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  using LayoutQ = typename Traits::SmemLayoutQ;
  using LayoutK = typename Traits::SmemLayoutK;
  return BwdParams<Traits>{make_tma_load<kBlockM, kHeadDim, LayoutQ>(query_tensor<Element>(p, p.q, p.q_strides)),
                           make_tma_load<kBlockM, kHeadDim, LayoutQ>(query_tensor<Element>(p, p.dout, p.do_strides)),
                           make_tma_load<kBlockN, kHeadDim, LayoutK>(key_tensor<Element>(p, p.k, p.k_strides)),
                           make_tma_load<kBlockN, kHeadDim, LayoutK>(key_tensor<Element>(p, p.v, p.v_strides)),
                           make_tma_store_box<Element>(key_tensor<Element>(p, p.dk, p.dk_strides)),
                           make_tma_store_box<Element>(key_tensor<Element>(p, p.dv, p.dv_strides)),
                           query_shape(p),
                           key_shape(p),
                           int((p.S + kBlockN - 1) / kBlockN),
                           int((p.T + kBlockM - 1) / kBlockM),
                           int(p.N / p.K),
                           1,
                           int(p.N / p.K),
                           p.deterministic,
                           p};
}

// The query blocks a key block's CTA walks, per query head of its group: [begin, end). Top-left
// causal starts at the first block with a query at or after the block's first key.
template <typename Traits, bool kCausal>
__forceinline__ __device__ int2 bwd_m_block_range(const BwdParams<Traits>& p, int n_block) {
  const int begin = kCausal ? min(n_block * Traits::kBlockN / Traits::kBlockM, p.num_m_blocks) : 0;
  return make_int2(begin, p.num_m_blocks);
}

// Step s of a CTA's walk over `heads` query heads from head0: query head head0 + s /
// steps_per_head, query block begin + the rest. `ordered` (deterministic=True, and causal CTAs that
// walk several heads: bwd_launch.h) walks the other way: down from the last query block, the
// query heads innermost, so that the CTAs of every key block reach a query block at the same
// step and each waits for its turn there (bwd_dq_order.h) only as long as the lower key blocks'
// adds take; walking up from the diagonal, a causal key block's first block would be the lower
// key blocks' last.
struct BwdStep {
  int head;  // the query head
  int m_block;
  // Whether the mask's summaries prove the step's tile full (1) or not (0), where the walk read
  // them ahead (bwd_for_each_step); -1: not read, bwd_step looks them up itself.
  int mask_full = -1;
};

struct BwdWalk {
  int head0, batch, n_block;  // head0: the first query head the CTA walks
  int m_begin, steps_per_head, num_steps;
  bool ordered;
  int first = 0;  // the first step walked (bwd_next_step)

  __forceinline__ __device__ int kv_head(int group) const { return head0 / group; }
  __forceinline__ __device__ BwdStep step(int s, int heads) const {
    if (ordered) {
      const int back = s / heads;
      return {head0 + (s - back * heads), m_begin + steps_per_head - 1 - back};
    }
    const int g = s / steps_per_head;
    return {head0 + g, m_begin + (s - g * steps_per_head)};
  }
  // Step s + 1 from step s (`st`): step()'s order without its division, which the loops' walks
  // would otherwise repeat at the start of every step.
  __forceinline__ __device__ BwdStep after(BwdStep st, int heads) const {
    if (ordered) {
      if (++st.head == head0 + heads) {
        st.head = head0;
        --st.m_block;
      }
    } else if (++st.m_block == m_begin + steps_per_head) {
      st.m_block = m_begin;
      ++st.head;
    }
    return st;
  }
};

// Whether the walk skips the steps that the boolean mask's summaries prove empty: on its kernels
// when a mask is given (the kernel of every feature also runs calls without one), unless
// deterministic=True, where every step is a turn of the ordered dQ adds (bwd_dq_order.h) that the
// later key blocks count on.
template <typename Traits, int kPolicies>
__forceinline__ __device__ bool bwd_skips_empty_steps(const BwdParams<Traits>& p) {
  return (kPolicies & kPolicyBoolMask) != 0 && p.attn.mask.packed_mask.present() && !p.attn.deterministic;
}

// The summaries of step st's row blocks (kBlockM rows of one head) in the CTA's key column, as
// loaded: a step is empty when every one is (MaskTileKind::kEmpty is 0; rows past T read as empty).
// Kept apart and tested later (seen()), so that a caller can load them early and wait for them only
// where it tests them. Everything but the step is read from the parameters, which cost no registers.
template <int kRowBlocks>
struct BwdStepSummaries {
  uint32_t kinds[kRowBlocks];

  __forceinline__ __device__ bool seen() const {
    uint32_t any = 0;
    CUTE_UNROLL
    for (int i = 0; i < kRowBlocks; ++i) any |= kinds[i];
    return any != 0;
  }
  // Whether every row block of the step inside T is full (the tile needs no per-element test).
  __forceinline__ __device__ bool full(int m_block, int64_t row_blocks) const {
    bool all = true;
    CUTE_UNROLL
    for (int i = 0; i < kRowBlocks; ++i)
      all = all && (m_block * kRowBlocks + i >= row_blocks || kinds[i] == uint32_t(MaskTileKind::kFull));
    return all;
  }
  // Lane `from`'s summaries, on every lane.
  __forceinline__ __device__ BwdStepSummaries from_lane(int from) const {
    BwdStepSummaries s;
    CUTE_UNROLL
    for (int i = 0; i < kRowBlocks; ++i) s.kinds[i] = __shfl_sync(0xffffffffu, kinds[i], from);
    return s;
  }
};

template <typename Traits>
__forceinline__ __device__ BwdStepSummaries<Traits::kBlockM / kMaskTileRows> bwd_step_summaries(
    const BwdParams<Traits>& p, const BwdWalk& walk, const BwdStep& st) {
  constexpr int kRowBlocks = Traits::kBlockM / kMaskTileRows;
  static_assert(Traits::kBlockM % kMaskTileRows == 0);
  static_assert(kMaskChunkKeys % Traits::kBlockN == 0, "a key block lies in one chunk of summaries");
  static_assert(uint8_t(MaskTileKind::kEmpty) == 0);
  const PackedMaskView& m = p.attn.mask.packed_mask;
  const int rb0 = st.m_block * kRowBlocks;
  const uint8_t* column = m.tiles + walk.batch * m.tiles_batch_stride + st.head * m.tiles_head_stride +
                          rb0 * m.chunks + walk.n_block * Traits::kBlockN / kMaskChunkKeys;
  BwdStepSummaries<kRowBlocks> summaries;
  CUTE_UNROLL
  for (int i = 0; i < kRowBlocks; ++i)
    summaries.kinds[i] = kRowBlocks == 1 || rb0 + i < m.row_blocks ? column[i * m.chunks] : 0u;
  return summaries;
}

// Whether no query of step st sees a key of the CTA's key block, by the summaries.
template <typename Traits>
__forceinline__ __device__ bool bwd_step_empty(const BwdParams<Traits>& p, const BwdWalk& walk, const BwdStep& st) {
  return !bwd_step_summaries(p, walk, st).seen();
}

// The step walked after step s (walk.num_steps: none). The producer, the dQ writer and the MMA
// warpgroups all walk with it, so a skipped step is neither loaded, computed nor added. Every lane
// of the calling warp takes part: past an empty step the lanes test 32 steps at once, so a run of
// empty steps costs one summary read per 32 rather than one dependent read each.
template <typename Traits, int kPolicies>
__forceinline__ __device__ int bwd_next_step(const BwdParams<Traits>& p, const BwdWalk& walk, int s) {
  ++s;
  if constexpr ((kPolicies & kPolicyBoolMask) == 0) {
    return s;
  } else {
    if (!bwd_skips_empty_steps<Traits, kPolicies>(p) || s >= walk.num_steps ||
        !bwd_step_empty(p, walk, walk.step(s, p.heads)))
      return s;
    const int lane = int(threadIdx.x % 32);
#pragma unroll 1
    for (++s; s < walk.num_steps; s += 32) {
      const int mine = s + lane;
      const unsigned seen =
          __ballot_sync(0xffffffffu, mine < walk.num_steps && !bwd_step_empty(p, walk, walk.step(mine, p.heads)));
      if (seen != 0) return s + __ffs(seen) - 1;
    }
    return walk.num_steps;
  }
}

// The CTA's walk; the general path (kPolicies != 0) takes its query blocks from the call's masks
// (bwd_general.h), and a key block that no query sees gets an empty walk. Inside the position
// range, which holds every step that some query head of the group sees, a block-sparse or random
// mask leaves steps empty for one head or for all: bwd_next_step skips them.
template <typename Traits, bool kCausal, int kPolicies, typename Order>
__forceinline__ __device__ BwdWalk bwd_walk(const BwdParams<Traits>& p, const Order& order) {
  const TileCoord t = order.get(int(blockIdx.x));  // t.head: K/V head · head_chunks + chunk
  const int kv_head = t.head / p.head_chunks;
  int2 range;
  if constexpr (kPolicies != 0)
    range = bwd_general_m_blocks<Traits::kBlockM, Traits::kBlockN, kPolicies, /*kWarpScan=*/true>(p.attn, t.batch,
                                                                                                 kv_head, t.m_block);
  else
    range = bwd_m_block_range<Traits, kCausal>(p, t.m_block);
  const int per_head = range.y - range.x;
  const int head0 = kv_head * p.group + (t.head - kv_head * p.head_chunks) * p.heads;
  BwdWalk walk{head0, t.batch, t.m_block, range.x, per_head, per_head * p.heads, p.walk_down};
  if (bwd_skips_empty_steps<Traits, kPolicies>(p) && walk.num_steps > 0) {
    walk.first = bwd_next_step<Traits, kPolicies>(p, walk, -1);
    if (walk.first >= walk.num_steps) walk.num_steps = 0;  // no query head of the walk sees the block
  }
  return walk;
}

// The summaries of 32 consecutive steps of the walk, from which an MMA warp picks the step after
// the current one by a ballot: lane i holds step base + i's, base the current step rounded down to
// a multiple of 16, so that at least 16 steps after the current one are in it and nothing but the
// summaries stays live across a step. Between two steps in different halves the window slides by
// half its width, and only the steps that come in are read, after the step, so that the next
// step's GEMMs hide the read: most steps compute no summary address at all (one per lane and step,
// each with a division, would come before every step's first GEMM).
template <typename Traits>
struct BwdStepWindow {
  static constexpr int kWidth = 32, kHalf = kWidth / 2;
  static constexpr int kRowBlocks = Traits::kBlockM / kMaskTileRows;
  using Summaries = BwdStepSummaries<kRowBlocks>;
  Summaries mine{};  // step base_of(current) + lane's (none past the walk's end: empty)

  static __forceinline__ __device__ int base_of(int s) { return s & ~(kHalf - 1); }

  __forceinline__ __device__ void load(const BwdParams<Traits>& p, const BwdWalk& walk, int base, int lane) {
    mine = base + lane < walk.num_steps ? bwd_step_summaries(p, walk, walk.step(base + lane, p.heads)) : Summaries{};
  }
  // The first step after s whose summaries show a visible key, and its summaries in
  // `next_summaries`; past the window, the search goes on 32 steps per read (bwd_next_step), and
  // the step found is read by itself. walk.num_steps: none.
  template <int kPolicies>
  __forceinline__ __device__ int next(const BwdParams<Traits>& p, const BwdWalk& walk, int s,
                                      Summaries& next_summaries) const {
    const int base = base_of(s), after = s - base + 1;  // lanes from `after` on: the steps after s
    const unsigned seen = __ballot_sync(0xffffffffu, mine.seen()) & (~0u << after);
    if (seen != 0) {
      const int next_lane = __ffs(seen) - 1;
      next_summaries = mine.from_lane(next_lane);
      return base + next_lane;
    }
    const int found = min(bwd_next_step<Traits, kPolicies>(p, walk, base + kWidth - 1), walk.num_steps);
    if (found < walk.num_steps) next_summaries = bwd_step_summaries(p, walk, walk.step(found, p.heads));
    return found;
  }
  // From step s to step `next`: in the next half, the upper lanes' summaries move down and the
  // upper lanes read the steps that come in; further on (found past the window), every lane reads.
  __forceinline__ __device__ void advance(const BwdParams<Traits>& p, const BwdWalk& walk, int s, int next, int lane) {
    const int base = base_of(s), next_base = base_of(next);
    if (next_base == base || next >= walk.num_steps) return;
    if (next_base == base + kHalf) {
      CUTE_UNROLL
      for (int i = 0; i < kRowBlocks; ++i) mine.kinds[i] = __shfl_down_sync(0xffffffffu, mine.kinds[i], kHalf);
      if (lane >= kHalf) load(p, walk, next_base, lane);
    } else {
      load(p, walk, next_base, lane);
    }
  }
};

// Waits for the CTA's K and V, then runs body(k, the step, next_step, the Q/dO ring's read state)
// for every step of the walk (the k-th walked), advancing the ring after each; next_step() is the
// index of the step walked after it. With a mask's summaries to skip by, the MMA warps pick the
// next step from a window of the summaries of the steps ahead (BwdStepWindow), loaded ahead so that
// the ballot, after the body (or where it first asks), waits for no L2 read; the next step's
// summaries also tell it whether its tile is full (BwdStep::mask_full).
template <typename Traits, int kPolicies, typename Storage, typename Body>
__forceinline__ __device__ void bwd_for_each_step(const BwdParams<Traits>& p, Storage& ss, const BwdWalk& walk,
                                                  Body&& body) {
  ss.kv_full.wait(0);
  typename Traits::PipelineState read;
  // The step carried from one iteration to the next (BwdWalk::after) saves a division per step
  // but holds two more registers across it, which the dropout kernels, short of registers, pay for
  // more than the division (docs/performance.md): they recompute the step.
  constexpr bool kCarryStep = (kPolicies & kPolicyDropout) == 0;
  constexpr bool kMaskWalk = (kPolicies & kPolicyBoolMask) != 0;
  const bool skips = bwd_skips_empty_steps<Traits, kPolicies>(p);
  const int lane = int(threadIdx.x % 32);
  BwdStep st = walk.step(walk.first, p.heads);
  BwdStepWindow<Traits> window;
  typename BwdStepWindow<Traits>::Summaries current{};  // the step's own, when skipping
  if constexpr (kMaskWalk)
    if (skips && walk.first < walk.num_steps) {
      const int base = BwdStepWindow<Traits>::base_of(walk.first);
      window.load(p, walk, base, lane);
      current = window.mine.from_lane(walk.first - base);
    }
#pragma unroll 1
  for (int s = walk.first, k = 0; s < walk.num_steps; ++k) {
    if constexpr (!kCarryStep) st = walk.step(s, p.heads);
    st.mask_full = skips ? int(current.full(st.m_block, p.attn.mask.packed_mask.row_blocks)) : -1;
    int next = -1;
    typename BwdStepWindow<Traits>::Summaries next_summaries{};
    auto next_step = [&]() CUTLASS_LAMBDA_FUNC_INLINE {
      if (next < 0) {
        if constexpr (kMaskWalk)
          next = skips ? window.template next<kPolicies>(p, walk, s, next_summaries) : s + 1;
        else
          next = s + 1;
      }
      return next;
    };
    body(k, st, next_step, read);
    ++read;
    next_step();
    if constexpr (kCarryStep) st = next == s + 1 ? walk.after(st, p.heads) : walk.step(next, p.heads);
    if constexpr (kMaskWalk)
      if (skips && next < walk.num_steps) {
        current = next_summaries;
        window.advance(p, walk, s, next, lane);
      }
    s = next;
  }
}

// Offset of the row statistics (and, times H, of the dQ accumulator) of query block m_block.
template <typename Traits>
__forceinline__ __device__ int64_t bwd_row_offset(const AttentionParams& p, int batch, int head, int m_block) {
  return (int64_t(batch) * p.N + head) * p.dq_accum_rows() + int64_t(m_block) * Traits::kBlockM;
}

// Floats per copy ("lane", params.h: kDqLanes) of the dQ accumulator of a kernel of head dim
// kHeadDim.
template <int kHeadDim>
__forceinline__ __host__ __device__ int64_t bwd_dq_lane_floats(const AttentionParams& p) {
  return p.B * p.N * p.dq_accum_rows() * kHeadDim;
}

// A warpgroup's share of the dK (which = 0) or dV (1) partial sums of key block n_block in the
// workspace (params.h: dkv_accum), in atomic_add_share's order; the warpgroups' shares follow one
// another.
template <typename Traits>
__forceinline__ __device__ float* bwd_dkv_share(const AttentionParams& p, int which, int batch, int kv_head,
                                                int n_block, int w) {
  constexpr int kShareFloats = Traits::kBlockN * Traits::kHeadDim / Traits::kNumMmaWarpGroups;
  return p.dkv_accum + ((int64_t(which) * p.B + batch) * p.K + kv_head) * p.dkv_accum_rows() * Traits::kHeadDim +
         int64_t(n_block) * Traits::kBlockN * Traits::kHeadDim + w * kShareFloats;
}

}  // namespace jfa::sm90
