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
#include "sm90/utils.h"

namespace jfa::sm90::sparse {

using namespace cute;

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;
// The exponent base for a row max: a row that has seen no valid slot yet (max −inf) takes 0, so
// that exp2(−inf − base) is 0 rather than NaN, for any finite logit however large.
__forceinline__ __device__ float exp_base(float max) { return max == -INFINITY ? 0.f : max; }

// Where a CTA's work lies: query (b, t), key head kh, query heads n0 … n0 + 63.
struct SparseTile {
  int64_t b, t, kh, n0;
  __forceinline__ __device__ explicit SparseTile(const SparseParams& p) {
    const int64_t head_blocks = p.group_size() / 64;
    int64_t i = blockIdx.x;
    const int64_t hb = i % head_blocks;
    i /= head_blocks;
    kh = i % p.K;
    i /= p.K;
    t = i % p.T;
    b = i / p.T;
    n0 = kh * p.group_size() + hb * 64;
  }
};

// Copies 16 bytes from global to shared memory, or writes 16 zero bytes when !read (src is then not
// dereferenced). L2::256B: a thread group reads 128 bytes of each of a row's nine tiles.
__forceinline__ __device__ void copy_16b(void* dst, const void* src, bool read) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(cast_smem_ptr_to_uint(dst)),
               "l"(src), "r"(read ? 16 : 0)
               : "memory");
}

// ---------------------------------------------------------------------------------------------
// Gathering warpgroup: thread (group g = tid / 8, chunk c = tid % 8) copies 16-byte chunk c of every
// 64-column tile of rows g, g + 16, g + 32, g + 48.

template <typename Traits>
struct Gatherer {
  using Element = typename Traits::Element;
  static constexpr int kRowsPerThread = Traits::kBlockKeys / 16;

  const SparseParams& p;
  const SparseTile& tile;
  typename Traits::SharedStorage& smem;
  int group, chunk;
  int32_t rows[2][kRowsPerThread];  // the pair's key rows this thread copies; -1: not gathered

  // Address of this thread's chunk of (row group, tile 0) in a 64-row buffer; rows 16 apart are
  // 16·64 elements apart and tiles 64·64 (sparse_fwd_traits.h).
  __forceinline__ __device__ Element* chunk_base(Element* buffer) const {
    Tensor s = make_tensor(make_smem_ptr(buffer), typename Traits::template RowTiles<Traits::kTiles>{});
    return &s(group, chunk * 8);
  }

  __forceinline__ __device__ void copy_queries() {
    const Element* q = static_cast<const Element*>(p.q) + p.q_row(tile.b, tile.t, tile.n0) + chunk * 8;
    Element* dst = chunk_base(smem.q.data());
    CUTE_UNROLL
    for (int r = 0; r < kRowsPerThread; ++r)
      CUTE_UNROLL
      for (int c = 0; c < Traits::kTiles; ++c)
        copy_16b(dst + r * 16 * 64 + c * 64 * 64, q + int64_t(group + 16 * r) * p.H + c * 64, true);
    cutlass::arch::cpasync_barrier_arrive_noinc(reinterpret_cast<uint64_t*>(&smem.q_ready));
  }

  // Reads the indices of blocks `block` and `block + 1`; slots past topk and indices that select
  // nothing (sparse_index_valid) are zero-filled and masked, never read.
  __forceinline__ __device__ void load_pair(int block) {
    const int32_t* indices = p.indices + p.index_row(tile.b, tile.t, tile.kh);
    CUTE_UNROLL
    for (int j = 0; j < 2; ++j)
      CUTE_UNROLL
      for (int r = 0; r < kRowsPerThread; ++r) {
        const int64_t slot = int64_t(block + j) * Traits::kBlockKeys + group + 16 * r;
        const int32_t s = slot < p.topk ? __ldg(indices + slot) : -1;
        rows[j][r] = slot < p.topk && sparse_index_valid(p, tile.t, s) ? s : -1;
      }
  }

  // Tiles [kFirst, kLast) of the pair's block j into buffer j, then the buffer half's barrier.
  template <int j, int kFirst, int kLast>
  __forceinline__ __device__ void copy_half(cutlass::arch::ClusterBarrier& ready) {
    const Element* k = static_cast<const Element*>(p.k) + chunk * 8;
    Element* dst = chunk_base(smem.k[j].data());
    CUTE_UNROLL
    for (int r = 0; r < kRowsPerThread; ++r) {
      const bool valid = rows[j][r] >= 0;
      const Element* src = k + (valid ? p.k_row(tile.b, rows[j][r], tile.kh) : 0);
      CUTE_UNROLL
      for (int c = kFirst; c < kLast; ++c) copy_16b(dst + r * 16 * 64 + c * 64 * 64, src + c * 64, valid);
    }
    cutlass::arch::cpasync_barrier_arrive_noinc(reinterpret_cast<uint64_t*>(&ready));
  }


  // Each half is refilled in the order its readers release it: block 0's value columns (wg 0's
  // P·V), block 1's right half (wg 1's P·V), block 0's right half (wg 1's P·V of block 0), block
  // 1's value columns (wg 0's P·V of block 1).
  __forceinline__ __device__ void run(int pairs) {
    copy_queries();
    int phase = 1;  // a fresh barrier's preceding phase counts as complete: the first waits pass
    for (int pair = 0; pair < pairs; ++pair) {
      load_pair(2 * pair);
      smem.k_free[0][0].wait(phase);
      copy_half<0, 0, 4>(smem.k_ready[0][0]);
      smem.k_free[1][1].wait(phase);
      copy_half<1, 4, Traits::kTiles>(smem.k_ready[1][1]);
      smem.k_free[0][1].wait(phase);
      copy_half<0, 4, Traits::kTiles>(smem.k_ready[0][1]);
      smem.k_free[1][0].wait(phase);
      copy_half<1, 0, 4>(smem.k_ready[1][0]);
      phase ^= 1;
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Consumer warpgroups.

// The pointer, as a value the compiler cannot see through: the wgmma descriptors derived from it
// are then computed where they are used. Otherwise they are loop-invariant, and the compiler kept
// all 72 of Q·Kᵀ's (64-bit each) in registers across the loop, spilling O.
template <typename T>
__forceinline__ __device__ T* opaque(T* ptr) {
  asm volatile("" : "+l"(ptr));
  return ptr;
}

inline constexpr int kConsumerThreads = 256;  // both consumer warpgroups, at their meetings

template <typename Traits>
struct Consumer {
  using Element = typename Traits::Element;
  using QkMma = typename Traits::QkMma;
  using PvMmaOwnP = typename Traits::PvMmaOwnP;
  using PvMmaOtherP = typename Traits::PvMmaOtherP;
  template <int n>
  using RowTiles = typename Traits::template RowTiles<n>;
  template <int n>
  using ColumnTiles = typename Traits::template ColumnTiles<n>;

  const SparseParams& p;
  const SparseTile& tile;
  typename Traits::SharedStorage& smem;
  const int wg;   // 0: even blocks, O columns 0-255; 1: odd blocks, columns 256-511
  const int tid;  // thread in the warpgroup
  const float scale_log2;

  decltype(partition_fragment_C(PvMmaOwnP{}, Shape<_64, _256>{})) o;
  decltype(partition_fragment_C(QkMma{}, Shape<_64, _64>{})) s;
  decltype(make_tensor<Element>(partition_shape_A(PvMmaOwnP{}, Shape<_64, _64>{}))) p_regs;
  float row_max[2] = {-INFINITY, -INFINITY};  // log2 units (scale·log2(e)·q·k)
  float row_sum[2] = {0.f, 0.f};        // this thread's share, under row_max

  __forceinline__ __device__ Consumer(const SparseParams& p_, const SparseTile& tile_, typename Traits::SharedStorage& smem_, int wg_)
      : p(p_), tile(tile_), smem(smem_), wg(wg_), tid(threadIdx.x % 128), scale_log2(p_.scale * kLog2e) {
    clear(o);
  }

  // Waits until the gatherer's cp.async copies behind `ready` have landed. They are generic-proxy
  // writes and wgmma reads through the async proxy: the proxy fence orders the two.
  __forceinline__ __device__ static void wait_gathered(cutlass::arch::ClusterBarrier& ready, int phase) {
    ready.wait(phase);
    cutlass::arch::fence_view_async_shared();
  }

  // Issues S (+)= Q·Kᵀ over tiles [kFirst, kLast) of block buffer j (no commit).
  template <int kFirst, int kLast>
  __forceinline__ __device__ void issue_qk(int j, bool zero_init) {
    QkMma mma;
    auto thr = mma.get_slice(tid);
    Element* q = opaque(smem.q.data());
    Element* k = opaque(smem.k[j].data());
    warpgroup_fence_operand(s);
    warpgroup_arrive();
    mma.accumulate_ = zero_init ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
    CUTE_UNROLL
    for (int c = kFirst; c < kLast; ++c) {
      Tensor sq = make_tensor(make_smem_ptr(q + c * 64 * 64), RowTiles<1>{});
      Tensor sk = make_tensor(make_smem_ptr(k + c * 64 * 64), RowTiles<1>{});
      Tensor fq = thr.partition_fragment_A(sq);
      Tensor fk = thr.partition_fragment_B(sk);
      CUTE_UNROLL
      for (int k = 0; k < size<2>(fq); ++k) {
        cute::gemm(mma, fq(_, _, k), fk(_, _, k), s);
        mma.accumulate_ = GMMA::ScaleOut::One;
      }
    }
    warpgroup_fence_operand(s);
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

  // Accumulator element e of this thread: row (e / 2) % 2 of its two, column 8·(e / 4) + 2·(tid % 4) + e % 2.
  __forceinline__ __device__ static int fragment_column(int e, int tid) { return 8 * (e / 4) + 2 * (tid % 4) + e % 2; }
  __forceinline__ __device__ static int fragment_row(int r, int tid) { return tid / 32 * 16 + r * 8 + tid % 32 / 4; }

  // Bit 2·(e / 4) + e % 2 of the result: whether the slot of this thread's column
  // fragment_column(e) of block `block` selects a key (as the gatherer decided, from the same
  // indices). Read from global memory (the warpgroup reads one 256-byte span, from L1) rather than
  // handed over in shared memory by the gatherer, so that the only exchanges between warpgroups
  // are the row maxima and P, and are ordered by named barriers.
  __forceinline__ __device__ uint32_t load_valid(int block) const {
    const int32_t* indices = p.indices + p.index_row(tile.b, tile.t, tile.kh);
    uint32_t bits = 0;
    CUTE_UNROLL
    for (int i = 0; i < 16; ++i) {
      const int64_t slot = int64_t(block) * Traits::kBlockKeys + 8 * (i / 2) + 2 * (tid % 4) + i % 2;
      const int32_t key = slot < p.topk ? __ldg(indices + slot) : -1;
      bits |= uint32_t(slot < p.topk && sparse_index_valid(p, tile.t, key)) << i;
    }
    return bits;
  }

  // S in log2 units (scale·log2(e)·q·k), −inf at the slots not gathered. Scaled before the max,
  // so that any scale, 0 and negative ones included, keeps the masked slots at −inf.
  __forceinline__ __device__ void scale_and_mask(uint32_t valid) {
    CUTE_UNROLL
    for (int e = 0; e < size(s); ++e) s(e) = (valid >> (2 * (e / 4) + e % 2)) & 1u ? s(e) * scale_log2 : -INFINITY;
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
    issue_qk<0, 4>(0, true);
    wait_gathered(smem.k_ready[0][1], 0);
    issue_qk<4, Traits::kTiles>(0, false);
    warpgroup_commit_batch();
    uint32_t valid = load_valid(0);
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
        issue_qk<0, 4>(0, true);
        warpgroup_commit_batch();
        warpgroup_wait<1>();  // the P·V of block 1 is done: release its value columns
        smem.k_free[1][0].arrive();
        wait_gathered(smem.k_ready[0][1], phase);
        issue_qk<4, Traits::kTiles>(0, false);
        warpgroup_commit_batch();
        valid = load_valid(2 * pair + 2);
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
      issue_qk<4, Traits::kTiles>(1, true);
      wait_gathered(smem.k_ready[1][0], phase);
      issue_qk<0, 4>(1, false);
      warpgroup_commit_batch();
      const uint32_t valid = load_valid(2 * pair + 1);
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
    Element* out = static_cast<Element*>(p.o) + p.o_row(tile.b, tile.t, tile.n0) + wg * (Traits::kDimV / 2);
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      const int row = fragment_row(r, tid);
      const float inv = total[r] > 0.f ? 1.f / total[r] : 0.f;
      Element* dst = out + int64_t(row) * p.Hv;
      CUTE_UNROLL
      for (int e = 2 * r; e < size(o); e += 4) {
        cutlass::Array<Element, 2> pair;
        pair[0] = Element(o(e) * inv);
        pair[1] = Element(o(e + 1) * inv);
        *reinterpret_cast<cutlass::Array<Element, 2>*>(dst + fragment_column(e, tid)) = pair;
      }
      if (wg == 0 && tid % 4 == 0)
        p.lse[p.stat(tile.b, tile.t, tile.n0 + row)] =
            total[r] > 0.f ? (row_max[r] + log2f(total[r])) * kLn2 : -INFINITY;
    }
  }
};

template <typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1) sparse_forward_kernel(const __grid_constant__ SparseParams p) {
  extern __shared__ __align__(1024) unsigned char smem_bytes[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_bytes);
  if (threadIdx.x == 0) {
    smem.q_ready.init(128);
    for (int j = 0; j < 2; ++j)
      for (int h = 0; h < 2; ++h) {
        smem.k_ready[j][h].init(128);  // every gathering thread's cp.async arrival
        smem.k_free[j][h].init(128);   // every thread of the warpgroup that reads the half last
      }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  const SparseTile tile(p);
  const int pairs = int((p.topk + 2 * Traits::kBlockKeys - 1) / (2 * Traits::kBlockKeys));
  const int wg = cutlass::canonical_warp_group_idx();
  if (wg == 2) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    Gatherer<Traits> gatherer{p, tile, smem, int(threadIdx.x % 128) / 8, int(threadIdx.x % 8)};
    gatherer.run(pairs);
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    Consumer<Traits> consumer(p, tile, smem, wg);
    if (wg == 0)
      consumer.run_even(pairs);
    else
      consumer.run_odd(pairs);
    consumer.write_output();
  }
}

}  // namespace jfa::sm90::sparse
