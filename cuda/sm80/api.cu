// Dispatch of the sm80 kernels on (dtype, head dim), limited to the variants this build compiled
// (JFA_SM80_BUILT_MASK, common/built_variants.h).
#include "sm80/api.h"

#include <string>

#include "common/built_variants.h"
#include "sm80/run.h"

#ifndef JFA_SM80_BUILT_MASK
#define JFA_SM80_BUILT_MASK 0
#endif

namespace jfa::sm80 {
namespace {

using Variants = BuiltVariants<JFA_SM80_BUILT_MASK, 32, 64, 96, 128, 192, 256>;
constexpr int kNumHeadDims = Variants::kNumHeadDims;
constexpr const int* kHeadDims = Variants::kHeadDimList;

cudaError_t dispatch(bool backward, const AttentionParams& p, cudaStream_t stream) {
  if (p.Hv != p.H) return cudaErrorNotSupported;
  return Variants::dispatch(p.dtype, int(p.H), [&](auto variant) {
    using V = decltype(variant);
    return backward ? run_bwd<typename V::Element, V::kHeadDim>(p, stream)
                    : run_fwd<typename V::Element, V::kHeadDim>(p, stream);
  });
}

}  // namespace

bool is_built(DType dtype, int head_dim) { return Variants::is_built(dtype, head_dim); }

const char* built_variants() {
  static const std::string text = [] {
    std::string dtypes, hdims;
    for (int d = 0; d < 2; ++d) {
      bool any = false;
      for (int h = 0; h < kNumHeadDims; ++h) any |= Variants::built_bit(d * kNumHeadDims + h);
      if (any) dtypes += std::string(dtypes.empty() ? "" : ",") + (d == 0 ? "fp16" : "bf16");
    }
    for (int h = 0; h < kNumHeadDims; ++h) {
      bool any = false;
      for (int d = 0; d < 2; ++d) any |= Variants::built_bit(d * kNumHeadDims + h);
      if (any) hdims += (hdims.empty() ? "" : ",") + std::to_string(kHeadDims[h]);
    }
    if (dtypes.empty()) return std::string("none");
    return "fwd+bwd: " + dtypes + " x hdim " + hdims;
  }();
  return text.c_str();
}

int round_up_head_dim(int head_dim) {
  for (int h = 0; h < kNumHeadDims; ++h) {
    if (kHeadDims[h] < head_dim) continue;
    for (int d = 0; d < 2; ++d)
      if (Variants::built_bit(d * kNumHeadDims + h)) return kHeadDims[h];
  }
  return -1;
}

cudaError_t forward(const AttentionParams& p, cudaStream_t stream) { return dispatch(false, p, stream); }

cudaError_t backward(const AttentionParams& p, cudaStream_t stream) { return dispatch(true, p, stream); }

}  // namespace jfa::sm80
