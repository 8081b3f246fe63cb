// The Hopper backward's MMA warpgroups: the steps of one key block (bwd_traits.h has the GEMMs).
//
// One step, per warpgroup (its 64 keys against the step's kBlockM queries):
//   issue Sᵀ = K·Qᵀ, then dPᵀ = V·dOᵀ; wait for Sᵀ: mask, P = exp2(S·scale·log2 e − LSE·log2 e);
//   wait for dPᵀ: dS = P∘(dP − D); store dSᵀ to smem (transposed: dS);
//   issue dV += Pᵀ·dO (A from registers); meet the other warpgroup (its dS is in smem);
//   issue dQ = dS·K; wait for dV (dO's stage is free); issue dK += dSᵀ·Q; wait for dQ;
//   stage dQ in smem for the dQ writer warp; wait for dK (Q's stage is free).
// The two warpgroups run in lockstep (dQ needs both halves of dS), so there is no ping-pong: the
// overlap is between a step's GEMMs and its own element-wise work.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "bwd_general.h"
#include "bwd_params.h"
#include "bwd_traits.h"
#include "named_barriers.h"
#include "utils.h"

namespace jfa::sm90 {

using namespace cute;

// This warpgroup's dQ share (the dQ accumulator, unscaled) into its smem slice for the dQ writer
// warp, in the order of BwdTraits::kDqSliceFloats' comment. After the first step it first waits
// until the writer's add has read the slice.
template <typename Acc>
__forceinline__ __device__ void bwd_stage_dq(Acc const& acc, float* slice, int w, int wg_tid, bool first_step) {
  constexpr int kHandshake = 128 + 32;
  constexpr int n = decltype(size(acc))::value;
  static_assert(n % 4 == 0);
  if (!first_step) bar_sync(kBwdBarDqEmptyFirst + w, kHandshake);
  CUTE_UNROLL
  for (int g = 0; g < n / 4; ++g)
    reinterpret_cast<float4*>(slice)[g * 128 + wg_tid] = make_float4(acc(4 * g), acc(4 * g + 1), acc(4 * g + 2), acc(4 * g + 3));
  cutlass::arch::fence_view_async_shared();  // visible to the bulk copy (the async proxy)
  bar_arrive(kBwdBarDqFullFirst + w, kHandshake);
}

// Runs every step of the CTA's walk (at least one); dK (unscaled) and dV accumulate in the given
// fragments. kPolicies: the plain path (0) or the general one (bwd_general.h).
template <typename Traits, bool kCausal, int kPolicies, typename AccKV>
__forceinline__ __device__ void bwd_mainloop(const BwdParams<Traits>& p, BwdSharedStorage<Traits>& ss,
                                             typename Traits::Pipeline& pipeline_q,
                                             typename Traits::Pipeline& pipeline_do, const BwdWalk& walk,
                                             AccKV& tdKrdK, AccKV& tdVrdV) {
  using Element = typename Traits::Element;
  using PipelineState = typename Traits::PipelineState;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  const int tid = threadIdx.x - 128;
  const int w = mma_warp_group(), wg_tid = tid % 128;

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename Traits::SmemLayoutdO{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutV{});
  Tensor sQt = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(ss.dout.data()), typename Traits::SmemLayoutdOt{});
  Tensor sKt = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutKt{});
  Tensor sdS = make_tensor(make_smem_ptr(ss.step.ds.data()), typename Traits::SmemLayoutdS{});
  Tensor sdSt = make_tensor(make_smem_ptr(ss.step.ds.data()), typename Traits::SmemLayoutdSt{});

  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmadKV mma_dkv;
  typename Traits::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  auto thr_dq = mma_dq.get_thread_slice(tid);
  Tensor tSrK = thr_sdp.partition_fragment_A(sK);       // (MMA, M, K)
  Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);       // (MMA, N, K, stage)
  Tensor tdPrV = thr_sdp.partition_fragment_A(sV);
  Tensor tdPrdO = thr_sdp.partition_fragment_B(sdO);
  Tensor tdVrdO = thr_dkv.partition_fragment_B(sdOt);  // (MMA, N = H, K = queries, stage)
  Tensor tdKrQ = thr_dkv.partition_fragment_B(sQt);
  // dQ = dS·K: dS (queries, keys, stage) the A operand, Kᵀ (H, keys) the B; for dQᵀ = Kᵀ·dSᵀ the other
  // way round.
  Tensor tdQrdS = [&] {
    if constexpr (Traits::kDqTransposed) return thr_dq.partition_fragment_B(sdS);
    else return thr_dq.partition_fragment_A(sdS);
  }();
  Tensor tdQrK = [&] {
    if constexpr (Traits::kDqTransposed) return thr_dq.partition_fragment_A(sKt);
    else return thr_dq.partition_fragment_B(sKt);
  }();

  auto copy_ds = make_tiled_copy_C(typename Traits::SmemCopyAtomdS{}, mma_sdp);
  auto thr_copy_ds = copy_ds.get_thread_slice(tid);
  Tensor tdSsdS = thr_copy_ds.partition_D(as_position_independent_swizzle_tensor(sdSt));  // (CPY, M, N, stage)

  // This thread's (key, query) coordinates in the Sᵀ accumulator.
  Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));
  Tensor cS_rc = make_tensor(cS.data(), acc_rowcol(cS.layout()));

  const BwdGeneralBlock block = bwd_block<kPolicies, kBlockN>(p.attn, walk.batch, walk.n_block);
  // Dropout: the keep bits of the step at hand, made during the last GEMM of the step before.
  constexpr bool kDropout = (kPolicies & kPolicyDropout) != 0;
  auto keep_bits_of = [&](int s) {
    const BwdStep st = walk.step(s, p.heads);
    return bwd_keep_bits</*kQueriesInColumns=*/true>(block, st.head, st.m_block, kBlockM, cS_rc);
  };
  decltype(keep_bits_of(0)) keep{};
  if constexpr (kDropout) keep = keep_bits_of(walk.first);

  bwd_for_each_step<Traits, kPolicies>(p, ss, walk, [&](int k, const BwdStep& st, auto&& next_step, const PipelineState& read)
                                                       CUTLASS_LAMBDA_FUNC_INLINE {
    const int stage = read.index();
    Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});  // Pᵀ after this
    Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});  // dSᵀ after this
    bwd_step<Traits, kCausal, kPolicies, /*kQueriesInColumns=*/true>(
        mma_sdp, pipeline_q, pipeline_do, read, tSrK, tSrQ(_, _, _, stage), tdPrV, tdPrdO(_, _, _, stage), tSrS,
        tdPrdP, cS_rc, ss.lse_log2[stage], ss.d[stage], p.attn, block, st.head, st.m_block, st.mask_full, keep,
        ss.slope_sums[k & 1]);

    Tensor rP = make_tensor<Element>(tSrS.layout());
    Tensor rdS = make_tensor<Element>(tdPrdP.layout());
    convert(tSrS, rP);
    convert(tdPrdP, rdS);
    copy(copy_ds, thr_copy_ds.retile_S(rdS), tdSsdS(_, _, _, stage));
    // dV += Pᵀ·dO, Pᵀ straight from the registers.
    Tensor tdVrP = make_tensor(rP.data(), acc_as_a_operand(tSrS.layout()));
    gemm</*zero_init=*/false, /*wait=*/-1>(mma_dkv, tdVrP, tdVrdO(_, _, _, stage), tdVrdV);
    cutlass::arch::fence_view_async_shared();  // dS visible to wgmma (the async proxy)
    bar_sync(kBwdBarDsReady, Traits::kNumMmaThreads);
    if ((kPolicies & kPolicyAlibi) != 0 && p.attn.mask.dslopes != nullptr)  // each warpgroup's keys are one slot
      bwd_add_slope_dot<4>(p.attn, ss.slope_sums[k & 1], tid, walk.batch, st.head, block.key0 + w * 64);
    Tensor tdQrdQ = partition_fragment_C(mma_dq, typename Traits::AccShapedQ{});
    if constexpr (Traits::kDqTransposed)
      gemm</*zero_init=*/true, /*wait=*/1>(mma_dq, tdQrK, tdQrdS(_, _, _, stage), tdQrdQ);  // dV has finished
    else
      gemm</*zero_init=*/true, /*wait=*/1>(mma_dq, tdQrdS(_, _, _, stage), tdQrK, tdQrdQ);
    pipeline_do.consumer_release(read);
    Tensor tdKrdS = make_tensor(rdS.data(), acc_as_a_operand(tdPrdP.layout()));
    gemm</*zero_init=*/false, /*wait=*/1>(mma_dkv, tdKrdS, tdKrQ(_, _, _, stage), tdKrdK);  // dQ has finished
    bwd_stage_dq(tdQrdQ, ss.step.dq[w], w, wg_tid, k == 0);
    if constexpr (kDropout)
      if (const int next = next_step(); next < walk.num_steps) keep = keep_bits_of(next);  // while dK's GEMM runs
    warpgroup_wait<0>();
    pipeline_q.consumer_release(read);
  });
}

}  // namespace jfa::sm90
