// Dispatch of the sm90 kernels on (dtype, head dim), limited to the variants this build compiled
// (JFA_SM90_BUILT_MASK, common/built_variants.h).
#include "sm90/api.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>

#include "common/built_variants.h"
#include "sm90/run.h"

#ifndef JFA_SM90_BUILT_MASK
#define JFA_SM90_BUILT_MASK 0
#endif

namespace jfa::sm90 {
namespace {

using Variants = BuiltVariants<JFA_SM90_BUILT_MASK, 64, 128, 256>;

cudaError_t dispatch(bool backward, const AttentionParams& p, cudaStream_t stream) {
  return Variants::dispatch(p.dtype, kernel_head_dim(p.dtype, int(p.H)), [&](auto variant) {
    using V = decltype(variant);
    return backward ? run_bwd<typename V::Element, V::kHeadDim>(p, stream)
                    : run_fwd<typename V::Element, V::kHeadDim>(p, stream);
  });
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
  // H a multiple of 8: the backward's row statistics read rows in 16-byte pieces.
  if (kernel_head_dim(p.dtype, int(p.H)) < 0 || p.Hv != p.H || p.H % 8 != 0) return false;
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

bool is_built(DType dtype, int head_dim) { return Variants::is_built(dtype, head_dim); }

int kernel_head_dim(DType dtype, int head_dim) {
  if (head_dim < 1) return -1;
  for (int i = 0; i < Variants::kNumHeadDims; ++i) {
    const int h = Variants::kHeadDimList[i];
    if (h >= head_dim) return Variants::is_built(dtype, h) ? h : -1;
  }
  return -1;
}

int workspace_head_dim(int head_dim) {
  int cols = head_dim;
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) cols = std::max(cols, kernel_head_dim(dtype, head_dim));
  return cols;
}

bool can_implement(const AttentionParams& p) {
  // A paged call's page lookups run in 32 bits (paged_kv.h).
  if (p.paged.present() && (p.paged.page_size % kPagedPageRows != 0 || p.paged.num_pages > INT32_MAX ||
                            p.paged.table_stride * p.paged.page_size > INT32_MAX))
    return false;
  return shapes_ok(p, {{p.q, p.q_strides, p.N}, {p.k, p.k_strides, p.K}, {p.v, p.v_strides, p.K},
                       {p.o, p.o_strides, p.N}});
}

bool can_implement_backward(const AttentionParams& p) {
  if (p.deterministic && p.dq_semaphore == nullptr) return false;
  // The partial sums span the kernel's width (params.h, accum_cols).
  if (std::max(p.accum_cols, p.H) < kernel_head_dim(p.dtype, int(p.H))) return false;
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
