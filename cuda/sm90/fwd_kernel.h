// Forward kernel for Hopper (sm90a): TMA loads, wgmma, warp specialization, persistent tiles.
//
// Roles. Warpgroup 0 is the producer: one thread issues TMA loads of each tile's Q (once) and of
// K and V through a kStages-deep smem ring guarded by full/empty mbarriers (PipelineTmaAsync);
// it lowers its registers with setmaxnreg so that the consumers can raise theirs. Warpgroups
// 1..kNumMmaWarpGroups are consumers, each owning 64 query rows of the tile.
//
// Consumer schedule per key block n (walked from the last block down: the boundary/diagonal
// blocks come first and are the only ones masked):
//   wait K[n]; [scheduler barrier] issue S = Q·K[n]ᵀ (SS); O *= scale(n+1) (if a max grew); issue O += P(n+1)·V[n+1]
//   (RS, P in registers) [arrive at the next warpgroup's barrier]; wait S; softmax(S) -> P(n), scale(n);
//   wait P·V.
// So inside a warpgroup the softmax of block n runs while the tensor cores do P·V of block n+1
// (provided the wait comes after it in SASS: utils.h, softmax_done),
// and between warpgroups the named "scheduler" barriers make their GEMM issues alternate
// (ping-pong): one warpgroup's softmax runs under the other's GEMMs.
// Epilogue, per consumer warpgroup: O / rowsum to bf16/fp16 into its rows of smem (stmatrix), TMA
// stores of those rows (rows >= T are clipped by TMA), LSE straight from registers.
//
// kPolicies != 0, the general path (with kCausal = false): masks and score modifiers as policies
// (jfa/mask.h, jfa/row_policy.cuh; causality from p.attn.is_causal), compiled for the set of
// them in kPolicies (mask.h). A tile visits only the key blocks of its
// position range (causal with either alignment, window, valid lengths) that may share a segment
// with it (the segment summaries): that is its trip count. Each thread reads its rows' bounds once
// per tile (mask.h, TileRows) and runs per block only the per-element tests its elements need
// (block_needs: position bounds, which take in a row's segment where the summaries prove it one
// key range, as for packed sequences on 16-key chunks; other segments outside the tile's
// one-segment key run; the boolean mask); score modifiers run on every block (ALiBi on the
// tensor cores excepted, below). A tile that sees no key visits block 0 fully masked, so it
// writes O = 0 and LSE = -inf the usual way. With kPolicyDropout in kPolicies, each block's
// probabilities are dropped after the softmax statistics (dropout.h), the row sums and LSE kept
// dropout-free, and O's final scale takes the 1 / (1 - rate).
//
// ALiBi on the tensor cores (kAlibiPrefix: the positions-and-ALiBi set's kernel, mask.h). Q·Kᵀ
// takes one more k block of 16 in front of the head dim's: key j's holds (c, c, c, 0, ...) with
// c = j − n0 its column in the block (the same for every block: written to smem once per CTA), and
// each query row of a tile holds (a1, a2, a3, 0, ...), the slope in the units of the raw scores
// (slope / scale) split into three 16-bit pieces: the same in every row, so that side is an A
// fragment in registers (an RS wgmma, set once per tile), with no smem, barrier or descriptor of its
// own in the loop. The products are exact and wgmma sums them in
// float, so the scores come out with slope·(j − n0) added: to float precision in bf16; in fp16 the
// pieces below its normal range keep fewer bits (about 2^-25 absolute per column of c, raw-score
// units), and a slope / scale past its range makes the tile fall back to the per-element term
// (alibi_prefix). The column c must be exact in 16 bits: kBlockN <= 256. On a block where
// every key a thread's rows see lies left of them (every block of a causal row) ALiBi is then a
// per-block shift, and the block skips the policy code as blocks without tests do (general_scores,
// block_needs' kNeedsAlibiAbs). The cost: one more k block of Q·Kᵀ, i.e. 1/8 more Q·Kᵀ work at
// H 128 (1/16 of Q·Kᵀ and P·V together), 1/4 at H 64, 1/16 at H 256. Measured (H200, bf16,
// causal 16k, sm90_check --masks): 82 / 82 / 82 % of plain causal before, 88 / 85 / 86 % after at
// H 64 / 128 / 256. The prefix alone, with the policy code still run on every block, gained
// nothing (ncu, H 128: 50M fewer instructions, the same cycles): what held ALiBi back was that
// code's instruction fetches and branches (ncu "no instruction" and "branch resolving" stall samples
// 3.7x and 2.1x the no-op window's; with the skip, 1.25x and 0.9x). The slopes' values do not
// matter (slopes of 0 measured the same). After that, ncu (H 256) found the kernel's time following
// its instruction count, both 12 % above the no-op window's: per key block and warp, the prefix's
// Q-side descriptors rebuilt (the rows' side was in smem then), block_needs' per-row |·| test and
// a null test of the slopes, and the shift's select. With the rows' side in registers, the |·|
// test a per-tile block index (TileRows::alibi_abs_from) and the rest compile-time: 91-92 / 93-95 /
// 95-98 % of plain causal at H 64 / 128 / 256, from 85-86 / 88-95 / 85-86 % (H200, bf16, causal 16k,
// interleaved A/B, benchmarks/results/2026-11-23-nvidia-h200-masks-15.csv); ptxas's spills of the
// kernel fell from 112 / 136 bytes (H 64 / 256) to 4.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "dropout.h"
#include "jfa/params.h"
#include "kernel_traits.h"
#include "mask.h"
#include "softmax.h"
#include "tile_scheduler.h"
#include "utils.h"

namespace jfa::sm90 {

using namespace cute;

// Global tensors as TMA sees them: (rows, head dim, heads, batch), head dim contiguous.
using GmemShape = Shape<int32_t, int32_t, int32_t, int32_t>;
using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;

template <typename Traits, typename GTensor>
auto make_tma_q(GTensor const& t) {
  return make_tma_copy(SM90_TMA_LOAD{}, t, typename Traits::SmemLayoutQ{},
                       Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>{}, _1{});
}
template <typename Traits, typename GTensor>
auto make_tma_kv(GTensor const& t) {
  return make_tma_copy(SM90_TMA_LOAD{}, t, take<0, 2>(typename Traits::SmemLayoutK{}),
                       Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{}, _1{});
}
// O is stored per consumer warpgroup, in boxes of 64 rows x 64 columns (one 128-byte swizzle
// atom wide): in SmemLayoutO such a box is contiguous and swizzled like a box of its own.
template <typename Traits, typename GTensor>
auto make_tma_o(GTensor const& t) {
  return make_tma_copy(SM90_TMA_STORE{}, t, typename Traits::SmemLayoutOBox{}, Shape<_64, _64>{}, _1{});
}

template <typename Traits>
struct KernelParams {
  using Element = typename Traits::Element;
  using GIn = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemShape{}, GmemStride{}));
  using GOut = decltype(make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), GmemShape{}, GmemStride{}));
  using TmaQ = decltype(make_tma_q<Traits>(std::declval<GIn>()));
  using TmaKV = decltype(make_tma_kv<Traits>(std::declval<GIn>()));
  using TmaO = decltype(make_tma_o<Traits>(std::declval<GOut>()));

  TmaQ tma_q;
  TmaKV tma_k, tma_v;
  TmaO tma_o;
  GmemShape shape_q, shape_kv;  // (T, H, N, B) and (S, H, K, B); O has Q's shape
  float* lse;
  int64_t lse_batch, lse_row, lse_head;
  float scale_log2;
  int T, S, group;  // group = N / K query heads per K/V head
  int num_tiles;
  AttentionParams attn;  // the whole call: the general path reads its masks and modifiers here
};

// Named barriers, by raw id (0 is __syncthreads'; the kernel uses no CUTLASS collective, so
// CUTLASS's reserved ids are free): per consumer warpgroup w, its ping-pong scheduler barrier, its
// tile meeting with the producer warp and its epilogue. Per warpgroup, so that nothing but the
// ping-pong order ties the consumers together: a warpgroup ending a tile stores its own 64 rows
// of O and starts the next tile while the other still runs its last P·V. With one barrier of all
// consumers there, both waited for the later one and then ran their epilogues side by side, the
// tensor cores idle; it weighs most on tiles of few key blocks: causal 1k measured 3-4 % faster
// without it (H 64 and H 128, H200, benchmarks/ab_sm90.sh --lengths), 16k level.
enum : int { kBarSchedFirst = 1, kBarTileFirst = 4, kBarEpilogueFirst = 7 };

__forceinline__ __device__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__forceinline__ __device__ void bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// The tile meeting of the producer warp and consumer warpgroup w. The unaligned form: the
// producer lanes may arrive diverged (each spins on the pipeline's mbarriers on its own), which
// bar.sync's aligned form does not allow (synccheck reports it).
__forceinline__ __device__ void tile_meeting(int w) {
  asm volatile("barrier.sync %0, %1;" ::"r"(kBarTileFirst + w), "r"(128 + 32) : "memory");
}

// The smem words through which the producer hands out tiles: the tile meetings (named barriers)
// order the accesses between the producer and the consumers, __syncwarp the producer lanes' read
// back of lane 0's write, for the hardware; the volatile accesses and compiler fences do it for
// the compiler (CUTLASS's barrier asm declares no memory clobber).
__forceinline__ __device__ void publish_work(TileWork& slot, const TileWork& w) {
  asm volatile("" ::: "memory");
  volatile int* words = reinterpret_cast<volatile int*>(&slot);
  words[0] = w.tile;
  words[1] = w.coord.m_block;
  words[2] = w.coord.head;
  words[3] = w.coord.batch;
  words[4] = w.n_begin;
  words[5] = w.n_end;
  asm volatile("" ::: "memory");
}
__forceinline__ __device__ TileWork announced_work(const TileWork& slot) {
  asm volatile("" ::: "memory");
  const volatile int* words = reinterpret_cast<const volatile int*>(&slot);
  const TileWork w{words[0], {words[1], words[2], words[3]}, words[4], words[5]};
  asm volatile("" ::: "memory");
  return w;
}

// The general path's key blocks [x, y) of query tile m_block: those of its position range that
// may share a segment with it; no key at all gives block 0, fully masked.
template <int kBlockM, int kBlockN>
__forceinline__ __device__ int2 general_block_range(const AttentionParams& p, int batch, int m_block) {
  const int m0 = m_block * kBlockM;
  const KeyRange r =
      segment_narrowed(key_range(p, sequence_bounds(p, batch), m0, kBlockM), p.mask.q_segment_chunks, batch,
                       int(p.T), m0, kBlockM);
  if (r.end <= r.begin) return make_int2(0, 1);
  return make_int2(int(r.begin / kBlockN), int((r.end + kBlockN - 1) / kBlockN));
}

template <typename Traits, bool kCausal, int kPolicies>
__global__ void __launch_bounds__(Traits::kNumThreads, 1)
    fwd_kernel(CUTE_GRID_CONSTANT KernelParams<Traits> const p, TileScheduler<kCausal || kPolicies != 0> const sched) {
  constexpr bool kGeneral = kPolicies != 0;
  constexpr bool kDropout = (kPolicies & kPolicyDropout) != 0;
  constexpr bool kAlibiPrefix = alibi_on_tensor_cores(kPolicies);
  static_assert(!kAlibiPrefix || Traits::kBlockN <= 256, "the prefix's key columns must be exact in bf16");
  static_assert(!(kCausal && kGeneral), "the general path takes causality from p.attn");
  using Element = typename Traits::Element;
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename Traits::PipelineState;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kNumMmaThreads = Traits::kNumMmaThreads;
  constexpr int kNumMmaWarpGroups = Traits::kNumMmaWarpGroups;

  extern __shared__ __align__(1024) char smem_raw[];
  auto& ss = *reinterpret_cast<SharedStorage<Traits, kAlibiPrefix>*>(smem_raw);
  const int warp_group = cutlass::canonical_warp_group_idx();

  if (threadIdx.x == 0) {
    ss.q_full.init(1);
    // Aliased O: each consumer warpgroup's storing thread, once its store has read smem.
    ss.q_empty.init(Traits::kOAliasesQ ? kNumMmaWarpGroups : kNumMmaThreads);
  }
  typename Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = Traits::kKVStageBytes;
  pipe_params.role = warp_group == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = kNumMmaThreads;
  Pipeline pipeline_k(ss.pipeline_k, pipe_params, Shape<_1, _1, _1>{});
  Pipeline pipeline_v(ss.pipeline_v, pipe_params, Shape<_1, _1, _1>{});
  // ALiBi's k prefix, the keys' side: every block's, (c, c, c, 0, ...) for column c.
  constexpr int kPrefixK = Traits::kPrefixK;
  if constexpr (kAlibiPrefix) {
    Tensor sKPrefix = make_tensor(make_smem_ptr(ss.prefix.k.data()), typename Traits::SmemLayoutKPrefix{});
    for (int i = threadIdx.x; i < kBlockN * kPrefixK; i += Traits::kNumThreads)
      sKPrefix(i / kPrefixK, i % kPrefixK) = Element(i % kPrefixK < 3 ? float(i / kPrefixK) : 0.f);
    cutlass::arch::fence_view_async_shared();  // visible to wgmma (the async proxy) after the barrier
  }
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutV{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutVt{});
  Element* const smem_o = Traits::kOAliasesQ ? ss.q.data() : ss.o.data();
  Tensor sO = make_tensor(make_smem_ptr(smem_o), typename Traits::SmemLayoutO{});

  // Tile `tile` with its coordinates and the key blocks [n_begin, n_end) it visits (walked from
  // n_end - 1 down to n_begin).
  auto work_of = [&](int tile) {
    TileWork w{tile, {0, 0, 0}, 0, 1};
    if (tile >= p.num_tiles) return w;
    w.coord = sched.get(tile);
    if constexpr (kGeneral) {
      const int2 r = general_block_range<kBlockM, kBlockN>(p.attn, w.coord.batch, w.coord.m_block);
      w.n_begin = r.x;
      w.n_end = r.y;
    } else {
      w.n_end = (p.S + kBlockN - 1) / kBlockN;
      if constexpr (kCausal) w.n_end = min(w.n_end, (w.coord.m_block * kBlockM + kBlockM + kBlockN - 1) / kBlockN);
    }
    return w;
  };

  if (warp_group == 0) {
    // ---------------- producer ----------------
    // Warp 0 produces: all its lanes take part in the tile handshake's named barrier, lane 0
    // issues the loads (PipelineTmaAsync's is_leader).
    cutlass::arch::warpgroup_reg_dealloc<Traits::kLoadRegs>();
    if (threadIdx.x >= 32) return;
    const bool leader = threadIdx.x == 0;
    Tensor mQ = p.tma_q.get_tma_tensor(p.shape_q);
    Tensor mK = p.tma_k.get_tma_tensor(p.shape_kv);
    Tensor mV = p.tma_v.get_tma_tensor(p.shape_kv);
    PipelineState write = cutlass::make_producer_start_state<Pipeline>();
    TileWork work = work_of(blockIdx.x);
    for (int iter = 0; work.tile < p.num_tiles; ++iter) {
      const TileCoord t = work.coord;
      const int kv_head = t.head / p.group;
      Tensor gQ = local_tile(mQ(_, _, t.head, t.batch), Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(t.m_block, _0{}));
      Tensor gK = local_tile(mK(_, _, kv_head, t.batch), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
      Tensor gV = local_tile(mV(_, _, kv_head, t.batch), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
      auto [tQgQ, tQsQ] = tma_partition(p.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto [tKgK, tKsK] = tma_partition(p.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto [tVgV, tVsV] = tma_partition(p.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));

      auto load_k = [&](int n, PipelineState const& st) {
        pipeline_k.producer_acquire(st);
        if (leader) copy(p.tma_k.with(*pipeline_k.producer_get_barrier(st)), tKgK(_, n), tKsK(_, st.index()));
      };
      auto load_v = [&](int n, PipelineState const& st) {
        pipeline_v.producer_acquire(st);
        if (leader) copy(p.tma_v.with(*pipeline_v.producer_get_barrier(st)), tVgV(_, n), tVsV(_, st.index()));
      };
      int n = work.n_end - 1;
      // The first K goes out before waiting for the consumers to free Q: it overlaps their epilogue.
      load_k(n, write);
      if (iter > 0) ss.q_empty.wait((iter - 1) & 1);
      if (leader) {
        ss.q_full.arrive_and_expect_tx(Traits::kQBytes);
        copy(p.tma_q.with(reinterpret_cast<uint64_t&>(ss.q_full)), tQgQ, tQsQ);
      }
      // K of block n-1 goes out before V of block n: the consumers need it first (Q·K[n-1]ᵀ is
      // issued before P·V[n]), and V[n]'s slot frees later (when P·V[n-2] has finished).
      auto load_step = [&] {
        PipelineState write_v = write;
        ++write;
        load_k(n - 1, write);
        load_v(n, write_v);
        --n;
      };
      // The first step's slots free during the previous tile: its loads go out before the wait
      // below, which lasts until the consumers start this tile (a tile of one block: its V).
      const bool one_block = n == work.n_begin;
      if (one_block) {
        load_v(n, write);
        ++write;
      } else {
        load_step();
      }
      // Consumer 0 leads the ping-pong, so it is met first.
      for (int w = 0; w < kNumMmaWarpGroups; ++w) tile_meeting(w);
      // The next tile: claimed (sched.next), worked out (work_of) and handed to the consumers, who
      // read it after the next meeting (SharedStorage::next_work). Here, after this meeting, the
      // claim's round trip and the block range (with segment ids, the summaries' loads) run while
      // the consumers compute this tile's first block and the next load step waits for its slots.
      // Before, they ran ahead of this tile's first load step (general kernels) or of the meeting
      // (plain ones), where the consumers waited for them (ncu, H 128, causal on 4k rows: 1.7x
      // plain causal's stall samples at the meeting). Measured against that (H200, bf16,
      // benchmarks/ab_sm90.sh --masks, two A/Bs on two machines, 2 rounds each; benchmarks/
      // results/2026-11-23-nvidia-h200-masks-12.csv): 4 segments of 4096 2.1-2.4 % faster at H 128
      // and 1.4-2.0 % at H 64; the other rows within the round-to-round noise (about +-3 %).
      {
        const TileWork next = work_of(__shfl_sync(0xffffffffu, leader ? sched.next(work.tile) : 0, 0));
        if (leader) publish_work(ss.next_work[(iter + 1) & 1], next);
      }
      if (!one_block) {
#pragma unroll 1
        while (n > work.n_begin) load_step();
        load_v(work.n_begin, write);
        ++write;
      }
      // Read back rather than kept in registers through the loop (the producer has 24); lane 0
      // wrote it, no meeting since.
      __syncwarp();
      work = announced_work(ss.next_work[(iter + 1) & 1]);
    }
    // One more meeting per consumer, where they read that no tile is left.
    for (int w = 0; w < kNumMmaWarpGroups; ++w) tile_meeting(w);
    // Do not exit while a consumer may still arrive on a barrier of this CTA.
    pipeline_k.producer_tail(write);
    pipeline_v.producer_tail(write);
    return;
  }

  // ---------------- consumers ----------------
  cutlass::arch::warpgroup_reg_alloc<Traits::kMmaRegs>();
  const int tid = threadIdx.x - 128;
  const int mma_wg = warp_group - 1;
  const int wg_tid = tid % 128;
  auto sched_sync = [&] { bar_sync(kBarSchedFirst + mma_wg, 256); };
  auto sched_arrive = [&] {
    const int next = mma_wg + 1 == kNumMmaWarpGroups ? 0 : mma_wg + 1;
    bar_arrive(kBarSchedFirst + next, 256);
  };
  if (mma_wg == 0) bar_arrive(kBarSchedFirst, 256);  // consumer 0 goes first

  typename Traits::TiledMmaQK mma_qk;
  typename Traits::TiledMmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(tid);
  auto thr_pv = mma_pv.get_thread_slice(tid);
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);
  Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, N, K, stage)
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, N, K, stage)
  // ALiBi's k prefix: the rows' side in registers (the same for every row: the A fragment's
  // elements of columns 0-2 hold the slope's pieces, set per tile), the keys' side in smem.
  typename Traits::TiledMmaQKPrefix mma_qk_prefix;
  auto thr_qk_prefix = mma_qk_prefix.get_thread_slice(tid);
  const auto prefix_shape_a = Shape<Int<kBlockM>, Int<kPrefixK>>{};
  Tensor tSrQPrefix = thr_qk_prefix.partition_fragment_A(make_identity_tensor(prefix_shape_a));
  Tensor tScQPrefix = thr_qk_prefix.partition_A(make_identity_tensor(prefix_shape_a));
  Element* const k_prefix = [&] {
    if constexpr (kAlibiPrefix) return ss.prefix.k.data(); else return ss.k.data();  // unused then
  }();
  Tensor tSrKPrefix =
      thr_qk_prefix.partition_fragment_B(make_tensor(make_smem_ptr(k_prefix), typename Traits::SmemLayoutKPrefix{}));
  Tensor cS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor cS_rc = make_tensor(cS.data(), acc_rowcol(cS.layout()));
  // Thread 0's coordinates: compile-time constants (see apply_policy).
  Tensor cS0 = mma_qk.get_thread_slice(0).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor cS0_rc = make_tensor(cS0.data(), acc_rowcol(cS0.layout()));
  Tensor cO = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor cO_rc = make_tensor(cO.data(), acc_rowcol(cO.layout()));
  constexpr int kRows = decltype(size<0>(cO_rc))::value;

  auto copy_o = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_pv);
  auto thr_copy_o = copy_o.get_thread_slice(tid);
  Tensor tOsO = thr_copy_o.partition_D(sO);

  PipelineState read;
  TileWork work = work_of(blockIdx.x);
  // Keep each block's softmax before the wait for the P·V under it (utils.h, softmax_done). Not on
  // the general path with three consumers (H 64's 192 x 112 at 160 registers): the P and O
  // registers held through the softmax raise its spills from 12 to 60 bytes (ptxas), and its masks
  // measured 2-7 % slower that way (H200, 16k, benchmarks/ab_sm90.sh --masks, masks-6.csv). The
  // plain tiles gained 1-5 % (benchmarks/results/2026-11-22-nvidia-h200-pin-softmax.csv), the
  // other general tiles stayed level.
  constexpr bool kPinSoftmax = !(kGeneral && kNumMmaWarpGroups == 3);
  float& softmax_sink = ss.softmax_sink[tid];
  // Meetings with the producer (which it reaches once it has issued that tile's first loads):
  // this one for the first tile, then one at the end of each tile for the next.
  tile_meeting(mma_wg);
#pragma unroll 1
  for (int iter = 0; work.tile < p.num_tiles; ++iter) {
    const TileCoord t = work.coord;
    const int m0 = t.m_block * kBlockM;
    int n = work.n_end - 1;
    // General path: this thread's rows of the tile, the per-element tests block n needs (found
    // under the block's GEMMs), and its scores with masks and modifiers applied, in units the
    // softmax multiplies by `logit_scale` (policy_logit_scale). The rows are read under the first
    // block's GEMM (below): read here, before it, their 64-bit position bounds put ~155
    // instructions between the tile meeting and that GEMM's issue (plain causal: ~75), and the
    // general kernel's tile start took 1.5x plain causal's stall samples (ncu, H200, H 128,
    // causal on 4k rows, a window that hides nothing).
    [[maybe_unused]] TileRows<kRows> rows;
    auto tests_of = [&](int n_block) CUTLASS_LAMBDA_FUNC_INLINE {
      return kGeneral ? block_needs<kPolicies>(p.attn, rows, n_block) : 0;
    };
    // Score modifiers touch every block (the full policy code). Without them a block whose
    // elements need no test (most blocks of a window or of packed segments) skips the policy code
    // altogether, and the others run a copy without the modifiers. Before, the per-feature checks
    // ran on every block: ncu, H200, H 128 causal 16k with a no-op window, 619M instructions
    // against plain causal's 540M, 565M with the skip.
    // The ALiBi prefix kernel always has slopes (launch.h runs it for calls with ALiBi only; without
    // them its prefix and shifts would add zeros): a compile-time true there, one select less per
    // block.
    constexpr int kScoreMods = kPolicyAlibi | kPolicyScore;
    const bool score_mods = kAlibiPrefix || ((kPolicies & kScoreMods) && p.attn.mask.has_score_mod());
    // ALiBi's slope in the units of the raw scores (apply_policy's), for the tensor cores' prefix.
    const MaskParams& mp = p.attn.mask;
    [[maybe_unused]] const float prefix_slope =
        kAlibiPrefix && mp.alibi_slopes != nullptr
            ? mp.alibi_slope(t.batch, t.head) * (kLog2eF / p.attn.scale_log2)
            : 0.f;
    // The per-row shift of the block's scores (apply_policy: ALiBi), which the softmax adds; only
    // ALiBi sets one, so the other sets' kernels run the softmax without it.
    constexpr bool kShifts = (kPolicies & kPolicyAlibi) != 0;
    float shift[kRows];
    // With ALiBi's term in the scores (the tensor cores' prefix) ALiBi is no score modifier: a block
    // whose elements need no test (kNeedsAlibiAbs among them) takes its shift alone.
    // The per-block lambdas are inlined by force: ptxas once compiled this one as a called function
    // in the dropout kernel, with S in local memory (a 448-byte stack frame; 5.4x slower at H 128).
    auto general_scores = [&](auto& scores_rc, int n_block, int needs,
                              bool alibi_in_scores) CUTLASS_LAMBDA_FUNC_INLINE {
      const int n0 = n_block * kBlockN;
      if (score_mods && !alibi_in_scores) {
        apply_policy<kPolicies>(scores_rc, cS_rc, cS0_rc, p.attn, rows, t.batch, t.head, m0, n0, kBlockN, needs, shift);
      } else if (needs != 0) {
        if (alibi_in_scores)
          apply_policy<kPolicies>(scores_rc, cS_rc, cS0_rc, p.attn, rows, t.batch, t.head, m0, n0, kBlockN, needs,
                                  shift, true);
        else
          apply_policy<kPolicies & ~kScoreMods>(scores_rc, cS_rc, cS0_rc, p.attn, rows, t.batch, t.head, m0, n0, kBlockN,
                                                needs, shift);
      } else {
        const float uniform = alibi_in_scores && score_mods ? alibi_shift(prefix_slope, rows, n0) : 0.f;
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) shift[r] = uniform;
      }
    };
    const float logit_scale = kGeneral ? policy_logit_scale(p.attn) : p.scale_log2;
    // ALiBi's k prefix for this tile: the slope in raw-score units, in three 16-bit pieces. fp16
    // cannot hold a slope / scale past its range: such a tile adds the term per element instead.
    constexpr bool kPrefixHoldsAnySlope = !is_same_v<Element, cutlass::half_t>;  // bf16 has float's range
    const bool alibi_prefix = kAlibiPrefix && (kPrefixHoldsAnySlope || fabsf(prefix_slope) <= 65504.f);
    // What apply_policy's ALiBi code (which runs only with slopes) is told of the loop's scores: a
    // compile-time true where every slope takes the prefix, so that its per-element path is not
    // compiled into the loop.
    const bool alibi_in_scores = kAlibiPrefix && (kPrefixHoldsAnySlope || alibi_prefix);
    // The rows' side of the prefix for this tile, in registers: (a1, a2, a3, 0, ...) in every row.
    // This warpgroup's GEMMs of the previous tile, which read the fragment, have finished (its tile
    // ends with a wait for all of them).
    if constexpr (kAlibiPrefix) {
      const Element a1(prefix_slope);
      const float rest = prefix_slope - float(a1);
      const Element a2(rest);
      const Element a3(rest - float(a2));
      CUTE_UNROLL
      for (int i = 0; i < size(tSrQPrefix); ++i) {
        const int k = get<1>(tScQPrefix(i));
        tSrQPrefix(i) = k == 0 ? a1 : k == 1 ? a2 : k == 2 ? a3 : Element(0.f);
      }
    }

    Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor tSrS_rc = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
    Tensor tOrP = make_tensor<Element>(acc_as_a_operand(tSrS.layout()));
    Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    Tensor tOrO_rc = make_tensor(tOrO.data(), acc_rowcol(tOrO.layout()));
    static_assert(decltype(size<0>(tSrS_rc))::value == kRows);
    // Dropout: this thread's share of the tile's stream; its columns are those of thread 0 shifted
    // by a per-thread constant (as in apply_policy).
    [[maybe_unused]] const DropoutTile drop =
        kDropout ? dropout_tile(p.attn, t.batch, t.head, m0, cS_rc) : DropoutTile{};
    [[maybe_unused]] const int drop_col_shift = get<1>(cS_rc(0, 0)) - get<1>(cS0_rc(0, 0));
    auto dropout = [&](int n_block) CUTLASS_LAMBDA_FUNC_INLINE {
      if constexpr (kDropout) apply_dropout(tSrS_rc, drop, n_block * kBlockN + drop_col_shift, cS0_rc);
    };
    OnlineSoftmax<kRows> softmax;
    float o_scale[kRows];
    // Whether O must be scaled by o_scale before the next P·V: only when a row's running max grew
    // (softmax.h, kMaxGrowthLog2). Decided per warp, so that the warp skips or runs the FMULs as
    // one; tiles without kRescaleOnGrowthOnly (kernel_traits.h) scale on every block.
    bool rescale_o = false;
    auto rescale_o_if_needed = [&]() CUTLASS_LAMBDA_FUNC_INLINE {
      if (!Traits::kRescaleOnGrowthOnly || __any_sync(0xffffffffu, rescale_o)) scale_rows(tOrO_rc, o_scale);
    };

    ss.q_full.wait(iter & 1);

    // Once its last Q·Kᵀ has finished, a consumer is done with Q: with an own O buffer, the next
    // tile's Q may load under this tile's last softmax, P·V and epilogue.
    auto release_q_after = [&](int n_block) CUTLASS_LAMBDA_FUNC_INLINE {
      if constexpr (!Traits::kOAliasesQ)
        if (n_block == work.n_begin) ss.q_empty.arrive();
    };

    // First (last-in-memory) key block: the only one that can cross S; causal diagonal too. Its
    // tests are found under its GEMM, as in the loop (they wait for tile_rows' loads). It runs
    // without ALiBi's prefix (apply_policy adds the term per element).
    pipeline_k.consumer_wait(read);
    gemm</*zero_init=*/true, /*wait=*/-1>(mma_qk, tSrQ, tSrK(_, _, _, read.index()), tSrS);
    if constexpr (kGeneral) rows = tile_rows<kPolicies, kRows, kBlockM, kBlockN>(p.attn, t.batch, t.head, m0, cS_rc);
    int needs = tests_of(n);
    warpgroup_wait<0>();
    warpgroup_fence_operand(tSrS);
    pipeline_k.consumer_release(read);
    release_q_after(n);
    if constexpr (kGeneral) {
      general_scores(tSrS_rc, n, needs, false);
      if constexpr (kShifts)
        rescale_o = softmax.template update<true>(tSrS_rc, logit_scale, o_scale, shift);
      else
        rescale_o = softmax.template update<true>(tSrS_rc, logit_scale, o_scale);
      dropout(n);
    } else {
      apply_mask<kCausal, true>(tSrS, cS, m0, n * kBlockN, p.S);
      rescale_o = softmax.template update<true>(tSrS_rc, logit_scale, o_scale);
    }
    convert(tSrS, tOrP);
    clear(tOrO);

#pragma unroll 1
    for (--n; n >= work.n_begin; --n) {
      PipelineState read_v = read;  // V of the previous block
      ++read;
      pipeline_k.consumer_wait(read);
      sched_sync();
      // (Not a lambda: one for this issue made ptxas keep S in local memory, a 464-byte stack frame
      // in the all-policies kernel.)
      if (kAlibiPrefix && alibi_prefix)
        gemm_with_prefix(mma_qk_prefix, mma_qk, tSrQPrefix, tSrKPrefix, tSrQ, tSrK(_, _, _, read.index()), tSrS);
      else
        gemm</*zero_init=*/true, /*wait=*/-1>(mma_qk, tSrQ, tSrK(_, _, _, read.index()), tSrS);
      rescale_o_if_needed();
      pipeline_v.consumer_wait(read_v);
      gemm</*zero_init=*/false, /*wait=*/-1>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
      sched_arrive();
      needs = tests_of(n);
      warpgroup_wait<1>();  // S is ready; P·V still running
      pipeline_k.consumer_release(read);
      release_q_after(n);
      if constexpr (kGeneral) {
        general_scores(tSrS_rc, n, needs, alibi_in_scores);
        if constexpr (kShifts)
          rescale_o = softmax.template update<false>(tSrS_rc, logit_scale, o_scale, shift);
        else
          rescale_o = softmax.template update<false>(tSrS_rc, logit_scale, o_scale);
        dropout(n);
      } else {
        if (kCausal && n * kBlockN + kBlockN - 1 > m0) apply_mask<kCausal, false>(tSrS, cS, m0, n * kBlockN, p.S);
        rescale_o = softmax.template update<false>(tSrS_rc, logit_scale, o_scale);
      }
      if constexpr (kPinSoftmax) {
        float last = softmax.row_sum[0] + softmax.row_sum[kRows - 1];
        // With dropout, a probability it computes last joins in: that ties the last Philox call to
        // the store (the others are not tied to it; timing, not results, depends on where they go).
        if constexpr (kDropout) last += tSrS_rc(kRows - 1, size<1>(tSrS_rc) - 1);
        softmax_done(softmax_sink, last);
      }
      warpgroup_wait<0>();  // P·V(n + 1) has finished: P may be overwritten
      pipeline_v.consumer_release(read_v);
      convert(tSrS, tOrP);
    }
    rescale_o_if_needed();
    pipeline_v.consumer_wait(read);
    gemm</*zero_init=*/false, /*wait=*/-1>(mma_pv, tOrP, tOrV(_, _, _, read.index()), tOrO);
    float lse[kRows];
    softmax.finalize(logit_scale, o_scale, lse);
    if constexpr (kGeneral) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) lse[r] -= alibi_lse_shift(p.attn, rows, r);
    }
    if constexpr (kDropout) {
      const float keep_scale = 1.f / (1.f - p.attn.mask.dropout_rate);
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) o_scale[r] *= keep_scale;
    }
    warpgroup_wait<0>();
    pipeline_v.consumer_release(read);
    ++read;
    scale_rows(tOrO_rc, o_scale);

    // ---------------- epilogue ----------------
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
    // Each warpgroup stores its own rows: its threads write their O fragments into its 64 rows of
    // sO, and its first thread issues the TMA stores of those rows (rows >= T are clipped by TMA).
    const int epilogue_bar = kBarEpilogueFirst + mma_wg;
    if constexpr (!Traits::kOAliasesQ) {
      // This warpgroup's previous store must have read its rows of sO before they are overwritten.
      if (wg_tid == 0) tma_store_wait<0>();
      bar_sync(epilogue_bar, 128);
    }
    copy(copy_o, thr_copy_o.retile_S(rO), tOsO);
    cutlass::arch::fence_view_async_shared();  // make the smem writes visible to TMA
    bar_sync(epilogue_bar, 128);
    if (wg_tid == 0) {
      Tensor mO = p.tma_o.get_tma_tensor(p.shape_q);
      Tensor gO = local_tile(mO(_, _, t.head, t.batch), Shape<_64, _64>{},
                             make_coord(t.m_block * kNumMmaWarpGroups + mma_wg, _));  // (64, 64, H / 64)
      CUTE_UNROLL
      for (int c = 0; c < kHeadDim / 64; ++c) {
        Tensor sO_box = make_tensor(make_smem_ptr(smem_o + Traits::o_box_offset(mma_wg, c)),
                                    typename Traits::SmemLayoutOBox{});
        auto [tOgO_tma, tOsO_tma] =
            tma_partition(p.tma_o, _0{}, Layout<_1>{}, group_modes<0, 2>(sO_box), group_modes<0, 2>(gO(_, _, c)));
        copy(p.tma_o, tOsO_tma, tOgO_tma);
      }
      tma_store_arrive();
      if constexpr (Traits::kOAliasesQ) {
        tma_store_wait<0>();  // O lives in Q's smem: the next Q may load once the stores have read it
        ss.q_empty.arrive();
      }
    }
    // The next tile's meeting, after which the producer's word on that tile may be read.
    tile_meeting(mma_wg);
    work = announced_work(ss.next_work[(iter + 1) & 1]);
  }
  if (wg_tid == 0) tma_store_wait<0>();
}

}  // namespace jfa::sm90
