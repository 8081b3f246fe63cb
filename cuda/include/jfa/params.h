// AttentionParams: the one description of an attention call that every kernel path sees.
//
// The FFI handlers fill it from XLA buffers and attributes; kernels (CPU, sm80, sm90) read nothing
// else. Shape letters follow DESIGN.md: B batch, T query length, S key/value length, N query heads,
// K key/value heads (N % K == 0, G = N / K), H head dim of q/k, Hv head dim of v.
//
// Layouts. q [B,T,N,H], k [B,S,K,H], v [B,S,K,Hv], o/do [B,T,N,Hv]; the last dimension is
// contiguous and the other strides are given in elements, so a kernel never assumes packing.
// lse/dlse are float32 [B,T,N] (natural log, the public layout) with their own strides.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JFA_HOST_DEVICE __host__ __device__
#else
#define JFA_HOST_DEVICE
#endif

namespace jfa {

// Rows of the dQ accumulator are padded to a multiple of this (a multiple of every backward
// kBlockM). jax_flashattn/primitives.py sizes the workspace with the same constant.
inline constexpr int64_t kDqAccumRowAlign = 128;

enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
  }
  return "unknown";
}

// Element strides of a [batch, row, head, dim] tensor whose last dimension is contiguous.
struct Strides {
  int64_t batch = 0;
  int64_t row = 0;
  int64_t head = 0;
};

// Strides of a densely packed [batch, rows, heads, dim] tensor.
inline Strides packed_strides(int64_t rows, int64_t heads, int64_t dim) {
  return Strides{rows * heads * dim, heads * dim, dim};
}

struct AttentionParams {
  // Shapes.
  int64_t B = 0, T = 0, S = 0, N = 0, K = 0, H = 0, Hv = 0;
  DType dtype = DType::kFloat32;  // of q, k, v, o, do, dq, dk, dv

  // Softmax scale applied to q·k (natural units) and the same folded with log2(e) for exp2.
  float scale = 1.f;
  float scale_log2 = 1.4426950408889634f;

  // Masking. Causal uses jax.nn's top-left alignment: query i sees keys j <= i.
  bool is_causal = false;

  // Forward inputs and outputs.
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;
  Strides q_strides, k_strides, v_strides, o_strides;
  Strides lse_strides;  // dim unused: lse[b,t,n] = lse[b*batch + t*row + n*head]

  // Backward inputs and outputs (unused by the forward pass).
  const void* dout = nullptr;  // cotangent of o, layout of o
  const float* dlse = nullptr; // cotangent of lse, layout of lse; may be null (treated as 0)
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  Strides do_strides, dq_strides, dk_strides, dv_strides;

  // Backward workspace for GPU kernels, provided by the FFI (never allocated per call).
  // dq_accum: float32 [B, N, dq_accum_rows(), H]. Rows are padded so that every query tile of
  // the backward kernel owns a whole contiguous block, which the kernel stores in the order its
  // threads hold the dQ fragments (sm80/dq_accum.h): its atomics then cover contiguous spans.
  float* dq_accum = nullptr;
  float* softmax_d = nullptr;  // float32 [B,N,T], packed: rowsum(dO∘O) - dLSE

  JFA_HOST_DEVICE int64_t dq_accum_rows() const {
    return (T + kDqAccumRowAlign - 1) / kDqAccumRowAlign * kDqAccumRowAlign;
  }

  JFA_HOST_DEVICE int64_t group_size() const { return N / K; }
};

}  // namespace jfa
