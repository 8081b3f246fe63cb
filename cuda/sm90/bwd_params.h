// What the Hopper backward's kernels read: the TMA descriptors of Q, dO, K, V (loads) and dK, dV
// (stores), built on the host per call, and the call itself.
#pragma once

#include <cute/tensor.hpp>

#include "bwd_traits.h"
#include "jfa/params.h"
#include "tile_scheduler.h"
#include "tma.h"

namespace jfa::sm90 {

using namespace cute;

template <typename Traits>
struct BwdParams {
  using Element = typename Traits::Element;
  using GIn = decltype(gmem_tensor<Element>(static_cast<const void*>(nullptr), GmemShape{}, GmemStride{}));
  using GOut = decltype(gmem_tensor<Element>(static_cast<void*>(nullptr), GmemShape{}, GmemStride{}));
  using TmaQ = decltype(make_tma_load<Traits::kBlockM, Traits::kHeadDim, typename Traits::SmemLayoutQ>(std::declval<GIn>()));
  using TmaKV = decltype(make_tma_load<Traits::kBlockN, Traits::kHeadDim, typename Traits::SmemLayoutK>(std::declval<GIn>()));
  using TmaStore = decltype(make_tma_store_box<Element>(std::declval<GOut>()));

  TmaQ tma_q, tma_do;
  TmaKV tma_k, tma_v;
  TmaStore tma_dk, tma_dv;
  GmemShape shape_q, shape_kv;  // (T, H, N, B) and (S, H, K, B); dO has Q's shape, dK and dV K's
  int num_n_blocks, num_m_blocks, group;  // group = N / K query heads per K/V head
  AttentionParams attn;
};

template <typename Traits>
BwdParams<Traits> make_bwd_params(const AttentionParams& p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  using LayoutQ = typename Traits::SmemLayoutQ;
  using LayoutK = typename Traits::SmemLayoutK;
  const GmemShape shape_q{int(p.T), int(p.H), int(p.N), int(p.B)};
  const GmemShape shape_kv{int(p.S), int(p.H), int(p.K), int(p.B)};
  auto q = gmem_tensor<Element>(p.q, shape_q, gmem_stride(p.q_strides, p.N, p.B));
  auto dout = gmem_tensor<Element>(p.dout, shape_q, gmem_stride(p.do_strides, p.N, p.B));
  auto k = gmem_tensor<Element>(p.k, shape_kv, gmem_stride(p.k_strides, p.K, p.B));
  auto v = gmem_tensor<Element>(p.v, shape_kv, gmem_stride(p.v_strides, p.K, p.B));
  auto dk = gmem_tensor<Element>(p.dk, shape_kv, gmem_stride(p.dk_strides, p.K, p.B));
  auto dv = gmem_tensor<Element>(p.dv, shape_kv, gmem_stride(p.dv_strides, p.K, p.B));
  return BwdParams<Traits>{make_tma_load<kBlockM, kHeadDim, LayoutQ>(q),
                           make_tma_load<kBlockM, kHeadDim, LayoutQ>(dout),
                           make_tma_load<kBlockN, kHeadDim, LayoutK>(k),
                           make_tma_load<kBlockN, kHeadDim, LayoutK>(v),
                           make_tma_store_box<Element>(dk),
                           make_tma_store_box<Element>(dv),
                           shape_q,
                           shape_kv,
                           int((p.S + kBlockN - 1) / kBlockN),
                           int((p.T + kBlockM - 1) / kBlockM),
                           int(p.N / p.K),
                           p};
}

// The query blocks a key block's CTA walks, per query head of its group: [begin, end). Top-left
// causal starts at the first block with a query at or after the block's first key.
template <typename Traits, bool kCausal>
__forceinline__ __device__ int2 bwd_m_block_range(const BwdParams<Traits>& p, int n_block) {
  const int begin = kCausal ? min(n_block * Traits::kBlockN / Traits::kBlockM, p.num_m_blocks) : 0;
  return make_int2(begin, p.num_m_blocks);
}

// Step s of a CTA's walk: query head (of the group) s / steps_per_head, query block begin + the rest.
struct BwdStep {
  int head;  // the query head
  int m_block;
};

struct BwdWalk {
  int kv_head, batch, n_block;
  int m_begin, steps_per_head, num_steps;

  __forceinline__ __device__ BwdStep step(int s, int group) const {
    const int g = s / steps_per_head;
    return {kv_head * group + g, m_begin + (s - g * steps_per_head)};
  }
};

template <typename Traits, bool kCausal>
__forceinline__ __device__ BwdWalk bwd_walk(const BwdParams<Traits>& p, const BwdTileOrder<kCausal>& order) {
  const TileCoord t = order.get(int(blockIdx.x));
  const int2 range = bwd_m_block_range<Traits, kCausal>(p, t.m_block);
  const int per_head = range.y - range.x;
  return BwdWalk{t.head, t.batch, t.m_block, range.x, per_head, per_head * p.group};
}

// Offset of the row statistics (and, times H, of the dQ accumulator) of query block m_block.
template <typename Traits>
__forceinline__ __device__ int64_t bwd_row_offset(const AttentionParams& p, int batch, int head, int m_block) {
  return (int64_t(batch) * p.N + head) * p.dq_accum_rows() + int64_t(m_block) * Traits::kBlockM;
}

}  // namespace jfa::sm90
