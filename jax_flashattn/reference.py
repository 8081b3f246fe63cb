"""A pure-jnp float32 reference of exactly what the kernels compute (T×S memory: tests only).

Every keyword of flash_attention is built here the obvious dense way: a [B, N, T, S] visibility
mask from positions, lengths, segment ids and the boolean mask; logits scaled, soft-capped,
biased (bias and ALiBi); softmax; dropout from an explicit keep mask (jax_flashattn.dropout
gives the kernels' own).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def _bnts(x, B, N, T, S):
    x = jnp.asarray(x)
    return jnp.broadcast_to(x.reshape((1,) * (4 - x.ndim) + x.shape), (B, N, T, S))


def visibility(B, N, T, S, *, is_causal=False, mask=None, query_seq_lengths=None,
               key_value_seq_lengths=None, local_window_size=None, causal_alignment="top_left",
               q_segment_ids=None, kv_segment_ids=None):
    """bool [B, N, T, S]: which keys each query sees; also the key offset of query positions
    [B, 1, 1, 1] (0 for top-left alignment, kv_len - q_len for bottom-right)."""
    q_len = jnp.full((B,), T) if query_seq_lengths is None else jnp.clip(query_seq_lengths, 0, T)
    kv_len = jnp.full((B,), S) if key_value_seq_lengths is None else jnp.clip(key_value_seq_lengths, 0, S)
    offset = (kv_len - q_len if causal_alignment == "bottom_right" else jnp.zeros_like(q_len))
    offset = offset[:, None, None, None]
    i = jnp.arange(T)[None, None, :, None]
    j = jnp.arange(S)[None, None, None, :]
    pos = i + offset
    seen = (i < q_len[:, None, None, None]) & (j < kv_len[:, None, None, None])
    if is_causal:
        seen &= j <= pos
    if local_window_size is not None:
        left, right = ((local_window_size,) * 2 if isinstance(local_window_size, int)
                       else local_window_size)
        seen &= (j >= pos - left) & (j <= pos + right)
    if q_segment_ids is not None:
        seen &= q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :]
    if mask is not None:
        seen &= _bnts(mask, B, N, T, S)
    return jnp.broadcast_to(seen, (B, N, T, S)), offset


def attention_reference(query, key, value, *, scale=None, is_causal=False, bias=None, mask=None,
                        query_seq_lengths=None, key_value_seq_lengths=None,
                        local_window_size=None, causal_alignment="top_left", q_segment_ids=None,
                        kv_segment_ids=None, softcap=None, alibi_slopes=None, dropout_rate=0.0,
                        dropout_keep=None):
    """(out, lse) in float32 for q BTNH, k BSKH, v BSKHv (GQA by head grouping), batched.

    dropout_keep: bool [B, N, T, S], the elements dropout keeps (with dropout_rate > 0).
    Rows with no visible key give out = 0 and lse = -inf, as the kernels do.
    """
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (query, key, value))
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(H) if scale is None else scale
    k = jnp.repeat(k, N // K, axis=2)
    v = jnp.repeat(v, N // K, axis=2)
    logits = jnp.einsum("btnh,bsnh->bnts", q, k, precision="highest") * scale
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    if bias is not None:
        logits = logits + _bnts(jnp.asarray(bias, jnp.float32), B, N, T, S)
    seen, offset = visibility(
        B, N, T, S, is_causal=is_causal, mask=mask, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
        causal_alignment=causal_alignment, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids)
    if alibi_slopes is not None:
        slopes = jnp.asarray(alibi_slopes, jnp.float32).reshape(-1, N)[:, :, None, None]
        distance = jnp.abs(jnp.arange(T)[:, None] + offset - jnp.arange(S)[None, :])
        logits = logits - slopes * distance
    logits = jnp.where(seen, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    safe = jnp.where(denom == 0, 1.0, denom)  # finite gradients for fully masked rows
    lse = jnp.where(denom == 0, -jnp.inf, jnp.log(safe) + m)
    p = p / safe
    if dropout_rate:
        p = jnp.where(dropout_keep, p / (1.0 - dropout_rate), 0.0)
    out = jnp.einsum("bnts,bsnh->btnh", p, v, precision="highest")
    return out, jnp.moveaxis(lse[..., 0], 1, 2)
