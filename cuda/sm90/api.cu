// Dispatch of the sm90 kernels on (dtype, head dim), limited to the variants this build compiled.
//
// CMake passes JFA_SM90_BUILT_MASK: bit (dtype_index * 3 + hdim_index) is set for each built
// variant, dtype_index 0 = fp16, 1 = bf16, hdim_index over kHeadDims. Unbuilt variants are never
// referenced, so they need not be linked.
#include "sm90/api.h"

#include <atomic>
#include <cstdint>
#include <initializer_list>

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

// The backward's head dims (bwd_traits.h, BwdConfig).
constexpr bool has_backward(int head_dim) { return head_dim == 64 || head_dim == 128 || head_dim == 256; }

template <int kBit, typename Element, int kHeadDim>
cudaError_t call(bool backward, const AttentionParams& p, cudaStream_t stream) {
  if constexpr (((kBuiltMask >> kBit) & 1u) == 0) {
    return cudaErrorNotSupported;
  } else if constexpr (has_backward(kHeadDim)) {
    return backward ? run_bwd<Element, kHeadDim>(p, stream) : run_fwd<Element, kHeadDim>(p, stream);
  } else {
    return backward ? cudaErrorNotSupported : run_fwd<Element, kHeadDim>(p, stream);
  }
}

template <typename Element, int kDtypeIndex>
cudaError_t call_hdim(bool backward, const AttentionParams& p, cudaStream_t stream) {
  constexpr int b = kDtypeIndex * kNumHeadDims;
  switch (p.H) {
    case 64: return call<b + 0, Element, 64>(backward, p, stream);
    case 128: return call<b + 1, Element, 128>(backward, p, stream);
    case 256: return call<b + 2, Element, 256>(backward, p, stream);
    default: return cudaErrorNotSupported;
  }
}

cudaError_t dispatch(bool backward, const AttentionParams& p, cudaStream_t stream) {
  if (p.dtype == DType::kFloat16) return call_hdim<cutlass::half_t, 0>(backward, p, stream);
  return call_hdim<cutlass::bfloat16_t, 1>(backward, p, stream);
}

// TMA: global addresses and strides in multiples of 16 bytes (8 fp16/bf16 elements).
bool tma_ok(const void* ptr, const Strides& s) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && s.row % 8 == 0 && s.head % 8 == 0 &&
         s.batch % 8 == 0;
}

// What both kernels need: sizes whose tile indices fit an int, H == Hv, and TMA's alignment of
// the tensors in `tensors` ((pointer, strides, heads) each).
struct TmaTensor {
  const void* ptr;
  Strides strides;
  int64_t heads;
};

bool shapes_ok(const AttentionParams& p, std::initializer_list<TmaTensor> tensors) {
  constexpr int64_t kMax = INT32_MAX;
  if (!is_built(p.dtype, int(p.H)) || p.Hv != p.H) return false;
  if (p.T < 1 || p.S < 1 || p.T > kMax || p.S > kMax || p.B < 1 || p.N < 1 || p.K < 1 || p.N % p.K != 0)
    return false;
  // Tile indices fit an int (the smallest tiles: 64 rows).
  if ((p.T + 63) / 64 * p.N * p.B > kMax || (p.S + 63) / 64 * p.N * p.B > kMax) return false;
  // Strides of size-1 dimensions are never used (tma.h, gmem_stride, replaces them), so do not
  // check them.
  for (const TmaTensor& t : tensors) {
    Strides s = t.strides;
    if (t.heads == 1) s.head = s.row;
    if (p.B == 1) s.batch = s.row;
    if (!tma_ok(t.ptr, s)) return false;
  }
  return true;
}

}  // namespace

bool is_built(DType dtype, int head_dim) {
  const int d = dtype_index(dtype), h = hdim_index(head_dim);
  return d >= 0 && h >= 0 && ((kBuiltMask >> (d * kNumHeadDims + h)) & 1u) != 0;
}

bool can_implement(const AttentionParams& p) {
  return shapes_ok(p, {{p.q, p.q_strides, p.N}, {p.k, p.k_strides, p.K}, {p.v, p.v_strides, p.K},
                       {p.o, p.o_strides, p.N}});
}

bool can_implement_backward(const AttentionParams& p) {
  if (!has_backward(int(p.H)) || (p.deterministic && p.dq_semaphore == nullptr)) return false;
  return shapes_ok(p, {{p.q, p.q_strides, p.N}, {p.k, p.k_strides, p.K}, {p.v, p.v_strides, p.K},
                       {p.dout, p.do_strides, p.N}, {p.dk, p.dk_strides, p.K}, {p.dv, p.dv_strides, p.K}});
}

cudaError_t forward(const AttentionParams& p, cudaStream_t stream) {
  if (!can_implement(p)) return cudaErrorNotSupported;
  return dispatch(false, p, stream);
}

cudaError_t backward(const AttentionParams& p, cudaStream_t stream) {
  if (!can_implement_backward(p)) return cudaErrorNotSupported;
  return dispatch(true, p, stream);
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
