// Backward kernels (FlashAttention-2 on mma.sync).
//
//   1. bwd_row_stats_kernel (jfa/bwd_row_stats.cuh): D = rowsum(dO∘O) − dLSE into softmax_d.
//   2. bwd_kernel: one CTA per (key tile, kv head, batch). It loops over the G query heads of its
//      group and over their query tiles, so dK and dV are complete in registers at the end
//      (no atomics, no workspace for them). Per query tile:
//        S = Q·Kᵀ, P = exp2(S·scale_log2 − LSE·log2 e)            (recomputed, P -> smem)
//        dP = dO·Vᵀ, dS = P∘(dP − D)                              (dS -> smem)
//        dV += Pᵀ·dO, dK += dSᵀ·Q, dQ_accum += dS·K (fp32 atomics, dq_accum.h)
//      The next Q tile (double-buffered) and dO tile load with cp.async behind the gemms.
//      CTAs start their loop at different steps (rotated by the key tile index), except when the
//      dQ adds are ordered (deterministic=True, below).
//   3. bwd_convert_dq_kernel: dq = scale · dq_accum, cast to the element type.
// The kGeneral instantiation (masks, score modifiers, dropout; tile_masks.h) visits only the query tiles
// of query_range, computes dS = P∘(dP·z − D)·(1 − tanh²) in one element pass (z: dropout
// multiplier; dV sees P·z) and adds d(bias) = P∘(dP·z − D) into p.mask.dbias with float32
// atomics (zeroed by run_bwd; the summation order over broadcast axes is not deterministic).
// With ALiBi it also sums d(slope) = -sum dS·|pos - j| per (batch, head, key tile), without atomics.
// deterministic=True orders the dQ adds by key tile (dq_accum.h): compiled in by kOrdered (the
// plain and causal kernels' own ordered variants) or tested at run time by the general kernel.
#pragma once

#include <cute/tensor.hpp>

#include "jfa/bwd_row_stats.cuh"
#include "jfa/params.h"
#include "dq_accum.h"
#include "kernel_traits.h"
#include "dropout.h"
#include "tile_masks.h"
#include "utils.h"

namespace jfa::sm80 {

using namespace cute;

// ---------------------------------------------------------------------------------------------
// 3. dq = scale · dq_accum. One CTA per query tile, reading the tile in the fragment order the main
//    kernel wrote it (dq_accum.h), so it uses the same dQ mma partition to find each value's place.
template <typename Traits, int kLanes>
__global__ void __launch_bounds__(Traits::kNThreads) bwd_convert_dq_kernel(const AttentionParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kNThreads = Traits::kNThreads;
  using Order = DqAccumOrder<kNThreads>;
  const int T = int(p.T);
  const int num_m_blocks = (T + kBlockM - 1) / kBlockM;
  const int m0 = int(blockIdx.x % num_m_blocks) * kBlockM;
  const int64_t head = (blockIdx.x / num_m_blocks) % p.N;
  const int64_t batch = blockIdx.x / num_m_blocks / p.N;
  const int tidx = threadIdx.x;

  typename Traits::TiledMmadQ mma_dq;
  Tensor coord = mma_dq.get_thread_slice(tidx).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  constexpr int n = decltype(size(coord))::value;
  float v[n];
  CUTE_UNROLL
  for (int i = 0; i < n; ++i) v[i] = 0.f;
  // The ordered causal kernel's lanes (dq_accum.h), added in lane order.
  CUTE_UNROLL
  for (int lane = 0; lane < kLanes; ++lane) {
    const float* tile = dq_accum_tile(p, lane, batch, head, m0, kHeadDim);
    CUTE_UNROLL
    for (int i = 0; i < n; i += Order::kVec) {
      if constexpr (Order::kVec == 4) {
        const float4 x = *reinterpret_cast<const float4*>(tile + Order::index(i, tidx));
        v[i] += x.x; v[i + 1] += x.y; v[i + 2] += x.z; v[i + 3] += x.w;
      } else {
        v[i] += tile[Order::index(i, tidx)];
      }
    }
  }
  Element* dq = static_cast<Element*>(p.dq) + batch * p.dq_strides.batch + head * p.dq_strides.head;
  // m16n8 C fragment: values (i, i + 1), i even, are columns (c, c + 1) of one row.
  CUTE_UNROLL
  for (int i = 0; i < n; i += 2) {
    const int row = m0 + get<0>(coord(i)), col = get<1>(coord(i));
    if (row < T) {
      cutlass::Array<Element, 2> pair;
      pair[0] = Element(v[i] * p.scale);
      pair[1] = Element(v[i + 1] * p.scale);
      *reinterpret_cast<cutlass::Array<Element, 2>*>(dq + int64_t(row) * p.dq_strides.row + col) = pair;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 2. The main kernel.
// kGeneral (with kCausal = false): every masking feature through the shared policies (tile_masks.h),
// causality from p.is_causal, d(bias) by atomics; the plain instantiations compile none of it.
// kDropout (with kGeneral): dropout too, a separate instantiation (the Philox stream costs registers).
// kOrdered (without kGeneral): the dQ adds in key-tile order, a separate instantiation so that the
// default plain and causal kernels compile none of it (it spilled them).
template <typename Traits, bool kCausal, bool kGeneral = false, bool kDropout = false, bool kOrdered = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1) bwd_kernel(const AttentionParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr bool kDoubleBufferQ = Traits::kDoubleBufferQ;
  extern __shared__ char smem[];

  const int num_n_blocks = (int(p.S) + kBlockN - 1) / kBlockN;
  const int64_t bid = blockIdx.x;
  // Causal: the first key tiles have the most query tiles to visit. They go first for every head
  // (blocks are issued in index order), so that the longest CTAs do not start in the last wave.
  // The ordered kernels take this key-tile-major order too: their dQ adds follow the key tiles
  // (dq_accum.h), and it keeps few key tiles of one head on the GPU at a time.
  constexpr bool kKeyTileMajor = kCausal || kOrdered;
  const int n_block = kKeyTileMajor ? int(bid / (p.B * p.K)) : int(bid % num_n_blocks);
  const int64_t bk = kKeyTileMajor ? bid % (p.B * p.K) : bid / num_n_blocks;
  const int kv_head = int(bk % p.K);
  const int64_t batch = bk / p.K;
  const int tidx = threadIdx.x;
  const int T = int(p.T), S = int(p.S);
  const int G = int(p.N / p.K);
  const int n0 = n_block * kBlockN;
  // With ALiBi (general kernels): each warp's share of sum dS·|pos - j| of a step, added up in
  // warp order by thread 0 into this key tile's d(slope) slot (deterministic, no atomics).
  static_assert(kBlockN % kDslopeKeys == 0, "a d(slope) slot must belong to one key tile");
  __shared__ float dslope_warp_sums[kGeneral ? Traits::kNWarps : 1];

  // Query tiles [x, y) that see key tile nb: causal (top-left) skips those entirely above the
  // diagonal; the general path those that cannot see it by position (causal, window, lengths) or
  // share no segment with it. Also evaluated for other key tiles by the general kernel's
  // deterministic mode.
  const int num_m_blocks = (T + kBlockM - 1) / kBlockM;
  [[maybe_unused]] const SequenceBounds bounds = kGeneral ? sequence_bounds(p, batch) : SequenceBounds{};
  auto m_blocks_of = [&](int nb) {
    const int j0 = nb * kBlockN;
    if constexpr (kGeneral) {
      const KeyRange r = mask_narrowed_queries(
          p, batch, int64_t(kv_head) * G, G, j0, kBlockN,
          segment_narrowed(query_range(p, bounds, j0, kBlockN), p.mask.kv_segment_chunks, batch, S, j0, kBlockN));
      const int lo = int(r.begin / kBlockM);
      return make_int2(lo, r.end > r.begin ? int((r.end + kBlockM - 1) / kBlockM) : lo);
    } else {
      return make_int2(kCausal ? min(j0 / kBlockM, num_m_blocks) : 0, num_m_blocks);
    }
  };
  const int2 m_blocks = m_blocks_of(n_block);
  // deterministic=True: ordered dQ adds (dq_turn below). A compile-time false in the default
  // plain and causal kernels.
  static_assert(!(kOrdered && kGeneral), "the general kernel orders at run time (p.deterministic)");
  const bool ordered = kOrdered || (kGeneral && p.deterministic);
  // The dQ accumulator's lane of this key tile (dq_accum.h): the ordered causal kernel's only.
  constexpr int kLanes = kDqLanesOf<kCausal, kOrdered>;
  const int lane = n_block % kLanes;
  const int m_block_min = m_blocks.x, m_block_end = m_blocks.y;
  // What the segment summaries say about this key block (unknown without segment ids).
  [[maybe_unused]] const SegmentIds kv_seg =
      kGeneral ? segment_ids(p.mask.kv_segment_chunks, batch, S, n0, kBlockN) : SegmentIds{};
  const int m_per_head = m_block_end - m_block_min;
  const int num_steps = G * m_per_head;  // step j: head g = j / m_per_head, m_block = m_block_min + j % m_per_head

  // Tensors that do not depend on the step.
  const Element* k_ptr = static_cast<const Element*>(p.k) + batch * p.k_strides.batch + kv_head * p.k_strides.head;
  const Element* v_ptr = static_cast<const Element*>(p.v) + batch * p.v_strides.batch + kv_head * p.v_strides.head;
  Tensor gK = local_tile(make_tensor(make_gmem_ptr(k_ptr), make_shape(S, Int<kHeadDim>{}), make_stride(p.k_strides.row, _1{})),
                         Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));
  Tensor gV = local_tile(make_tensor(make_gmem_ptr(v_ptr), make_shape(S, Int<kHeadDim>{}), make_stride(p.v_strides.row, _1{})),
                         Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));

  // Smem: Q (1 or 2 buffers), dO, K, V, P, dS.
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQdO{});
  constexpr int kQBuffers = kDoubleBufferQ ? 2 : 1;
  Tensor sdO = make_tensor(sQ.data() + kQBuffers * size(sQ), typename Traits::SmemLayoutQdO{});
  Tensor sK = make_tensor(sdO.data() + size(sdO), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(sK.data() + size(sK), typename Traits::SmemLayoutKV{});
  Tensor sP = make_tensor(sV.data() + size(sV), typename Traits::SmemLayoutPdS{});
  Tensor sdS = make_tensor(sP.data() + size(sP), typename Traits::SmemLayoutPdS{});
  Tensor sKt = make_tensor(sK.data(), typename Traits::SmemLayoutKt{});
  Tensor sKtNoSwizzle = make_tensor(sK.data().get(), typename Traits::SmemLayoutKtNoSwizzle{});
  Tensor sdOt = make_tensor(sdO.data(), typename Traits::SmemLayoutQdOt{});
  Tensor sdOtNoSwizzle = make_tensor(sdO.data().get(), typename Traits::SmemLayoutQdOtNoSwizzle{});
  Tensor sQtNoSwizzle = make_tensor(sQ.data().get(), typename Traits::SmemLayoutQdOtNoSwizzle{});
  Tensor sPt = make_tensor(sP.data(), typename Traits::SmemLayoutPdSt{});
  Tensor sPtNoSwizzle = make_tensor(sP.data().get(), typename Traits::SmemLayoutPdStNoSwizzle{});
  Tensor sdSt = make_tensor(sdS.data(), typename Traits::SmemLayoutPdSt{});
  Tensor sdStNoSwizzle = make_tensor(sdS.data().get(), typename Traits::SmemLayoutPdStNoSwizzle{});

  typename Traits::GmemTiledCopyLoad gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tidx);
  Tensor tKsK = gmem_thr.partition_D(sK);
  Tensor tVsV = gmem_thr.partition_D(sV);
  Tensor tdOsdO = gmem_thr.partition_D(sdO);
  Tensor tQcQ = gmem_thr.partition_D(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKVcKV = gmem_thr.partition_D(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));

  // Pointers of step j's query tile (head g, rows m0..m0+kBlockM).
  struct Step {
    int g, m0;
    int64_t head;
  };
  auto step_of = [&](int j) {
    // Each key tile's CTA starts at a different step, so the CTAs of one head that run at the
    // same time add into different dQ tiles instead of queueing on the same addresses.
    // The deterministic mode walks them in order instead: the CTAs of neighbouring key tiles then
    // reach a dQ tile one after the other, as its semaphore wants them.
    if (!ordered) j = (j + n_block) % num_steps;
    Step s;
    if constexpr (kOrdered && kCausal) {
      // The ordered causal kernel walks down from the last query tile, query heads innermost: then
      // every key tile's CTA reaches tile (g, m) at the same step, whatever its diagonal, and
      // follows the next-lower key tile only by the release's delay. Walking up from the
      // diagonal, it reached its first tiles steps before the lower key tiles did.
      s.g = j % G;
      s.m0 = (m_block_end - 1 - j / G) * kBlockM;
    } else {
      s.g = j / m_per_head;
      s.m0 = (m_block_min + j % m_per_head) * kBlockM;
    }
    s.head = int64_t(kv_head) * G + s.g;
    return s;
  };
  // Deterministic mode: the dQ adds in key-tile order, per lane. A tile's turn is how many lower
  // key tiles of its lane add into query tile m_block (dq_accum.h). Without the general path all
  // of them do (plain: every key tile visits every query tile; top-left causal: the ranges of
  // lower key tiles start no later and all end at num_m_blocks); with it the threads count them
  // together with the same m_blocks_of.
  auto dq_turn = [&](int m_block) {
    if constexpr (!kGeneral) return n_block / kLanes;
    int turn = 0;
    for (int base = 0; base < n_block; base += Traits::kNThreads) {
      bool adds = false;
      const int nb = base + tidx;
      if (nb < n_block && nb % kLanes == lane) {
        const int2 r = m_blocks_of(nb);
        adds = m_block >= r.x && m_block < r.y;
      }
      turn += __syncthreads_count(adds);
    }
    return turn;
  };
  // Ordered kernels: thread 0 ends the turn of step j (recomputed: nothing stays live across
  // the steps but the semaphore value read ahead, `seen`).
  [[maybe_unused]] int seen = 0;
  [[maybe_unused]] auto dq_release_turn = [&](int j) {
    const Step s = step_of(j);
    dq_semaphore_release(dq_semaphore(p, lane, batch, s.head, s.m0), dq_turn(s.m0 / kBlockM) + 1);
  };
  auto q_tile = [&](const Step& s) {
    const Element* ptr = static_cast<const Element*>(p.q) + batch * p.q_strides.batch + s.head * p.q_strides.head +
                         int64_t(s.m0) * p.q_strides.row;
    return make_tensor(make_gmem_ptr(ptr), Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_stride(p.q_strides.row, _1{}));
  };
  auto do_tile = [&](const Step& s) {
    const Element* ptr = static_cast<const Element*>(p.dout) + batch * p.do_strides.batch + s.head * p.do_strides.head +
                         int64_t(s.m0) * p.do_strides.row;
    return make_tensor(make_gmem_ptr(ptr), Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_stride(p.do_strides.row, _1{}));
  };
  auto load_q = [&](const Step& s, int buffer) {
    Tensor tQgQ = gmem_thr.partition_S(q_tile(s));
    Tensor tQsQ = gmem_thr.partition_D(make_tensor(sQ.data() + buffer * size(sQ), sQ.layout()));
    copy_rows<true>(gmem_copy, tQgQ, tQsQ, tQcQ, T - s.m0);
  };
  auto load_do = [&](const Step& s) {
    Tensor tdOgdO = gmem_thr.partition_S(do_tile(s));
    copy_rows<true>(gmem_copy, tdOgdO, tdOsdO, tQcQ, T - s.m0);
  };

  // Mma partitions.
  typename Traits::TiledMmaSdP mma_sdp;
  auto thr_sdp = mma_sdp.get_thread_slice(tidx);
  Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);
  Tensor tSrK = thr_sdp.partition_fragment_B(sK);
  Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO);
  Tensor tdPrV = thr_sdp.partition_fragment_B(sV);

  typename Traits::TiledMmadKV mma_dkv;
  auto thr_dkv = mma_dkv.get_thread_slice(tidx);
  Tensor tdKrdSt = thr_dkv.partition_fragment_A(sdStNoSwizzle);
  Tensor tdKrQt = thr_dkv.partition_fragment_B(sQtNoSwizzle);
  Tensor tdVrPt = thr_dkv.partition_fragment_A(sPtNoSwizzle);
  Tensor tdVrdO = thr_dkv.partition_fragment_B(sdOtNoSwizzle);

  typename Traits::TiledMmadQ mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(tidx);
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_dq.partition_fragment_B(sKtNoSwizzle);

  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});

  // Smem -> register copies (ldmatrix, .trans for the transposed operands) and C -> smem stores.
  auto smem_copy_a_sdp = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma_sdp);
  auto smem_thr_a_sdp = smem_copy_a_sdp.get_thread_slice(tidx);
  Tensor tSsQ = smem_thr_a_sdp.partition_S(sQ);
  Tensor tdPsdO = smem_thr_a_sdp.partition_S(sdO);
  auto smem_copy_b_sdp = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, mma_sdp);
  auto smem_thr_b_sdp = smem_copy_b_sdp.get_thread_slice(tidx);
  Tensor tSsK = smem_thr_b_sdp.partition_S(sK);
  Tensor tdPsV = smem_thr_b_sdp.partition_S(sV);
  auto smem_copy_pds = make_tiled_copy_C(typename Traits::SmemCopyAtomStore{}, mma_sdp);
  auto smem_thr_pds = smem_copy_pds.get_thread_slice(tidx);
  Tensor tPsP = smem_thr_pds.partition_D(sP);
  Tensor tdSsdS = smem_thr_pds.partition_D(sdS);

  auto smem_copy_a_dkv = make_tiled_copy_A(typename Traits::SmemCopyAtomTransposed{}, mma_dkv);
  auto smem_thr_a_dkv = smem_copy_a_dkv.get_thread_slice(tidx);
  Tensor tdVsPt = smem_thr_a_dkv.partition_S(sPt);
  Tensor tdKsdSt = smem_thr_a_dkv.partition_S(sdSt);
  auto smem_copy_b_dkv = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, mma_dkv);
  auto smem_thr_b_dkv = smem_copy_b_dkv.get_thread_slice(tidx);
  Tensor tdVsdOt = smem_thr_b_dkv.partition_S(sdOt);

  auto smem_copy_a_dq = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma_dq);
  auto smem_thr_a_dq = smem_copy_a_dq.get_thread_slice(tidx);
  Tensor tdQsdS = smem_thr_a_dq.partition_S(sdS);
  auto smem_copy_b_dq = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, mma_dq);
  auto smem_thr_b_dq = smem_copy_b_dq.get_thread_slice(tidx);
  Tensor tdQsKt = smem_thr_b_dq.partition_S(sKt);

  // Coordinates of this thread's S/dP elements (rows for LSE/D, both for masks) and dQ elements.
  Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  constexpr int kNRows = decltype(size<0>(tScS_rc))::value;
  Tensor tdQcdQ = thr_dq.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));

  // Per-row LSE (pre-multiplied by log2 e) and D of a step. Rows past T get LSE = +inf, so P = 0.
  float lse_log2[kNRows], dsum[kNRows];
  auto load_row_stats = [&](const Step& s) {
    const float* lse_ptr = p.lse + batch * p.lse_strides.batch + s.head * p.lse_strides.head;
    const float* d_ptr = p.softmax_d + (batch * p.N + s.head) * p.dq_accum_rows();
    CUTE_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) {
      const int row = s.m0 + get<0>(tScS_rc(mi, 0));
      const bool valid = row < T;
      const float lse = valid ? lse_ptr[int64_t(row) * p.lse_strides.row] : INFINITY;
      lse_log2[mi] = lse == -INFINITY ? INFINITY : lse * float(M_LOG2E);  // empty row: P = 0
      dsum[mi] = valid ? d_ptr[row] : 0.f;
    }
  };

  clear(acc_dk);
  clear(acc_dv);

  if (num_steps > 0) {
    // Prologue: K, V, the first Q and dO tiles.
    Step cur = step_of(0);
    copy_rows<true>(gmem_copy, gmem_thr.partition_S(gK), tKsK, tKVcKV, S - n0);
    copy_rows<true>(gmem_copy, gmem_thr.partition_S(gV), tVsV, tKVcKV, S - n0);
    load_q(cur, 0);
    load_do(cur);
    cute::cp_async_fence();
    load_row_stats(cur);

    for (int j = 0; j < num_steps; ++j) {
      const int buffer = kDoubleBufferQ ? (j & 1) : 0;
      const bool has_next = j + 1 < num_steps;
      const Step next = step_of(has_next ? j + 1 : j);
      Tensor tSsQ_cur = make_tensor(tSsQ.data() + buffer * size(sQ), tSsQ.layout());

      cp_async_wait<0>();
      __syncthreads();  // Q, dO of this step visible; previous step done with sP, sdS
      // Ordered kernels: the previous step's turn ends only now, after the barrier that orders
      // every thread's adds before thread 0's release, and a gemm after the adds, so the release's
      // fence mostly finds them landed. Later (after this step's S gemm, or at the next barrier)
      // the next CTA in the order more often misses the release at its early read.
      if constexpr (kOrdered)
        if (tidx == 0 && j > 0) dq_release_turn(j - 1);

      // S = Q·Kᵀ and P.
      Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_s);
      gemm_ss(acc_s, tSrQ, tSrK, tSsQ_cur, tSsK, mma_sdp, smem_copy_a_sdp, smem_copy_b_sdp, smem_thr_a_sdp,
              smem_thr_b_sdp);
      Tensor scores = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
      Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      Tensor dS = make_tensor(acc_dp.data(), scores.layout());
      if constexpr (kGeneral) {
        // dP = dO·Vᵀ before P, so that one pass over the elements has the raw logit and dP at
        // hand: the softcap derivative and the dropout multiplier need no extra register tile.
        clear(acc_dp);
        gemm_ss(acc_dp, tdPrdO, tdPrV, tdPsdO, tdPsV, mma_sdp, smem_copy_a_sdp, smem_copy_b_sdp, smem_thr_a_sdp,
                smem_thr_b_sdp);
        const bool partial =
            general_tile_partial(p, bounds, batch, cur.head, cur.m0, kBlockM, n0, kBlockN) ||
            segments_split(p, segment_ids(p.mask.q_segment_chunks, batch, T, cur.m0, kBlockM), kv_seg);
        constexpr bool dropout = kDropout;
        const DropoutStream drop = dropout ? dropout_stream(p, batch) : DropoutStream{};
        [[maybe_unused]] KeepBits<kNRows, decltype(size<1>(scores))::value> keep;
        if constexpr (dropout) keep = dropout_keep_bits(drop, int(cur.head), cur.m0, n0, tScS_rc);
        const bool slopes_grad = p.mask.dslopes != nullptr;
        float slope_dot = 0.f;  // sum of dS·|pos - j| over this thread's elements
        CUTE_UNROLL
        for (int mi = 0; mi < kNRows; ++mi) {
          const int row = cur.m0 + get<0>(tScS_rc(mi, 0));
          const RowPolicy rp = row_policy(p, bounds, batch, cur.head, row);
          const Strides4& dbs = p.mask.dbias_strides;  // the bias's shape, or the full one (MaskParams)
          float* dbias_row = p.mask.dbias != nullptr ? p.mask.dbias + batch * dbs.batch + cur.head * dbs.head +
                                                           int64_t(row) * dbs.row
                                                     : nullptr;
          CUTE_UNROLL
          for (int ni = 0; ni < size<1>(scores); ni += 2) {
            const int col = n0 + get<1>(tScS_rc(mi, ni));  // col + 1 is element ni + 1
            CUTE_UNROLL
            for (int e = 0; e < 2; ++e) {
              float g;
              const float x = row_logit(p, rp, col + e, scores(mi, ni + e), partial, &g);
              const float prob = exp2f(x - lse_log2[mi]);  // 0 if hidden or the row is empty
              const float ze = !dropout ? 1.f : keep.kept(mi, ni + e) ? drop.keep_scale : 0.f;
              // d(logit) = P∘(dP·z − D): dropout scales dP, and dV sees the dropped P·z.
              const float ds = prob * (dS(mi, ni + e) * ze - dsum[mi]);
              if (dbias_row != nullptr && ds != 0.f)  // d(bias) = d(logit), before the softcap derivative
                atomicAdd(dbias_row + (col + e) * dbs.col, ds);
              if (slopes_grad) {  // the ALiBi term is -slope·|pos - j|: d(slope) = -sum dS·|pos - j|
                const int d = rp.pos - (col + e);
                slope_dot = fmaf(ds, float(d < 0 ? -d : d), slope_dot);
              }
              scores(mi, ni + e) = prob * ze;
              dS(mi, ni + e) = ds * g;
            }
          }
        }
        if (slopes_grad) {
          CUTE_UNROLL
          for (int offset = 16; offset > 0; offset /= 2) slope_dot += __shfl_xor_sync(0xffffffffu, slope_dot, offset);
          if (tidx % 32 == 0) dslope_warp_sums[tidx / 32] = slope_dot;  // read after the next barrier
        }
        Tensor rP = convert_type<Element>(acc_s);
        cute::copy(smem_copy_pds, smem_thr_pds.retile_S(rP), tPsP);
      } else {
        if (tile_needs_mask<kCausal>(cur.m0, n0, kBlockN, S)) apply_mask<kCausal>(scores, tScS_rc, cur.m0, n0, S);
        CUTE_UNROLL
        for (int mi = 0; mi < kNRows; ++mi) {
          CUTE_UNROLL
          for (int ni = 0; ni < size<1>(scores); ++ni)
            scores(mi, ni) = exp2f(scores(mi, ni) * p.scale_log2 - lse_log2[mi]);
        }
        Tensor rP = convert_type<Element>(acc_s);
        cute::copy(smem_copy_pds, smem_thr_pds.retile_S(rP), tPsP);

        // dP = dO·Vᵀ and dS = P∘(dP − D).
        clear(acc_dp);
        gemm_ss(acc_dp, tdPrdO, tdPrV, tdPsdO, tdPsV, mma_sdp, smem_copy_a_sdp, smem_copy_b_sdp, smem_thr_a_sdp,
                smem_thr_b_sdp);
        CUTE_UNROLL
        for (int mi = 0; mi < kNRows; ++mi) {
          CUTE_UNROLL
          for (int ni = 0; ni < size<1>(dS); ++ni) dS(mi, ni) = scores(mi, ni) * (dS(mi, ni) - dsum[mi]);
        }
      }

      // The next Q tile goes to the other buffer while this one is still read by dK.
      if (kDoubleBufferQ && has_next) {
        load_q(next, buffer ^ 1);
        cute::cp_async_fence();
      }

      Tensor rdS = convert_type<Element>(acc_dp);
      cute::copy(smem_copy_pds, smem_thr_pds.retile_S(rdS), tdSsdS);
      __syncthreads();  // sP, sdS complete
      if constexpr (kGeneral) {
        // This step's d(slope) share into the slot of (batch, head, key tile). Only this thread
        // writes the slot, step after step; the warps' next sums are written after the next
        // step's first barrier, which this thread reaches only after this read.
        if (tidx == 0 && p.mask.dslopes != nullptr) {
          float sum = 0.f;
          CUTE_UNROLL
          for (int w = 0; w < Traits::kNWarps; ++w) sum += dslope_warp_sums[w];
          p.mask.dslopes[(batch * p.N + cur.head) * p.mask.dslope_slots + n0 / kDslopeKeys] -= sum;
        }
      }
      // Ordered kernels: read the semaphore of this step's dQ tile now, so that the read's round
      // trip overlaps the gemms before the add, which then usually finds its turn already there.
      if constexpr (kOrdered)
        if (tidx == 0) seen = dq_semaphore_peek(dq_semaphore(p, lane, batch, cur.head, cur.m0));

      // dV += Pᵀ·dO.
      gemm_ss(acc_dv, tdVrPt, tdVrdO, tdVsPt, tdVsdOt, mma_dkv, smem_copy_a_dkv, smem_copy_b_dkv, smem_thr_a_dkv,
              smem_thr_b_dkv);
      // Ordered kernels: thread 0 waits for the turn of this step's dQ adds before the barrier
      // that precedes them anyway (no barrier of their own).
      if constexpr (kOrdered)
        if (tidx == 0)
          dq_wait_turn_from(dq_semaphore(p, lane, batch, cur.head, cur.m0), dq_turn(cur.m0 / kBlockM), seen);
      __syncthreads();  // everyone is done with sdO (and the ordered kernels' turn has come)
      if (has_next) {
        load_do(next);
        cute::cp_async_fence();
      }

      // dQ_accum += dS·K (unscaled; the convert kernel applies the softmax scale).
      Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
      static_assert(decltype(size<0>(acc_dq))::value == 4);
      clear(acc_dq);
      gemm_ss(acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, mma_dq, smem_copy_a_dq, smem_copy_b_dq, smem_thr_a_dq,
              smem_thr_b_dq);
      float* dq_tile = dq_accum_tile(p, lane, batch, cur.head, cur.m0, kHeadDim);
      if (ordered && !kOrdered) {
        // The general kernel keeps the simple protocol: wait, add, fence and release at once.
        int32_t* sem = dq_semaphore(p, lane, batch, cur.head, cur.m0);
        const int turn = dq_turn(cur.m0 / kBlockM);
        dq_wait_turn(sem, turn);
        dq_accum_add<Traits::kNThreads>(dq_tile, acc_dq, tidx);
        dq_end_turn(sem, turn);
      } else {
        dq_accum_add<Traits::kNThreads>(dq_tile, acc_dq, tidx);
      }

      // dK += dSᵀ·Q.
      if (has_next) load_row_stats(next);
      Tensor tdKsQt = smem_thr_b_dkv.partition_S(
          make_tensor(sQ.data() + buffer * size(sQ), typename Traits::SmemLayoutQdOt{}));
      gemm_ss(acc_dk, tdKrdSt, tdKrQt, tdKsdSt, tdKsQt, mma_dkv, smem_copy_a_dkv, smem_copy_b_dkv, smem_thr_a_dkv,
              smem_thr_b_dkv);
      if (!kDoubleBufferQ && has_next) {
        __syncthreads();  // everyone is done with sQ
        load_q(next, 0);
        cute::cp_async_fence();
      }
      cur = next;
    }
  }

  // Epilogue: dK (scaled) and dV through smem (reusing sK, sV) to coalesced 16-byte stores.
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= p.scale;
  Tensor rdK = convert_type<Element>(acc_dk);
  Tensor rdV = convert_type<Element>(acc_dv);
  Tensor sdK = make_tensor(sK.data(), typename Traits::SmemLayoutdKV{});
  Tensor sdV = make_tensor(sV.data(), typename Traits::SmemLayoutdKV{});
  auto smem_copy_dkv = make_tiled_copy_C(typename Traits::SmemCopyAtomStore{}, mma_dkv);
  auto smem_thr_dkv = smem_copy_dkv.get_thread_slice(tidx);
  __syncthreads();  // everyone is done with sK, sV; the last step's dQ adds are issued
  if constexpr (kOrdered)
    if (tidx == 0 && num_steps > 0) dq_release_turn(num_steps - 1);
  cute::copy(smem_copy_dkv, smem_thr_dkv.retile_S(rdK), smem_thr_dkv.partition_D(sdK));
  cute::copy(smem_copy_dkv, smem_thr_dkv.retile_S(rdV), smem_thr_dkv.partition_D(sdV));
  __syncthreads();

  Element* dk_ptr = static_cast<Element*>(p.dk) + batch * p.dk_strides.batch + kv_head * p.dk_strides.head;
  Element* dv_ptr = static_cast<Element*>(p.dv) + batch * p.dv_strides.batch + kv_head * p.dv_strides.head;
  Tensor gdK = local_tile(make_tensor(make_gmem_ptr(dk_ptr), make_shape(S, Int<kHeadDim>{}), make_stride(p.dk_strides.row, _1{})),
                          Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));
  Tensor gdV = local_tile(make_tensor(make_gmem_ptr(dv_ptr), make_shape(S, Int<kHeadDim>{}), make_stride(p.dv_strides.row, _1{})),
                          Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));
  typename Traits::GmemTiledCopyStore gmem_copy_out;
  auto gmem_thr_out = gmem_copy_out.get_thread_slice(tidx);
  Tensor tdKgdK = gmem_thr_out.partition_D(gdK);
  Tensor tdVgdV = gmem_thr_out.partition_D(gdV);
  Tensor tdKrdK = make_tensor<Element>(shape(tdKgdK));
  Tensor tdVrdV = make_tensor<Element>(shape(tdVgdV));
  cute::copy(gmem_copy_out, gmem_thr_out.partition_S(sdK), tdKrdK);
  cute::copy(gmem_copy_out, gmem_thr_out.partition_S(sdV), tdVrdV);
  Tensor tcOut = gmem_thr_out.partition_D(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  copy_rows<false>(gmem_copy_out, tdKrdK, tdKgdK, tcOut, S - n0);
  copy_rows<false>(gmem_copy_out, tdVrdV, tdVgdV, tcOut, S - n0);
}

}  // namespace jfa::sm80
