"""`varlen_attention`: FlashAttention-style variable-length attention over packed sequences.

Sequence b owns query rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of a [total_T, N, H] query
and key rows [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of the key/value. Positions (causal, window,
ALiBi, dropout coordinates) count from each sequence's start, and causal_alignment applies per
sequence (bottom-right: the last query of a sequence sits at its last key).

How: the packed rows are gathered into a [num_seqs, max_seqlen, ...] batch, flash_attention runs
with the sequence lengths as query_seq_lengths / key_value_seq_lengths (tiles past a sequence's
end are skipped), and the rows are gathered back. The padded copies cost
O(num_seqs · max_seqlen · N · H) memory — never a T×S buffer; gradients flow through both gathers.
"""
from __future__ import annotations

import numbers

import jax.numpy as jnp

from .attention import flash_attention


def _check(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim != 3:
            raise ValueError(f"varlen_attention: {name} must be packed [total, heads, head_dim], "
                             f"got shape {x.shape}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != jnp.int32 or cu.ndim != 1 or cu.shape[0] < 2:
            raise ValueError(f"varlen_attention: {name} must be int32 [num_seqs + 1] (cumulative "
                             f"offsets starting at 0), got {cu.dtype} {cu.shape}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"varlen_attention: cu_seqlens_q {cu_seqlens_q.shape} and cu_seqlens_k "
                         f"{cu_seqlens_k.shape} must describe the same number of sequences")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(m, numbers.Integral) or isinstance(m, bool) or m < 1:
            raise ValueError(f"varlen_attention: {name} must be a static int >= 1, got {m!r}")


def _pad(x, cu, lengths, max_len):
    """[total, ...] packed rows → [num_seqs, max_len, ...], zero past each sequence's length."""
    t = jnp.arange(max_len)
    rows = jnp.clip(cu[:-1, None] + t[None, :], 0, x.shape[0] - 1)
    valid = t[None, :] < lengths[:, None]
    padded = x[rows]
    return jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 1)), padded, 0)


def _unpad(y, cu, total, fill):
    """[num_seqs, max_len, ...] → [total, ...]: row r of sequence b is y[b, r - cu[b]]; rows in
    no sequence (or past max_len) get `fill`."""
    r = jnp.arange(total)
    b = jnp.clip(jnp.searchsorted(cu, r, side="right") - 1, 0, cu.shape[0] - 2)
    t = r - cu[b]
    valid = (r >= cu[0]) & (r < cu[-1]) & (t < y.shape[1])
    picked = y[b, jnp.clip(t, 0, y.shape[1] - 1)]
    return jnp.where(valid.reshape(valid.shape + (1,) * (y.ndim - 2)), picked, fill)


def varlen_attention(query, key, value, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k,
                     return_lse=False, **keywords):
    """Attention over packed variable-length sequences.

    Args:
      query: [total_T, N, H]; key [total_S, K, H]; value [total_S, K, Hv].
      cu_seqlens_q, cu_seqlens_k: int32 [num_seqs + 1], cumulative sequence offsets (0 first).
      max_seqlen_q, max_seqlen_k: static ints, at least the longest query / key sequence
        (longer sequences are cut there).
      return_lse: also return the LSE, float32 [total_T, N].
      **keywords: flash_attention's keywords (scale, is_causal, causal_alignment,
        local_window_size, softcap, alibi_slopes [N] or [num_seqs, N], dropout_rate,
        dropout_rng, deterministic, implementation; bias and mask broadcastable to
        [num_seqs, N, max_seqlen_q, max_seqlen_k]). The sequence lengths come from cu_seqlens;
        query_seq_lengths, key_value_seq_lengths and segment ids are not taken.

    Returns:
      out [total_T, N, Hv] (0 for rows in no sequence), or (out, lse).
    """
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    cu_q, cu_k = jnp.asarray(cu_seqlens_q), jnp.asarray(cu_seqlens_k)
    _check(query, key, value, cu_q, cu_k, max_seqlen_q, max_seqlen_k)
    for name in ("query_seq_lengths", "key_value_seq_lengths", "q_segment_ids", "kv_segment_ids"):
        if keywords.get(name) is not None:
            raise TypeError(f"varlen_attention: {name} is implied by cu_seqlens and not taken")
    q_len, k_len = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    q = _pad(query, cu_q, q_len, max_seqlen_q)
    k = _pad(key, cu_k, k_len, max_seqlen_k)
    v = _pad(value, cu_k, k_len, max_seqlen_k)
    out, lse = flash_attention(q, k, v, query_seq_lengths=jnp.minimum(q_len, max_seqlen_q),
                               key_value_seq_lengths=jnp.minimum(k_len, max_seqlen_k),
                               return_lse=True, **keywords)
    out = _unpad(out, cu_q, query.shape[0], 0)
    lse = _unpad(lse, cu_q, query.shape[0], -jnp.inf)
    return (out, lse) if return_lse else out
