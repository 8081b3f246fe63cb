// The Hopper backward's producer warpgroup: warp 0 loads, warp 1 adds the dQ partial sums.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "bwd_dq_order.h"
#include "bwd_params.h"
#include "bwd_traits.h"
#include "named_barriers.h"
#include "tma.h"

namespace jfa::sm90 {

using namespace cute;

// Warp 0: K and V of the key block once, then per step the query block's Q with its LSE·log2 e
// rows and its dO with its D rows, each pair on one mbarrier of a 2-stage ring (the Q of the next
// step goes out right after the dO of this one, as the consumers need them). All lanes wait on the
// ring, lane 0 issues the copies.
template <typename Traits, int kPolicies>
__forceinline__ __device__ void bwd_load(const BwdParams<Traits>& p, BwdSharedStorage<Traits>& ss,
                                         typename Traits::Pipeline& pipeline_q, typename Traits::Pipeline& pipeline_do,
                                         const BwdWalk& walk) {
  using Element = typename Traits::Element;
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename Traits::PipelineState;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  const bool leader = threadIdx.x == 0;
  PipelineState write = cutlass::make_producer_start_state<Pipeline>();
  if (walk.num_steps > 0) {
    // A query block's tile (Q or dO) and its row statistics, on one barrier of `pipeline`'s ring.
    auto load_rows = [&](auto const& tma, auto const& layout, Element* smem, Pipeline& pipeline, const float* stats,
                         float* stats_smem, BwdStep st) CUTLASS_LAMBDA_FUNC_INLINE {
      pipeline.producer_acquire(write);
      if (leader) {
        uint64_t* bar = pipeline.producer_get_barrier(write);
        tma_load_tile<kBlockM, kHeadDim>(tma, tma.get_tma_tensor(p.shape_q), st.head, walk.batch, st.m_block,
                                         make_tensor(make_smem_ptr(smem), layout)(_, _, write.index()), *bar);
        bulk_load(stats_smem, stats + bwd_row_offset<Traits>(p.attn, walk.batch, st.head, st.m_block),
                  Traits::kRowStatsBytes, *bar);
      }
    };
    const typename Traits::SmemLayoutQ layout_q;
    const typename Traits::SmemLayoutdO layout_do;
    load_rows(p.tma_q, layout_q, ss.q.data(), pipeline_q, p.attn.lse_log2, ss.lse_log2[write.index()],
              walk.step(walk.first, p.heads));
    if (leader) {
      ss.kv_full.arrive_and_expect_tx(2 * Traits::kKVBytes);
      uint64_t& bar = reinterpret_cast<uint64_t&>(ss.kv_full);
      tma_load_tile<kBlockN, kHeadDim>(p.tma_k, p.tma_k.get_tma_tensor(p.shape_kv), walk.kv_head(p.group), walk.batch,
                                       walk.n_block, make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutK{}), bar);
      tma_load_tile<kBlockN, kHeadDim>(p.tma_v, p.tma_v.get_tma_tensor(p.shape_kv), walk.kv_head(p.group), walk.batch,
                                       walk.n_block, make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutV{}), bar);
    }
#pragma unroll 1
    for (int s = walk.first; s < walk.num_steps;) {
      const int next = bwd_next_step<Traits, kPolicies>(p, walk, s);
      load_rows(p.tma_do, layout_do, ss.dout.data(), pipeline_do, p.attn.softmax_d, ss.d[write.index()],
                walk.step(s, p.heads));
      ++write;
      if (next < walk.num_steps)
        load_rows(p.tma_q, layout_q, ss.q.data(), pipeline_q, p.attn.lse_log2, ss.lse_log2[write.index()],
                  walk.step(next, p.heads));
      s = next;
    }
  }
  // Do not exit while a consumer may still arrive on a barrier of this CTA.
  pipeline_q.producer_tail(write);
  pipeline_do.producer_tail(write);
}

// The split-head layout's plain path (bwd_keeps_dq_turns) with deterministic=True: warp 1 keeps
// the turns of the MMA threads' own dQ adds, so that the waits and the release, each a round trip
// to L2, leave the MMA threads' path. Per step it waits for the key block's turn at the query
// block and says so (kBwdBarDqTurn); the MMA threads add and arrive at kBwdBarDqAdded, where this
// warp waits before it passes the turn on. The release is cumulative: the adds the barrier ordered
// before it are visible to the CTA that acquires the turn next, with no fence in the MMA threads.
template <typename Traits, int kPolicies>
__forceinline__ __device__ void bwd_keep_dq_turns(const BwdParams<Traits>& p, const BwdWalk& walk) {
  static_assert(bwd_keeps_dq_turns<Traits, kPolicies>());
  const bool leader = threadIdx.x % 32 == 0;
  constexpr int kLanes = bwd_dq_lanes<Traits, kPolicies>();
  const int lane = bwd_dq_lane<kLanes>(p.attn, walk.n_block);
#pragma unroll 1
  for (int s = walk.first; s < walk.num_steps;) {
    const int next = bwd_next_step<Traits, kPolicies>(p, walk, s);
    const BwdStep st = walk.step(s, p.heads);
    const int turn = bwd_dq_turn<Traits::kBlockM, Traits::kBlockN, kPolicies, kLanes>(
        p.attn, walk.batch, walk.kv_head(p.group), walk.n_block, st.m_block);
    int32_t* semaphore = bwd_dq_semaphore<Traits::kBlockM>(p.attn, lane, walk.batch, st.head, st.m_block);
    if (leader) bwd_dq_wait_turn(semaphore, turn);
    __syncwarp();
    bar_arrive(kBwdBarDqTurn, kBwdDqTurnThreads<Traits>);
    bar_sync(kBwdBarDqAdded, kBwdDqTurnThreads<Traits>);
    if (leader) bwd_dq_pass_turn(semaphore);
    __syncwarp();
    s = next;
  }
}

// Warp 1: per step, each MMA warpgroup's dQ share (staged in smem as float32) added into the
// global accumulator with one bulk reduction, performed in L2. Handshake per warpgroup w: it fills
// its slice and arrives at dQ-full; this warp waits there, issues the add, and once the add has
// read the slice arrives at dQ-empty, where w waits before its next fill (not after the last step:
// every arrival has its wait). deterministic=True: the adds of a query block in key-block order
// (bwd_dq_order.h), each complete before the next key block's.
template <typename Traits, int kPolicies>
__forceinline__ __device__ void bwd_store_dq(const BwdParams<Traits>& p, BwdSharedStorage<Traits>& ss,
                                             const BwdWalk& walk) {
  static_assert(Traits::kNumMmaWarpGroups == 2);
  const bool leader = threadIdx.x % 32 == 0;
  constexpr int kHandshake = 128 + 32;
  constexpr int kLanes = bwd_dq_lanes<Traits, kPolicies>();
  const int lane = bwd_dq_lane<kLanes>(p.attn, walk.n_block);
  float* const dq_lane = p.attn.dq_accum + lane * bwd_dq_lane_floats<Traits::kHeadDim>(p.attn);
#pragma unroll 1
  for (int s = walk.first; s < walk.num_steps;) {
    const int next = bwd_next_step<Traits, kPolicies>(p, walk, s);
    const BwdStep st = walk.step(s, p.heads);
    float* dq = dq_lane + bwd_row_offset<Traits>(p.attn, walk.batch, st.head, st.m_block) * Traits::kHeadDim;
    int32_t* semaphore = nullptr;
    if (p.attn.deterministic) {
      const int turn =
          bwd_dq_turn<Traits::kBlockM, Traits::kBlockN, kPolicies, kLanes>(p.attn, walk.batch, walk.kv_head(p.group), walk.n_block, st.m_block);
      semaphore = bwd_dq_semaphore<Traits::kBlockM>(p.attn, lane, walk.batch, st.head, st.m_block);
      if (leader) bwd_dq_wait_turn(semaphore, turn);
      __syncwarp();
    }
    CUTE_UNROLL
    for (int w = 0; w < 2; ++w) {
      bar_sync(kBwdBarDqFullFirst + w, kHandshake);
      if (leader) {
        bulk_reduce_add(dq + w * Traits::kDqSliceFloats, ss.step.dq[w], Traits::kDqSliceBytes);
        bulk_commit();
      }
    }
    if (p.attn.deterministic) {
      if (leader) {
        bulk_wait_all();  // the adds are complete, not only read
        bwd_dq_pass_turn(semaphore);
      }
      __syncwarp();
    }
    if (next < walk.num_steps) {
      if (leader) bulk_wait_read<1>();
      __syncwarp();
      bar_arrive(kBwdBarDqEmptyFirst + 0, kHandshake);
      if (leader) bulk_wait_read<0>();
      __syncwarp();
      bar_arrive(kBwdBarDqEmptyFirst + 1, kHandshake);
    }
    s = next;
  }
  // The adds are complete before the CTA ends (the dQ conversion reads them next).
  if (leader) bulk_wait_all();
}

}  // namespace jfa::sm90
