// Templated launchers of the sm80 kernels. Each generated instantiation file (one per
// fwd/bwd x dtype x hdim x variant, the ordered variants bwd only; see
// cuda/generate_instantiations.py) explicitly instantiates launch_fwd_variant or
// launch_bwd_variant (declared in run.h) for one combination.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "bwd_kernel.h"
#include "fwd_kernel.h"
#include "jfa/params.h"
#include "kernel_traits.h"
#include "run.h"

namespace jfa::sm80 {

namespace detail {

// Kernels using more than 48 KB of dynamic smem must opt in before their launch.
template <typename Kernel>
cudaError_t set_smem(Kernel kernel, int bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

template <typename Traits, bool kCausal, bool kGeneral = false, bool kDropout = false>
cudaError_t launch_fwd(const AttentionParams& p, cudaStream_t stream) {
  auto kernel = &fwd_kernel<Traits, kCausal, kGeneral, kDropout>;
  constexpr int smem = Traits::kSmemSize;
  if (cudaError_t err = set_smem(kernel, smem); err != cudaSuccess) return err;
  const int64_t blocks = (p.T + Traits::kBlockM - 1) / Traits::kBlockM * p.N * p.B;
  kernel<<<dim3(unsigned(blocks)), Traits::kNThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename Traits, bool kCausal, bool kGeneral = false, bool kDropout = false, bool kOrdered = false>
cudaError_t launch_bwd_main(const AttentionParams& p, cudaStream_t stream) {
  auto kernel = &bwd_kernel<Traits, kCausal, kGeneral, kDropout, kOrdered>;
  constexpr int smem = Traits::kSmemSize;
  if (cudaError_t err = set_smem(kernel, smem); err != cudaSuccess) return err;
  const int64_t blocks = (p.S + Traits::kBlockN - 1) / Traits::kBlockN * p.K * p.B;
  kernel<<<dim3(unsigned(blocks)), Traits::kNThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace detail

// The kernel template flags of each variant (run.h). kOrdered is a backward flag only.
template <Variant kVariant>
struct VariantFlags {
  static constexpr bool kCausal = kVariant == Variant::kCausal || kVariant == Variant::kCausalOrdered;
  static constexpr bool kGeneral = kVariant == Variant::kMasked || kVariant == Variant::kDropout;
  static constexpr bool kDropout = kVariant == Variant::kDropout;
  static constexpr bool kOrdered = kVariant == Variant::kPlainOrdered || kVariant == Variant::kCausalOrdered;
};

template <typename Element, int kHeadDim, Variant kVariant>
cudaError_t launch_fwd_variant(const AttentionParams& p, cudaStream_t stream) {
  using Traits = typename FwdConfig<Element, kHeadDim>::Traits;
  using F = VariantFlags<kVariant>;
  static_assert(!F::kOrdered, "the ordered variants are backward-only");
  return detail::launch_fwd<Traits, F::kCausal, F::kGeneral, F::kDropout>(p, stream);
}

template <typename Element, int kHeadDim, Variant kVariant>
cudaError_t launch_bwd_variant(const AttentionParams& p, cudaStream_t stream) {
  using F = VariantFlags<kVariant>;
  using Traits = typename std::conditional_t<F::kGeneral, GeneralBwdConfig<Element, kHeadDim>,
                                             BwdConfig<Element, kHeadDim>>::Traits;
  // dq_accum is accumulated with atomics: start from zero (padding rows and the lanes used
  // included: the ordered causal kernel's, dq_accum.h).
  constexpr int kLanes = kDqLanesOf<F::kCausal, F::kOrdered>;
  cudaError_t err = cudaMemsetAsync(
      p.dq_accum, 0, size_t(kLanes * p.B * p.N * p.dq_accum_rows()) * kHeadDim * sizeof(float), stream);
  if (err != cudaSuccess) return err;
  // The deterministic mode's semaphores count finished adds per dQ tile and lane from zero.
  if (p.deterministic) {
    err = cudaMemsetAsync(p.dq_semaphore, 0, size_t(kLanes * p.B * p.N * p.dq_semaphores_per_head()) * sizeof(int32_t),
                          stream);
    if (err != cudaSuccess) return err;
  }
  // d(bias) and d(slopes) zeroed, then the row statistics.
  if ((err = launch_bwd_row_stats<Element, kHeadDim>(p, stream)) != cudaSuccess) return err;

  err = detail::launch_bwd_main<Traits, F::kCausal, F::kGeneral, F::kDropout, F::kOrdered>(p, stream);
  if (err != cudaSuccess) return err;

  const int64_t tiles = (p.T + Traits::kBlockM - 1) / Traits::kBlockM * p.N * p.B;
  bwd_convert_dq_kernel<Traits, kLanes><<<dim3(unsigned(tiles)), Traits::kNThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jfa::sm80
