// The Hopper backward's epilogue: dK (times the softmax scale) and dV of the CTA's key block, to
// the input dtype, staged in the Q and dO buffers and stored by TMA, each MMA warpgroup its own
// 64 keys (rows past S are clipped by TMA). A key block that no query sees stores zeros.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "bwd_params.h"
#include "bwd_traits.h"
#include "named_barriers.h"
#include "tma.h"
#include "utils.h"

namespace jfa::sm90 {

using namespace cute;

template <typename Traits, typename AccKV>
__forceinline__ __device__ void bwd_epilogue(const BwdParams<Traits>& p, BwdSharedStorage<Traits>& ss,
                                             const BwdWalk& walk, AccKV& tdKrdK, AccKV const& tdVrdV) {
  using Element = typename Traits::Element;
  constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  const int tid = threadIdx.x - 128;
  const int w = tid / 128, wg_tid = tid % 128;
  CUTE_UNROLL
  for (int i = 0; i < size(tdKrdK); ++i) tdKrdK(i) *= p.attn.scale;
  Tensor rdK = make_tensor<Element>(tdKrdK.layout());
  Tensor rdV = make_tensor<Element>(tdVrdV.layout());
  convert(tdKrdK, rdK);
  convert(tdVrdV, rdV);

  // Both warpgroups' last GEMMs, which read every row of Q and dO, have finished.
  bar_sync(kBwdBarMainloopDone, Traits::kNumMmaThreads);
  Tensor sdK = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutK{});
  Tensor sdV = make_tensor(make_smem_ptr(ss.dout.data()), typename Traits::SmemLayoutV{});
  typename Traits::TiledMmadKV mma_dkv;
  auto copy_kv = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_dkv);
  auto thr_copy_kv = copy_kv.get_thread_slice(tid);
  copy(copy_kv, thr_copy_kv.retile_S(rdK), thr_copy_kv.partition_D(sdK));
  copy(copy_kv, thr_copy_kv.retile_S(rdV), thr_copy_kv.partition_D(sdV));
  cutlass::arch::fence_view_async_shared();  // visible to TMA
  bar_sync(kBwdBarEpilogueFirst + w, 128);
  if (wg_tid == 0) {
    Tensor mdK = p.tma_dk.get_tma_tensor(p.shape_kv);
    Tensor mdV = p.tma_dv.get_tma_tensor(p.shape_kv);
    const int row_block = walk.n_block * Traits::kNumMmaWarpGroups + w;
    tma_store_rows<kBlockN, kHeadDim>(p.tma_dk, mdK(_, _, walk.kv_head, walk.batch), ss.q.data(), w, row_block);
    tma_store_rows<kBlockN, kHeadDim>(p.tma_dv, mdV(_, _, walk.kv_head, walk.batch), ss.dout.data(), w, row_block);
    tma_store_arrive();
    tma_store_wait<0>();
  }
}

}  // namespace jfa::sm90
