"""Decoding on the GPU: a few queries against a long key/value cache, split along the keys.

With one query row per (batch, head) the kernels launch a CTA per (query tile, head, batch): too
few to fill the GPU, each streaming the whole cache. For such calls the dispatcher instead
  * folds the query heads of each K/V head into the query rows (no ALiBi, whose slope is per
    head; no window): the group's K/V are then read by one CTA, not G. With one query all rows
    share its position. With T > 1 queries (speculative decoding, chunked prefill) the rows of one
    tile have T positions, so the folded call covers the keys that every query sees (all of them
    without causality; bottom-right causal: all but the last T - 1) and the last T - 1 keys, which
    query t sees from t on, go to a small causal call of their own, merged with the rest;
  * cuts the keys into `chunks` equal blocks folded into the batch axis (a reshape, no copy of the
    cache), each called with the global positions of its first query and key (so causality,
    windows and ALiBi stay those of the whole sequence) and its clipped valid length;
  * merges the blocks' outputs through their log-sum-exps (float32).
Everything is differentiable through the kernels' LSE. The split runs on CUDA devices only
(`jax.lax.platform_dependent`); elsewhere, and for calls it does not cover, the plain call runs.
JFA_DECODE_SPLIT=0 in the environment (read when a call is traced) turns it off, for A/B timing.
"""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from ._lse_merge import merge_by_lse
from ._options import Extras

# Eligible calls: T at most this many queries (after folding the heads of a group)...
_MAX_ROWS = 64
# ...against blocks of at least this many keys (a multiple of the kernels' 128-key tiles, or of a
# paged cache's pages: chunk_counts' granule).
_MIN_CHUNK = 512
# CTAs the split aims for per SM (one CTA per SM runs at a time on the Hopper forward): one, as
# the first count of blocks reaching it; more blocks of fewer keys each measured slower, their
# per-CTA start and the merge costing more than a fuller last wave gains (docs/performance.md).
_WAVES = 1
# With T > 1 the heads fold only for caches of at least this many key elements (B·S·K·H): folding
# adds the causal tail's call and a merge, a fixed cost that the G-fold fewer reads of K and V
# outweigh only once those reads take tens of microseconds.
_MIN_FOLD_ELEMENTS = 1 << 24


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    chunks: int        # key blocks
    fold_heads: bool   # the G query heads of a K/V head become query rows (T·G of them)


def _sm_count() -> int:
    try:
        return max(int(getattr(jax.devices("gpu")[0], "core_count", 132)), 1)
    except RuntimeError:  # no GPU: the plan is traced for the CUDA branch only
        return 132


def chunk_counts(S, granule=128):
    """The numbers of equal key blocks (two or more) the split can cut S keys into: blocks of at
    least _MIN_CHUNK keys, each a whole number of `granule`-key pieces (the kernels' 128-key
    tiles; a paged cache's pages, so that a block's pages are a slice of the block table)."""
    return [n for n in range(2, S // _MIN_CHUNK + 1) if S % n == 0 and (S // n) % granule == 0]


def split_plan(q_shape, k_shape, config, extras: Extras, implementation, granule=128):
    """The split for this call, or None where it does not apply (module docstring). k_shape is
    the [B, S, K, H] cache (a paged call's as its block table reaches); granule as chunk_counts'."""
    if implementation == "cpu" or os.environ.get("JFA_DECODE_SPLIT") == "0":
        return None
    B, T, N, _ = q_shape
    S, K, H = k_shape[1], k_shape[2], k_shape[3]
    present = set(extras.present())
    if present - {"key_value_seq_lengths", "alibi_slopes", "block_table"} or config.dropout_rate:
        return None
    if T > 1 and (config.is_causal or config.window_left >= 0 or config.window_right >= 0) \
            and not config.bottom_right:
        return None  # top-left queries sit at the cache's start: nothing long to split
    # One query: folded rows get positions 0..G-1 past the query's, the same keys only without a
    # left window, and where the keys past the query are masked anyway (bottom-right) or seen
    # anyway. T > 1: no window at all (the folded call has no positions: split_kv_attention).
    fold = (N > K and "alibi_slopes" not in present and config.window_left < 0
            and T * (N // K) <= _MAX_ROWS
            and (config.bottom_right or (not config.is_causal and config.window_right < 0))
            and (T == 1 or (config.window_right < 0 and B * S * K * H >= _MIN_FOLD_ELEMENTS)))
    rows = T * (N // K) if fold else T
    heads = K if fold else N
    if rows > _MAX_ROWS:
        return None
    target = _WAVES * _sm_count()
    best = 1
    for chunks in chunk_counts(S, granule):
        best = chunks
        if B * heads * chunks >= target:
            break
    if best == 1 and not fold:
        return None
    return SplitPlan(best, fold)


def split_kv_attention(q, k, v, config, extras: Extras, plan: SplitPlan, call):
    """(out, lse) of the call through `plan`; `call(q, k, v, config, extras)` runs one kernel call.
    With extras.block_table, k and v are page pools (paged.py): the blocks are slices of the
    table, the pools are passed whole."""
    B, T, N, H = q.shape
    table = extras.block_table
    S = k.shape[1] if table is None else table.shape[1] * k.shape[1]
    K, Hv = k.shape[2], v.shape[-1]
    G, P = N // K, plan.chunks
    chunk = S // P
    kv_len = extras.key_value_seq_lengths
    kv_len = jnp.full((B,), S, jnp.int32) if kv_len is None else jnp.clip(kv_len, 0, S)
    block_config, seen = config, kv_len
    causal_tail = plan.fold_heads and T > 1 and config.is_causal
    rows = q
    if plan.fold_heads:  # [B, T, N, H] -> [B, T·G, K, H]: row t·G + g of K/V head j is query t of head j·G + g
        rows = q.reshape(B, T, K, G, H).transpose(0, 1, 3, 2, 4).reshape(B, T * G, K, H)
        if T > 1:  # the keys every query sees, without positions (the causal tail: _causal_tail)
            block_config = dataclasses.replace(config, is_causal=False)
            seen = jnp.clip(kv_len - (T - 1), 0, S) if causal_tail else kv_len
    # Query 0 sits at kv_len - T (bottom-right) or 0; both positions are raised by T so that they
    # stay non-negative (only their difference matters without dropout).
    q_position = (kv_len - T if config.bottom_right else jnp.zeros_like(kv_len)) + T
    starts = jnp.arange(P, dtype=jnp.int32) * chunk
    positions = jnp.stack([jnp.broadcast_to(q_position[:, None], (B, P)),
                           jnp.broadcast_to(starts[None] + T, (B, P))], axis=-1).reshape(B * P, 2)
    lengths = jnp.clip(seen[:, None] - starts[None], 0, chunk).reshape(B * P).astype(jnp.int32)
    slopes = extras.alibi_slopes
    if slopes is not None:
        slopes = jnp.repeat(jnp.broadcast_to(slopes, (B, N)), P, axis=0)
    block_table, block_k, block_v = table, k, v
    if table is None:
        block_k, block_v = k.reshape(B * P, chunk, K, H), v.reshape(B * P, chunk, K, Hv)
    else:
        block_table = table.reshape(B * P, table.shape[1] // P)
    block_extras = Extras(key_value_seq_lengths=lengths, alibi_slopes=slopes, positions=positions,
                          block_table=block_table)
    block_config = dataclasses.replace(block_config, bottom_right=False)
    fold_batch = lambda x: jnp.repeat(x, P, axis=0)  # noqa: E731  block p of batch b at b·P + p
    out, lse = call(fold_batch(rows), block_k, block_v, block_config, block_extras)
    out = out.astype(jnp.float32).reshape(B, P, rows.shape[1], rows.shape[2], Hv)
    out, lse = merge_by_lse(out, lse.reshape(B, P, rows.shape[1], rows.shape[2]), axis=1)
    if plan.fold_heads:
        out = out.reshape(B, T, G, K, Hv).transpose(0, 1, 3, 2, 4).reshape(B, T, N, Hv)
        lse = lse.reshape(B, T, G, K).transpose(0, 1, 3, 2).reshape(B, T, N)
    if causal_tail:
        tail_out, tail_lse = _causal_tail(q, k, v, table, kv_len, config, call)
        out, lse = merge_by_lse(jnp.stack([out, tail_out.astype(jnp.float32)], axis=1),
                                jnp.stack([lse, tail_lse], axis=1), axis=1)
    return out.astype(q.dtype), lse


def _causal_tail(q, k, v, table, kv_len, config, call):
    """(out, lse) of the T queries against the last T - 1 keys of their sequence, which query t
    sees from its own position on (bottom-right causal): keys kv_len - T + 1 + i for i < T - 1,
    query t seeing key i when i < t, and none before the cache's start. One small call with that
    mask, unfolded (each row its own position), on those keys gathered (from their pages, with a
    block table)."""
    B, T = q.shape[:2]
    index = kv_len[:, None] - (T - 1) + jnp.arange(T - 1, dtype=jnp.int32)[None]  # [B, T - 1]
    if table is None:
        gather = lambda x: jnp.take_along_axis(  # noqa: E731
            x, jnp.clip(index, 0, x.shape[1] - 1)[:, :, None, None], axis=1)
    else:
        page_size = k.shape[1]
        index_in = jnp.clip(index, 0, table.shape[1] * page_size - 1)
        pages = jnp.clip(jnp.take_along_axis(table, index_in // page_size, axis=1), 0, k.shape[0] - 1)
        gather = lambda x: x[pages, index_in % page_size]  # noqa: E731  [B, T - 1, K, H]
    mask = (jnp.arange(T)[:, None] > jnp.arange(T - 1)[None])[None] & (index >= 0)[:, None, :]  # [B, T, T - 1]
    tail_config = dataclasses.replace(config, is_causal=False, bottom_right=False)
    return call(q, gather(k), gather(v), tail_config, Extras(mask=mask[:, None]))
