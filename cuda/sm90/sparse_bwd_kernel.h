// First pass of the top-k sparse backward on Hopper (sparse_bwd_traits.h has the tile): per query
// position and 64 heads, dQ = scale·dS·K and the P and scale·dS that the second pass
// (sparse_key_rows_kernel.h, or cuda/sparse/backward_key_rows.cu) turns into dK and dV. Warpgroup 2 gathers Q, dO and each block of 32
// selected rows with cp.async into the swizzled tiles wgmma reads (TMA has no row gather on sm90).
// Per block:
//   wg 1   dP = dO·Vᵀ, into shared memory (the next block's issued behind this one's dQ columns);
//   wg 0   S = Q·Kᵀ; then P = exp(scale·S − LSE) and scale·dS = scale·P∘(dP − D), both written to the
//          workspace, dS to shared memory;
//   both   dQ += scale·dS·K over their columns; then both release the block's buffer.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "jfa/sparse_params.h"
#include "sm90/named_barriers.h"
#include "sm90/sparse_bwd_traits.h"
#include "sm90/sparse_gatherer.h"
#include "sm90/sparse_logits.h"
#include "sm90/utils.h"

namespace jfa::sm90::sparse {

using namespace cute;

// Where a CTA's results go: the chunk's workspace of P and scale·dS, [items, 2, N / K,
// weight_row_slots(topk)], item (b·T + t)·K + kh − first_item.
struct BackwardOutputs {
  const float* softmax_d;  // [B, T, N]: rowsum(dO∘O) − dLSE
  void* weights;
  int64_t first_item;
};

template <typename Element>
__forceinline__ __device__ uint32_t pack_pair(float lo, float hi) {
  return uint32_t(Element(lo).raw()) | uint32_t(Element(hi).raw()) << 16;
}

// ---------------------------------------------------------------------------------------------
// Gathering warpgroup: thread (group g = tid / 8, chunk c = tid % 8) copies 16-byte chunk c of every
// 64-column tile of its rows: g + 16·r of Q and dO (r < 4), of a block (r < 2).

template <typename Traits>
struct BackwardGatherer {
  using Element = typename Traits::Element;
  static constexpr int kRowsPerThread = Traits::kBlockKeys / 16;
  static_assert(Traits::kFlagWriters * kRowsPerThread == Traits::kBlockKeys, "one flag per slot");

  const SparseParams& p;
  const SparseTile& tile;
  typename Traits::SharedStorage& smem;
  int group, chunk;

  template <int kRows, int kTileCount>
  __forceinline__ __device__ Element* at(Element* buffer, int row, int column) const {
    Tensor s = make_tensor(make_smem_ptr(buffer), typename Traits::template RowTiles<kRows, kTileCount>{});
    return &s(row, column);
  }

  // Q's and dO's rows of the CTA's heads, then q_ready.
  __forceinline__ __device__ void copy_heads() {
    const Element* q = static_cast<const Element*>(p.q) + p.q_row(tile.b, tile.t, tile.n0) + chunk * 8;
    const Element* dout = static_cast<const Element*>(p.dout) + p.o_row(tile.b, tile.t, tile.n0) + chunk * 8;
    CUTE_UNROLL
    for (int r = 0; r < Traits::kHeads / 16; ++r) {
      const int row = group + 16 * r;
      CUTE_UNROLL
      for (int c = 0; c < Traits::kTiles; ++c)
        copy_16b(at<Traits::kHeads, Traits::kTiles>(smem.q.data(), row, c * 64 + chunk * 8),
                 q + int64_t(row) * p.H + c * 64, true);
      CUTE_UNROLL
      for (int c = 0; c < Traits::kVTiles; ++c)
        copy_16b(at<Traits::kHeads, Traits::kVTiles>(smem.dout.data(), row, c * 64 + chunk * 8),
                 dout + int64_t(row) * p.Hv + c * 64, true);
    }
    cutlass::arch::cpasync_barrier_arrive_noinc(reinterpret_cast<uint64_t*>(&smem.q_ready));
  }

  // The indices of block `block`'s rows into `indices`, loaded a block ahead of their copies;
  // slots past topk read the last slot, in bounds, and are masked when copied.
  __forceinline__ __device__ void fetch(int block, int32_t (&indices)[kRowsPerThread]) const {
    const int32_t* row = p.indices + p.index_row(tile.b, tile.t, tile.kh);
    CUTE_UNROLL
    for (int r = 0; r < kRowsPerThread; ++r)
      indices[r] = __ldg(row + min(int64_t(block) * Traits::kBlockKeys + group + 16 * r, p.topk - 1));
  }

  // Block `block`'s rows (their indices fetched) into buffer j, zeros for slots that select
  // nothing, and the slots' flags; then k_ready[j]: the copies arrive as they land, the flags'
  // writers once more (an arrive orders their stores before the consumers' wait).
  __forceinline__ __device__ void copy_block(int block, int j, const int32_t (&indices)[kRowsPerThread]) {
    const Element* k = static_cast<const Element*>(p.k) + chunk * 8;
    CUTE_UNROLL
    for (int r = 0; r < kRowsPerThread; ++r) {
      const int row = group + 16 * r;
      const bool valid =
          int64_t(block) * Traits::kBlockKeys + row < p.topk && sparse_index_valid(p, tile.t, indices[r]);
      const Element* src = k + (valid ? p.k_row(tile.b, indices[r], tile.kh) : 0);
      CUTE_UNROLL
      for (int c = 0; c < Traits::kTiles; ++c)
        copy_16b(at<Traits::kBlockKeys, Traits::kTiles>(smem.k[j].data(), row, c * 64 + chunk * 8), src + c * 64,
                 valid);
      if (chunk == 0) smem.slot_valid[j][row] = valid;
    }
    cutlass::arch::cpasync_barrier_arrive_noinc(reinterpret_cast<uint64_t*>(&smem.k_ready[j]));
    if (chunk == 0) smem.k_ready[j].arrive();
  }

  __forceinline__ __device__ void run(int blocks) {
    int32_t next[kRowsPerThread];
    if (blocks > 0) fetch(0, next);
    copy_heads();
    for (int block = 0; block < blocks; ++block) {
      const int j = block % 2;
      int32_t current[kRowsPerThread];
      CUTE_UNROLL
      for (int r = 0; r < kRowsPerThread; ++r) current[r] = next[r];
      if (block + 1 < blocks) fetch(block + 1, next);
      // A fresh barrier's preceding phase counts as complete: each buffer's first wait passes.
      smem.k_free[j].wait(((block / 2) & 1) ^ 1);
      copy_block(block, j, current);
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Consumer warpgroups.

inline constexpr int kBackwardConsumerThreads = 256;  // both consumer warpgroups, at their meetings

template <typename Traits>
struct BackwardConsumer {
  using Element = typename Traits::Element;
  using ScoreMma = typename Traits::ScoreMma;
  template <int kRows, int n>
  using RowTiles = typename Traits::template RowTiles<kRows, n>;
  template <int n>
  using BlockColumns = typename Traits::template BlockColumns<n>;
  using Dq0Mma = typename Traits::template DqMma<64 * Traits::kDq0Tiles>;
  using Dq1Mma = typename Traits::template DqMma<64 * (Traits::kTiles - Traits::kDq0Tiles - 1)>;
  using DqTailMma = typename Traits::template DqMma<64>;
  static_assert(Traits::kTiles - Traits::kDq0Tiles - 1 == 4, "warpgroup 1's columns: 256, then 64");

  const SparseParams& p;
  const SparseTile& tile;
  typename Traits::SharedStorage& smem;
  const BackwardOutputs& out;
  const int wg, tid;

  decltype(partition_fragment_C(ScoreMma{}, Shape<_64, Int<Traits::kBlockKeys>>{})) s;  // S, or dP in wg 1
  decltype(partition_fragment_C(Dq0Mma{}, Shape<_64, _256>{})) dq;  // columns 0-255, or 256-511 in wg 1
  decltype(partition_fragment_C(DqTailMma{}, Shape<_64, _64>{})) dq_tail;  // wg 1: columns 512-575

  __forceinline__ __device__ BackwardConsumer(const SparseParams& p_, const SparseTile& tile_,
                                              typename Traits::SharedStorage& smem_, const BackwardOutputs& out_,
                                              int wg_)
      : p(p_), tile(tile_), smem(smem_), out(out_), wg(wg_), tid(threadIdx.x % 128) {
    clear(dq);
    clear(dq_tail);
  }

  // Issues s = A·Kᵀ of block buffer j over kTileCount 64-column tiles of `a` (Q or dO; no commit).
  template <int kTileCount>
  __forceinline__ __device__ void issue_scores(Element* a, int j) {
    ScoreMma mma;
    warpgroup_fence_operand(s);
    warpgroup_arrive();
    mma.accumulate_ = GMMA::ScaleOut::Zero;
    accumulate_row_tiles<RowTiles<Traits::kHeads, 1>, RowTiles<Traits::kBlockKeys, 1>, 0, kTileCount>(
        mma, tid, a, opaque(smem.k[j].data()), s);
    warpgroup_fence_operand(s);
  }

  // Issues acc += dS·K over kTileCount column tiles of block buffer j from tile kFirst (no commit).
  template <typename Mma, int kFirst, int kTileCount, typename Acc>
  __forceinline__ __device__ void issue_dq(int j, Acc& acc) {
    Mma mma;
    auto thr = mma.get_slice(tid);
    Tensor sds = make_tensor(make_smem_ptr(opaque(smem.ds.data())), typename Traits::DsTile{});
    Tensor sk = make_tensor(make_smem_ptr(opaque(smem.k[j].data()) + kFirst * Traits::kBlockKeys * 64),
                            BlockColumns<kTileCount>{});
    Tensor fds = thr.partition_fragment_A(sds);
    Tensor fk = thr.partition_fragment_B(sk);
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    mma.accumulate_ = GMMA::ScaleOut::One;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(fds); ++k) cute::gemm(mma, fds(_, _, k), fk(_, _, k), acc);
    warpgroup_fence_operand(acc);
  }

  // Accumulator element e of this thread: row tid / 32 · 16 + tid % 32 / 4, plus 8 for (e / 2) odd;
  // column 8·(e / 4) + 2·(tid % 4) + e % 2.
  __forceinline__ __device__ int row_of(int e) const { return tid / 32 * 16 + (e / 2) % 2 * 8 + tid % 32 / 4; }
  __forceinline__ __device__ int column_of(int e) const { return 8 * (e / 4) + 2 * (tid % 4) + e % 2; }

  // Bit 2·(e / 4) + e % 2: whether the slot of this thread's column of the block in buffer j
  // selects a key, from the gatherer's flags (columns 8·i + 2·(tid % 4), and the next).
  __forceinline__ __device__ uint32_t valid_slots(int j) const {
    return valid_slot_bits<Traits::kBlockKeys>(smem.slot_valid[j], tid);
  }

  // One of this thread's rows of P or scale·dS in the block (pairs[c]: columns 8·c + 2·(tid % 4)
  // and the next) as one 16-byte store of columns 8·(tid % 4) to 8·(tid % 4) + 7, after a 4 x 4
  // transpose across the quad; four times fewer stores than pair by pair.
  __forceinline__ __device__ void store_row(Element* row, uint32_t (&pairs)[4]) const {
    const int q = tid % 4;
    CUTE_UNROLL
    for (int c0 = 0; c0 < 2; ++c0) {  // the 2 x 2 blocks off the diagonal change places
      const uint32_t got = __shfl_xor_sync(0xffffffffu, q & 2 ? pairs[c0] : pairs[2 + c0], 2);
      if (q & 2) pairs[c0] = got; else pairs[2 + c0] = got;
    }
    CUTE_UNROLL
    for (int c1 = 0; c1 < 2; ++c1) {  // then each 2 x 2 block is transposed
      const uint32_t got = __shfl_xor_sync(0xffffffffu, q & 1 ? pairs[2 * c1] : pairs[2 * c1 + 1], 1);
      if (q & 1) pairs[2 * c1] = got; else pairs[2 * c1 + 1] = got;
    }
    *reinterpret_cast<uint4*>(row + 8 * q) = make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
  }

  // Warpgroup 0: S, the exchange with warpgroup 1, P and scale·dS, dQ's first columns.
  __forceinline__ __device__ void run_scores(int blocks) {
    // The LSE in log2 units (+inf for a row that saw no key, so that its P is 0) and D of this
    // thread's two rows.
    float lse_log2[2], d[2];
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      const int64_t stat = p.stat(tile.b, tile.t, tile.n0 + row_of(2 * r));
      const float lse = p.lse[stat];
      lse_log2[r] = lse == -INFINITY ? INFINITY : lse * kLog2e;
      d[r] = out.softmax_d[stat];
    }
    const float scale_log2 = p.scale * kLog2e;
    const int64_t G = p.group_size(), row_slots = weight_row_slots(p.topk);
    const int64_t item = (tile.b * p.T + tile.t) * p.K + tile.kh - out.first_item;
    Element* probs = static_cast<Element*>(out.weights) + (item * 2 * G + (tile.n0 - tile.kh * G)) * row_slots;
    Element* dscores = probs + G * row_slots;
    Tensor sds = make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::DsTile{});
    wait_gathered(smem.q_ready, 0);
    for (int block = 0; block < blocks; ++block) {
      const int j = block % 2;
      wait_gathered(smem.k_ready[j], (block / 2) & 1);
      issue_scores<Traits::kTiles>(smem.q.data(), j);
      warpgroup_commit_batch();
      const uint32_t valid = valid_slots(j);
      warpgroup_wait<0>();
      warpgroup_fence_operand(s);  // no read of S moves above the wait
      bar_sync(kSparseBwdBarDpReady, kBackwardConsumerThreads);
      uint32_t pairs[2][2][4];  // [P, scale·dS][row: + 0 or + 8][column group]
      CUTE_UNROLL
      for (int e = 0; e < size(s); e += 2) {
        float w[2][2];  // [P, scale·dS][the pair]
        CUTE_UNROLL
        for (int i = 0; i < 2; ++i) {
          const int r = (e / 2) % 2;
          const bool ok = (valid >> (2 * (e / 4) + i)) & 1u;
          const float prob = ok ? exp2f(s(e + i) * scale_log2 - lse_log2[r]) : 0.f;
          w[0][i] = prob;
          w[1][i] = ok ? p.scale * prob * (smem.dp[e + i][tid] - d[r]) : 0.f;
        }
        pairs[0][(e / 2) % 2][e / 4] = pack_pair<Element>(w[0][0], w[0][1]);
        pairs[1][(e / 2) % 2][e / 4] = pack_pair<Element>(w[1][0], w[1][1]);
        *reinterpret_cast<uint32_t*>(&sds(row_of(e), column_of(e))) = pairs[1][(e / 2) % 2][e / 4];
      }
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const int64_t at = int64_t(row_of(2 * h)) * row_slots + int64_t(block) * Traits::kBlockKeys;
        store_row(probs + at, pairs[0][h]);
        store_row(dscores + at, pairs[1][h]);
      }
      // dS's generic-proxy stores before wgmma reads them through the async proxy. Only warpgroup 1
      // waits at this meeting, as only warpgroup 0 waits at the dP one: each generation of an
      // aligned bar.sync must be waited at from one instruction.
      cutlass::arch::fence_view_async_shared();
      bar_arrive(kSparseBwdBarDsReady, kBackwardConsumerThreads);
      issue_dq<Dq0Mma, 0, Traits::kDq0Tiles>(j, dq);
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      smem.k_free[j].arrive();
    }
  }

  // Warpgroup 1: dP into shared memory, dQ's last columns. The next block's dP is issued right
  // behind this block's dQ columns, so that it runs while warpgroup 0 computes the next S, and the
  // block's buffer is released as soon as its dQ products are done (issued before the dP, which
  // they would otherwise wait for: a warpgroup's MMAs complete in order).
  __forceinline__ __device__ void run_value_grads(int blocks) {
    wait_gathered(smem.q_ready, 0);
    for (int block = 0; block < blocks; ++block) {
      const int j = block % 2;
      if (block == 0) {  // later blocks' dP are issued at the end of the block before
        wait_gathered(smem.k_ready[0], 0);
        issue_scores<Traits::kVTiles>(smem.dout.data(), 0);
        warpgroup_commit_batch();
      }
      warpgroup_wait<0>();
      warpgroup_fence_operand(s);
      // Warpgroup 0 read the previous block's dP before the last dS meeting, which this
      // warpgroup has passed.
      CUTE_UNROLL
      for (int e = 0; e < size(s); ++e) smem.dp[e][tid] = s(e);
      bar_arrive(kSparseBwdBarDpReady, kBackwardConsumerThreads);
      bar_sync(kSparseBwdBarDsReady, kBackwardConsumerThreads);
      issue_dq<Dq1Mma, Traits::kDq0Tiles, 4>(j, dq);
      issue_dq<DqTailMma, Traits::kTiles - 1, 1>(j, dq_tail);
      warpgroup_commit_batch();
      if (block + 1 < blocks) {
        wait_gathered(smem.k_ready[1 - j], ((block + 1) / 2) & 1);
        issue_scores<Traits::kVTiles>(smem.dout.data(), 1 - j);
        warpgroup_commit_batch();
        warpgroup_wait<1>();
      } else {
        warpgroup_wait<0>();
      }
      // The dQ products are done: also what lets warpgroup 0 overwrite dS, as it waits for the
      // next block's dP meeting first.
      warpgroup_fence_operand(dq);
      warpgroup_fence_operand(dq_tail);
      smem.k_free[j].arrive();
    }
    // Stated for write_dq's reads (the last block waited already; ptxas cannot tell).
    warpgroup_wait<0>();
    warpgroup_fence_operand(dq);
    warpgroup_fence_operand(dq_tail);
  }

  // This warpgroup's columns of dQ (scale is in dS) for the CTA's 64 heads.
  template <typename Acc>
  __forceinline__ __device__ void write_columns(const Acc& acc, int first_column) const {
    Element* base = static_cast<Element*>(p.dq) + p.q_row(tile.b, tile.t, tile.n0) + first_column;
    CUTE_UNROLL
    for (int e = 0; e < size(acc); e += 2)
      *reinterpret_cast<uint32_t*>(base + int64_t(row_of(e)) * p.H + column_of(e)) = pack_pair<Element>(acc(e), acc(e + 1));
  }

  __forceinline__ __device__ void write_dq() const {
    if (wg == 0) {
      write_columns(dq, 0);
    } else {
      write_columns(dq, 64 * Traits::kDq0Tiles);
      write_columns(dq_tail, 64 * (Traits::kTiles - 1));
    }
  }
};

template <typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    sparse_backward_weights_kernel(const __grid_constant__ SparseParams p, const __grid_constant__ BackwardOutputs out) {
  extern __shared__ __align__(1024) unsigned char smem_bytes[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_bytes);
  if (threadIdx.x == 0) {
    smem.q_ready.init(Traits::kGatherThreads);
    for (int j = 0; j < 2; ++j) {
      smem.k_ready[j].init(Traits::kGatherThreads + Traits::kFlagWriters);  // copies landed, flags written
      smem.k_free[j].init(kBackwardConsumerThreads);  // both consumer warpgroups
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  const SparseTile tile(p, out.first_item * (p.group_size() / Traits::kHeads) + blockIdx.x);
  const int blocks = int((p.topk + Traits::kBlockKeys - 1) / Traits::kBlockKeys);
  const int wg = cutlass::canonical_warp_group_idx();
  if (wg == 2) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    BackwardGatherer<Traits>{p, tile, smem, int(threadIdx.x % 128) / 8, int(threadIdx.x % 8)}.run(blocks);
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
  BackwardConsumer<Traits> consumer(p, tile, smem, out, wg);
  if (wg == 0)
    consumer.run_scores(blocks);
  else
    consumer.run_value_grads(blocks);
  consumer.write_dq();
}

}  // namespace jfa::sm90::sparse
