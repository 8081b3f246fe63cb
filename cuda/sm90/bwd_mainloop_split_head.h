// The Hopper backward's MMA warpgroups for wide heads (BwdTraitsSplitHead, H 256): the steps of
// one 64-key block, the head dim of dK, dV and dQ split over the two warpgroups.
//
// One step, per warpgroup w (its 32 of the keys for S and dP, its 128 of the head dims for the rest):
//   issue S = Q·Kᵀ, then dP = dO·Vᵀ; wait for S: mask, P = exp2(S·scale·log2 e − LSE·log2 e);
//   wait for dP: dS = P∘(dP − D); store P and dS to smem; meet the other warpgroup (every key's P
//   and dS are in smem);
//   issue dVᵀ += dOᵀ·P, dQ = dS·K, dKᵀ += Qᵀ·dS; wait for dV and dQ (dO's stage is free);
//   add dQ into the global accumulator (16-byte atomics; deterministic=True: in key-block order,
//   bwd_dq_order.h; on the plain path once the turn keeper warp has seen the turn come); wait for
//   dK (Q's stage is free).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "bwd_dq_order.h"
#include "bwd_general.h"
#include "bwd_params.h"
#include "bwd_traits.h"
#include "named_barriers.h"
#include "utils.h"

namespace jfa::sm90 {

using namespace cute;

// Runs every step of the CTA's walk (at least one); dKᵀ (unscaled) and dVᵀ accumulate in the
// given fragments. kPolicies: the plain path (0) or the general one (bwd_general.h).
template <typename Traits, bool kCausal, int kPolicies, typename AccKV>
__forceinline__ __device__ void bwd_mainloop_split_head(const BwdParams<Traits>& p, BwdSharedStorage<Traits>& ss,
                                                        typename Traits::Pipeline& pipeline_q,
                                                        typename Traits::Pipeline& pipeline_do,
                                                        const BwdWalk& walk, AccKV& tdKrdK, AccKV& tdVrdV) {
  using Element = typename Traits::Element;
  using PipelineState = typename Traits::PipelineState;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  const int tid = threadIdx.x - 128;
  const int w = mma_warp_group(), wg_tid = tid % 128;

  typename Traits::TiledMmaSdP mma_sdp;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  Tensor tSrQ = thr_sdp.partition_fragment_A(make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQ{}));
  Tensor tSrK = thr_sdp.partition_fragment_B(make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutK{}));
  Tensor tdPrdO = thr_sdp.partition_fragment_A(make_tensor(make_smem_ptr(ss.dout.data()), typename Traits::SmemLayoutdO{}));
  Tensor tdPrV = thr_sdp.partition_fragment_B(make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutV{}));
  // dKᵀ and dVᵀ: A = Qᵀ, dOᵀ (H, queries); B = dS, P as (keys, queries).
  typename Traits::TiledMmadKV mma_dkv;
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  Tensor tdVrdOt = thr_dkv.partition_fragment_A(make_tensor(make_smem_ptr(ss.dout.data()), typename Traits::SmemLayoutdOt{}));
  Tensor tdKrQt = thr_dkv.partition_fragment_A(make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQt{}));
  Tensor tdVrPt = thr_dkv.partition_fragment_B(make_tensor(make_smem_ptr(ss.step.p.data()), typename Traits::SmemLayoutPdSt{}));
  Tensor tdKrdSt = thr_dkv.partition_fragment_B(make_tensor(make_smem_ptr(ss.step.ds.data()), typename Traits::SmemLayoutPdSt{}));
  typename Traits::TiledMmadQ mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(tid);
  Tensor tdQrdS = thr_dq.partition_fragment_A(make_tensor(make_smem_ptr(ss.step.ds.data()), typename Traits::SmemLayoutPdS{}));
  Tensor tdQrKt = thr_dq.partition_fragment_B(make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutKt{}));

  auto copy_pds = make_tiled_copy_C(typename Traits::SmemCopyAtomPdS{}, mma_sdp);
  auto thr_copy_pds = copy_pds.get_thread_slice(tid);
  Tensor tPsP = thr_copy_pds.partition_D(make_tensor(make_smem_ptr(ss.step.p.data()), typename Traits::SmemLayoutPdS{}));
  Tensor tdSsdS = thr_copy_pds.partition_D(make_tensor(make_smem_ptr(ss.step.ds.data()), typename Traits::SmemLayoutPdS{}));

  // This thread's (query, key) coordinates in the S accumulator.
  Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor cS_rc = make_tensor(cS.data(), acc_rowcol(cS.layout()));
  const BwdGeneralBlock block = bwd_block<kPolicies, kBlockN>(p.attn, walk.batch, walk.n_block);
  // Dropout: the keep bits of the step at hand, made during the last GEMM of the step before.
  constexpr bool kDropout = (kPolicies & kPolicyDropout) != 0;
  auto keep_bits_of = [&](int s) {
    const BwdStep st = walk.step(s, p.heads);
    return bwd_keep_bits</*kQueriesInColumns=*/false>(block, st.head, st.m_block, kBlockM, cS_rc);
  };
  decltype(keep_bits_of(0)) keep{};
  if constexpr (kDropout) keep = keep_bits_of(walk.first);

  bwd_for_each_step<Traits, kPolicies>(p, ss, walk, [&](int k, const BwdStep& st, auto&& next_step, const PipelineState& read)
                                                       CUTLASS_LAMBDA_FUNC_INLINE {
    const int stage = read.index();
    Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});  // P after this
    Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});  // dS after this
    bwd_step<Traits, kCausal, kPolicies, /*kQueriesInColumns=*/false>(
        mma_sdp, pipeline_q, pipeline_do, read, tSrQ(_, _, _, stage), tSrK, tdPrdO(_, _, _, stage), tdPrV, tSrS,
        tdPrdP, cS_rc, ss.lse_log2[stage], ss.d[stage], p.attn, block, st.head, st.m_block, st.mask_full, keep,
        ss.slope_sums[k & 1]);

    Tensor rP = make_tensor<Element>(tSrS.layout());
    Tensor rdS = make_tensor<Element>(tdPrdP.layout());
    convert(tSrS, rP);
    convert(tdPrdP, rdS);
    copy(copy_pds, thr_copy_pds.retile_S(rP), tPsP(_, _, _, stage));
    copy(copy_pds, thr_copy_pds.retile_S(rdS), tdSsdS(_, _, _, stage));
    cutlass::arch::fence_view_async_shared();  // P and dS visible to wgmma (the async proxy)
    bar_sync(kBwdBarDsReady, Traits::kNumMmaThreads);
    if ((kPolicies & kPolicyAlibi) != 0 && p.attn.mask.dslopes != nullptr)  // the block's 64 keys are one slot
      bwd_add_slope_dot<8>(p.attn, ss.slope_sums[k & 1], tid, walk.batch, st.head, block.key0);
    gemm</*zero_init=*/false, /*wait=*/-1>(mma_dkv, tdVrdOt(_, _, _, stage), tdVrPt(_, _, _, stage), tdVrdV);
    Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    gemm</*zero_init=*/true, /*wait=*/-1>(mma_dq, tdQrdS(_, _, _, stage), tdQrKt, tdQrdQ);
    gemm</*zero_init=*/false, /*wait=*/1>(mma_dkv, tdKrQt(_, _, _, stage), tdKrdSt(_, _, _, stage), tdKrdK);
    pipeline_do.consumer_release(read);  // dP and dV have read dO
    constexpr int kLanes = bwd_dq_lanes<Traits, kPolicies>();
    const int lane = bwd_dq_lane<kLanes>(p.attn, walk.n_block);
    float* dq = p.attn.dq_accum + lane * bwd_dq_lane_floats<kHeadDim>(p.attn) +
                bwd_row_offset<Traits>(p.attn, walk.batch, st.head, st.m_block) * kHeadDim;
    // deterministic=True: this key block's turn at the query block first. On the plain path the
    // turn keeper warp (bwd_keep_dq_turns) has seen it come, and passes it on once the adds are
    // issued; the general path's kernels wait for it themselves (bwd_keeps_dq_turns).
    int32_t* semaphore = nullptr;
    if (p.attn.deterministic) {
      if constexpr (bwd_keeps_dq_turns<Traits, kPolicies>()) {
        bar_sync(kBwdBarDqTurn, kBwdDqTurnThreads<Traits>);
      } else {
        semaphore = bwd_dq_semaphore<kBlockM>(p.attn, lane, walk.batch, st.head, st.m_block);
        if (tid < 32) {
          const int turn = bwd_dq_turn<kBlockM, kBlockN, kPolicies, kLanes>(p.attn, walk.batch, walk.kv_head(p.group),
                                                                            walk.n_block, st.m_block);
          if (tid == 0) bwd_dq_wait_turn(semaphore, turn);
        }
        bar_sync(kBwdBarDqTurn, Traits::kNumMmaThreads);
      }
    }
    atomic_add_share(tdQrdQ, dq + w * Traits::kDqSliceFloats, wg_tid);
    if (p.attn.deterministic) {
      if constexpr (bwd_keeps_dq_turns<Traits, kPolicies>()) {
        bar_arrive(kBwdBarDqAdded, kBwdDqTurnThreads<Traits>);
      } else {
        __threadfence();
        bar_sync(kBwdBarDqTurn, Traits::kNumMmaThreads);
        if (tid == 0) bwd_dq_fence_and_pass_turn(semaphore);
      }
    }
    if constexpr (kDropout)
      if (const int next = next_step(); next < walk.num_steps) keep = keep_bits_of(next);  // while dK's GEMM runs
    warpgroup_wait<0>();
    pipeline_q.consumer_release(read);
  });
}

}  // namespace jfa::sm90
