"""`varlen_attention`: FlashAttention-style variable-length attention over packed sequences.

Sequence b owns query rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of a [total_T, N, H] query
and key rows [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of the key/value. Positions (causal, window,
ALiBi, dropout coordinates) count from each sequence's start, and causal_alignment applies per
sequence (bottom-right: the last query of a sequence sits at its last key).

Two ways, chosen at trace time:
  * unpadded: the packed rows are one batch row and the sequences its segment ids, so nothing is
    copied or padded and the kernels skip the tiles of different sequences. Needs no dropout,
    bias, mask or per-sequence slopes (they are defined per padded sequence), and either
      - packed self-attention (cu_seqlens_k is cu_seqlens_q, or None; as many query as key
        rows): within a sequence the global position differences are the local ones, so causal,
        window and ALiBi mean the same; bottom-right equals top-left for equal lengths; or
      - any two packings without positions (no causal mask, window or ALiBi): then nothing
        depends on where a sequence starts on either side.
  * otherwise: the packed rows are gathered into a [num_seqs, max_seqlen, ...] batch,
    flash_attention runs with the sequence lengths as query_seq_lengths /
    key_value_seq_lengths (tiles past a sequence's end are skipped), and the rows are gathered
    back. The padded copies cost O(num_seqs · max_seqlen · N · H) memory — never a T×S buffer.
Gradients flow through both.
"""
from __future__ import annotations

import numbers

import jax.numpy as jnp
import numpy as np

from ._explicit_sharding import take_rows, whole_axes
from ._validate import concrete
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
    for side, cu, rows, max_len in (("q", cu_seqlens_q, query.shape[0], max_seqlen_q),
                                    ("k", cu_seqlens_k, key.shape[0], max_seqlen_k)):
        _check_offsets(f"cu_seqlens_{side}", concrete(cu), rows, f"max_seqlen_{side}", max_len)


def _check_offsets(name, cu, rows, max_name, max_len):
    """Offsets known at trace time must be sequences: from 0 up, within the packed rows, none
    longer than max_seqlen. (Traced offsets cannot be checked: a longer sequence is then cut at
    max_seqlen, and rows outside [cu[0], cu[-1]) belong to no sequence.)"""
    if cu is None:
        return
    lengths = np.diff(cu)
    if cu[0] < 0 or np.any(lengths < 0) or cu[-1] > rows:
        raise ValueError(f"varlen_attention: {name} must rise from 0 or more to at most the "
                         f"{rows} packed rows, got {cu.tolist()}")
    if lengths.max() > max_len:
        b = int(np.argmax(lengths))
        raise ValueError(f"varlen_attention: sequence {b} has {int(lengths[b])} rows ({name}[{b}:{b + 2}] = "
                         f"{cu[b:b + 2].tolist()}), more than {max_name}={max_len}")


def _pad(x, cu, lengths, max_len):
    """[total, ...] packed rows → [num_seqs, max_len, ...], zero past each sequence's length."""
    if x.shape[0] == 0:  # every sequence is empty: there is no row to gather from
        return jnp.zeros((lengths.shape[0], max_len) + x.shape[1:], x.dtype)
    t = jnp.arange(max_len)
    rows = jnp.clip(cu[:-1, None] + t[None, :], 0, x.shape[0] - 1)
    valid = t[None, :] < lengths[:, None]
    padded = take_rows(x, rows)
    return jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 1)), padded, 0)


def _unpad(y, cu, total, fill):
    """[num_seqs, max_len, ...] → [total, ...]: row r of sequence b is y[b, r - cu[b]]; rows in
    no sequence (or past max_len) get `fill`."""
    r = jnp.arange(total)
    b = jnp.clip(jnp.searchsorted(cu, r, side="right") - 1, 0, cu.shape[0] - 2)
    t = r - cu[b]
    valid = (r >= cu[0]) & (r < cu[-1]) & (t < y.shape[1])
    flat = whole_axes(y, (0, 1)).reshape((-1,) + y.shape[2:])
    picked = take_rows(flat, b * y.shape[1] + jnp.clip(t, 0, y.shape[1] - 1))
    return jnp.where(valid.reshape(valid.shape + (1,) * (y.ndim - 2)), picked, fill)


def _sequence_ids(cu, total, max_len, before, past):
    """int32 [total]: each packed row's sequence index; rows before the first sequence get
    `before`, rows after the last `past`, and rows past max_len within a sequence `before` (ids
    that match nothing on the other side)."""
    r = jnp.arange(total)
    b = jnp.clip(jnp.searchsorted(cu, r, side="right") - 1, 0, cu.shape[0] - 2)
    ids = jnp.where(r < cu[0], before, jnp.where(r >= cu[-1], past, b))
    return jnp.where((r >= cu[0]) & (r < cu[-1]) & (r - cu[b] >= max_len), before, ids).astype(jnp.int32)


def _packs_as_segments(query, key, same_offsets, max_seqlen_q, max_seqlen_k, keywords):
    """Whether the call runs as one batch row with segment ids (module docstring). Bottom-right
    alignment also needs max_seqlen_q == max_seqlen_k: a sequence cut to different lengths on the
    two sides would shift its queries by the difference."""
    slopes = keywords.get("alibi_slopes")
    if keywords.get("dropout_rate") or keywords.get("bias") is not None or keywords.get("mask") is not None:
        return False
    if not same_offsets or query.shape[0] != key.shape[0]:  # two packings: only without positions
        return (not keywords.get("is_causal") and keywords.get("local_window_size") is None
                and slopes is None)
    aligned = keywords.get("causal_alignment", "top_left") != "bottom_right" or max_seqlen_q == max_seqlen_k
    return aligned and (slopes is None or jnp.ndim(slopes) == 1)


def varlen_attention(query, key, value, cu_seqlens_q, cu_seqlens_k=None, *, max_seqlen_q, max_seqlen_k,
                     return_lse=False, **keywords):
    """Attention over packed variable-length sequences.

    Args:
      query: [total_T, N, H]; key [total_S, K, H]; value [total_S, K, Hv].
      cu_seqlens_q, cu_seqlens_k: int32 [num_seqs + 1], cumulative sequence offsets (0 first).
        cu_seqlens_k None, or the very same array as cu_seqlens_q: self-attention over the
        same packing. It and calls without positions (no causal, window or ALiBi) run without
        padding (module docstring).
      max_seqlen_q, max_seqlen_k: static ints, at least the longest query / key sequence.
        A longer one is an error where cu_seqlens are known at trace time (concrete arrays,
        closed over or passed outside jit); traced ones cannot be checked, and a longer
        sequence is then cut there.
      return_lse: also return the LSE, float32 [total_T, N].
      **keywords: flash_attention's keywords (scale, is_causal, causal_alignment,
        local_window_size, softcap, alibi_slopes [N] or [num_seqs, N], dropout_rate,
        dropout_rng, deterministic, implementation; bias and mask broadcastable to
        [num_seqs, N, max_seqlen_q, max_seqlen_k], the mask boolean or a PackedMask of
        T = max_seqlen_q, S = max_seqlen_k). The sequence lengths come from cu_seqlens;
        query_seq_lengths, key_value_seq_lengths and segment ids are not taken.

    Returns:
      out [total_T, N, Hv] (0 for rows in no sequence), or (out, lse).
    """
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    same_offsets = cu_seqlens_k is None or cu_seqlens_k is cu_seqlens_q
    cu_q = jnp.asarray(cu_seqlens_q)
    cu_k = cu_q if cu_seqlens_k is None else jnp.asarray(cu_seqlens_k)
    _check(query, key, value, cu_q, cu_k, max_seqlen_q, max_seqlen_k)
    for name in ("query_seq_lengths", "key_value_seq_lengths", "q_segment_ids", "kv_segment_ids"):
        if keywords.get(name) is not None:
            raise TypeError(f"varlen_attention: {name} is implied by cu_seqlens and not taken")
    if _packs_as_segments(query, key, same_offsets, max_seqlen_q, max_seqlen_k, keywords):
        # Query and key rows outside every sequence get different ids (-1 / -2 before, num_seqs /
        # num_seqs + 1 after): they match nothing, so their rows give 0 and -inf.
        n = cu_q.shape[0] - 1
        q_ids = _sequence_ids(cu_q, query.shape[0], max_seqlen_q, -1, n)
        kv_ids = _sequence_ids(cu_k, key.shape[0], max_seqlen_k, -2, n + 1)
        out, lse = flash_attention(query[None], key[None], value[None], q_segment_ids=q_ids[None],
                                   kv_segment_ids=kv_ids[None], return_lse=True, **keywords)
        return (out[0], lse[0]) if return_lse else out[0]
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
