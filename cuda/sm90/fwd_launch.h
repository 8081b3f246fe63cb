// Host side of the sm90 forward: TMA descriptors built from the call's strides (per call, on the
// host: cuTensorMapEncodeTiled through CuTe's make_tma_copy, fwd_params.h), passed as
// __grid_constant__ kernel parameters, and a persistent launch of one CTA per SM. Each
// instantiation file (cuda/generate_instantiations.py) instantiates run_fwd for one (dtype, head
// dim); the dropout kernel's files instantiate run_fwd_dropout (fwd_launch_dropout.h), which run_fwd
// only declares.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>

#include "fwd_kernel.h"
#include "fwd_params.h"
#include "fwd_traits.h"
#include "jfa/params.h"
#include "paged_kv.h"
#include "run.h"

namespace jfa::sm90 {

namespace detail {

template <typename Traits, bool kCausal, int kPolicies = 0>
cudaError_t launch_fwd(const AttentionParams& p, cudaStream_t stream) {
  constexpr bool kGeneral = kPolicies != 0;
  if (p.paged.present() && (!reads_pages<Traits, kPolicies>() || p.paged.page_size % kPagedPageRows != 0))
    return cudaErrorNotSupported;
  using Element = typename Traits::Element;
  const FwdParams<Traits> kp = make_fwd_params<Traits>(p);
  const int num_m_blocks = int((p.T + Traits::kBlockM - 1) / Traits::kBlockM);
  // Masked tiles run longest first too: their trip counts differ like causal ones. L2 sections
  // take 32 of the 50 MB of an H100/H200 (FlashAttention-3's budget: the rest holds Q, O and
  // the other tensors of the step).
  const TileScheduler<kCausal || kGeneral> sched{
      num_m_blocks, int(p.N), int(p.N * p.B),
      // At most every head: a larger section orders tiles the same, and section · num_m_blocks
      // then stays within num_tiles (an int).
      std::min(l2_section_bh(p.S, p.H, int64_t(sizeof(Element)), p.N / p.K, int64_t(32) << 20), int(p.N * p.B)),
      p.tile_counter};
  if (p.tile_counter != nullptr)
    if (cudaError_t err = cudaMemsetAsync(p.tile_counter, 0, sizeof(int32_t), stream); err != cudaSuccess)
      return err;

  auto kernel = &fwd_kernel<Traits, kCausal, kPolicies>;
  constexpr int smem = int(sizeof(FwdSharedStorage<Traits, alibi_on_tensor_cores(kPolicies)>));
  static_assert(smem <= 227 * 1024, "exceeds the 227 KB of smem an sm90 CTA may use");
  if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      err != cudaSuccess)
    return err;
  const int grid = std::min(kp.num_tiles, num_sms());
  kernel<<<dim3(unsigned(grid)), Traits::kNumThreads, smem, stream>>>(kp, sched);
  return cudaGetLastError();
}

// The general path: the smallest compiled policy set (mask_policies.h) that covers the call. Five sets:
// positions alone; positions and ALiBi; positions and segment ids; positions and the data masks
// (segment ids, boolean mask); everything. Positions alone is a set of its own because the ALiBi
// set's kernel carries the prefix (fwd_mainloop.h, kAlibiPrefix) in its loop and smem even when a
// call has no slopes, which costs calls without them.
// LeanTraits: the tiles of the positions-only and segment-ids kernels (GeneralFwdConfig's kLean).
template <typename Traits, typename LeanTraits = Traits>
cudaError_t launch_general(const AttentionParams& p, cudaStream_t stream) {
  constexpr int kAlibiSet = kPolicyPositions | kPolicyAlibi, kSegmentsSet = kPolicyPositions | kPolicySegments,
                kDataSet = kPolicyPositions | kPolicyData;
  const int needed = policies_needed(p.mask);
  // Paged calls with data masks: the all-policies kernel (paged_kv.h, reads_pages).
  if (p.paged.present() && (needed & kPolicyData) != 0) return launch_fwd<Traits, false, kPolicyAll>(p, stream);
  if (needed == kPolicyPositions) return launch_fwd<LeanTraits, false, kPolicyPositions>(p, stream);
  if ((needed & ~kAlibiSet) == 0) return launch_fwd<Traits, false, kAlibiSet>(p, stream);
  if ((needed & ~kSegmentsSet) == 0) return launch_fwd<LeanTraits, false, kSegmentsSet>(p, stream);
  if ((needed & ~kDataSet) == 0) return launch_fwd<Traits, false, kDataSet>(p, stream);
  return launch_fwd<Traits, false, kPolicyAll>(p, stream);
}

}  // namespace detail

template <typename Element, int kHeadDim>
cudaError_t run_fwd(const AttentionParams& p, cudaStream_t stream) {
  using Short = FwdTraits<Element, kHeadDim, 128, 128, 2>;
  if (p.mask.has_dropout()) return run_fwd_dropout<Element, kHeadDim>(p, stream);
  // Masks and score modifiers: the general kernel, on tiles whose registers leave room for the
  // policy code (GeneralFwdConfig; at H 64 the positions-only and segment-ids kernels' are plain
  // causal's). H 64 takes 128 x 128 for short sequences, as plain causal does below (that
  // choice was timed on the plain path), and for the other sets' kernels with segment ids (a 192-row tile
  // straddles more segment boundaries, whose keys those kernels test per element).
  // Paged caches take the general path too (paged_kv.h, reads_pages).
  using Lean = typename GeneralFwdConfig<Element, kHeadDim, true>::Traits;
  if (p.mask.active() || p.paged.present()) {
    if constexpr (kHeadDim == 64) {
      // The boolean mask too: on 128-key blocks its threads read one word per row (mask_policies.h,
      // hide_masked); the 112-key blocks of the 192-row tile straddle chunks and test bit by bit.
      if (p.T <= 1536 || p.mask.packed_mask.present() || p.paged.present())
        return detail::launch_general<Short>(p, stream);
      if (p.mask.q_segment_ids != nullptr) return detail::launch_general<Short, Lean>(p, stream);
    }
    return detail::launch_general<typename GeneralFwdConfig<Element, kHeadDim>::Traits, Lean>(p, stream);
  }
  // Short sequences: 128 x 128 tiles with two consumers (and an own O buffer) where FwdConfig's
  // tile loses: at H 64 causal, 192-row tiles spend a third of their work on the diagonal and past
  // T at T = 1k; at H 128 non-causal, the 176-key tile's O reuses Q's smem, so the next tile's Q
  // cannot load under the epilogue, which weighs most when a tile has few key blocks.
  if constexpr (kHeadDim == 64) {
    if (p.is_causal && p.T <= 1536) return detail::launch_fwd<Short, true>(p, stream);
  } else if constexpr (kHeadDim == 128) {
    if (!p.is_causal && p.S <= 2048) return detail::launch_fwd<Short, false>(p, stream);
  }
  return p.is_causal
             ? detail::launch_fwd<typename FwdConfig<Element, kHeadDim, true>::Traits, true>(p, stream)
             : detail::launch_fwd<typename FwdConfig<Element, kHeadDim, false>::Traits, false>(p, stream);
}

}  // namespace jfa::sm90
