// The sm80 entry points run_fwd / run_bwd and the per-variant launchers they pick from.
//
// Light on purpose: api.cu includes this, not the kernels, so the dispatch compiles in seconds.
// Each variant launcher is defined in launch.h and instantiated in its own generated file
// (cuda/instantiations/sm80_<pass>_<dtype>_hdim<H>_<variant>.cu), so a build compiles the
// variants of one head dim (four forward, six backward) in parallel instead of in one long
// translation unit.
#pragma once

#include <cuda_runtime_api.h>
#include <cutlass/numeric_types.h>

#include "jfa/params.h"

namespace jfa::sm80 {

// Which kernel template runs: the plain and causal ones carry no mask code at all; kMasked is the
// general kernel (every mask, score modifier and d(bias), causality from p.is_causal); kDropout
// is the general kernel with Philox dropout on P. kPlainOrdered and kCausalOrdered are backward
// only: the plain and causal kernels with the dQ adds in key-tile order (deterministic=True).
enum class Variant { kPlain, kCausal, kMasked, kDropout, kPlainOrdered, kCausalOrdered };

template <typename Element, int kHeadDim, Variant kVariant>
cudaError_t launch_fwd_variant(const AttentionParams& p, cudaStream_t stream);
template <typename Element, int kHeadDim, Variant kVariant>
cudaError_t launch_bwd_variant(const AttentionParams& p, cudaStream_t stream);

inline Variant pick_variant(const AttentionParams& p) {
  if (p.mask.active()) return p.mask.has_dropout() ? Variant::kDropout : Variant::kMasked;
  return p.is_causal ? Variant::kCausal : Variant::kPlain;
}

template <typename Element, int kHeadDim>
cudaError_t run_fwd(const AttentionParams& p, cudaStream_t stream) {
  switch (pick_variant(p)) {
    case Variant::kPlain: return launch_fwd_variant<Element, kHeadDim, Variant::kPlain>(p, stream);
    case Variant::kCausal: return launch_fwd_variant<Element, kHeadDim, Variant::kCausal>(p, stream);
    case Variant::kMasked: return launch_fwd_variant<Element, kHeadDim, Variant::kMasked>(p, stream);
    case Variant::kDropout: return launch_fwd_variant<Element, kHeadDim, Variant::kDropout>(p, stream);
    case Variant::kPlainOrdered:
    case Variant::kCausalOrdered: break;  // backward only
  }
  return cudaErrorNotSupported;
}

// deterministic=True runs the plain and causal backward on their ordered variants: the default
// kernels compile without the ordering and keep their registers (compiled in as a run-time flag,
// it made the plain backward spill), and the general kernel, which orders at run time, is several
// times slower (docs/performance.md). Masked and dropout calls stay on their general kernels.
inline Variant pick_bwd_variant(const AttentionParams& p) {
  const Variant v = pick_variant(p);
  if (!p.deterministic) return v;
  if (v == Variant::kPlain) return Variant::kPlainOrdered;
  if (v == Variant::kCausal) return Variant::kCausalOrdered;
  return v;
}

template <typename Element, int kHeadDim>
cudaError_t run_bwd(const AttentionParams& p, cudaStream_t stream) {
  switch (pick_bwd_variant(p)) {
    case Variant::kPlain: return launch_bwd_variant<Element, kHeadDim, Variant::kPlain>(p, stream);
    case Variant::kCausal: return launch_bwd_variant<Element, kHeadDim, Variant::kCausal>(p, stream);
    case Variant::kMasked: return launch_bwd_variant<Element, kHeadDim, Variant::kMasked>(p, stream);
    case Variant::kDropout: return launch_bwd_variant<Element, kHeadDim, Variant::kDropout>(p, stream);
    case Variant::kPlainOrdered: return launch_bwd_variant<Element, kHeadDim, Variant::kPlainOrdered>(p, stream);
    case Variant::kCausalOrdered: return launch_bwd_variant<Element, kHeadDim, Variant::kCausalOrdered>(p, stream);
  }
  return cudaErrorNotSupported;
}

}  // namespace jfa::sm80
