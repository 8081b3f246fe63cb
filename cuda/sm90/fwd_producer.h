// The Hopper forward's producer warp: per tile, Q once and K, V through a kStages-deep smem ring
// guarded by full/empty mbarriers (PipelineTmaAsync); and the handoff of the next tile.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "fwd_params.h"
#include "fwd_traits.h"
#include "named_barriers.h"
#include "paged_kv.h"
#include "tile_scheduler.h"

namespace jfa::sm90 {

using namespace cute;

// Warp 0 of the producer warpgroup: all its lanes take part in the tile meetings, lane 0 issues the
// loads (PipelineTmaAsync's is_leader). Key blocks are loaded from the last one down, as the
// consumers walk them.
template <typename Traits, bool kCausal, int kPolicies, typename Storage, typename Scheduler>
__forceinline__ __device__ void fwd_produce(const FwdParams<Traits>& p, const Scheduler& sched, Storage& ss,
                                            typename Traits::Pipeline& pipeline_k,
                                            typename Traits::Pipeline& pipeline_v) {
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename Traits::PipelineState;
  using Walk = FwdBlockWalk<Traits, kPolicies>;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  const bool leader = threadIdx.x == 0;
  // K and V tiles are partitioned once per tile and indexed by key block.
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutK{});
  Tensor mK = p.tma_k.get_tma_tensor(p.shape_kv);
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutV{});
  Tensor mV = p.tma_v.get_tma_tensor(p.shape_kv);
  PipelineState write = cutlass::make_producer_start_state<Pipeline>();
  TileWork work = fwd_tile_work<Traits, kCausal, kPolicies>(p, sched, blockIdx.x);
  for (int iter = 0; work.tile < p.num_tiles; ++iter) {
    const TileCoord t = work.coord;
    Walk walk(fwd_tile_summaries<Traits, kPolicies>(p.attn, t), work);
    const int kv_head = t.head / p.group;
    Tensor gK = local_tile(mK(_, _, kv_head, t.batch), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
    Tensor gV = local_tile(mV(_, _, kv_head, t.batch), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
    // Named tensors, not structured bindings: the loaders below capture them, which C++17 forbids for bindings.
    auto k_parts = tma_partition(p.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto v_parts = tma_partition(p.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    auto const& tKgK = get<0>(k_parts);
    auto const& tKsK = get<1>(k_parts);
    auto const& tVgV = get<0>(v_parts);
    auto const& tVsV = get<1>(v_parts);

    auto load = [&](auto& pipeline, auto const& tma, auto const& narrow, auto const& wide, auto const& m,
                    auto const& s, auto const& tg, auto const& ts, int n, PipelineState const& st) {
      pipeline.producer_acquire(st);
      uint64_t& bar = *pipeline.producer_get_barrier(st);
      if constexpr (reads_pages<Traits, kPolicies>())
        if (p.attn.paged.present())
          return load_paged_block<kBlockN, kHeadDim>(p.attn.paged, tma, narrow, wide, m, p.shape_kv,
                                                     s(_, _, st.index()), t.batch, kv_head, n, bar);
      if (leader) copy(tma.with(bar), tg(_, n), ts(_, st.index()));
    };
    // K of block n, with the block's facts for the consumers on the mask's kernels (written before
    // the stage's acquire: block_info_slot).
    auto load_k = [&](int n, bool partial, int next, PipelineState const& st) {
      if constexpr (Walk::kMask)
        if (leader) hand_block(ss, st, n, partial, walk.visits(next));
      load(pipeline_k, p.tma_k, p.tma_k_narrow, p.tma_k_wide, mK, sK, tKgK, tKsK, n, st);
    };
    auto load_v = [&](int n, PipelineState const& st) {
      load(pipeline_v, p.tma_v, p.tma_v_narrow, p.tma_v_wide, mV, sV, tVgV, tVsV, n, st);
    };
    // The walk runs a block ahead of the loads: a K stage says whether another block follows.
    int n = work.n_end - 1;
    const bool first_partial = walk.partial(n);
    int prev = walk.prev(n);
    // The first K goes out before waiting for the consumers to free Q: it overlaps their epilogue.
    load_k(n, first_partial, prev, write);
    if (iter > 0) ss.q_empty.wait((iter - 1) & 1);
    if (leader) {
      ss.q_full.arrive_and_expect_tx(Traits::kQBytes);
      tma_load_tile<kBlockM, kHeadDim>(p.tma_q, p.tma_q.get_tma_tensor(p.shape_q), t.head, t.batch, t.m_block,
                                       make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQ{}),
                                       reinterpret_cast<uint64_t&>(ss.q_full));
    }
    // K of block n-1 goes out before V of block n: the consumers need it first (Q·K[n-1]ᵀ is
    // issued before P·V[n]), and V[n]'s slot frees later (when P·V[n-2] has finished).
    auto load_step = [&] {
      const bool partial = walk.partial(prev);  // before the walk moves past prev's window
      const int next = walk.prev(prev);
      PipelineState write_v = write;
      ++write;
      load_k(prev, partial, next, write);
      load_v(n, write_v);
      n = prev;
      prev = next;
    };
    // The first step's slots free during the previous tile: its loads go out before the meetings
    // below, which last until the consumers start this tile (a tile of one block: its V).
    const bool one_block = !walk.visits(prev);
    if (one_block) {
      load_v(n, write);
      ++write;
    } else {
      load_step();
    }
    // Consumer 0 leads the ping-pong, so it is met first.
    for (int w = 0; w < Traits::kNumMmaWarpGroups; ++w) fwd_tile_meeting(w);
    // The next tile: claimed, worked out and handed to the consumers, who read it after the next
    // meeting; here its claim's round trip and block range run while the consumers compute this
    // tile's first block.
    {
      const TileWork next =
          fwd_tile_work<Traits, kCausal, kPolicies>(p, sched, __shfl_sync(0xffffffffu, leader ? sched.next(work.tile) : 0, 0));
      if (leader) publish_work(ss.next_work[(iter + 1) & 1], next);
    }
    if (!one_block) {
#pragma unroll 1
      while (walk.visits(prev)) load_step();
      load_v(n, write);
      ++write;
    }
    // Read back rather than kept in registers through the loop (the producer has 24); lane 0
    // wrote it, no meeting since.
    __syncwarp();
    work = announced_work(ss.next_work[(iter + 1) & 1]);
  }
  // One more meeting per consumer, where they read that no tile is left.
  for (int w = 0; w < Traits::kNumMmaWarpGroups; ++w) fwd_tile_meeting(w);
  // Do not exit while a consumer may still arrive on a barrier of this CTA.
  pipeline_k.producer_tail(write);
  pipeline_v.producer_tail(write);
}

}  // namespace jfa::sm90
