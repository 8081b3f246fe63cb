"""`context_parallel_attention`: attention over a sequence split across the devices of one mesh
axis, called inside `shard_map`; and `load_balance`, the layout that gives every device the same
share of causal work.

Device r of n holds the r-th block of the queries and of the keys/values (in the load-balanced
layout: sequence chunks r and 2n - 1 - r of 2n). Two strategies:
  * ring: the K/V blocks travel around the ring with `ppermute` (the next transfer is issued
    before the block in hand is computed, so they can overlap); each device merges its partial
    outputs through their log-sum-exps. The backward runs the ring again with the final output
    and LSE, which makes each block's gradients exact, and sends each block's dK/dV (float32)
    around with it until they reach their owner. Blocks that causality leaves empty are not
    computed: with load balancing every step after the first is half a block on every device
    (all queries against an earlier device's first chunk, or the second query chunk against a
    later device's keys).
  * all_gather: K/V are gathered once and each query chunk attends to the prefix of keys it can
    see (bottom-right alignment with the prefix as the key length places it at its global
    position); JAX's transpose of the gather reduce-scatters dK/dV. It holds the whole K/V on
    every device, which is cheap when K/V are small (GQA).
Position-dependent keywords other than causality (windows, ALiBi, dropout, lengths, bias, masks)
are not supported across shards: they raise a ValueError naming the keyword.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from . import _options, _validate
from ._compat import pcast_varying, varying_axes
from .attention import flash_attention
from .autodiff import extra_operands, vary_together
from .primitives import attention_bwd_p, attention_fwd_p

STRATEGIES = ("ring", "all_gather")

# flash_attention keywords whose positions or layouts are not offset per block here.
_UNSUPPORTED = ("bias", "mask", "query_seq_lengths", "key_value_seq_lengths", "local_window_size",
                "alibi_slopes", "dropout_rate", "dropout_rng")


def _balanced_chunk_order(n: int) -> np.ndarray:
    """Chunk indices in load-balanced order: device i's block is chunks i and 2n - 1 - i."""
    return np.stack([np.arange(n), 2 * n - 1 - np.arange(n)], axis=1).reshape(-1)


def load_balance(x, axis: int, n: int, inverse: bool = False):
    """Reorders a global array along `axis` into the load-balanced layout for n devices: the axis
    is cut into 2n chunks, and the i-th of n equal blocks holds chunks i and 2n - 1 - i, so each
    device gets as much of the causal triangle as any other. `inverse=True` reorders back.
    Apply it to queries, keys, values, segment ids and anything else laid out along the sequence.
    """
    x = jnp.asarray(x)
    if not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"load_balance: n must be a positive int (the number of devices), got {n!r}")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"load_balance: axis {axis} is out of range for shape {x.shape}")
    axis %= x.ndim
    length = x.shape[axis]
    if length % (2 * n):
        raise ValueError(f"load_balance: axis {axis} of x {x.shape} has length {length}, which "
                         f"must divide into 2·n = {2 * n} equal chunks")
    order = _balanced_chunk_order(n)
    if inverse:
        order = np.argsort(order)
    chunks = x.reshape(x.shape[:axis] + (2 * n, length // (2 * n)) + x.shape[axis + 1:])
    return jnp.take(chunks, order, axis=axis).reshape(x.shape)


@dataclasses.dataclass(frozen=True)
class _Ring:
    """The static description of one ring call."""
    axis_name: object
    n: int
    causal: bool
    balanced: bool
    scale: float
    softcap: float | None
    deterministic: bool
    implementation: str | None


def _vary_like(x, ref):
    """x marked as varying over the manual axes `ref` varies over (lax.cond's branches and
    concatenations need equal types inside shard_map)."""
    return pcast_varying(x, tuple(varying_axes(jax.typeof(ref)) - varying_axes(jax.typeof(x))))


def _canonical(ring, q, k, q_ids, kv_ids, causal):
    return _options.canonicalize(q.shape, False, k_len=k.shape[1], is_causal=causal,
                                 q_segment_ids=q_ids, kv_segment_ids=kv_ids, softcap=ring.softcap,
                                 deterministic=ring.deterministic)


def _block_forward(ring, q, k, v, q_ids, kv_ids, causal):
    """(out float32, lse) of q against one K/V block."""
    config, extras = _canonical(ring, q, k, q_ids, kv_ids, causal)
    o, lse = attention_fwd_p.bind(q, k, v, *extra_operands(extras.bias, extras[1:]),
                                  scale=ring.scale, config=config,
                                  implementation=ring.implementation)
    return o.astype(jnp.float32), lse


def _block_backward(ring, q, k, v, o, lse, do, dlse, q_ids, kv_ids, causal):
    """Float32 (dq, dk, dv) of one block, from the final output and LSE of the whole ring."""
    config, extras = _canonical(ring, q, k, q_ids, kv_ids, causal)
    dq, dk, dv, _, _ = attention_bwd_p.bind(q, k, v, o, lse, do, dlse,
                                            *extra_operands(extras.bias, extras[1:]),
                                            scale=ring.scale, config=config,
                                            implementation=ring.implementation)
    return tuple(x.astype(jnp.float32) for x in (dq, dk, dv))


def _rows(x, start, stop):
    return None if x is None else x[:, start:stop]


def _pad_rows(x, before, after, fill, ref):
    """x with `before` / `after` rows of `fill` around it along axis 1, typed like ref."""
    pad = [(0, 0)] * x.ndim
    pad[1] = (before, after)
    return _vary_like(jnp.pad(x, pad, constant_values=fill), ref)


def _step_kind(ring, step, rank):
    """What step `step` of the ring computes on device `rank` (traced): a static kind for steps
    every device treats alike, else (kind if the block comes from an earlier device, kind if
    from a later one) with the traced condition."""
    if not ring.causal:
        return "full"
    if step == 0:
        return "diagonal"
    earlier = (rank - step) % ring.n < rank
    return (("first_keys", "last_queries") if ring.balanced else ("full", "skip")), earlier


def _forward_kind(ring, kind, q, k, v, q_ids, kv_ids):
    T, Hv = q.shape[1], v.shape[-1]
    half_q, half_k = T // 2, k.shape[1] // 2
    if kind == "skip":
        o = jnp.zeros(q.shape[:3] + (Hv,), jnp.float32)
        return _vary_like(o, q), _vary_like(jnp.full(q.shape[:3], -jnp.inf, jnp.float32), q)
    if kind == "first_keys":  # every query sees the earlier device's first chunk in full
        o, lse = _block_forward(ring, q, k[:, :half_k], v[:, :half_k], q_ids, _rows(kv_ids, 0, half_k),
                                False)
        return _vary_like(o, q), _vary_like(lse, q)
    if kind == "last_queries":  # only the second query chunk sees a later device's block
        o, lse = _block_forward(ring, q[:, half_q:], k, v, _rows(q_ids, half_q, T), kv_ids, False)
        return _pad_rows(o, half_q, 0, 0.0, q), _pad_rows(lse, half_q, 0, -jnp.inf, q)
    o, lse = _block_forward(ring, q, k, v, q_ids, kv_ids, kind == "diagonal")
    return _vary_like(o, q), _vary_like(lse, q)


def _backward_kind(ring, kind, q, k, v, o, lse, do, dlse, q_ids, kv_ids):
    T, S = q.shape[1], k.shape[1]
    half_q, half_k = T // 2, S // 2
    zeros = lambda x: _vary_like(jnp.zeros(x.shape, jnp.float32), q)  # noqa: E731
    if kind == "skip":
        return zeros(q), zeros(k), zeros(v)
    if kind == "first_keys":
        dq, dk, dv = _block_backward(ring, q, k[:, :half_k], v[:, :half_k], o, lse, do, dlse, q_ids,
                                     _rows(kv_ids, 0, half_k), False)
        return (_vary_like(dq, q), _pad_rows(dk, 0, S - half_k, 0.0, q),
                _pad_rows(dv, 0, S - half_k, 0.0, q))
    if kind == "last_queries":
        rows = lambda x: x[:, half_q:]  # noqa: E731
        dq, dk, dv = _block_backward(ring, rows(q), k, v, rows(o), rows(lse), rows(do), rows(dlse),
                                     _rows(q_ids, half_q, T), kv_ids, False)
        return _pad_rows(dq, half_q, 0, 0.0, q), _vary_like(dk, q), _vary_like(dv, q)
    dq, dk, dv = _block_backward(ring, q, k, v, o, lse, do, dlse, q_ids, kv_ids, kind == "diagonal")
    return _vary_like(dq, q), _vary_like(dk, q), _vary_like(dv, q)


def _run_step(ring, step, rank, compute):
    """compute(kind) for this step's kind, choosing at run time where devices differ."""
    kind = _step_kind(ring, step, rank)
    if isinstance(kind, str):
        return compute(kind)
    (if_earlier, if_later), earlier = kind
    return jax.lax.cond(earlier, lambda: compute(if_earlier), lambda: compute(if_later))


def _send_to_next(ring, x):
    return jax.lax.ppermute(x, ring.axis_name, [(j, (j + 1) % ring.n) for j in range(ring.n)])


def _merge(o, lse, o_block, lse_block):
    """Two partial attentions over disjoint key sets, combined through their log-sum-exps."""
    new = jnp.logaddexp(lse, lse_block)
    safe = jnp.where(jnp.isfinite(new), new, 0.0)  # rows that see no key yet stay 0 and -inf
    scale_old = jnp.exp(lse - safe)[..., None]
    scale_block = jnp.exp(lse_block - safe)[..., None]
    return o * scale_old + o_block * scale_block, new


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ring_attention(q, k, v, q_ids, kv_ids, ring):
    return _ring_forward(q, k, v, q_ids, kv_ids, ring)


def _ring_forward(q, k, v, q_ids, kv_ids, ring):
    rank = jax.lax.axis_index(ring.axis_name)
    o = _vary_like(jnp.zeros(q.shape[:3] + (v.shape[-1],), jnp.float32), q)
    lse = _vary_like(jnp.full(q.shape[:3], -jnp.inf, jnp.float32), q)
    block = (k, v, kv_ids)
    for step in range(ring.n):
        if step + 1 < ring.n:
            incoming = _send_to_next(ring, block)
        o_block, lse_block = _run_step(
            ring, step, rank, lambda kind: _forward_kind(ring, kind, q, *block[:2], q_ids, block[2]))
        o, lse = _merge(o, lse, o_block, lse_block)
        if step + 1 < ring.n:
            block = incoming
    return o.astype(q.dtype), lse


def _ring_fwd(q, k, v, q_ids, kv_ids, ring):
    o, lse = _ring_forward(q, k, v, q_ids, kv_ids, ring)
    return (o, lse), (q, k, v, q_ids, kv_ids, o, lse)


def _ring_bwd(ring, residuals, cotangents):
    q, k, v, q_ids, kv_ids, o, lse = residuals
    do, dlse = cotangents
    do = jnp.asarray(do, o.dtype)
    dlse = jnp.asarray(dlse, jnp.float32)
    rank = jax.lax.axis_index(ring.axis_name)
    dq = _vary_like(jnp.zeros(q.shape, jnp.float32), q)
    # Each block's dK/dV accumulator travels with the block and, after the last step, one more
    # hop brings it home to the block's owner.
    dkv = (_vary_like(jnp.zeros(k.shape, jnp.float32), q), _vary_like(jnp.zeros(v.shape, jnp.float32), q))
    block = (k, v, kv_ids)
    for step in range(ring.n):
        if step + 1 < ring.n:
            incoming = _send_to_next(ring, block)
        dq_block, dk_block, dv_block = _run_step(
            ring, step, rank,
            lambda kind: _backward_kind(ring, kind, q, *block[:2], o, lse, do, dlse, q_ids, block[2]))
        dq = dq + dq_block
        dkv = _send_to_next(ring, (dkv[0] + dk_block, dkv[1] + dv_block))
        if step + 1 < ring.n:
            block = incoming
    return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype), None, None


_ring_attention.defvjp(_ring_fwd, _ring_bwd)


def _all_gather_attention(q, k, v, q_ids, kv_ids, ring):
    gather = lambda x: None if x is None else jax.lax.all_gather(x, ring.axis_name, axis=1, tiled=True)  # noqa: E731
    k_all, v_all, kv_ids_all = gather(k), gather(v), gather(kv_ids)
    keywords = dict(scale=ring.scale, softcap=ring.softcap, deterministic=ring.deterministic,
                    implementation=ring.implementation, return_lse=True)
    if not ring.causal:
        return flash_attention(q, k_all, v_all, q_segment_ids=q_ids, kv_segment_ids=kv_ids_all,
                               **keywords)
    if ring.balanced:  # back to sequence order, where a key's index is its position
        k_all, v_all = (load_balance(x, 1, ring.n, inverse=True) for x in (k_all, v_all))
        if kv_ids_all is not None:
            kv_ids_all = load_balance(kv_ids_all, 1, ring.n, inverse=True)
    rank = jax.lax.axis_index(ring.axis_name)
    T, B = q.shape[1], q.shape[0]
    chunk_of = [(0, rank), (T // 2, 2 * ring.n - 1 - rank)] if ring.balanced else [(0, rank)]
    size = T // len(chunk_of)
    outs, lses = [], []
    for start, chunk in chunk_of:
        # Bottom-right alignment with the chunk's key prefix as the key length puts its query i at
        # global position chunk · size + i; the kernels skip the keys past the prefix.
        prefix = jnp.full((B,), (chunk + 1) * size, jnp.int32)
        o, lse = flash_attention(q[:, start:start + size], k_all, v_all, is_causal=True,
                                 causal_alignment="bottom_right", key_value_seq_lengths=prefix,
                                 q_segment_ids=_rows(q_ids, start, start + size),
                                 kv_segment_ids=kv_ids_all, **keywords)
        outs.append(o)
        lses.append(lse)
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=1)


def _check(query, key, value, axis_name, strategy, is_causal, load_balanced, keywords):
    for name, value_ in keywords.items():
        if name not in _UNSUPPORTED:
            raise TypeError(f"context_parallel_attention got an unexpected keyword {name!r}")
        if value_ is not None and not (name == "dropout_rate" and value_ == 0.0):
            raise ValueError(f"context_parallel_attention does not support {name} across shards "
                             "(positions and masks beyond causality are not offset per block); "
                             "use flash_attention under jit, which keeps the query sequence "
                             "sharded where it can")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    for name, flag in (("is_causal", is_causal), ("load_balanced", load_balanced)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if query.ndim != 4:
        raise ValueError(f"context_parallel_attention takes batched blocks: query BTNH, got "
                         f"shape {query.shape}")
    _validate.check_qkv(query, key, value)
    try:
        n = jax.lax.axis_size(axis_name)
    except NameError as e:
        raise ValueError(f"context_parallel_attention must run inside shard_map with the sequence "
                         f"split over axis_name={axis_name!r}, which is not a bound axis here") from e
    T, S = query.shape[1], key.shape[1]
    if is_causal and T != S:
        raise ValueError(f"is_causal=True needs the same number of queries and keys per device: "
                         f"query {query.shape}, key {key.shape}")
    if is_causal and load_balanced and T % 2:
        raise ValueError(f"load_balanced=True holds two sequence chunks per device, so the local "
                         f"length must be even: query {query.shape}")
    return n


def context_parallel_attention(query, key, value, *, axis_name, strategy="ring", load_balanced=True,
                               is_causal=False, scale=None, return_lse=False, q_segment_ids=None,
                               kv_segment_ids=None, softcap=None, causal_alignment="top_left",
                               deterministic=False, implementation=None, **keywords):
    """Attention over a sequence split along the mesh axis `axis_name`, inside `shard_map`.

    Each device passes its block of the sequence: query [B, T/n, N, H], key [B, S/n, K, H],
    value [B, S/n, K, Hv] (and segment ids [B, T/n], [B, S/n]), in sequence order, or with
    `load_balanced=True` and `is_causal=True` in the layout of `load_balance` (device i holds
    chunks i and 2n - 1 - i; load_balanced has no effect without is_causal). The result is this
    device's block of flash_attention on the whole sequence, to float32 round-off, forward and
    gradients.

    Args:
      axis_name: the shard_map axis the sequence is split over.
      strategy: 'ring' (K/V blocks passed around with ppermute; O(S/n) memory) or 'all_gather'
        (K/V gathered once; cheaper when K/V are small, as with GQA).
      is_causal: causal attention over the global sequence (T = S; both alignments agree).
      scale, return_lse, q_segment_ids, kv_segment_ids (packed documents may span devices),
      softcap, deterministic, implementation: as in flash_attention.
      Other flash_attention keywords (bias, mask, lengths, window, ALiBi, dropout) raise a
      ValueError naming them.

    Returns:
      out [B, T/n, N, Hv], or (out, lse) with lse float32 [B, T/n, N].
    """
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    n = _check(query, key, value, axis_name, strategy, is_causal, load_balanced, keywords)
    if causal_alignment not in _options.ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {_options.ALIGNMENTS}, got {causal_alignment!r}")
    scale = _validate.check_scale(scale, query.shape[-1])
    implementation = _validate.check_implementation(implementation)
    # Validates the remaining keywords and segment ids on the local block.
    _options.canonicalize(query.shape, False, k_len=key.shape[1], is_causal=bool(is_causal),
                          q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                          softcap=softcap, deterministic=deterministic)
    q_ids = None if q_segment_ids is None else jnp.asarray(q_segment_ids)
    kv_ids = None if kv_segment_ids is None else jnp.asarray(kv_segment_ids)
    if scale < 0:  # as in flash_attention: the kernels stabilise by the largest logit
        query, scale = -query, -scale
    elif scale == 0:
        query, scale = jnp.zeros_like(query), 1.0
    ring = _Ring(axis_name, n, bool(is_causal), bool(load_balanced and is_causal), scale,
                 None if softcap is None else float(softcap), bool(deterministic), implementation)
    query, key, value, q_ids, kv_ids = vary_together(query, key, value, q_ids, kv_ids)
    if strategy == "ring":
        out, lse = _ring_attention(query, key, value, q_ids, kv_ids, ring)
    else:
        out, lse = _all_gather_attention(query, key, value, q_ids, kv_ids, ring)
    return (out, lse) if return_lse else out
