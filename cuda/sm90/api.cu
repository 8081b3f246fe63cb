// Dispatch of the sm90 forward on (dtype, head dim), limited to the variants this build compiled.
//
// CMake passes JFA_SM90_BUILT_MASK: bit (dtype_index * 3 + hdim_index) is set for each built
// variant, dtype_index 0 = fp16, 1 = bf16, hdim_index over kHeadDims. Unbuilt variants are never
// referenced, so they need not be linked.
#include "sm90/api.h"

#include <atomic>
#include <cstdint>

#include "sm90/run.h"

#ifndef JFA_SM90_BUILT_MASK
#define JFA_SM90_BUILT_MASK 0
#endif

namespace jfa::sm90 {
namespace {

constexpr int kHeadDims[] = {64, 128, 256};
constexpr int kNumHeadDims = 3;
constexpr unsigned kBuiltMask = JFA_SM90_BUILT_MASK;

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
cudaError_t call(const AttentionParams& p, cudaStream_t stream) {
  if constexpr (((kBuiltMask >> kBit) & 1u) != 0) {
    return run_fwd<Element, kHeadDim>(p, stream);
  } else {
    return cudaErrorNotSupported;
  }
}

template <typename Element, int kDtypeIndex>
cudaError_t call_hdim(const AttentionParams& p, cudaStream_t stream) {
  constexpr int b = kDtypeIndex * kNumHeadDims;
  switch (p.H) {
    case 64: return call<b + 0, Element, 64>(p, stream);
    case 128: return call<b + 1, Element, 128>(p, stream);
    case 256: return call<b + 2, Element, 256>(p, stream);
    default: return cudaErrorNotSupported;
  }
}

// TMA: global addresses and strides in multiples of 16 bytes (8 fp16/bf16 elements).
bool tma_ok(const void* ptr, const Strides& s) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && s.row % 8 == 0 && s.head % 8 == 0 &&
         s.batch % 8 == 0;
}

}  // namespace

bool is_built(DType dtype, int head_dim) {
  const int d = dtype_index(dtype), h = hdim_index(head_dim);
  return d >= 0 && h >= 0 && ((kBuiltMask >> (d * kNumHeadDims + h)) & 1u) != 0;
}

bool can_implement(const AttentionParams& p) {
  constexpr int64_t kMax = INT32_MAX;
  if (!is_built(p.dtype, int(p.H)) || p.Hv != p.H) return false;
  if (p.T < 1 || p.S < 1 || p.T > kMax || p.S > kMax || p.B < 1 || p.N < 1 || p.K < 1 || p.N % p.K != 0)
    return false;
  if ((p.T + 63) / 64 * p.N * p.B > kMax) return false;  // tile index fits an int
  // Strides of size-1 dimensions are never used (launch.h replaces them), so do not check them.
  auto strides = [&](Strides s, int64_t heads) {
    if (heads == 1) s.head = s.row;
    if (p.B == 1) s.batch = s.row;
    return s;
  };
  return tma_ok(p.q, strides(p.q_strides, p.N)) && tma_ok(p.k, strides(p.k_strides, p.K)) &&
         tma_ok(p.v, strides(p.v_strides, p.K)) && tma_ok(p.o, strides(p.o_strides, p.N));
}

cudaError_t forward(const AttentionParams& p, cudaStream_t stream) {
  if (!can_implement(p)) return cudaErrorNotSupported;
  if (p.dtype == DType::kFloat16) return call_hdim<cutlass::half_t, 0>(p, stream);
  return call_hdim<cutlass::bfloat16_t, 1>(p, stream);
}

int num_sms() {
  // One slot per device, filled on first use: an attribute query, no synchronization.
  static std::atomic<int> cache[64] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 1;
  if (device < 0 || device >= 64) {
    int n = 1;
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
    return n;
  }
  int n = cache[device].load(std::memory_order_relaxed);
  if (n == 0) {
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n < 1) n = 1;
    cache[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

}  // namespace jfa::sm90
