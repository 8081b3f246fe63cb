// The attention handlers' FFI operands, results and attributes, as the lists that call.h expands
// into their call structs and Bind() chains. Order and names are the contract with the lowering
// (jax_flashattn/primitives.py: the tensors, then Extras in _HANDLER_EXTRAS order, then
// _mask_ffi_attrs), so an operand is added to a list here and to Extras there.
#pragma once

#include <cstdint>

#include "ffi/call.h"

// The forward's tensors: q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv].
#define JFA_FORWARD_TENSORS(X) X(q) X(k) X(v)

// The backward's tensors: the forward's, its o and lse, and their cotangents.
#define JFA_BACKWARD_TENSORS(X) X(q) X(k) X(v) X(o) X(lse) X(dout) X(dlse)

// The optional operands (rank 0 = absent), decoded by decode_mask.h and decode_packed_mask.h:
// bias float32 broadcastable to [B, N, T, S]; the packed mask's bits uint32 [B|1, N|1, T,
// ceil(S/128)*4] and tiles uint8 [B|1, N|1, ceil(T/64), ceil(S/128)]; query_seq_lengths and
// key_value_seq_lengths int32 [B]; segment ids int32 [B, T] and [B, S]; ALiBi slopes float32
// [1 or B, N]; dropout seeds uint32 [B, 3]; positions of query row 0 and key 0 int32 [B, 2];
// block_table int32 [B, max_pages], which makes k and v page pools (the forward only; decode.h).
#define JFA_MASK_OPERANDS(X)                                                                     \
  X(bias) X(mask_bits) X(mask_tiles) X(q_lengths) X(kv_lengths) X(q_segment_ids) X(kv_segment_ids) \
  X(alibi_slopes) X(dropout_seeds) X(positions) X(block_table)

// The segment-id summaries the CUDA kernels skip tiles with, int32 [B, ceil(T/16), 8] and
// [B, ceil(S/16), 8], or rank 0 without segment ids (decode_segment_chunks).
#define JFA_SEGMENT_CHUNK_OPERANDS(X) X(q_segment_chunks) X(kv_segment_chunks)

// The forward's results: o [B, T, N, Hv] and lse float32 [B, T, N].
#define JFA_FORWARD_RESULTS(X) X(o) X(lse)

// The backward's results: dq, dk, dv, dbias (float32 in the bias's shape, rank 0 without a bias)
// and dslopes (float32, rank 0 without ALiBi slopes; decode_dslopes gives its shape per platform).
#define JFA_BACKWARD_RESULTS(X) X(dq) X(dk) X(dv) X(dbias) X(dslopes)

// The attributes of every attention handler; window sides -1 = unbounded, softcap and
// dropout_rate 0 = off.
#define JFA_ATTRS(X)                                                                          \
  X(float, scale) X(int32_t, is_causal) X(int32_t, bottom_right) X(int64_t, window_left)       \
  X(int64_t, window_right) X(float, softcap) X(float, dropout_rate)
