// The top-k sparse handlers' FFI operands, results and attributes, as the lists that call.h
// expands into their call structs and Bind() chains, shared by the CPU and CUDA handlers. Order
// and names are the contract with jax_flashattn/sparse_attention.py's lowering.
#pragma once

#include <cstdint>

#include "ffi/call.h"

// The forward: q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv] (or rank 0: V is
// k[..., :value_head_dim]) and indices int32 [B, T, K, topk]; o [B, T, N, Hv], lse float32 [B, T, N].
#define JFA_SPARSE_FORWARD_OPERANDS(ARG) ARG(q) ARG(k) ARG(v) ARG(indices)
#define JFA_SPARSE_FORWARD_RESULTS(RET) RET(o) RET(lse)

// The backward: the forward's operands, its o and lse, and their cotangents; dq, dk (with v rank 0:
// dK + dV in one buffer) and dv (or rank 0).
#define JFA_SPARSE_BACKWARD_OPERANDS(ARG) JFA_SPARSE_FORWARD_OPERANDS(ARG) ARG(o) ARG(lse) ARG(dout) ARG(dlse)
#define JFA_SPARSE_BACKWARD_RESULTS(RET) RET(dq) RET(dk) RET(dv)

// attn_dist: q, k, indices and lse (float32 [B, T, N], natural log); dist float32
// [B, N / head_group, T, topk].
#define JFA_ATTN_DIST_OPERANDS(ARG) ARG(q) ARG(k) ARG(indices) ARG(lse)
#define JFA_ATTN_DIST_RESULTS(RET) RET(dist)

// The attributes every sparse call starts with (SparseAttrs).
#define JFA_SPARSE_ATTRS(ATTR) ATTR(float, scale) ATTR(int32_t, is_causal) ATTR(int32_t, bottom_right)

// The calls without workspace; the CUDA backward adds its workspace results to its own list.
#define JFA_SPARSE_FORWARD(ARG, RET, ATTR)                                   \
  JFA_SPARSE_FORWARD_OPERANDS(ARG) JFA_SPARSE_FORWARD_RESULTS(RET) JFA_SPARSE_ATTRS(ATTR) \
  ATTR(int64_t, value_head_dim)
#define JFA_ATTN_DIST(ARG, RET, ATTR) \
  JFA_ATTN_DIST_OPERANDS(ARG) JFA_ATTN_DIST_RESULTS(RET) JFA_SPARSE_ATTRS(ATTR) ATTR(int64_t, head_group)
