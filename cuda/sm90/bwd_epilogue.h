// The Hopper backward's epilogue: dK (times the softmax scale) and dV of the CTA's key block, to
// the input dtype, staged in the Q and dO buffers and stored by TMA (rows past S are clipped by
// TMA). A key block that no query sees stores zeros. Where the query heads of a GQA group run in
// CTAs of their own, each adds its partial dK and dV into the float32 workspace instead
// (bwd_convert_dkv_kernel stores them).
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
  const int w = mma_warp_group(), wg_tid = tid % 128;
  CUTE_UNROLL
  for (int i = 0; i < size(tdKrdK); ++i) tdKrdK(i) *= p.attn.scale;
  if (p.head_chunks > 1) {
    if (walk.num_steps == 0) return;  // the workspace starts at zero
    float* dk = bwd_dkv_share<Traits>(p.attn, 0, walk.batch, walk.kv_head(p.group), walk.n_block, w);
    atomic_add_share(tdKrdK, dk, wg_tid);
    atomic_add_share(tdVrdV, bwd_dkv_share<Traits>(p.attn, 1, walk.batch, walk.kv_head(p.group), walk.n_block, w), wg_tid);
    return;
  }
  Tensor rdK = make_tensor<Element>(tdKrdK.layout());
  Tensor rdV = make_tensor<Element>(tdVrdV.layout());
  convert(tdKrdK, rdK);
  convert(tdVrdV, rdV);

  // Both warpgroups' last GEMMs, which read every row of Q and dO, have finished.
  bar_sync(kBwdBarMainloopDone, Traits::kNumMmaThreads);
  typename Traits::TiledMmadKV mma_dkv;
  auto store = [&](auto const& tma, Element* smem, int w_rows, int row_block) {
    Tensor m = tma.get_tma_tensor(p.shape_kv);
    tma_store_rows<kBlockN, kHeadDim>(tma, m(_, _, walk.kv_head(p.group), walk.batch), smem, w_rows, row_block);
  };
  if constexpr (Traits::kSplitHead) {
    // The accumulators hold dKᵀ and dVᵀ (each warpgroup some head dims of every key): stored
    // transposed (stmatrix .trans) into the (keys, H) tiles, which the first thread stores once
    // every warpgroup has written its dims.
    auto copy_kv = make_tiled_copy_C(typename Traits::SmemCopyAtomdKV{}, mma_dkv);
    auto thr_copy_kv = copy_kv.get_thread_slice(tid);
    auto transposed = [](Element* smem) {
      return as_position_independent_swizzle_tensor(make_tensor(make_smem_ptr(smem), typename Traits::SmemLayoutKt{}));
    };
    copy(copy_kv, thr_copy_kv.retile_S(rdK), thr_copy_kv.partition_D(transposed(ss.q.data())));
    copy(copy_kv, thr_copy_kv.retile_S(rdV), thr_copy_kv.partition_D(transposed(ss.dout.data())));
    cutlass::arch::fence_view_async_shared();  // visible to TMA
    bar_sync(kBwdBarEpilogueFirst, Traits::kNumMmaThreads);
    if (tid == 0) {
      store(p.tma_dk, ss.q.data(), 0, walk.n_block);
      store(p.tma_dv, ss.dout.data(), 0, walk.n_block);
      tma_store_arrive();
      tma_store_wait<0>();
    }
  } else {
    // Each warpgroup holds dK and dV of its 64 keys and stores them itself.
    auto copy_kv = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_dkv);
    auto thr_copy_kv = copy_kv.get_thread_slice(tid);
    copy(copy_kv, thr_copy_kv.retile_S(rdK),
         thr_copy_kv.partition_D(make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutK{})));
    copy(copy_kv, thr_copy_kv.retile_S(rdV),
         thr_copy_kv.partition_D(make_tensor(make_smem_ptr(ss.dout.data()), typename Traits::SmemLayoutV{})));
    cutlass::arch::fence_view_async_shared();  // visible to TMA
    bar_sync(kBwdBarEpilogueFirst + w, 128);
    if (wg_tid == 0) {
      const int row_block = walk.n_block * Traits::kNumMmaWarpGroups + w;
      store(p.tma_dk, ss.q.data(), w, row_block);
      store(p.tma_dv, ss.dout.data(), w, row_block);
      tma_store_arrive();
      tma_store_wait<0>();
    }
  }
}

}  // namespace jfa::sm90
