// CPU top-k sparse attention (jax_flashattn.sparse_attention, attn_dist): each query attends only to
// the keys its indices select; float32 arithmetic whatever the input dtype.
//
// The FFI handlers validate shapes first; empty problems are answered in Python. An index that
// sparse_index_valid rejects is never read. Rows with no valid index give o = 0 and lse = -inf.
#pragma once

#include "jfa/sparse_params.h"

namespace jfa::cpu {

// Reads q, k, v (or k's first Hv columns), indices; writes o and lse.
void sparse_forward(const SparseParams& p);

// Reads q, k, v, indices, o, lse, dout, dlse; writes dq, dk and dv (with v null, dk holds both).
// Deterministic: every key row's gradient is summed in (query, slot, head) order by one thread.
void sparse_backward(const SparseParams& p);

// Reads q, k, indices, lse; writes dist[b, n / head_group, t, j] = the sum over the group's heads
// of exp(scale · q·k[indices[j]] − lse) (0 for invalid slots and for rows whose lse is −inf).
void attn_dist(const SparseParams& p);

}  // namespace jfa::cpu
