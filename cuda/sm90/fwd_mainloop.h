// The Hopper forward's consumer warpgroups: each owns 64 query rows of a tile and walks its key
// blocks from the last one down (the boundary and diagonal blocks come first and are the only ones
// masked on the plain path). Per key block n:
//   wait K[n]; [scheduler barrier] issue S = Q·K[n]ᵀ (SS); O *= scale(n+1) (if a max grew);
//   issue O += P(n+1)·V[n+1] (RS, P in registers) [arrive at the next warpgroup's barrier];
//   wait S; softmax(S) -> P(n), scale(n); wait P·V.
// So inside a warpgroup the softmax of block n runs while the tensor cores do P·V of block n+1
// (provided the wait comes after it in SASS: utils.h, softmax_done), and between warpgroups the
// named "scheduler" barriers make their GEMM issues alternate (ping-pong): one warpgroup's softmax
// runs under the other's GEMMs.
//
// kPolicies != 0, the general path (with kCausal = false): masks and score modifiers as policies
// (mask_policies.h, fwd_general.h), compiled for the set of them in kPolicies; a tile visits only the key
// blocks of its position range that may share a segment with it (fwd_params.h, fwd_tile_work), and
// a tile that sees no key visits block 0 fully masked, so it writes O = 0 and LSE = -inf the usual
// way. With kPolicyDropout, each block's probabilities are dropped after the softmax statistics
// (dropout.h), the row sums and LSE kept dropout-free, and O's final scale takes 1 / (1 - rate).
//
// ALiBi on the tensor cores (kAlibiPrefix: the positions-and-ALiBi set's kernel, mask_policies.h). Q·Kᵀ
// takes one more k block of 16 in front of the head dim's: key j's holds (c, c, c, 0, ...) with
// c = j − n0 its column in the block (the same for every block: written to smem once per CTA), and
// each query row of a tile holds (a1, a2, a3, 0, ...), the slope in the units of the raw scores
// (slope / scale) split into three 16-bit pieces: the same in every row, so that side is an A
// fragment in registers (an RS wgmma, set once per tile). The products are exact and wgmma sums
// them in float, so the scores come out with slope·(j − n0) added: to float precision in bf16; in
// fp16 the pieces below its normal range keep fewer bits (about 2^-25 absolute per column of c,
// raw-score units), and a slope / scale past its range makes the tile fall back to the per-element
// term. The column c must be exact in 16 bits: kBlockN <= 256. On a block where every key a
// thread's rows see lies left of them (every block of a causal row) ALiBi is then a per-block
// shift, and the block skips the policy code as blocks without tests do. The cost: one more k
// block of Q·Kᵀ (1/16 of Q·Kᵀ and P·V together at H 128); what it saves is the policy code's
// per-element instructions, which set ALiBi's pace without it (docs/performance.md).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "dropout.h"
#include "fwd_epilogue.h"
#include "fwd_general.h"
#include "fwd_params.h"
#include "fwd_traits.h"
#include "mask_policies.h"
#include "named_barriers.h"
#include "paged_kv.h"
#include "softmax.h"
#include "tile_scheduler.h"
#include "utils.h"

namespace jfa::sm90 {

using namespace cute;

// A consumer thread's per-CTA objects: its tiled MMAs, operand fragments (smem descriptors; the
// ALiBi prefix's rows' side in registers) and the coordinates of its accumulator elements.
template <typename Traits, bool kAlibiPrefix, typename Storage>
__forceinline__ __device__ auto fwd_consumer_fragments(Storage& ss, int tid) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  typename Traits::TiledMmaQK mma_qk;
  auto thr_qk = mma_qk.get_thread_slice(tid);
  Tensor q = thr_qk.partition_fragment_A(make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQ{}));
  // (MMA, N, K, stage)
  Tensor k = thr_qk.partition_fragment_B(make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutK{}));
  typename Traits::TiledMmaPV mma_pv;
  auto thr_pv = mma_pv.get_thread_slice(tid);
  Tensor v = thr_pv.partition_fragment_B(make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutVt{}));
  typename Traits::TiledMmaQKPrefix mma_qk_prefix;
  auto thr_qk_prefix = mma_qk_prefix.get_thread_slice(tid);
  const auto prefix_shape_a = Shape<Int<kBlockM>, Int<Traits::kPrefixK>>{};
  Element* const k_prefix = [&] {
    if constexpr (kAlibiPrefix) return ss.prefix.k.data(); else return ss.k.data();  // unused then
  }();
  Tensor q_prefix = thr_qk_prefix.partition_fragment_A(make_identity_tensor(prefix_shape_a));
  Tensor q_prefix_coords = thr_qk_prefix.partition_A(make_identity_tensor(prefix_shape_a));
  Tensor k_prefix_frag =
      thr_qk_prefix.partition_fragment_B(make_tensor(make_smem_ptr(k_prefix), typename Traits::SmemLayoutKPrefix{}));
  Tensor cS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor cS0 = mma_qk.get_thread_slice(0).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor cO = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor s_coords = make_tensor(cS.data(), acc_rowcol(cS.layout()));
  // Thread 0's coordinates: compile-time constants (mask_policies.h, apply_policy).
  Tensor s_coords0 = make_tensor(cS0.data(), acc_rowcol(cS0.layout()));
  Tensor o_coords = make_tensor(cO.data(), acc_rowcol(cO.layout()));
  struct Fragments {
    typename Traits::TiledMmaQK mma_qk;
    typename Traits::TiledMmaPV mma_pv;
    typename Traits::TiledMmaQKPrefix mma_qk_prefix;
    decltype(q) tSrQ;
    decltype(k) tSrK;
    decltype(v) tOrV;
    decltype(q_prefix) tSrQPrefix;
    decltype(q_prefix_coords) tScQPrefix;
    decltype(k_prefix_frag) tSrKPrefix;
    decltype(cS) cS;                 // (key, query) of each score, accumulator layout
    decltype(s_coords) cS_rc;        // the same as (rows, cols)
    decltype(s_coords0) cS0_rc;      // thread 0's
    decltype(o_coords) cO_rc;        // of each output element, (rows, cols)
  };
  return Fragments{mma_qk, mma_pv, mma_qk_prefix, q, k, v, q_prefix, q_prefix_coords, k_prefix_frag,
                   cS, s_coords, s_coords0, o_coords};
}

// A consumer warpgroup whose 64 rows all lie past the call's queries (a decoding call's few folded
// rows, a short T's last tile) has nothing to compute, and its GEMMs and softmax would only slow the
// other warpgroup's: it keeps the hand-offs alone, every K and V stage waited on and released as the
// loop below does, every ping-pong barrier met, Q released, and the tile's blocks read from the
// producer's words where it hands them.
template <typename Traits, int kPolicies, typename Storage>
__forceinline__ __device__ void fwd_pass_idle(Storage& ss, typename Traits::Pipeline& pipeline_k,
                                              typename Traits::Pipeline& pipeline_v,
                                              typename Traits::PipelineState& read, const TileWork& work, int w) {
  using PipelineState = typename Traits::PipelineState;
  constexpr int kNumMmaWarpGroups = Traits::kNumMmaWarpGroups;
  constexpr bool kHandedBlocks = FwdBlockWalk<Traits, kPolicies>::kMask;
  auto release_q_after = [&](int n_block) CUTLASS_LAMBDA_FUNC_INLINE {
    if constexpr (!Traits::kOAliasesQ)
      if (n_block == work.n_begin) ss.q_empty.arrive();
  };
  FwdBlockInfo info{0};
  int n = work.n_end - 1;
  pipeline_k.consumer_wait(read);
  if constexpr (kHandedBlocks) {
    info = handed_block(ss, read);
    n = info.block();
  }
  pipeline_k.consumer_release(read);
  release_q_after(n);
  int next_n = kHandedBlocks ? (info.more() ? work.n_begin : -1) : n - 1;
#pragma unroll 1
  for (n = next_n; n >= work.n_begin; n = next_n) {
    PipelineState read_v = read;
    ++read;
    pipeline_k.consumer_wait(read);
    bar_sync(kFwdBarSchedFirst + w, kFwdSchedBarThreads);
    bar_arrive(kFwdBarSchedFirst + (w + 1 == kNumMmaWarpGroups ? 0 : w + 1), kFwdSchedBarThreads);
    if constexpr (kHandedBlocks) {
      info = handed_block(ss, read);
      n = info.block();
    }
    next_n = kHandedBlocks ? (info.more() ? work.n_begin : -1) : n - 1;
    pipeline_k.consumer_release(read);
    release_q_after(n);
    pipeline_v.consumer_wait(read_v);
    pipeline_v.consumer_release(read_v);
  }
  pipeline_v.consumer_wait(read);
  pipeline_v.consumer_release(read);
  ++read;
}

// One tile's key loop for this consumer warpgroup (w): O (scaled, in tOrO) and the rows' LSE.
template <typename Traits, bool kCausal, int kPolicies, typename Storage, typename Frags, typename AccO, int kRows>
__forceinline__ __device__ void fwd_attend(const FwdParams<Traits>& p, Storage& ss, typename Traits::Pipeline& pipeline_k,
                                           typename Traits::Pipeline& pipeline_v,
                                           typename Traits::PipelineState& read, const TileWork& work, int iter,
                                           Frags& f, int tid, int w, AccO& tOrO, float (&lse)[kRows]) {
  using Element = typename Traits::Element;
  using PipelineState = typename Traits::PipelineState;
  constexpr bool kGeneral = kPolicies != 0;
  constexpr bool kDropout = (kPolicies & kPolicyDropout) != 0;
  constexpr bool kAlibiPrefix = alibi_on_tensor_cores(kPolicies);
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kNumMmaWarpGroups = Traits::kNumMmaWarpGroups;
  using General = FwdGeneralTile<Traits, kPolicies, kRows>;
  const TileCoord t = work.coord;
  const int m0 = t.m_block * kBlockM;
  if (m0 + 64 * w >= p.T) {
    ss.q_full.wait(iter & 1);
    fwd_pass_idle<Traits, kPolicies>(ss, pipeline_k, pipeline_v, read, work, w);
    clear(tOrO);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) lse[r] = -INFINITY;  // rows past T: the epilogue writes none
    return;
  }
  int n = work.n_end - 1;
  auto sched_sync = [&] { bar_sync(kFwdBarSchedFirst + w, kFwdSchedBarThreads); };
  auto sched_arrive = [&] {
    bar_arrive(kFwdBarSchedFirst + (w + 1 == kNumMmaWarpGroups ? 0 : w + 1), kFwdSchedBarThreads);
  };
  // Keep each block's softmax before the wait for the P·V under it (utils.h, softmax_done). Not on
  // the general path with three consumers (H 64's 192 x 112 at 160 registers): the P and O
  // registers held through the softmax raise its spills there.
  constexpr bool kPinSoftmax = !(kGeneral && kNumMmaWarpGroups == 3);
  float& softmax_sink = ss.softmax_sink[tid];

  [[maybe_unused]] General general(p.attn, t, m0);
  float shift[kRows];
  const float logit_scale = kGeneral ? policy_logit_scale(p.attn) : p.scale_log2;
  if constexpr (kAlibiPrefix) general.set_prefix_rows(f.tSrQPrefix, f.tScQPrefix);

  Tensor tSrS = partition_fragment_C(f.mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor tSrS_rc = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
  Tensor tOrP = make_tensor<Element>(acc_as_a_operand(tSrS.layout()));
  Tensor tOrO_rc = make_tensor(tOrO.data(), acc_rowcol(tOrO.layout()));
  static_assert(decltype(size<0>(tSrS_rc))::value == kRows);
  // Dropout: this thread's share of the tile's stream; its columns are those of thread 0 shifted
  // by a per-thread constant (as in apply_policy).
  [[maybe_unused]] const DropoutTile drop =
      kDropout ? dropout_tile(p.attn, t.batch, t.head, m0, f.cS_rc) : DropoutTile{};
  [[maybe_unused]] const int drop_col_shift = get<1>(f.cS_rc(0, 0)) - get<1>(f.cS0_rc(0, 0));
  auto dropout = [&](int n_block) CUTLASS_LAMBDA_FUNC_INLINE {
    if constexpr (kDropout) apply_dropout(tSrS_rc, drop, n_block * kBlockN + drop_col_shift, f.cS0_rc);
  };
  OnlineSoftmax<kRows> softmax;
  float o_scale[kRows];
  // Whether O must be scaled by o_scale before the next P·V: only when a row's running max grew
  // (softmax.h, kMaxGrowthLog2). Decided per warp, so that the warp skips or runs the FMULs as
  // one; tiles without kRescaleOnGrowthOnly (fwd_traits.h) scale on every block.
  bool rescale_o = false;
  auto rescale_o_if_needed = [&]() CUTLASS_LAMBDA_FUNC_INLINE {
    if (!Traits::kRescaleOnGrowthOnly || __any_sync(0xffffffffu, rescale_o)) scale_rows(tOrO_rc, o_scale);
  };
  // The softmax of block n_block (the general path: masks and modifiers first; dropout after).
  auto block_softmax = [&](auto first, int n_block, int needs, bool alibi_in) CUTLASS_LAMBDA_FUNC_INLINE {
    constexpr bool kFirst = decltype(first)::value;
    if constexpr (kGeneral) {
      general.scores(tSrS_rc, f.cS_rc, f.cS0_rc, p.attn, n_block, needs, alibi_in, shift);
      if constexpr (General::kShifts)
        rescale_o = softmax.template update<kFirst>(tSrS_rc, logit_scale, o_scale, shift);
      else
        rescale_o = softmax.template update<kFirst>(tSrS_rc, logit_scale, o_scale);
      dropout(n_block);
    } else {
      if (kFirst || (kCausal && n_block * kBlockN + kBlockN - 1 > m0))
        apply_mask<kCausal, kFirst>(tSrS, f.cS, m0, n_block * kBlockN, p.S);
      rescale_o = softmax.template update<kFirst>(tSrS_rc, logit_scale, o_scale);
    }
  };

  // A paged call's first block (the last in memory) may end inside a page: its V rows past the
  // length are zeroed before the first P·V (paged_kv.h); kBlockN: nothing to zero.
  constexpr bool kPaged = reads_pages<Traits, kPolicies>();
  int v_rows = kPaged ? paged_block_rows<kBlockN>(p.attn, t.batch, work.n_end - 1) : kBlockN;
  auto zero_v_tail = [&](int stage) {
    if (!kPaged || v_rows == kBlockN) return;
    Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutV{});
    zero_rows_from<kBlockN, Traits::kHeadDim>(sV, stage, v_rows, tid % 128, kFwdBarEpilogueFirst + w);
    v_rows = kBlockN;
  };

  ss.q_full.wait(iter & 1);
  // Once its last Q·Kᵀ has finished, a consumer is done with Q: with an own O buffer, the next
  // tile's Q may load under this tile's last softmax, P·V and epilogue.
  auto release_q_after = [&](int n_block) CUTLASS_LAMBDA_FUNC_INLINE {
    if constexpr (!Traits::kOAliasesQ)
      if (n_block == work.n_begin) ss.q_empty.arrive();
  };

  // The block after n (walking down): with the boolean mask the producer says which and what it
  // holds, beside the block's K stage (FwdBlockWalk); else every block down to n_begin. There the
  // loop's next n is a placeholder in range, the block read after its K stage's wait.
  constexpr bool kHandedBlocks = FwdBlockWalk<Traits, kPolicies>::kMask;
  FwdBlockInfo info{0};

  // First (last-in-memory) key block: the only one that can cross S; causal diagonal too. Its
  // tests are found under its GEMM, as in the loop. It runs without ALiBi's prefix (apply_policy
  // adds the term per element).
  pipeline_k.consumer_wait(read);
  gemm</*zero_init=*/true, /*wait=*/-1>(f.mma_qk, f.tSrQ, f.tSrK(_, _, _, read.index()), tSrS);
  if constexpr (kHandedBlocks) {
    info = handed_block(ss, read);
    n = info.block();
  }
  if constexpr (kGeneral) general.read_rows(p.attn, f.cS_rc);
  int needs = kGeneral ? general.needs(p.attn, n, info.partial()) : 0;
  if constexpr (kGeneral) general.load_mask_words(p.attn, f.cS_rc, n, needs);
  warpgroup_wait<0>();
  warpgroup_fence_operand(tSrS);
  pipeline_k.consumer_release(read);
  release_q_after(n);
  block_softmax(cute::true_type{}, n, needs, false);
  convert(tSrS, tOrP);
  clear(tOrO);

  int next_n = kHandedBlocks ? (info.more() ? work.n_begin : -1) : n - 1;
#pragma unroll 1
  for (n = next_n; n >= work.n_begin; n = next_n) {
    PipelineState read_v = read;  // V of the previous block
    ++read;
    pipeline_k.consumer_wait(read);
    sched_sync();
    // (Not a lambda: one for this issue made ptxas keep S in local memory in the all-policies kernel.)
    if (kAlibiPrefix && general.alibi_prefix)
      gemm_with_prefix(f.mma_qk_prefix, f.mma_qk, f.tSrQPrefix, f.tSrKPrefix, f.tSrQ, f.tSrK(_, _, _, read.index()), tSrS);
    else
      gemm</*zero_init=*/true, /*wait=*/-1>(f.mma_qk, f.tSrQ, f.tSrK(_, _, _, read.index()), tSrS);
    rescale_o_if_needed();
    pipeline_v.consumer_wait(read_v);
    zero_v_tail(read_v.index());
    gemm</*zero_init=*/false, /*wait=*/-1>(f.mma_pv, tOrP, f.tOrV(_, _, _, read_v.index()), tOrO);
    sched_arrive();
    if constexpr (kHandedBlocks) {
      info = handed_block(ss, read);
      n = info.block();
    }
    needs = kGeneral ? general.needs(p.attn, n, info.partial()) : 0;
    if constexpr (kGeneral) general.load_mask_words(p.attn, f.cS_rc, n, needs);
    next_n = kHandedBlocks ? (info.more() ? work.n_begin : -1) : n - 1;
    warpgroup_wait<1>();  // S is ready; P·V still running
    pipeline_k.consumer_release(read);
    release_q_after(n);
    block_softmax(cute::false_type{}, n, needs, general.alibi_in_scores);
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
  zero_v_tail(read.index());
  gemm</*zero_init=*/false, /*wait=*/-1>(f.mma_pv, tOrP, f.tOrV(_, _, _, read.index()), tOrO);
  softmax.finalize(logit_scale, o_scale, lse);
  if constexpr (kGeneral) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) lse[r] -= alibi_lse_shift(p.attn, general.rows, r);
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
}

// The consumer warpgroups' tiles: each starts after its meeting with the producer (which reaches
// it once it has issued the tile's first loads) and reads the next tile after the next meeting.
template <typename Traits, bool kCausal, int kPolicies, typename Storage, typename Scheduler>
__forceinline__ __device__ void fwd_consume(const FwdParams<Traits>& p, const Scheduler& sched, Storage& ss,
                                            typename Traits::Pipeline& pipeline_k,
                                            typename Traits::Pipeline& pipeline_v) {
  constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim;
  const int tid = threadIdx.x - 128;
  const int w = mma_warp_group();
  if (w == 0) bar_arrive(kFwdBarSchedFirst, kFwdSchedBarThreads);  // consumer 0 goes first
  auto f = fwd_consumer_fragments<Traits, alibi_on_tensor_cores(kPolicies)>(ss, tid);
  constexpr int kRows = decltype(size<0>(f.cO_rc))::value;
  typename Traits::PipelineState read;
  TileWork work = fwd_tile_work<Traits, kCausal, kPolicies>(p, sched, blockIdx.x);
  fwd_tile_meeting(w);
#pragma unroll 1
  for (int iter = 0; work.tile < p.num_tiles; ++iter) {
    Tensor tOrO = partition_fragment_C(f.mma_pv, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    float lse[kRows];
    fwd_attend<Traits, kCausal, kPolicies>(p, ss, pipeline_k, pipeline_v, read, work, iter, f, tid, w, tOrO, lse);
    fwd_epilogue<Traits>(p, ss, f.mma_pv, f.cO_rc, work.coord, tid, w, tOrO, lse);
    // The next tile's meeting, after which the producer's word on that tile may be read.
    fwd_tile_meeting(w);
    work = announced_work(ss.next_work[(iter + 1) & 1]);
  }
  if (tid % 128 == 0) tma_store_wait<0>();
}

}  // namespace jfa::sm90
