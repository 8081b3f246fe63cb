// Dispatch of the sm80 kernels on (dtype, head dim), limited to the variants this build compiled.
//
// CMake passes JFA_SM80_BUILT_MASK: bit (dtype_index * 6 + hdim_index) is set for each built
// variant, dtype_index 0 = fp16, 1 = bf16, hdim_index over kHeadDims. Unbuilt variants are never
// referenced, so they need not be linked.
#include "sm80/api.h"

#include <string>

#include "sm80/run.h"

#ifndef JFA_SM80_BUILT_MASK
#define JFA_SM80_BUILT_MASK 0
#endif

namespace jfa::sm80 {
namespace {

constexpr int kHeadDims[] = {32, 64, 96, 128, 192, 256};
constexpr int kNumHeadDims = 6;
constexpr unsigned kBuiltMask = JFA_SM80_BUILT_MASK;

int dtype_index(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return 0;
    case DType::kBFloat16: return 1;
    default: return -1;
  }
}

int hdim_index(int head_dim) {
  for (int i = 0; i < kNumHeadDims; ++i)
    if (kHeadDims[i] == head_dim) return i;
  return -1;
}

template <int kBit, typename Element, int kHeadDim>
cudaError_t call(bool backward, const AttentionParams& p, cudaStream_t stream) {
  if constexpr (((kBuiltMask >> kBit) & 1u) != 0) {
    return backward ? run_bwd<Element, kHeadDim>(p, stream) : run_fwd<Element, kHeadDim>(p, stream);
  } else {
    return cudaErrorNotSupported;
  }
}

template <typename Element, int kDtypeIndex>
cudaError_t call_hdim(bool backward, const AttentionParams& p, cudaStream_t stream) {
  constexpr int b = kDtypeIndex * kNumHeadDims;
  switch (p.H) {
    case 32: return call<b + 0, Element, 32>(backward, p, stream);
    case 64: return call<b + 1, Element, 64>(backward, p, stream);
    case 96: return call<b + 2, Element, 96>(backward, p, stream);
    case 128: return call<b + 3, Element, 128>(backward, p, stream);
    case 192: return call<b + 4, Element, 192>(backward, p, stream);
    case 256: return call<b + 5, Element, 256>(backward, p, stream);
    default: return cudaErrorNotSupported;
  }
}

cudaError_t dispatch(bool backward, const AttentionParams& p, cudaStream_t stream) {
  if (!is_built(p.dtype, int(p.H)) || p.Hv != p.H) return cudaErrorNotSupported;
  if (p.dtype == DType::kFloat16) return call_hdim<cutlass::half_t, 0>(backward, p, stream);
  return call_hdim<cutlass::bfloat16_t, 1>(backward, p, stream);
}

}  // namespace

bool is_built(DType dtype, int head_dim) {
  const int d = dtype_index(dtype), h = hdim_index(head_dim);
  return d >= 0 && h >= 0 && ((kBuiltMask >> (d * kNumHeadDims + h)) & 1u) != 0;
}

const char* built_variants() {
  static const std::string text = [] {
    std::string dtypes, hdims;
    for (int d = 0; d < 2; ++d) {
      bool any = false;
      for (int h = 0; h < kNumHeadDims; ++h) any |= ((kBuiltMask >> (d * kNumHeadDims + h)) & 1u) != 0;
      if (any) dtypes += std::string(dtypes.empty() ? "" : ",") + (d == 0 ? "fp16" : "bf16");
    }
    for (int h = 0; h < kNumHeadDims; ++h) {
      bool any = false;
      for (int d = 0; d < 2; ++d) any |= ((kBuiltMask >> (d * kNumHeadDims + h)) & 1u) != 0;
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
      if (((kBuiltMask >> (d * kNumHeadDims + h)) & 1u) != 0) return kHeadDims[h];
  }
  return -1;
}

cudaError_t forward(const AttentionParams& p, cudaStream_t stream) { return dispatch(false, p, stream); }

cudaError_t backward(const AttentionParams& p, cudaStream_t stream) { return dispatch(true, p, stream); }

}  // namespace jfa::sm80
