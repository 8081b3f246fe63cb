"""`paged_attention`: attention of a few new queries against a paged KV cache (vLLM's layout).

The cache is a pool of fixed-size pages, [num_pages, page_size, K, H] for keys and for values;
sequence b owns the pages block_table[b, 0], block_table[b, 1], ... in that order, and its first
seq_lengths[b] rows are valid. Where the Hopper forward reads the pages in place (an sm90 GPU, a
Hopper kernel for the head dim, page_size a multiple of 16) the call goes to the paged forward
primitive (_paged_primitive.py), which hands the table to the kernel: its producer looks up the
pages of each key tile, so the cache is never copied; decode-shaped calls take the split-KV path
(decode.py) with each key block a slice of the table. The CPU's handler copies the pages itself
(the same primitive). Elsewhere (other GPUs, other page sizes) each sequence's pages are gathered
into a contiguous [B, S, K, H] buffer (one XLA gather; rows past a sequence's length zeroed in
the same pass) for the ordinary kernels. Gradients flow into query, both caches and the ALiBi
slopes; the backward differentiates the gathered call (recomputing its forward), since decoding,
what the paged layout is for, needs none.
"""
from __future__ import annotations

import math
import numbers
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from . import _ext, _options, _validate, decode
from ._explicit_sharding import explicitly_sharded, take_rows, whole_axes
from ._options import Extras
from ._paged_primitive import paged_fwd_p
from .autodiff import attention, attention_core, extra_operands, kernel_scale, vary_together


def _fail(message, error=ValueError):
    raise error(f"paged_attention: {message}")


def _check(query, key_cache, value_cache, block_table, seq_lengths, page_size):
    """Ranks, dtypes and shapes at trace time; (num_pages, page_size, max_pages)."""
    for name, x, layout in (("query", query, "[B, T, N, H]"),
                            ("key_cache", key_cache, "[num_pages, page_size, K, H]"),
                            ("value_cache", value_cache, "[num_pages, page_size, K, Hv]")):
        if x.ndim != 4:
            _fail(f"{name} must be {layout}, got shape {x.shape}")
        if not any(x.dtype == d for d in _validate.SUPPORTED_DTYPES):
            _fail(f"{name} must be float32, float16 or bfloat16, got {x.dtype}", TypeError)
    if not (query.dtype == key_cache.dtype == value_cache.dtype):
        _fail(f"query, key_cache and value_cache must have one dtype, got {query.dtype}, "
              f"{key_cache.dtype}, {value_cache.dtype}", TypeError)
    B, T, N, H = query.shape
    num_pages, cache_page_size, K, Hk = key_cache.shape
    if value_cache.shape[:3] != key_cache.shape[:3]:
        _fail(f"value_cache must match key_cache in pages, page size and heads: key_cache "
              f"{key_cache.shape}, value_cache {value_cache.shape}")
    if Hk != H:
        _fail(f"key_cache head dim must equal query head dim H={H}: query {query.shape}, "
              f"key_cache {key_cache.shape}")
    if H == 0 or value_cache.shape[-1] == 0:
        _fail(f"head dims must be >= 1: query {query.shape}, value_cache {value_cache.shape}")
    if K == 0 or N % K:
        _fail(f"query heads N={N} must be a multiple of cache heads K={K}: query {query.shape}, "
              f"key_cache {key_cache.shape}")
    if num_pages == 0 or cache_page_size == 0:
        _fail(f"key_cache must hold at least one page of at least one row, got {key_cache.shape}")
    if page_size is not None and (not isinstance(page_size, numbers.Integral)
                                  or isinstance(page_size, bool) or page_size != cache_page_size):
        _fail(f"page_size={page_size!r} does not match the caches' page size {cache_page_size} "
              f"(key_cache {key_cache.shape} is [num_pages, page_size, K, H])")
    if block_table.dtype != jnp.int32 or block_table.ndim != 2 or block_table.shape[0] != B:
        _fail(f"block_table must be int32 [B, max_pages] with B={B} (query {query.shape}), got "
              f"{block_table.dtype} {block_table.shape}", TypeError if block_table.dtype != jnp.int32
              else ValueError)
    if seq_lengths.dtype != jnp.int32 or seq_lengths.shape != (B,):
        _fail(f"seq_lengths must be int32 [B] with B={B} (query {query.shape}), got "
              f"{seq_lengths.dtype} {seq_lengths.shape}", TypeError if seq_lengths.dtype != jnp.int32
              else ValueError)
    max_pages = block_table.shape[1]
    _check_values(_validate.concrete(block_table), _validate.concrete(seq_lengths), T, num_pages, cache_page_size,
                  max_pages)
    return num_pages, cache_page_size, max_pages


def _check_values(table, lengths, T, num_pages, page_size, max_pages):
    """Where the table and lengths are known at trace time: lengths in [T, max_pages·page_size] and
    the page ids a sequence uses in [0, num_pages)."""
    capacity = max_pages * page_size
    if lengths is not None:
        for b, n in enumerate(lengths.tolist()):
            if not T <= n <= capacity:
                _fail(f"seq_lengths[{b}] = {n} must be in [T, max_pages * page_size] = "
                      f"[{T}, {max_pages} * {page_size} = {capacity}] (the T={T} queries are the "
                      f"last T of the sequence's cached rows)")
    if table is not None and lengths is not None:
        used = -(-lengths // page_size)
        for b in range(table.shape[0]):
            ids = table[b, :used[b]]
            bad = np.flatnonzero((ids < 0) | (ids >= num_pages))
            if bad.size:
                j = int(bad[0])
                _fail(f"block_table[{b}, {j}] = {int(ids[j])} is not a page of the caches "
                      f"(num_pages={num_pages}); sequence {b} uses its first {int(used[b])} "
                      f"entries (seq_lengths[{b}] = {int(lengths[b])}, page_size={page_size})")


def gathered_pages(max_pages, page_size):
    """Pages per sequence in the contiguous buffer: max_pages, raised where fewer than 512 more
    (masked) rows let the split-KV path cut a length it could not cut into blocks."""
    rows = max_pages * page_size
    padded = -(-rows // decode._MIN_CHUNK) * decode._MIN_CHUNK
    if padded % page_size or decode.chunk_counts(rows) or not decode.chunk_counts(padded):
        return max_pages
    return padded // page_size


def _gathered(q, key_cache, value_cache, block_table, lengths, slopes, scale, config, implementation):
    """(out, lse) with each sequence's pages gathered into a contiguous [B, S, K, H] buffer."""
    B = q.shape[0]
    max_pages, page_size = block_table.shape[1], key_cache.shape[1]
    pages = gathered_pages(max_pages, page_size)
    rows = pages * page_size
    ids = block_table
    if pages > max_pages:  # the extra pages lie past every length: any page id will do
        ids = jnp.pad(ids, ((0, 0), (0, pages - max_pages)))
    # Rows past a length may hold anything (stale or NaN rows, another sequence's pages): zeroed,
    # since a masked probability of 0 times a NaN value would still be NaN.
    valid = (jnp.arange(rows, dtype=jnp.int32)[None, :] < lengths[:, None])[:, :, None, None]

    ids = whole_axes(ids, (1,))  # a sequence's pages on one device: merged with their rows below

    def contiguous(cache):
        # mode="clip" clamps the page ids inside the gather, so a traced bad id reads a real page.
        gathered = take_rows(cache, ids, mode="clip")
        gathered = gathered.reshape((B, rows) + cache.shape[2:])
        return jnp.where(valid, gathered, jnp.zeros((), cache.dtype))

    extras = Extras(key_value_seq_lengths=lengths, alibi_slopes=slopes)
    return attention(q, contiguous(key_cache), contiguous(value_cache), scale, config, extras, implementation)


def _in_place(q, key_cache, value_cache, block_table, lengths, slopes, scale, config, implementation,
              split):
    """(out, lse) from the paged forward primitive, through the split-KV path where `split` (the
    CUDA branch) and the call is decode-shaped."""
    q, scale = kernel_scale(q, scale)
    extras = Extras(key_value_seq_lengths=lengths, alibi_slopes=slopes, block_table=block_table)

    def call(q, k, v, config, extras):
        if extras.block_table is None:  # the split's causal tail: a few rows gathered already
            return attention_core(q, k, v, extras.bias, tuple(extras[1:]), scale, config, implementation)
        return tuple(paged_fwd_p.bind(q, k, v, *extra_operands(extras.bias, extras[1:]), scale=scale,
                                      config=config, implementation=implementation))

    B, _, _, H = q.shape
    page_size, K = key_cache.shape[1:3]
    plan = None
    if split and not explicitly_sharded(q, key_cache, value_cache):
        # Key blocks of whole pages, and of whole 128-key tiles where the pages allow it: a block
        # that ends inside a tile reads that tile's rows past its end for nothing. A plan without
        # a split (heads folded only) gives way to one that splits into whole pages.
        k_shape = (B, block_table.shape[1] * page_size, K, H)
        for granule in dict.fromkeys((math.lcm(page_size, 128), page_size)):
            candidate = decode.split_plan(q.shape, k_shape, config, extras, implementation, granule=granule)
            if candidate is not None and (plan is None or candidate.chunks > 1):
                plan = candidate
            if plan is not None and plan.chunks > 1:
                break
    if plan is None:
        return call(q, key_cache, value_cache, config, extras)
    return decode.split_kv_attention(q, key_cache, value_cache, config, extras, plan, call)


@partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _paged_core(q, key_cache, value_cache, block_table, lengths, slopes, scale, config, implementation,
                split):
    return _in_place(q, key_cache, value_cache, block_table, lengths, slopes, scale, config,
                     implementation, split)


def _paged_core_fwd(q, key_cache, value_cache, block_table, lengths, slopes, scale, config,
                    implementation, split):
    out = _in_place(q, key_cache, value_cache, block_table, lengths, slopes, scale, config,
                    implementation, split)
    return out, (q, key_cache, value_cache, block_table, lengths, slopes)


def _paged_core_bwd(scale, config, implementation, split, residuals, cotangents):
    q, key_cache, value_cache, block_table, lengths, slopes = residuals

    def gathered(q, key_cache, value_cache, slopes):
        return _gathered(q, key_cache, value_cache, block_table, lengths, slopes, scale, config,
                         implementation)
    _, vjp = jax.vjp(gathered, q, key_cache, value_cache, slopes)
    dq, dk, dv, dslopes = vjp(tuple(cotangents))
    return dq, dk, dv, None, None, dslopes


_paged_core.defvjp(_paged_core_fwd, _paged_core_bwd)


def _hopper_reads_pages(query, value_cache, page_size) -> bool:
    """Whether the CUDA forward reads these caches in place: a Hopper GPU (the first one; the
    handler refuses a paged call elsewhere) with the Hopper kernels allowed, a Hopper kernel for
    the head dim, no head-dim padding, and page_size a multiple of what that kernel needs."""
    H = query.shape[-1]
    if not _ext.has_cuda() or value_cache.shape[-1] != H or _ext.cuda_head_dim(H) != H:
        return False
    if query.dtype not in (jnp.float16, jnp.bfloat16) or os.environ.get("JFA_FORCE_SM80") == "1":
        return False
    rows = _ext.cuda_paged_page_rows(H)
    if rows <= 0 or page_size % rows:
        return False
    try:
        return str(getattr(jax.devices("gpu")[0], "compute_capability", "")) == "9.0"
    except RuntimeError:  # no GPU here: the CUDA branch is only lowered, never run
        return False


def paged_attention(query, key_cache, value_cache, block_table, seq_lengths, *, page_size=None,
                    scale=None, is_causal=False, causal_alignment="bottom_right",
                    local_window_size=None, softcap=None, alibi_slopes=None, return_lse=False,
                    implementation=None, deterministic=False):
    """Attention of T new queries per sequence against a paged KV cache (vLLM's layout).

    Args:
      query: [B, T, N, H]; float32, float16 or bfloat16.
      key_cache: [num_pages, page_size, K, H], the page pool shared by the batch; N must be a
        multiple of K (MHA, GQA, MQA).
      value_cache: [num_pages, page_size, K, Hv].
      block_table: int32 [B, max_pages]: the pages of sequence b, in order; entries past its
        ceil(seq_lengths[b] / page_size) used pages are never read into the result.
      seq_lengths: int32 [B]: the cached rows of each sequence, including the T new ones. The T
        queries are its last T positions (bottom-right alignment against seq_lengths).
      page_size: optional static int, checked against the caches' second axis.
      scale, is_causal, causal_alignment, local_window_size, softcap, alibi_slopes, return_lse,
      implementation, deterministic: as in flash_attention; positions count from the sequence's
        first cached row, so query i sits at position seq_lengths[b] - T + i (bottom-right, the
        default; top-left puts it at i).

    Returns:
      out [B, T, N, Hv] in the query dtype, or (out, lse) with return_lse=True.

    Shapes, dtypes and page_size are checked at trace time. Where block_table and seq_lengths are
    concrete, seq_lengths must lie in [T, max_pages * page_size] and every used page id in
    [0, num_pages). Traced values are not checked: page ids are clamped into the pool (no read
    out of bounds) and lengths clipped to [0, max_pages * page_size].
    """
    query, key_cache, value_cache, block_table, seq_lengths = (
        jnp.asarray(x) for x in (query, key_cache, value_cache, block_table, seq_lengths))
    num_pages, page_size, max_pages = _check(query, key_cache, value_cache, block_table,
                                             seq_lengths, page_size)
    scale = _validate.check_scale(scale, query.shape[-1])
    implementation = _validate.check_implementation(implementation)
    B, T, N, _ = query.shape
    lengths = jnp.clip(seq_lengths, 0, max_pages * page_size)
    config, extras = _options.canonicalize(
        query.shape, False, k_len=max_pages * page_size, is_causal=is_causal,
        key_value_seq_lengths=lengths, local_window_size=local_window_size,
        causal_alignment=causal_alignment, softcap=softcap, alibi_slopes=alibi_slopes,
        deterministic=deterministic)
    slopes = extras.alibi_slopes
    # With Explicit mesh axes the pages are gathered: the choice between the platforms' paths is a
    # conditional, which JAX 0.8 cannot differentiate with Explicit shardings.
    if B * T * N == 0 or explicitly_sharded(query, key_cache, value_cache, block_table, lengths):
        out, lse = _gathered(query, key_cache, value_cache, block_table, lengths, slopes, scale,
                             config, implementation)
    else:
        query, key_cache, value_cache, block_table, lengths, slopes = vary_together(
            query, key_cache, value_cache, block_table, lengths, slopes)
        args = (query, key_cache, value_cache, block_table, lengths, slopes)
        in_place = partial(_paged_core, scale=scale, config=config, implementation=implementation)
        on_cuda = (partial(in_place, split=True) if _hopper_reads_pages(query, value_cache, page_size)
                   else partial(_gathered, scale=scale, config=config, implementation=implementation))
        out, lse = jax.lax.platform_dependent(*args, default=partial(in_place, split=False), cuda=on_cuda)
    return (out, lse) if return_lse else out
