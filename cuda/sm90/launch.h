// Host side of the sm90 forward: TMA descriptors built from the call's strides (per call, on the
// host: cuTensorMapEncodeTiled through CuTe's make_tma_copy), passed as __grid_constant__ kernel
// parameters, and a persistent launch of one CTA per SM. Each instantiation file
// (cuda/generate_instantiations.py) instantiates run_fwd for one (dtype, head dim); the dropout
// kernel's files instantiate run_fwd_dropout (launch_dropout.h), which run_fwd only declares.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>

#include "fwd_kernel.h"
#include "jfa/params.h"
#include "kernel_traits.h"
#include "run.h"

namespace jfa::sm90 {

namespace detail {

// (rows, H, heads, batch) view of a [batch, rows, heads, H] tensor. A dimension of size 1 never
// moves its index, so its stride is replaced by one TMA accepts (a multiple of 16 bytes).
inline GmemStride gmem_stride(const Strides& s, int64_t heads, int64_t batch) {
  return GmemStride{s.row, _1{}, heads == 1 ? s.row : s.head, batch == 1 ? s.row : s.batch};
}

template <typename Traits, bool kCausal, int kPolicies = 0>
cudaError_t launch_fwd(const AttentionParams& p, cudaStream_t stream) {
  constexpr bool kGeneral = kPolicies != 0;
  using Element = typename Traits::Element;
  const GmemShape shape_q{int(p.T), int(p.H), int(p.N), int(p.B)};
  const GmemShape shape_kv{int(p.S), int(p.H), int(p.K), int(p.B)};
  auto q = make_tensor(make_gmem_ptr(static_cast<const Element*>(p.q)), shape_q, gmem_stride(p.q_strides, p.N, p.B));
  auto k = make_tensor(make_gmem_ptr(static_cast<const Element*>(p.k)), shape_kv, gmem_stride(p.k_strides, p.K, p.B));
  auto v = make_tensor(make_gmem_ptr(static_cast<const Element*>(p.v)), shape_kv, gmem_stride(p.v_strides, p.K, p.B));
  auto o = make_tensor(make_gmem_ptr(static_cast<Element*>(p.o)), shape_q, gmem_stride(p.o_strides, p.N, p.B));

  const int num_m_blocks = int((p.T + Traits::kBlockM - 1) / Traits::kBlockM);
  KernelParams<Traits> kp{make_tma_q<Traits>(q), make_tma_kv<Traits>(k), make_tma_kv<Traits>(v), make_tma_o<Traits>(o),
                          shape_q, shape_kv, p.lse, p.lse_strides.batch, p.lse_strides.row,
                          p.lse_strides.head, p.scale_log2, int(p.T), int(p.S), int(p.N / p.K),
                          int(num_m_blocks * p.N * p.B), p};
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
  constexpr int smem = int(sizeof(SharedStorage<Traits, alibi_on_tensor_cores(kPolicies)>));
  static_assert(smem <= 227 * 1024, "exceeds the 227 KB of smem an sm90 CTA may use");
  if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      err != cudaSuccess)
    return err;
  const int grid = std::min(kp.num_tiles, num_sms());
  kernel<<<dim3(unsigned(grid)), Traits::kNumThreads, smem, stream>>>(kp, sched);
  return cudaGetLastError();
}

// The general path: the smallest compiled policy set (mask.h) that covers the call. Five sets:
// positions alone; positions and ALiBi; positions and segment ids; positions and the data masks
// (segment ids, boolean mask); everything. Positions alone is a set of its own because the ALiBi
// set's kernel carries the prefix (fwd_kernel.h, kAlibiPrefix) in its loop and smem even when a
// call has no slopes: a window that hides nothing measured 99.7 / 96.6 / 96.1 % of plain causal on
// it at H 64 / 128 / 256, against 98.7 / 100.8 / 100.5 % before the prefix (H200, bf16, causal
// 16k, sm90_check --masks; benchmarks/results/2026-11-23-nvidia-h200-masks-10.csv and -masks-9.csv).
// LeanTraits: the tiles of the positions-only and segment-ids kernels (GeneralFwdConfig's kLean).
template <typename Traits, typename LeanTraits = Traits>
cudaError_t launch_general(const AttentionParams& p, cudaStream_t stream) {
  constexpr int kAlibiSet = kPolicyPositions | kPolicyAlibi, kSegmentsSet = kPolicyPositions | kPolicySegments,
                kDataSet = kPolicyPositions | kPolicyData;
  const int needed = policies_needed(p.mask);
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
  // causal's). H 64 takes 128 x 128 for short sequences, as plain causal does below (measured
  // there, not on this path), and for the other sets' kernels with segment ids (kernel_traits.h).
  using Lean = typename GeneralFwdConfig<Element, kHeadDim, true>::Traits;
  if (p.mask.active()) {
    if constexpr (kHeadDim == 64) {
      if (p.T <= 1536) return detail::launch_general<Short>(p, stream);
      if (p.mask.q_segment_ids != nullptr) return detail::launch_general<Short, Lean>(p, stream);
    }
    return detail::launch_general<typename GeneralFwdConfig<Element, kHeadDim>::Traits, Lean>(p, stream);
  }
  // Short sequences: 128 x 128 tiles with two consumers (and an own O buffer) where FwdConfig's
  // tile loses. Measured on an H200 (bf16, B·T = 16k, N·H = 2048; tests/cuda/sm90_check.cu), TFLOP/s:
  //   H 64 causal: 192-row tiles spend a third of their work on the diagonal and past T at T = 1k:
  //     272 against 313 with 128 rows; 386 / 380 at 2k, 447 / 430 at 4k.
  //   H 128 non-causal: the 176-key tile's O reuses Q's smem, so the next tile's Q cannot load
  //     under the epilogue, which weighs most when a tile has few key blocks: 559 against 607 at
  //     S = 1k, 641 / 659 at 2k, 681 / 681 at 4k, 687 / 642 at 8k.
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
