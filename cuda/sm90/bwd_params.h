// What the Hopper backward's kernels read: the TMA descriptors of Q, dO, K, V (loads) and dK, dV
// (stores), built on the host per call, and the call itself.
#pragma once

#include <cute/tensor.hpp>

#include "bwd_general.h"
#include "bwd_traits.h"
#include "jfa/params.h"
#include "tile_scheduler.h"
#include "tma.h"

namespace jfa::sm90 {

using namespace cute;

template <typename Traits>
struct BwdParams {
  using Element = typename Traits::Element;
  TmaLoad<Element, Traits::kBlockM, Traits::kHeadDim, typename Traits::SmemLayoutQ> tma_q, tma_do;
  TmaLoad<Element, Traits::kBlockN, Traits::kHeadDim, typename Traits::SmemLayoutK> tma_k, tma_v;
  TmaStoreBox<Element> tma_dk, tma_dv;
  GmemShape shape_q, shape_kv;  // (T, H, N, B) and (S, H, K, B); dO has Q's shape, dK and dV K's
  int num_n_blocks, num_m_blocks, group;  // group = N / K query heads per K/V head
  // Set by the launcher (bwd_launch.h): CTAs per key block of a K/V head, the query heads each
  // walks (group / head_chunks: a parameter, so that the walk keeps no register for it), and
  // whether the walk runs down (BwdWalk::ordered).
  int head_chunks, heads;
  bool walk_down;
  AttentionParams attn;
};

template <typename Traits>
BwdParams<Traits> make_bwd_params(const AttentionParams& p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  using LayoutQ = typename Traits::SmemLayoutQ;
  using LayoutK = typename Traits::SmemLayoutK;
  return BwdParams<Traits>{make_tma_load<kBlockM, kHeadDim, LayoutQ>(query_tensor<Element>(p, p.q, p.q_strides)),
                           make_tma_load<kBlockM, kHeadDim, LayoutQ>(query_tensor<Element>(p, p.dout, p.do_strides)),
                           make_tma_load<kBlockN, kHeadDim, LayoutK>(key_tensor<Element>(p, p.k, p.k_strides)),
                           make_tma_load<kBlockN, kHeadDim, LayoutK>(key_tensor<Element>(p, p.v, p.v_strides)),
                           make_tma_store_box<Element>(key_tensor<Element>(p, p.dk, p.dk_strides)),
                           make_tma_store_box<Element>(key_tensor<Element>(p, p.dv, p.dv_strides)),
                           query_shape(p),
                           key_shape(p),
                           int((p.S + kBlockN - 1) / kBlockN),
                           int((p.T + kBlockM - 1) / kBlockM),
                           int(p.N / p.K),
                           1,
                           int(p.N / p.K),
                           p.deterministic,
                           p};
}

// The query blocks a key block's CTA walks, per query head of its group: [begin, end). Top-left
// causal starts at the first block with a query at or after the block's first key.
template <typename Traits, bool kCausal>
__forceinline__ __device__ int2 bwd_m_block_range(const BwdParams<Traits>& p, int n_block) {
  const int begin = kCausal ? min(n_block * Traits::kBlockN / Traits::kBlockM, p.num_m_blocks) : 0;
  return make_int2(begin, p.num_m_blocks);
}

// Step s of a CTA's walk over `heads` query heads from head0: query head head0 + s /
// steps_per_head, query block begin + the rest. `ordered` (deterministic=True, and causal CTAs that
// walk several heads: bwd_launch.h) walks the other way: down from the last query block, the
// query heads innermost, so that the CTAs of every key block reach a query block at the same
// step and each waits for its turn there (bwd_dq_order.h) only as long as the lower key blocks'
// adds take; walking up from the diagonal, a causal key block's first block would be the lower
// key blocks' last.
struct BwdStep {
  int head;  // the query head
  int m_block;
};

struct BwdWalk {
  int head0, batch, n_block;  // head0: the first query head the CTA walks
  int m_begin, steps_per_head, num_steps;
  bool ordered;

  __forceinline__ __device__ int kv_head(int group) const { return head0 / group; }
  __forceinline__ __device__ BwdStep step(int s, int heads) const {
    if (ordered) {
      const int back = s / heads;
      return {head0 + (s - back * heads), m_begin + steps_per_head - 1 - back};
    }
    const int g = s / steps_per_head;
    return {head0 + g, m_begin + (s - g * steps_per_head)};
  }
};

// The CTA's walk; the general path (kPolicies != 0) takes its query blocks from the call's masks
// (bwd_general.h), and a key block that no query sees gets an empty walk.
template <typename Traits, bool kCausal, int kPolicies, typename Order>
__forceinline__ __device__ BwdWalk bwd_walk(const BwdParams<Traits>& p, const Order& order) {
  const TileCoord t = order.get(int(blockIdx.x));  // t.head: K/V head · head_chunks + chunk
  const int kv_head = t.head / p.head_chunks;
  int2 range;
  if constexpr (kPolicies != 0)
    range = bwd_general_m_blocks<Traits::kBlockM, Traits::kBlockN, kPolicies>(p.attn, t.batch, kv_head, t.m_block);
  else
    range = bwd_m_block_range<Traits, kCausal>(p, t.m_block);
  const int per_head = range.y - range.x;
  const int head0 = kv_head * p.group + (t.head - kv_head * p.head_chunks) * p.heads;
  return BwdWalk{head0, t.batch, t.m_block, range.x, per_head, per_head * p.heads, p.walk_down};
}

// Waits for the CTA's K and V, then runs step(s, the step, the Q/dO ring's read state) for every
// step of the walk, advancing the ring after each.
template <typename Traits, typename Storage, typename Body>
__forceinline__ __device__ void bwd_for_each_step(Storage& ss, const BwdWalk& walk, int heads, Body&& body) {
  ss.kv_full.wait(0);
  typename Traits::PipelineState read;
#pragma unroll 1
  for (int s = 0; s < walk.num_steps; ++s) {
    body(s, walk.step(s, heads), read);
    ++read;
  }
}

// Offset of the row statistics (and, times H, of the dQ accumulator) of query block m_block.
template <typename Traits>
__forceinline__ __device__ int64_t bwd_row_offset(const AttentionParams& p, int batch, int head, int m_block) {
  return (int64_t(batch) * p.N + head) * p.dq_accum_rows() + int64_t(m_block) * Traits::kBlockM;
}

// A warpgroup's share of the dK (which = 0) or dV (1) partial sums of key block n_block in the
// workspace (params.h: dkv_accum), in atomic_add_share's order; the warpgroups' shares follow one
// another.
template <typename Traits>
__forceinline__ __device__ float* bwd_dkv_share(const AttentionParams& p, int which, int batch, int kv_head,
                                                int n_block, int w) {
  constexpr int kShareFloats = Traits::kBlockN * Traits::kHeadDim / Traits::kNumMmaWarpGroups;
  return p.dkv_accum + ((int64_t(which) * p.B + batch) * p.K + kv_head) * p.dkv_accum_rows() * Traits::kHeadDim +
         int64_t(n_block) * Traits::kBlockN * Traits::kHeadDim + w * kShareFloats;
}

}  // namespace jfa::sm90
