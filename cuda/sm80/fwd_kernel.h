// Forward kernel (FlashAttention-2 on mma.sync): one CTA per (query tile, query head, batch).
//
// Pipeline per key tile n (walked from the last tile down, so the one boundary tile comes first):
//   wait K[n]; issue cp.async V[n]  |  S = Q·K[n]ᵀ  |  wait V[n]; issue cp.async K[n-1]
//   | mask (boundary/diagonal tiles only), online softmax  |  O += P·V[n] with P from registers.
// So the load of V overlaps Q·Kᵀ and the load of the next K overlaps softmax and P·V.
#pragma once

#include <cute/tensor.hpp>

#include "jfa/params.h"
#include "kernel_traits.h"
#include "dropout.h"
#include "tile_masks.h"
#include "softmax.h"
#include "utils.h"

namespace jfa::sm80 {

using namespace cute;

// kGeneral (with kCausal = false): every masking feature through the shared policies (tile_masks.h);
// causality then comes from p.is_causal. kDropout (with kGeneral): dropout too, a separate
// instantiation because the Philox stream costs registers (bf16 H128 general forward spill bytes:
// 380 stores / 236 loads without it, ~1000 / ~700 with it). The plain instantiations compile none
// of that code.
template <typename Traits, bool kCausal, bool kGeneral = false, bool kDropout = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1) fwd_kernel(const AttentionParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  extern __shared__ char smem[];

  // Flattened grid, query tiles fastest and in reverse (the longest causal rows start first).
  const int num_m_blocks = (int(p.T) + kBlockM - 1) / kBlockM;
  const int64_t bid = blockIdx.x;
  const int m_block = num_m_blocks - 1 - int(bid % num_m_blocks);
  const int64_t bh = bid / num_m_blocks;
  const int head = int(bh % p.N);
  const int64_t batch = bh / p.N;
  const int kv_head = head / int(p.N / p.K);
  const int tidx = threadIdx.x;
  const int T = int(p.T), S = int(p.S);
  const int m0 = m_block * kBlockM;

  int n_block_max = (S + kBlockN - 1) / kBlockN;
  if (kCausal) n_block_max = min(n_block_max, (m0 + kBlockM + kBlockN - 1) / kBlockN);
  int n_block_min = 0;
  // What the segment summaries say about this query block (unknown without segment ids).
  [[maybe_unused]] const SegmentIds q_seg =
      kGeneral ? segment_ids(p.mask.q_segment_chunks, batch, T, m0, kBlockM) : SegmentIds{};
  if constexpr (kGeneral) {
    // The key tiles this query block may see (causal, window, lengths) and may share a segment
    // with: the loop's trip count.
    const SequenceBounds bounds = sequence_bounds(p, batch);
    const KeyRange r = mask_narrowed_keys(
        p, batch, head, m0, kBlockM,
        segment_narrowed(key_range(p, bounds, m0, kBlockM), p.mask.q_segment_chunks, batch, T, m0, kBlockM));
    n_block_min = int(r.begin / kBlockN);
    n_block_max = r.end > r.begin ? int((r.end + kBlockN - 1) / kBlockN) : n_block_min;  // empty: O = 0, LSE = -inf
  }

  // Global tensors of this (batch, head): Q/O [T, H], K/V [S, H], tiles selected below.
  const Element* q_ptr = static_cast<const Element*>(p.q) + batch * p.q_strides.batch + head * p.q_strides.head;
  const Element* k_ptr = static_cast<const Element*>(p.k) + batch * p.k_strides.batch + kv_head * p.k_strides.head;
  const Element* v_ptr = static_cast<const Element*>(p.v) + batch * p.v_strides.batch + kv_head * p.v_strides.head;
  Element* o_ptr = static_cast<Element*>(p.o) + batch * p.o_strides.batch + head * p.o_strides.head;
  Tensor mQ = make_tensor(make_gmem_ptr(q_ptr), make_shape(T, Int<kHeadDim>{}), make_stride(p.q_strides.row, _1{}));
  Tensor mK = make_tensor(make_gmem_ptr(k_ptr), make_shape(S, Int<kHeadDim>{}), make_stride(p.k_strides.row, _1{}));
  Tensor mV = make_tensor(make_gmem_ptr(v_ptr), make_shape(S, Int<kHeadDim>{}), make_stride(p.v_strides.row, _1{}));
  Tensor mO = make_tensor(make_gmem_ptr(o_ptr), make_shape(T, Int<kHeadDim>{}), make_stride(p.o_strides.row, _1{}));
  Tensor gQ = local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
  Tensor gO = local_tile(mO, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
  Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));  // (BN, H, n)
  Tensor gV = local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));

  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(sQ.data() + size(sQ), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(sK.data() + size(sK), typename Traits::SmemLayoutKV{});
  Tensor sVt = make_tensor(sV.data(), typename Traits::SmemLayoutVt{});
  Tensor sVtNoSwizzle = make_tensor(sV.data().get(), typename Traits::SmemLayoutVtNoSwizzle{});

  // Global -> smem copies, with row coordinates for the bounds predicates.
  typename Traits::GmemTiledCopyLoad gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tidx);
  Tensor tQgQ = gmem_thr.partition_S(gQ);
  Tensor tQsQ = gmem_thr.partition_D(sQ);
  Tensor tKgK = gmem_thr.partition_S(gK);
  Tensor tKsK = gmem_thr.partition_D(sK);
  Tensor tVgV = gmem_thr.partition_S(gV);
  Tensor tVsV = gmem_thr.partition_D(sV);
  Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKVcKV = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));

  // Mma partitions and smem -> register copies (ldmatrix).
  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tidx);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(sK);
  Tensor tOrVt = thr_mma.partition_fragment_B(sVtNoSwizzle);
  Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});

  auto smem_copy_q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_q = smem_copy_q.get_thread_slice(tidx);
  Tensor tSsQ = smem_thr_q.partition_S(sQ);
  auto smem_copy_k = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_k = smem_copy_k.get_thread_slice(tidx);
  Tensor tSsK = smem_thr_k.partition_S(sK);
  auto smem_copy_v = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma);
  auto smem_thr_v = smem_copy_v.get_thread_slice(tidx);
  Tensor tOsVt = smem_thr_v.partition_S(sVt);

  // (row, col) coordinates of this thread's score elements, for masks.
  Tensor tScS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));

  // Prologue: Q and the last K tile in flight.
  copy_rows<true>(gmem_copy, tQgQ, tQsQ, tQcQ, T - m0);
  int n_block = n_block_max - 1;
  if (!kGeneral || n_block >= n_block_min)
    copy_rows<true>(gmem_copy, tKgK(_, _, _, n_block), tKsK, tKVcKV, S - n_block * kBlockN);
  cute::cp_async_fence();

  clear(acc_o);
  Tensor acc_o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));
  OnlineSoftmax<decltype(size<0>(acc_o_rc))::value> softmax;

  for (; n_block >= n_block_min; --n_block) {
    const int n0 = n_block * kBlockN;
    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    cp_async_wait<0>();
    __syncthreads();  // K[n] visible to all; every warp is done reading V[n+1]
    copy_rows<true>(gmem_copy, tVgV(_, _, _, n_block), tVsV, tKVcKV, S - n0);
    cute::cp_async_fence();

    gemm_ss(acc_s, tSrQ, tSrK, tSsQ, tSsK, tiled_mma, smem_copy_q, smem_copy_k, smem_thr_q, smem_thr_k);

    Tensor scores = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
    if constexpr (kGeneral) {
      // Logits in log2 units (scale, soft-capping, bias, ALiBi); hidden ones -inf.
      // Recomputed per tile (two cached loads) rather than kept live across the loop.
      const SequenceBounds bounds = sequence_bounds(p, batch);
      const bool partial =
          general_tile_partial(p, bounds, batch, head, m0, kBlockM, n0, kBlockN) ||
          segments_split(p, q_seg, segment_ids(p.mask.kv_segment_chunks, batch, S, n0, kBlockN));
      CUTE_UNROLL
      for (int mi = 0; mi < size<0>(scores); ++mi) {
        const RowPolicy row = row_policy(p, bounds, batch, head, m0 + get<0>(tScS_rc(mi, 0)));
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(scores); ++ni)
          scores(mi, ni) = row_logit(p, row, n0 + get<1>(tScS_rc(mi, ni)), scores(mi, ni), partial, nullptr);
      }
    } else {
      if (tile_needs_mask<kCausal>(m0, n0, kBlockN, S)) apply_mask<kCausal>(scores, tScS_rc, m0, n0, S);
    }

    cp_async_wait<0>();
    __syncthreads();  // V[n] visible; every warp is done reading K[n]
    if (n_block > n_block_min) {
      // Interior tiles need no bounds: only the last tile (handled first) can cross S.
      cute::copy(gmem_copy, tKgK(_, _, _, n_block - 1), tKsK);
      cute::cp_async_fence();
    }

    softmax.update(scores, acc_o_rc, kGeneral ? 1.f : p.scale_log2);
    if constexpr (kGeneral) {
      // Dropout after the softmax statistics (the row sums and so LSE are dropout-free), as on the
      // CPU: P·keep/(1 - rate) enters P·V. Columns (ni, ni + 1), ni even, are adjacent keys.
      if constexpr (kDropout) {
        const DropoutStream drop = dropout_stream(p, batch);
        const auto keep = dropout_keep_bits(drop, head, m0, n0, tScS_rc);
        CUTE_UNROLL
        for (int mi = 0; mi < size<0>(scores); ++mi) {
          CUTE_UNROLL
          for (int ni = 0; ni < size<1>(scores); ++ni) scores(mi, ni) *= keep.kept(mi, ni) ? drop.keep_scale : 0.f;
        }
      }
    }

    Tensor rP = convert_type<Element>(acc_s);
    Tensor tOrP = make_tensor(rP.data(), acc_as_a_operand(rP.layout()));
    gemm_rs(acc_o, tOrP, tOrVt, tOsVt, tiled_mma, smem_copy_v, smem_thr_v);
  }

  // Epilogue: normalize, LSE, O through smem (reusing sQ) for 16-byte coalesced stores.
  if constexpr (kGeneral) cp_async_wait<0>();  // a block that saw no key tile still has Q in flight
  float lse[decltype(size<0>(acc_o_rc))::value];
  softmax.finalize(acc_o_rc, kGeneral ? 1.f : p.scale_log2, lse);

  Tensor rO = convert_type<Element>(acc_o);
  Tensor sO = make_tensor(sQ.data(), typename Traits::SmemLayoutO{});
  auto smem_copy_o = make_tiled_copy_C(typename Traits::SmemCopyAtomStore{}, tiled_mma);
  auto smem_thr_o = smem_copy_o.get_thread_slice(tidx);
  Tensor taccOrO = smem_thr_o.retile_S(rO);
  Tensor taccOsO = smem_thr_o.partition_D(sO);
  __syncthreads();  // all warps are done with sQ
  cute::copy(smem_copy_o, taccOrO, taccOsO);

  // LSE: the lane holding column 0 of each row writes it.
  Tensor tOcO = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tOcO_rc = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));
  if (get<1>(tOcO_rc(0, 0)) == 0) {
    float* lse_ptr = p.lse + batch * p.lse_strides.batch + head * p.lse_strides.head;
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(tOcO_rc); ++mi) {
      const int row = m0 + get<0>(tOcO_rc(mi, 0));
      if (row < T) lse_ptr[row * p.lse_strides.row] = lse[mi];
    }
  }

  __syncthreads();
  typename Traits::GmemTiledCopyStore gmem_copy_o;
  auto gmem_thr_o = gmem_copy_o.get_thread_slice(tidx);
  Tensor tOsO = gmem_thr_o.partition_S(sO);
  Tensor tOgO = gmem_thr_o.partition_D(gO);
  Tensor tOrOut = make_tensor<Element>(shape(tOgO));
  cute::copy(gmem_copy_o, tOsO, tOrOut);
  Tensor tOcOut = gmem_thr_o.partition_D(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  copy_rows<false>(gmem_copy_o, tOrOut, tOgO, tOcOut, T - m0);
}

}  // namespace jfa::sm80
