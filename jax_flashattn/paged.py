"""`paged_attention`: attention of a few new queries against a paged KV cache (vLLM's layout).

The cache is a pool of fixed-size pages, [num_pages, page_size, K, H] for keys and for values;
sequence b owns the pages block_table[b, 0], block_table[b, 1], ... in that order, and its first
seq_lengths[b] rows are valid. The kernels read K/V as one contiguous [B, S, K, H] array, so this
version gathers each sequence's pages into such a buffer (one XLA gather; rows past a sequence's
length are zeroed in the same pass) and calls flash_attention with the lengths as
key_value_seq_lengths. On CUDA that call takes the split-KV decoding path (decode.py) when it is
decode-shaped. Gradients flow into query and, through the gather, into both caches.
"""
from __future__ import annotations

import numbers

import jax.numpy as jnp
import numpy as np

from . import _validate
from ._explicit_sharding import take_rows, whole_axes
from .attention import flash_attention
from .decode import _MIN_CHUNK, chunk_counts


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
    padded = -(-rows // _MIN_CHUNK) * _MIN_CHUNK
    if padded % page_size or chunk_counts(rows) or not chunk_counts(padded):
        return max_pages
    return padded // page_size


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
    B = query.shape[0]
    pages = gathered_pages(max_pages, page_size)
    rows = pages * page_size
    ids = block_table
    if pages > max_pages:  # the extra pages lie past every length: any page id will do
        ids = jnp.pad(ids, ((0, 0), (0, pages - max_pages)))
    lengths = jnp.clip(seq_lengths, 0, max_pages * page_size)
    # Rows past a length may hold anything (stale or NaN rows, another sequence's pages): zeroed,
    # since a masked probability of 0 times a NaN value would still be NaN.
    valid = (jnp.arange(rows, dtype=jnp.int32)[None, :] < lengths[:, None])[:, :, None, None]

    ids = whole_axes(ids, (1,))  # a sequence's pages on one device: merged with their rows below

    def contiguous(cache):
        # mode="clip" clamps the page ids inside the gather, so a traced bad id reads a real page.
        gathered = take_rows(cache, ids, mode="clip")
        gathered = gathered.reshape((B, rows) + cache.shape[2:])
        return jnp.where(valid, gathered, jnp.zeros((), cache.dtype))

    return flash_attention(
        query, contiguous(key_cache), contiguous(value_cache), scale=scale, is_causal=is_causal,
        return_lse=return_lse, implementation=implementation, key_value_seq_lengths=lengths,
        local_window_size=local_window_size, causal_alignment=causal_alignment, softcap=softcap,
        alibi_slopes=alibi_slopes, deterministic=deterministic)
