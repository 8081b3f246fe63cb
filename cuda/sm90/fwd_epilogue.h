// The Hopper forward's epilogue, per consumer warpgroup: the LSE of its rows straight from
// registers, and its 64 rows of O to bf16/fp16 in smem (stmatrix) and out through TMA (rows >= T
// are clipped by TMA). Per warpgroup, so that one warpgroup's epilogue runs while the other still
// computes (named_barriers.h).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "fwd_params.h"
#include "fwd_traits.h"
#include "named_barriers.h"
#include "tile_scheduler.h"
#include "tma.h"
#include "utils.h"

namespace jfa::sm90 {

using namespace cute;

template <typename Traits, typename Storage, typename MmaPV, typename OutCoords, typename AccO, int kRows>
__forceinline__ __device__ void fwd_epilogue(const FwdParams<Traits>& p, Storage& ss, MmaPV const& mma_pv,
                                             OutCoords const& cO_rc, const TileCoord& t, int tid, int w,
                                             AccO const& tOrO, const float (&lse)[kRows]) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim;
  const int wg_tid = tid % 128;
  const int m0 = t.m_block * kBlockM;
  if (get<1>(cO_rc(0, 0)) == 0) {
    float* lse_ptr = p.lse + t.batch * p.lse_batch + t.head * p.lse_head;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int row = m0 + get<0>(cO_rc(r, 0));
      if (row < p.T) lse_ptr[row * p.lse_row] = lse[r];
    }
  }
  Tensor rO = make_tensor<Element>(tOrO.layout());
  convert(tOrO, rO);
  Element* const smem_o = Traits::kOAliasesQ ? ss.q.data() : ss.o.data();
  Tensor sO = make_tensor(make_smem_ptr(smem_o), typename Traits::SmemLayoutO{});
  auto copy_o = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_pv);
  auto thr_copy_o = copy_o.get_thread_slice(tid);
  const int epilogue_bar = kFwdBarEpilogueFirst + w;
  if constexpr (!Traits::kOAliasesQ) {
    // This warpgroup's previous store must have read its rows of sO before they are overwritten.
    if (wg_tid == 0) tma_store_wait<0>();
    bar_sync(epilogue_bar, 128);
  }
  copy(copy_o, thr_copy_o.retile_S(rO), thr_copy_o.partition_D(sO));
  cutlass::arch::fence_view_async_shared();  // make the smem writes visible to TMA
  bar_sync(epilogue_bar, 128);
  if (wg_tid == 0) {
    Tensor mO = p.tma_o.get_tma_tensor(p.shape_q);
    tma_store_rows<kBlockM, kHeadDim>(p.tma_o, mO(_, _, t.head, t.batch), smem_o, w,
                                      t.m_block * Traits::kNumMmaWarpGroups + w);
    tma_store_arrive();
    if constexpr (Traits::kOAliasesQ) {
      tma_store_wait<0>();  // O lives in Q's smem: the next Q may load once the stores have read it
      ss.q_empty.arrive();
    }
  }
}

}  // namespace jfa::sm90
