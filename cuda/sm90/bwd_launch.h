// Host side of the Hopper backward: its launches on the call's stream (no allocation, no
// synchronization: CUDA-graph safe). Each instantiation file (cuda/generate_instantiations.py)
// instantiates run_bwd for one (dtype, head dim), and the general path's run_bwd_policies for
// each policy set (mask_policies.h's kBwd*Set) in files of their own, so that they compile in parallel.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>

#include "bwd_kernel.h"
#include "bwd_mask_columns.h"
#include "bwd_postprocess.h"
#include "bwd_traits.h"
#include "jfa/bwd_row_stats.cuh"
#include "jfa/params.h"
#include "run.h"
#include "tile_scheduler.h"

namespace jfa::sm90 {

namespace detail {

template <typename Traits, bool kCausal, int kPolicies>
cudaError_t launch_bwd(const AttentionParams& p, cudaStream_t stream) {
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim;
  // The dQ partial sums are added into the accumulator, every lane the kernel uses
  // (bwd_dq_order.h): start from zero (padding rows too); so are the dQ turns, d(bias) and
  // d(slopes) (launch_bwd_row_stats).
  constexpr int kLanes = bwd_dq_lanes<Traits, kPolicies>();
  const int64_t lanes = p.deterministic ? kLanes : 1;
  cudaError_t err =
      cudaMemsetAsync(p.dq_accum, 0, size_t(lanes * bwd_dq_lane_floats<kHeadDim>(p)) * sizeof(float), stream);
  if (err != cudaSuccess) return err;
  if (p.deterministic) {  // the dQ turns (bwd_dq_order.h), in the portable kernels' layout
    err = cudaMemsetAsync(p.dq_semaphore, 0, size_t(lanes * p.B * p.N * p.dq_semaphores_per_head()) * sizeof(int32_t),
                          stream);
    if (err != cudaSuccess) return err;
  }
  if ((err = launch_bwd_row_stats<Element, kHeadDim>(p, stream)) != cudaSuccess) return err;
  // A mask's bits by key, for the tiles that hold keys in rows (bwd_mask_columns.h).
  AttentionParams with_key_bits = p;
  if constexpr ((kPolicies & kPolicyBoolMask) != 0 && !Traits::kSplitHead)
    if ((err = transpose_mask_bits(with_key_bits, /*every_block=*/p.deterministic, stream)) != cudaSuccess) return err;

  BwdParams<Traits> kp = make_bwd_params<Traits>(with_key_bits);
  const int group = int(p.N / p.K);
  // Causal GQA: a CTA per query head of the group, adding its partial dK and dV into the float32
  // workspace, rather than one walking the whole group. Causal CTAs of one K/V head end at
  // different times, so those walking a group drift apart over its query heads, whose Q, dO and dQ
  // together overflow L2 at long sequences; CTAs of one query head each fit in L2 sections, as
  // without GQA. deterministic=True keeps whole groups (the dK and dV atomics would reorder).
  kp.head_chunks = group > 1 && p.dkv_accum != nullptr && !p.deterministic && (kCausal || p.is_causal) ? group : 1;
  // Where a CTA still walks several query heads with causality (no workspace), it walks down from
  // the last query block with the heads innermost, so that the CTAs that start together read the
  // same Q and dO rows at the same time.
  const int heads = kp.heads = group / kp.head_chunks;
  kp.walk_down = p.deterministic || (heads > 1 && (kCausal || p.is_causal));
  if (kp.head_chunks > 1) {
    err = cudaMemsetAsync(p.dkv_accum, 0, size_t(2 * p.B * p.K * p.dkv_accum_rows()) * kHeadDim * sizeof(float), stream);
    if (err != cudaSuccess) return err;
  }
  const int num_units = int(p.B * p.K) * kp.head_chunks;  // (batch, K/V head, chunk of its query heads)
  // L2 sections take 32 of the 50 MB of an H100/H200, as the forward's (tile_scheduler.h), but
  // hold at least a wave of CTAs: longest-first only orders the tiles within a section, and
  // sections of fewer CTAs than the GPU runs at once (GQA, whose CTAs each walk a whole group of
  // query heads) would start their longest tiles late; more than that only spreads the CTAs
  // running together over more heads than L2 holds. Where one unit alone overflows that budget
  // (GQA at long sequences), sections buy nothing: one section, longest first over all.
  constexpr int64_t kL2Budget = int64_t(32) << 20;
  const int64_t unit_bytes = heads * p.T * p.H * (2 * int64_t(sizeof(Element)) + 4);
  const int one_wave = (num_sms() + kp.num_n_blocks - 1) / kp.num_n_blocks;
  const int section = unit_bytes > kL2Budget
                          ? num_units
                          : std::max(l2_section_bk(p.T, p.H, int64_t(sizeof(Element)), heads, kL2Budget), one_wave);
  const BwdOrderOf<kCausal, kPolicies> order{kp.num_n_blocks, int(p.K) * kp.head_chunks, num_units,
                                             std::min(section, num_units)};
  auto kernel = &bwd_kernel<Traits, kCausal, kPolicies>;
  constexpr int smem = int(sizeof(BwdSharedStorage<Traits>));
  static_assert(smem <= 227 * 1024, "exceeds the 227 KB of smem an sm90 CTA may use");
  if ((err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)) != cudaSuccess)
    return err;
  kernel<<<dim3(unsigned(kp.num_n_blocks * num_units)), Traits::kNumThreads, smem, stream>>>(kp, order);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  if (kp.head_chunks > 1) {
    bwd_convert_dkv_kernel<Traits>
        <<<dim3(unsigned(kp.num_n_blocks * p.K * p.B)), Traits::kNumMmaThreads, 0, stream>>>(p);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }

  bwd_convert_dq_kernel<Traits, kLanes>
      <<<dim3(unsigned(kp.num_m_blocks * p.N * p.B)), Traits::kNumMmaThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace detail

template <typename Element, int kHeadDim>
cudaError_t run_bwd(const AttentionParams& p, cudaStream_t stream) {
  using Config = BwdConfig<Element, kHeadDim>;
  if (p.mask.active() || p.mask.has_dropout()) {
    const int set = bwd_policy_set(p.mask);
    switch (set) {
      case kBwdPositionsSet: return run_bwd_policies<Element, kHeadDim, kBwdPositionsSet>(p, stream);
      case kBwdMaskSet: return run_bwd_policies<Element, kHeadDim, kBwdMaskSet>(p, stream);
      case kBwdAlibiSet: return run_bwd_policies<Element, kHeadDim, kBwdAlibiSet>(p, stream);
      case kBwdSoftcapSet: return run_bwd_policies<Element, kHeadDim, kBwdSoftcapSet>(p, stream);
      case kPolicyAll: return run_bwd_policies<Element, kHeadDim, kPolicyAll>(p, stream);
      case kBwdDropoutPositionsSet: return run_bwd_policies<Element, kHeadDim, kBwdDropoutPositionsSet>(p, stream);
      default: return run_bwd_policies<Element, kHeadDim, kPolicyAll | kPolicyDropout>(p, stream);
    }
  }
  return p.is_causal ? detail::launch_bwd<typename Config::Traits, true, 0>(p, stream)
                     : detail::launch_bwd<typename Config::PlainTraits, false, 0>(p, stream);
}

}  // namespace jfa::sm90
