// SparseParams: the one description of a top-k sparse attention call (jax_flashattn.sparse_attention,
// attn_dist) that the CPU and CUDA kernels see, and the index validity rule both share.
//
// Layouts (dense, last dimension contiguous; shape letters as in DESIGN.md):
//   q [B,T,N,H], k [B,S,K,H], v [B,S,K,Hv] (or V = k[..., :Hv] when v is null), indices int32
//   [B,T,K,topk], o/do [B,T,N,Hv], lse/dlse float32 [B,T,N] (natural log), attn_dist out float32
//   [B, N / head_group, T, topk]. Query head n reads key/value head n / (N / K).
#pragma once

#include <cstdint>

#include "jfa/host_device.h"
#include "jfa/params.h"

namespace jfa {

struct SparseParams {
  DType dtype = DType::kFloat32;
  int64_t B = 0, T = 0, S = 0, N = 0, K = 0, H = 0, Hv = 0, topk = 0;
  float scale = 1.f;
  bool is_causal = false;
  int64_t causal_offset = 0;  // query t sees keys j <= t + causal_offset (S - T bottom-right, else 0)

  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;  // null: V is the first Hv columns of k (one shared buffer)
  const int32_t* indices = nullptr;
  void* o = nullptr;
  float* lse = nullptr;

  // Backward: inputs o (above, read), lse, dout, dlse; outputs dq, dk, dv (dv null when v is).
  const void* dout = nullptr;
  const float* dlse = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  bool deterministic = false;

  // attn_dist: output and heads per group.
  float* dist = nullptr;
  int64_t head_group = 1;

  // Element offsets of row starts in the dense layouts above.
  JFA_HOST_DEVICE int64_t q_row(int64_t b, int64_t t, int64_t n) const { return ((b * T + t) * N + n) * H; }
  JFA_HOST_DEVICE int64_t o_row(int64_t b, int64_t t, int64_t n) const { return ((b * T + t) * N + n) * Hv; }
  JFA_HOST_DEVICE int64_t k_row(int64_t b, int64_t s, int64_t kh) const { return ((b * S + s) * K + kh) * H; }
  JFA_HOST_DEVICE int64_t v_row(int64_t b, int64_t s, int64_t kh) const { return ((b * S + s) * K + kh) * Hv; }
  JFA_HOST_DEVICE int64_t index_row(int64_t b, int64_t t, int64_t kh) const { return ((b * T + t) * K + kh) * topk; }
  JFA_HOST_DEVICE int64_t stat(int64_t b, int64_t t, int64_t n) const { return (b * T + t) * N + n; }
  JFA_HOST_DEVICE int64_t group_size() const { return N / K; }
};

// Whether index `s` selects a key for query position t: in [0, S), and not after the query when
// causal. Every kernel tests each index with this before it reads a key row.
JFA_HOST_DEVICE bool sparse_index_valid(const SparseParams& p, int64_t t, int32_t s) {
  return s >= 0 && s < p.S && (!p.is_causal || s <= t + p.causal_offset);
}

// Slots per row of the tensor-core backward's P and scale·dS workspace: topk in whole 64-slot
// blocks (cuda/sparse/sparse_gpu.h, SparseBackwardWorkspace::weights).
JFA_HOST_DEVICE constexpr int64_t weight_row_slots(int64_t topk) { return (topk + 63) / 64 * 64; }

}  // namespace jfa
