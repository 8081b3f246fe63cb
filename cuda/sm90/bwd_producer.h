// The Hopper backward's producer warpgroup: warp 0 loads, warp 1 adds the dQ partial sums.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "bwd_params.h"
#include "bwd_traits.h"
#include "named_barriers.h"
#include "tma.h"

namespace jfa::sm90 {

using namespace cute;

// Warp 0: K and V of the key block once, then per step the query block's Q with its LSE·log2 e
// rows and its dO with its D rows, each pair on one mbarrier of a 2-stage ring (the Q of step
// s + 1 goes out right after the dO of step s, as the consumers need them). All lanes wait on the
// ring, lane 0 issues the copies. Returns the ring's write state after the last step.
template <typename Traits>
__forceinline__ __device__ void bwd_load(const BwdParams<Traits>& p, BwdSharedStorage<Traits>& ss,
                                         typename Traits::Pipeline& pipeline_q, typename Traits::Pipeline& pipeline_do,
                                         const BwdWalk& walk) {
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename Traits::PipelineState;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  const bool leader = threadIdx.x == 0;
  PipelineState write = cutlass::make_producer_start_state<Pipeline>();
  if (walk.num_steps > 0) {
    Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename Traits::SmemLayoutdO{});
    Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutV{});
    Tensor mQ = p.tma_q.get_tma_tensor(p.shape_q);
    Tensor mdO = p.tma_do.get_tma_tensor(p.shape_q);
    Tensor mK = p.tma_k.get_tma_tensor(p.shape_kv);
    Tensor mV = p.tma_v.get_tma_tensor(p.shape_kv);
    const auto tile_q = Shape<Int<kBlockM>, Int<kHeadDim>>{};
    const auto tile_kv = Shape<Int<kBlockN>, Int<kHeadDim>>{};

    auto load_rows = [&](auto const& tma, auto& gmem, auto& smem, Pipeline& pipeline, const float* stats,
                         float* stats_smem, BwdStep st) CUTLASS_LAMBDA_FUNC_INLINE {
      pipeline.producer_acquire(write);
      if (leader) {
        Tensor g = local_tile(gmem(_, _, st.head, walk.batch), tile_q, make_coord(st.m_block, _0{}));
        auto [tg, ts] = tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(smem(_, _, write.index())),
                                      group_modes<0, 2>(g));
        uint64_t* bar = pipeline.producer_get_barrier(write);
        copy(tma.with(*bar), tg, ts);
        bulk_load(stats_smem, stats + bwd_row_offset<Traits>(p.attn, walk.batch, st.head, st.m_block),
                  Traits::kRowStatsBytes, *bar);
      }
    };
    const BwdStep first = walk.step(0, p.group);
    load_rows(p.tma_q, mQ, sQ, pipeline_q, p.attn.lse_log2, ss.lse_log2[write.index()], first);
    if (leader) {
      ss.kv_full.arrive_and_expect_tx(2 * Traits::kKVBytes);
      Tensor gK = local_tile(mK(_, _, walk.kv_head, walk.batch), tile_kv, make_coord(walk.n_block, _0{}));
      Tensor gV = local_tile(mV(_, _, walk.kv_head, walk.batch), tile_kv, make_coord(walk.n_block, _0{}));
      auto [tKg, tKs] = tma_partition(p.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto [tVg, tVs] = tma_partition(p.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
      copy(p.tma_k.with(reinterpret_cast<uint64_t&>(ss.kv_full)), tKg, tKs);
      copy(p.tma_v.with(reinterpret_cast<uint64_t&>(ss.kv_full)), tVg, tVs);
    }
#pragma unroll 1
    for (int s = 0; s < walk.num_steps; ++s) {
      const BwdStep st = walk.step(s, p.group);
      load_rows(p.tma_do, mdO, sdO, pipeline_do, p.attn.softmax_d, ss.d[write.index()], st);
      ++write;
      if (s + 1 < walk.num_steps)
        load_rows(p.tma_q, mQ, sQ, pipeline_q, p.attn.lse_log2, ss.lse_log2[write.index()], walk.step(s + 1, p.group));
    }
  }
  // Do not exit while a consumer may still arrive on a barrier of this CTA.
  pipeline_q.producer_tail(write);
  pipeline_do.producer_tail(write);
}

// Warp 1: per step, each MMA warpgroup's dQ share (staged in smem as float32) added into the
// global accumulator with one bulk reduction, performed in L2. Handshake per warpgroup w: it fills
// its slice and arrives at dQ-full; this warp waits there, issues the add, and once the add has
// read the slice arrives at dQ-empty, where w waits before its next fill (not after the last step:
// every arrival has its wait).
template <typename Traits>
__forceinline__ __device__ void bwd_store_dq(const BwdParams<Traits>& p, BwdSharedStorage<Traits>& ss,
                                             const BwdWalk& walk) {
  static_assert(Traits::kNumMmaWarpGroups == 2);
  const bool leader = threadIdx.x % 32 == 0;
  constexpr int kHandshake = 128 + 32;
#pragma unroll 1
  for (int s = 0; s < walk.num_steps; ++s) {
    const BwdStep st = walk.step(s, p.group);
    float* dq = p.attn.dq_accum + bwd_row_offset<Traits>(p.attn, walk.batch, st.head, st.m_block) * Traits::kHeadDim;
    CUTE_UNROLL
    for (int w = 0; w < 2; ++w) {
      bar_sync(kBwdBarDqFullFirst + w, kHandshake);
      if (leader) {
        bulk_reduce_add(dq + w * Traits::kDqSliceFloats, ss.dq[w], Traits::kDqSliceBytes);
        bulk_commit();
      }
    }
    if (s + 1 < walk.num_steps) {
      if (leader) bulk_wait_read<1>();
      __syncwarp();
      bar_arrive(kBwdBarDqEmptyFirst + 0, kHandshake);
      if (leader) bulk_wait_read<0>();
      __syncwarp();
      bar_arrive(kBwdBarDqEmptyFirst + 1, kHandshake);
    }
  }
  // The adds are complete before the CTA ends (the dQ conversion reads them next).
  if (leader) bulk_wait_all();
}

}  // namespace jfa::sm90
