// attn_dist on Hopper: for each query position, selected slot and group of 64 query heads, the sum
// over the group of exp(scale·q·k − lse). Warpgroup 2 gathers as for the sparse forward
// (sparse_gatherer.h); consumer warpgroups 0 and 1 take the even and odd blocks of each pair of 64
// slots, each on its own: S = Q·Kᵀ over all 576 columns (sparse_logits.h), P against the rows'
// saved LSE, the 64 rows summed per slot (within a warp by shuffles, across the four warps through
// shared memory, in a fixed order) and added to the output row. The output is zeroed first; a group
// of 128 heads spans two CTAs, whose two adds commute exactly, so the result does not depend on
// their order.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "jfa/sparse_params.h"
#include "sm90/named_barriers.h"
#include "sm90/sparse_dist_traits.h"
#include "sm90/sparse_gatherer.h"
#include "sm90/sparse_logits.h"
#include "sm90/utils.h"

namespace jfa::sm90::sparse {

using namespace cute;

template <typename Traits>
struct DistConsumer : BlockLogits<Traits> {
  using Base = BlockLogits<Traits>;
  using Base::p, Base::tile, Base::smem, Base::wg, Base::tid, Base::s;
  using Base::valid_slots, Base::scale_and_mask, Base::fragment_column, Base::fragment_row;

  // This thread's two rows' LSE in log2 units; +inf for a row that saw no key, so that its
  // probabilities exp2(S − lse) are 0.
  float lse_log2[2];

  __forceinline__ __device__ DistConsumer(const SparseParams& p_, const SparseTile& tile_,
                                          typename Traits::SharedStorage& smem_, int wg_)
      : Base(p_, tile_, smem_, wg_) {
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      const float lse = p.lse[p.stat(tile.b, tile.t, tile.n0 + fragment_row(r, tid))];
      lse_log2[r] = lse == -INFINITY ? INFINITY : lse * kLog2e;
    }
  }

  // S (masked, log2 units) becomes P, 0 at the masked slots whatever the LSE holds; each warp's
  // sums over its 16 rows go to sums[warp][slot]. The eight lanes that hold a column (same
  // tid % 4) add theirs by shuffles.
  __forceinline__ __device__ void warp_column_sums(float (&sums)[4][Traits::kBlockKeys]) {
    CUTE_UNROLL
    for (int e = 0; e < size(s); ++e) s(e) = s(e) == -INFINITY ? 0.f : exp2f(s(e) - lse_log2[(e / 2) % 2]);
    CUTE_UNROLL
    for (int e = 0; e < size(s); e += 4) {
      float left = s(e) + s(e + 2), right = s(e + 1) + s(e + 3);  // columns c and c + 1, both rows
      CUTE_UNROLL
      for (int offset = 4; offset < 32; offset <<= 1) {
        left += __shfl_xor_sync(0xffffffffu, left, offset);
        right += __shfl_xor_sync(0xffffffffu, right, offset);
      }
      if (tid % 32 < 4) {
        sums[tid / 32][fragment_column(e, tid)] = left;
        sums[tid / 32][fragment_column(e + 1, tid)] = right;
      }
    }
  }

  __forceinline__ __device__ void run(int pairs) {
    const int64_t groups = p.N / p.head_group;
    float* dist = p.dist + ((tile.b * groups + tile.n0 / p.head_group) * p.T + tile.t) * p.topk;
    const int j = wg;  // this warpgroup's buffer of each pair
    int phase = 0;
    wait_gathered(smem.q_ready, 0);
    for (int pair = 0; pair < pairs; ++pair) {
      const int block = 2 * pair + wg;
      wait_gathered(smem.k_ready[j][0], phase);
      this->template issue_qk<0, 4>(j, true);
      wait_gathered(smem.k_ready[j][1], phase);
      this->template issue_qk<4, Traits::kTiles>(j, false);
      warpgroup_commit_batch();
      const uint32_t valid = valid_slots(j);
      warpgroup_wait<0>();
      smem.k_free[j][0].arrive();
      smem.k_free[j][1].arrive();
      scale_and_mask(valid);
      auto& sums = smem.column_sums[wg][pair % 2];
      warp_column_sums(sums);
      bar_sync(kSparseDistBarSumsFirst + wg, 128);
      const int64_t slot = int64_t(block) * Traits::kBlockKeys + tid;
      if (tid < Traits::kBlockKeys && slot < p.topk)
        atomicAdd(dist + slot, ((sums[0][tid] + sums[1][tid]) + sums[2][tid]) + sums[3][tid]);
      phase ^= 1;
    }
  }
};

template <typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1) sparse_dist_kernel(const __grid_constant__ SparseParams p) {
  extern __shared__ __align__(1024) unsigned char smem_bytes[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_bytes);
  init_gather_barriers(smem);
  const SparseTile tile(p);
  const int wg = cutlass::canonical_warp_group_idx();
  if (wg == 2) {
    gather_pairs<Traits>(p, tile, smem, pair_count<Traits>(p));
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    DistConsumer<Traits>(p, tile, smem, wg).run(pair_count<Traits>(p));
  }
}

}  // namespace jfa::sm90::sparse
