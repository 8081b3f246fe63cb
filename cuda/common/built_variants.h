// The (dtype, head dim) kernel variants a build compiled, and the dispatch of a call onto the
// compiled template, shared by the sm80 and sm90 entry points.
//
// CMake passes each library a bit mask: bit (dtype_index * sizeof...(kHeadDims) + hdim_index) is
// set for each built variant, dtype_index 0 = fp16, 1 = bf16, hdim_index over kHeadDims. Unbuilt
// variants are never instantiated, so they need not be linked.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

#include "cutlass/numeric_types.h"
#include "jfa/params.h"

namespace jfa {

// The compile-time (element type, head dim) of one variant, handed to the dispatch callback.
template <typename ElementT, int kHeadDimV>
struct VariantTag {
  using Element = ElementT;
  static constexpr int kHeadDim = kHeadDimV;
};

template <unsigned kMask, int... kHeadDims>
struct BuiltVariants {
  static constexpr int kNumHeadDims = sizeof...(kHeadDims);
  static constexpr int kHeadDimList[] = {kHeadDims...};

  static int dtype_index(DType dtype) {
    switch (dtype) {
      case DType::kFloat16: return 0;
      case DType::kBFloat16: return 1;
      default: return -1;
    }
  }

  static int hdim_index(int head_dim) {
    for (int i = 0; i < kNumHeadDims; ++i)
      if (kHeadDimList[i] == head_dim) return i;
    return -1;
  }

  static constexpr bool built_bit(int bit) { return ((kMask >> bit) & 1u) != 0; }

  static bool is_built(DType dtype, int head_dim) {
    const int d = dtype_index(dtype), h = hdim_index(head_dim);
    return d >= 0 && h >= 0 && built_bit(d * kNumHeadDims + h);
  }

  // Returns run(VariantTag<Element, kHeadDim>{}) for the built variant of (dtype, head_dim), or
  // cudaErrorNotSupported where there is none.
  template <typename Run>
  static cudaError_t dispatch(DType dtype, int head_dim, const Run& run) {
    using Indices = std::make_index_sequence<sizeof...(kHeadDims)>;
    if (dtype == DType::kFloat16) return by_head_dim<cutlass::half_t, 0>(head_dim, run, Indices{});
    if (dtype == DType::kBFloat16) return by_head_dim<cutlass::bfloat16_t, 1>(head_dim, run, Indices{});
    return cudaErrorNotSupported;
  }

 private:
  template <typename Element, int kDtypeIndex, typename Run, size_t... I>
  static cudaError_t by_head_dim(int head_dim, const Run& run, std::index_sequence<I...>) {
    cudaError_t err = cudaErrorNotSupported;
    (void)((head_dim == kHeadDimList[I] &&
            (err = call<kDtypeIndex * kNumHeadDims + int(I), Element, kHeadDimList[I]>(run), true)) ||
           ...);
    return err;
  }

  template <int kBit, typename Element, int kHeadDim, typename Run>
  static cudaError_t call(const Run& run) {
    if constexpr (built_bit(kBit)) {
      return run(VariantTag<Element, kHeadDim>{});
    } else {
      return cudaErrorNotSupported;
    }
  }
};

}  // namespace jfa
