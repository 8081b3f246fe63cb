"""Summaries of packed-sequence segment ids per chunk of 16 positions, for the CUDA kernels.

With them a GPU kernel knows, before touching a tile, which keys a block of queries may share a
segment with (its key loop covers only those) and whether a tile lies inside one segment (no
per-element test). XLA computes them in the lowering from the ids, so the kernels need no
pre-pass; the cost is O(B·T·S/256) compare-and-reduce, small beside the attention itself.

Per chunk c of one side: (min id, max id, begin, end). The other side's positions that may share
an id with chunk c are those in the chunks whose id range overlaps [min, max]; call their first
position b(c) and their end e(c) (none: b = other length, e = 0). Stored are begin = min of b(c')
over c' >= c and end = max of e(c') over c' <= c, so that a kernel tile of chunks c0..c1 reads its
span [begin(c0), end(c1)) with two loads (a superset of the exact union, equal to it for sorted
ids, as packed sequences have; empty when begin >= end). Then, of the side's own positions,
[run begin, run end): the maximal run of consecutive chunks that each hold one id, the same one,
around chunk c (empty unless c holds one id), which lets a kernel prove a whole range of blocks
inside one segment with two loads per tile; and [match begin, match end): for a chunk that holds
one id, the other side's run of one-id chunks with that id at its chunk `begin` or the next one
(empty if neither): a kernel tile inside one segment finds its keys that need no segment test
with one load, instead of a chain of three dependent ones (8 int32 per chunk, two aligned int4
loads). Matches jfa::MaskParams::q_segment_chunks (cuda/include/jfa/params.h); chunk =
jfa::kSegmentChunk.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK = 16  # jfa::kSegmentChunk


def _id_ranges(ids):
    """Min and max id per chunk of the last axis, [B, ceil(L / CHUNK)] each."""
    B, L = ids.shape
    pad = -L % CHUNK
    # Edge padding repeats the last id, which changes no chunk's range.
    chunks = jnp.pad(ids, ((0, 0), (0, pad)), mode="edge").reshape(B, -1, CHUNK)
    return chunks.min(-1), chunks.max(-1)


def _spans(lo, hi, other_lo, other_hi, other_len):
    """(begin, end) per chunk as the module docstring defines them."""
    overlap = (other_lo[:, None, :] <= hi[:, :, None]) & (other_hi[:, None, :] >= lo[:, :, None])
    n = other_lo.shape[1]
    index = jnp.arange(n, dtype=jnp.int32)
    first = jnp.min(jnp.where(overlap, index, n), axis=-1)
    last = jnp.max(jnp.where(overlap, index, -1), axis=-1)
    none = last < 0
    b = jnp.where(none, other_len, first * CHUNK)
    e = jnp.where(none, 0, jnp.minimum((last + 1) * CHUNK, other_len))
    begin = jax.lax.cummin(b, axis=1, reverse=True)
    end = jax.lax.cummax(e, axis=1)
    return begin.astype(jnp.int32), end.astype(jnp.int32)


def _uniform_runs(lo, hi, length):
    """[run begin, run end) positions per chunk as the module docstring defines them."""
    n = lo.shape[1]
    index = jnp.arange(n, dtype=jnp.int32)
    uniform = lo == hi
    # cont[c]: chunk c continues the run of chunk c - 1.
    cont = jnp.zeros_like(uniform).at[:, 1:].set(uniform[:, 1:] & uniform[:, :-1] & (lo[:, 1:] == lo[:, :-1]))
    first = jax.lax.cummax(jnp.where(cont, 0, index), axis=1)
    cont_next = jnp.zeros_like(uniform).at[:, :-1].set(cont[:, 1:])
    last = jax.lax.cummin(jnp.where(cont_next, n, index), axis=1, reverse=True)
    begin = jnp.where(uniform, first * CHUNK, index * CHUNK)
    end = jnp.where(uniform, jnp.minimum((last + 1) * CHUNK, length), index * CHUNK)
    return begin.astype(jnp.int32), end.astype(jnp.int32)


def _matching_runs(lo, hi, begin, other_lo, other_hi, other_run):
    """[match begin, match end) per chunk as the module docstring defines them."""
    n_other = other_lo.shape[1]
    k0 = begin // CHUNK
    match_begin = match_end = jnp.zeros_like(lo)
    take = lambda x, k: jnp.take_along_axis(x, k, axis=1)  # noqa: E731
    for step in (1, 0):  # chunk `begin` wins over the next one
        k = jnp.minimum(k0 + step, n_other - 1)
        olo, ohi = take(other_lo, k), take(other_hi, k)
        match = (k0 + step < n_other) & (lo == hi) & (olo == ohi) & (olo == lo)
        match_begin = jnp.where(match, take(other_run[0], k), match_begin)
        match_end = jnp.where(match, take(other_run[1], k), match_end)
    return match_begin, match_end


def segment_chunks(q_segment_ids, kv_segment_ids):
    """(q summaries int32 [B, ceil(T/16), 8], kv summaries int32 [B, ceil(S/16), 8])."""
    q_lo, q_hi = _id_ranges(q_segment_ids)
    k_lo, k_hi = _id_ranges(kv_segment_ids)
    T, S = q_segment_ids.shape[1], kv_segment_ids.shape[1]
    q_run, k_run = _uniform_runs(q_lo, q_hi, T), _uniform_runs(k_lo, k_hi, S)

    def side(lo, hi, run, other_lo, other_hi, other_run, other_len):
        begin, end = _spans(lo, hi, other_lo, other_hi, other_len)
        match = _matching_runs(lo, hi, begin, other_lo, other_hi, other_run)
        return jnp.stack([lo, hi, begin, end, *run, *match], -1).astype(jnp.int32)

    return side(q_lo, q_hi, q_run, k_lo, k_hi, k_run, S), side(k_lo, k_hi, k_run, q_lo, q_hi, q_run, T)
