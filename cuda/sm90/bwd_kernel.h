// Backward kernel for Hopper (sm90a): TMA loads, wgmma, warp specialization. A CTA per (key block,
// K/V head, batch), in the order of BwdTileOrder (tile_scheduler.h); it walks the query blocks that
// see its keys, for each query head of the K/V head's group, so that dK and dV are complete in
// registers at the end (GQA needs no reduction across CTAs).
//
// Roles. Warpgroup 0 is the producer, with its registers lowered by setmaxnreg: warp 0 loads
// (bwd_producer.h, bwd_load), warp 1 adds each step's dQ partial sums into the float32 accumulator
// (bwd_store_dq), or in the split-head layout's plain path with deterministic=True keeps the
// turns of the MMA threads' own adds (bwd_keep_dq_turns). Warpgroups 1 and 2 compute
// (bwd_mainloop.h: 64 keys each; for wide heads bwd_mainloop_split_head.h: half the head dims
// each, adding dQ themselves), then store dK and dV (bwd_epilogue.h). Around it:
// bwd_row_stats_kernel (D and LSE·log2 e per query row) before, and bwd_convert_dq_kernel
// (bwd_postprocess.h) after (bwd_launch.h).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "bwd_epilogue.h"
#include "bwd_mainloop.h"
#include "bwd_mainloop_split_head.h"
#include "bwd_params.h"
#include "bwd_producer.h"
#include "bwd_traits.h"
#include "tile_scheduler.h"

namespace jfa::sm90 {

using namespace cute;

// The key blocks' order: longest first (in L2 sections) for top-left causal calls and on the
// general path, whose masks (causal with either alignment, windows, lengths) make lengths differ.
template <bool kCausal, int kPolicies>
using BwdOrderOf = BwdTileOrder<kCausal || kPolicies != 0>;

// kPolicies: 0, the plain and top-left causal (kCausal) path; otherwise the general path with the
// features of that policy set (bwd_general.h, mask_policies.h's kBwd*Set; kCausal false).
template <typename Traits, bool kCausal, int kPolicies>
__global__ void __launch_bounds__(Traits::kNumThreads, 1)
    bwd_kernel(CUTE_GRID_CONSTANT BwdParams<Traits> const p, BwdOrderOf<kCausal, kPolicies> const order) {
  static_assert(!(kCausal && kPolicies != 0), "the general path takes causality from the call");
  using Pipeline = typename Traits::Pipeline;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& ss = *reinterpret_cast<BwdSharedStorage<Traits>*>(smem_raw);
  const int warp_group = cutlass::canonical_warp_group_idx();

  if (threadIdx.x == 0) ss.kv_full.init(1);
  typename Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = Traits::kQBytes + Traits::kRowStatsBytes;  // a tile and its rows' stats
  pipe_params.role = warp_group == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = Traits::kNumMmaThreads;
  Pipeline pipeline_q(ss.pipeline_q, pipe_params, Shape<_1, _1, _1>{});
  Pipeline pipeline_do(ss.pipeline_do, pipe_params, Shape<_1, _1, _1>{});
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  const BwdWalk walk = bwd_walk<Traits, kCausal, kPolicies>(p, order);
  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kLoadRegs>();
    const int warp = threadIdx.x / 32;
    if (warp == 0) bwd_load<Traits, kPolicies>(p, ss, pipeline_q, pipeline_do, walk);
    if (warp == 1) {
      if constexpr (!Traits::kSplitHead)
        bwd_store_dq<Traits, kPolicies>(p, ss, walk);
      else if constexpr (bwd_keeps_dq_turns<Traits, kPolicies>())  // (split-head: the MMA threads add)
        if (p.attn.deterministic) bwd_keep_dq_turns<Traits, kPolicies>(p, walk);
    }
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<Traits::kMmaRegs>();
  typename Traits::TiledMmadKV mma_dkv;
  Tensor tdKrdK = partition_fragment_C(mma_dkv, typename Traits::AccShapeKV{});
  Tensor tdVrdV = partition_fragment_C(mma_dkv, typename Traits::AccShapeKV{});
  clear(tdKrdK);
  clear(tdVrdV);
  if (walk.num_steps > 0) {
    if constexpr (Traits::kSplitHead)
      bwd_mainloop_split_head<Traits, kCausal, kPolicies>(p, ss, pipeline_q, pipeline_do, walk, tdKrdK, tdVrdV);
    else
      bwd_mainloop<Traits, kCausal, kPolicies>(p, ss, pipeline_q, pipeline_do, walk, tdKrdK, tdVrdV);
  }
  bwd_epilogue<Traits>(p, ss, walk, tdKrdK, tdVrdV);
}

}  // namespace jfa::sm90
