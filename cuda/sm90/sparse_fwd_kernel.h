// Top-k sparse attention forward on Hopper: warpgroup 2 gathers the selected key rows with cp.async
// into the swizzled tiles wgmma reads (TMA has no row gather on sm90), and consumer warpgroups 0
// and 1 run the even and odd blocks of each pair of 64 slots (sparse_fwd_traits.h). Per pair:
//   both   S = Q·Kᵀ of its block (all 576 columns), invalid slots masked;
//   wg 0   softmax under its running max, publishes the max; O₀ += P₀·V₀ (its 256 columns);
//   wg 1   softmax under max(wg 0's, its own), publishes the joint max; O₁ += P₁·V₁;
//   wg 0   rescales P₀ and O₀ to the joint max, hands P₀ over; both add the other's P times
//          their columns of the other block's V.
// Each half of a block buffer (columns 0-255 and 256-575) is released by the one warpgroup that
// reads it last, so the gatherer refills a half while the other half is still in use.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "jfa/sparse_params.h"
#include "sm90/named_barriers.h"
#include "sm90/sparse_fwd_traits.h"
#include "sm90/sparse_gatherer.h"
#include "sm90/sparse_logits.h"
#include "sm90/utils.h"

namespace jfa::sm90::sparse {

using namespace cute;

inline constexpr float kLn2 = 0.6931471805599453f;
// The exponent base for a row max: a row that has seen no valid slot yet (max −inf) takes 0, so
// that exp2(−inf − base) is 0 rather than NaN, for any finite logit however large.
__forceinline__ __device__ float exp_base(float max) { return max == -INFINITY ? 0.f : max; }

// ---------------------------------------------------------------------------------------------
// Consumer warpgroups.

inline constexpr int kConsumerThreads = 256;  // both consumer warpgroups, at their meetings

template <typename Traits>
struct Consumer : BlockLogits<Traits> {
  using Base = BlockLogits<Traits>;
  using typename Base::Element;
  using typename Base::QkMma;
  using PvMmaOwnP = typename Traits::PvMmaOwnP;
  using PvMmaOtherP = typename Traits::PvMmaOtherP;
  template <int n>
  using RowTiles = typename Traits::template RowTiles<n>;
  template <int n>
  using ColumnTiles = typename Traits::template ColumnTiles<n>;
  using Base::p, Base::tile, Base::smem, Base::wg, Base::tid, Base::s;
  using Base::valid_slots, Base::scale_and_mask;
  using Base::fragment_column, Base::fragment_row;

  // wg 0 accumulates O's columns 0-255, wg 1 columns 256-511.
  decltype(partition_fragment_C(PvMmaOwnP{}, Shape<_64, _256>{})) o;
  decltype(make_tensor<Element>(partition_shape_A(PvMmaOwnP{}, Shape<_64, _64>{}))) p_regs;
  float row_max[2] = {-INFINITY, -INFINITY};  // log2 units (scale·log2(e)·q·k)
  float row_sum[2] = {0.f, 0.f};              // this thread's share, under row_max

  __forceinline__ __device__ Consumer(const SparseParams& p_, const SparseTile& tile_,
                                      typename Traits::SharedStorage& smem_, int wg_)
      : Base(p_, tile_, smem_, wg_) {
    clear(o);
  }

  // Issues O += P·V with P from registers and V = this warpgroup's columns of block buffer j.
  __forceinline__ __device__ void issue_pv_own(int j) {
    PvMmaOwnP mma;
    auto thr = mma.get_slice(tid);
    Tensor sv = make_tensor(make_smem_ptr(opaque(smem.k[j].data()) + wg * Traits::kHalfVTiles * 64 * 64),
                            ColumnTiles<Traits::kHalfVTiles>{});
    Tensor fv = thr.partition_fragment_B(sv);
    warpgroup_fence_operand(p_regs);
    warpgroup_fence_operand(o);
    warpgroup_arrive();
    mma.accumulate_ = GMMA::ScaleOut::One;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(p_regs); ++k) cute::gemm(mma, p_regs(_, _, k), fv(_, _, k), o);
    warpgroup_fence_operand(o);
    warpgroup_fence_operand(p_regs);
  }

  // Issues O += P'·V with the other warpgroup's P' from shared memory and block buffer j's columns.
  __forceinline__ __device__ void issue_pv_other(Element* other_p, int j) {
    PvMmaOtherP mma;
    auto thr = mma.get_slice(tid);
    Tensor sp = make_tensor(make_smem_ptr(opaque(other_p)), RowTiles<1>{});
    Tensor sv = make_tensor(make_smem_ptr(opaque(smem.k[j].data()) + wg * Traits::kHalfVTiles * 64 * 64),
                            ColumnTiles<Traits::kHalfVTiles>{});
    Tensor fp = thr.partition_fragment_A(sp);
    Tensor fv = thr.partition_fragment_B(sv);
    warpgroup_fence_operand(o);
    warpgroup_arrive();
    mma.accumulate_ = GMMA::ScaleOut::One;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(fp); ++k) cute::gemm(mma, fp(_, _, k), fv(_, _, k), o);
    warpgroup_fence_operand(o);
  }

  // P of warpgroup 0 over block 0's rotary tile; warpgroup 1's in its own buffer.
  __forceinline__ __device__ Element* p_buffer(int of_wg) const {
    return of_wg == 0 ? smem.k[0].data() + (Traits::kTiles - 1) * 64 * 64 : smem.p1.data();
  }

  // The block's maximum of S per row, over the quad that holds the row.
  __forceinline__ __device__ void block_max(float (&m)[2]) const {
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      float x = -INFINITY;
      CUTE_UNROLL
      for (int e = 2 * r; e < size(s); e += 4) x = fmaxf(x, fmaxf(s(e), s(e + 1)));
      m[r] = quad_max(x);
    }
  }

  // Multiplies the accumulator elements of this thread's row r (of its two) by factor.
  template <typename Accumulator>
  __forceinline__ __device__ static void scale_row(Accumulator& acc, int r, float factor) {
    CUTE_UNROLL
    for (int e = 2 * r; e < size(acc); e += 4) {
      acc(e) *= factor;
      acc(e + 1) *= factor;
    }
  }

  // P = exp2(S − new_max) into p_regs; O and the sum rescaled from row_max to new_max.
  __forceinline__ __device__ void softmax(const float (&new_max)[2]) {
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      const float base = exp_base(new_max[r]);
      const float correction = exp2f(row_max[r] - base);
      scale_row(o, r, correction);
      float sum = 0.f;
      CUTE_UNROLL
      for (int e = 2 * r; e < size(s); e += 4) {
        s(e) = exp2f(s(e) - base);
        s(e + 1) = exp2f(s(e + 1) - base);
        sum += s(e) + s(e + 1);
      }
      row_sum[r] = row_sum[r] * correction + sum;
      row_max[r] = new_max[r];
    }
    convert(s, p_regs);
  }

  // Each warpgroup has its own slots: warpgroup 1 reads warpgroup 0's max while its own leaders
  // publish the joint one.
  __forceinline__ __device__ void publish_max() {
    if (tid % 4 == 0) smem.row_max[wg][tid / 4] = make_float2(row_max[0], row_max[1]);
  }

  // P (this thread's registers) into `buffer` (64 x 64, K-major swizzled) with stmatrix, visible
  // to the other warpgroup's wgmma.
  __forceinline__ __device__ void store_p(Element* buffer) {
    auto copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, QkMma{});
    auto thr = copy.get_slice(tid);
    Tensor dst = thr.partition_D(make_tensor(make_smem_ptr(buffer), RowTiles<1>{}));
    cute::copy(copy, thr.retile_S(p_regs), dst);
    cutlass::arch::fence_view_async_shared();
  }

  // Warpgroup 0, after warpgroup 1 published the joint max: P and O brought from its own max to
  // the joint one (S still holds this block's probabilities under the old max).
  __forceinline__ __device__ void adopt_joint_max() {
    const float2 joint = smem.row_max[1][tid / 4];
    const float new_max[2] = {joint.x, joint.y};
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      const float correction = exp2f(row_max[r] - exp_base(new_max[r]));
      scale_row(s, r, correction);
      scale_row(o, r, correction);
      row_sum[r] *= correction;
      row_max[r] = new_max[r];
    }
    convert(s, p_regs);
  }

  // Warpgroup 0's pairs. The first block's logits are computed before the loop and every later
  // pair's at the end of the one before, under the other warpgroup's P·V.
  __forceinline__ __device__ void run_even(int pairs) {
    int phase = 0;
    wait_gathered(smem.q_ready, 0);
    wait_gathered(smem.k_ready[0][0], 0);
    this->template issue_qk<0, 4>(0, true);
    wait_gathered(smem.k_ready[0][1], 0);
    this->template issue_qk<4, Traits::kTiles>(0, false);
    warpgroup_commit_batch();
    uint32_t valid = valid_slots(0);
    warpgroup_wait<0>();
    for (int pair = 0; pair < pairs; ++pair) {
      scale_and_mask(valid);
      float m[2];
      block_max(m);
      const float new_max[2] = {fmaxf(row_max[0], m[0]), fmaxf(row_max[1], m[1])};
      softmax(new_max);
      publish_max();
      bar_arrive(kSparseBarMax0, kConsumerThreads);
      issue_pv_own(0);
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      smem.k_free[0][0].arrive();
      bar_sync(kSparseBarMax1, kConsumerThreads);
      adopt_joint_max();
      store_p(p_buffer(0));
      bar_arrive(kSparseBarP0, kConsumerThreads);
      bar_sync(kSparseBarP1, kConsumerThreads);
      issue_pv_other(p_buffer(1), 1);
      warpgroup_commit_batch();
      phase ^= 1;
      if (pair + 1 < pairs) {
        wait_gathered(smem.k_ready[0][0], phase);
        this->template issue_qk<0, 4>(0, true);
        warpgroup_commit_batch();
        warpgroup_wait<1>();  // the P·V of block 1 is done: release its value columns
        smem.k_free[1][0].arrive();
        wait_gathered(smem.k_ready[0][1], phase);
        this->template issue_qk<4, Traits::kTiles>(0, false);
        warpgroup_commit_batch();
        valid = valid_slots(0);
        warpgroup_wait<0>();
      } else {
        warpgroup_wait<0>();
        smem.k_free[1][0].arrive();
      }
    }
  }

  // Warpgroup 1's pairs.
  __forceinline__ __device__ void run_odd(int pairs) {
    int phase = 0;
    wait_gathered(smem.q_ready, 0);
    for (int pair = 0; pair < pairs; ++pair) {
      wait_gathered(smem.k_ready[1][1], phase);
      this->template issue_qk<4, Traits::kTiles>(1, true);
      wait_gathered(smem.k_ready[1][0], phase);
      this->template issue_qk<0, 4>(1, false);
      warpgroup_commit_batch();
      const uint32_t valid = valid_slots(1);
      warpgroup_wait<0>();
      scale_and_mask(valid);
      float m[2];
      block_max(m);
      bar_sync(kSparseBarMax0, kConsumerThreads);
      const float2 other = smem.row_max[0][tid / 4];
      const float new_max[2] = {fmaxf(other.x, m[0]), fmaxf(other.y, m[1])};
      softmax(new_max);
      publish_max();
      bar_arrive(kSparseBarMax1, kConsumerThreads);
      store_p(p_buffer(1));  // before the P·V that reads the same registers is in flight
      issue_pv_own(1);
      warpgroup_commit_batch();
      bar_sync(kSparseBarP0, kConsumerThreads);
      issue_pv_other(p_buffer(0), 0);
      warpgroup_commit_batch();
      bar_arrive(kSparseBarP1, kConsumerThreads);
      warpgroup_wait<1>();
      smem.k_free[1][1].arrive();
      warpgroup_wait<0>();
      smem.k_free[0][1].arrive();
      phase ^= 1;
    }
  }

  // Normalizes and writes this warpgroup's 256 columns of O; warpgroup 0 writes the LSE (natural
  // log; −inf and O = 0 for a row that saw no valid slot).
  __forceinline__ __device__ void write_output() {
    float total[2];
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) total[r] = quad_sum(row_sum[r]);
    if (tid % 4 == 0) smem.row_sum[wg * 32 + tid / 4] = make_float2(total[0], total[1]);
    bar_sync(kSparseBarSums, kConsumerThreads);
    const float2 other = smem.row_sum[(1 - wg) * 32 + tid / 4];
    total[0] += other.x;
    total[1] += other.y;
    // O's half, normalized, through shared memory (block buffer 0, free now: both warpgroups' MMAs
    // completed before the barrier above) so that global memory gets 16-byte row chunks.
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) scale_row(o, r, total[r] > 0.f ? 1.f / total[r] : 0.f);
    Tensor o_half = make_tensor<Element>(shape(o));
    convert(o, o_half);
    Element* staged = smem.k[0].data() + wg * Traits::kHalfVTiles * 64 * 64;
    {
      auto copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, PvMmaOwnP{});
      auto thr = copy.get_slice(tid);
      Tensor dst = thr.partition_D(make_tensor(make_smem_ptr(staged), RowTiles<Traits::kHalfVTiles>{}));
      cute::copy(copy, thr.retile_S(o_half), dst);
    }
    bar_sync(kSparseBarStagedFirst + wg, 128);
    Tensor view = make_tensor(make_smem_ptr(staged), RowTiles<Traits::kHalfVTiles>{});
    Element* out = static_cast<Element*>(p.o) + p.o_row(tile.b, tile.t, tile.n0) + wg * (Traits::kDimV / 2);
    constexpr int kChunksPerRow = Traits::kDimV / 2 / 8;  // 16-byte chunks of a row's half
    CUTE_UNROLL
    for (int i = 0; i < Traits::kHeads * kChunksPerRow / 128; ++i) {
      const int chunk = i * 128 + tid, row = chunk / kChunksPerRow, column = chunk % kChunksPerRow * 8;
      *reinterpret_cast<uint4*>(out + int64_t(row) * p.Hv + column) = *reinterpret_cast<const uint4*>(&view(row, column));
    }
    if (wg == 0 && tid % 4 == 0)
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r)
        p.lse[p.stat(tile.b, tile.t, tile.n0 + fragment_row(r, tid))] =
            total[r] > 0.f ? (row_max[r] + log2f(total[r])) * kLn2 : -INFINITY;
  }
};

template <typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1) sparse_forward_kernel(const __grid_constant__ SparseParams p) {
  extern __shared__ __align__(1024) unsigned char smem_bytes[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_bytes);
  init_gather_barriers(smem);
  const SparseTile tile(p);
  const int pairs = pair_count<Traits>(p);
  const int wg = cutlass::canonical_warp_group_idx();
  if (wg == 2) {
    gather_pairs<Traits>(p, tile, smem, pairs);
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
  Consumer<Traits> consumer(p, tile, smem, wg);
  if (wg == 0)
    consumer.run_even(pairs);
  else
    consumer.run_odd(pairs);
  consumer.write_output();
}

}  // namespace jfa::sm90::sparse
