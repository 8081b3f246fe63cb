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
  * all_gather: K/V are gathered once and each query chunk is one call against all of them, told
    the global position of its first row, so causality (and a window) hide the keys it cannot
    see and the kernels skip them; JAX's transpose of the gather reduce-scatters dK/dV. With
    causality alone a chunk is instead two calls on the kernels' plain path (its diagonal block,
    causal, and the keys before it), merged through their LSEs. It holds the whole K/V on every
    device, which is cheap when K/V are small (GQA).
Lengths, bias and masks are cut per block: a block's lengths are the global ones clipped to its
chunks (padding sits at the end of the global sequence, so the valid rows of any block are a
prefix of it), and the bias/mask rows of this device are sliced to the keys of the block in hand.
Windows, ALiBi and dropout cross shards through the kernels' positions operand: each call is told
the global positions of its first query row and key, and applies the window, the ALiBi distances
(and their slope gradient, summed over the calls and devices) and the dropout stream there, so the
dropout mask is the single-device call's for the same dropout_rng. A call must then cover
contiguous positions: a ring step of the load-balanced layout is cut into one call per pair of
chunks, and calls the window leaves empty are skipped. Bottom-right alignment (query i of batch
element b at key position i + kv_len[b] - q_len[b]) uses the same positions, each batch element's
query position moved on by kv_len[b] - q_len[b]: a query may then see keys of later blocks, so a
causal ring computes every step, skipping the calls that no batch element's positions reach.
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import _options, _validate
from ._compat import pcast_varying, varying_axes
from ._lse_merge import merge_by_lse
from .autodiff import attention, extra_operands, named_residuals, vary_together
from .masks import PackedMask
from .primitives import attention_bwd_p, attention_fwd_p

STRATEGIES = ("ring", "all_gather")


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
    window: tuple[int, int] | None = None  # (left, right), both >= 0
    dropout_rate: float = 0.0
    # Whether the kernels need each piece's global positions (windows, ALiBi, dropout, shift).
    positional: bool = False
    # Whether queries sit kv_len - q_len (per batch element, _Keywords.shift) after their own
    # positions: bottom-right alignment where it differs from top-left.
    shifted: bool = False


class _Keywords(NamedTuple):
    """The operands of one call besides q, k, v, batched: segment ids of this device's queries and
    of the keys in hand; bias (float32) and mask (bool) of this device's query rows against every
    key of the global sequence, rank 4 with broadcast axes of size 1; global valid lengths [B]."""
    q_ids: Optional[jax.Array] = None
    kv_ids: Optional[jax.Array] = None
    bias: Optional[jax.Array] = None
    mask: Optional[jax.Array] = None
    q_lengths: Optional[jax.Array] = None
    kv_lengths: Optional[jax.Array] = None
    alibi_slopes: Optional[jax.Array] = None   # float32 [1|B, N], differentiable
    dropout_seeds: Optional[jax.Array] = None  # uint32 [B, 3]
    shift: Optional[jax.Array] = None          # int32 [B]: valid keys minus valid queries


def _vary_like(x, ref):
    """x marked as varying over the manual axes `ref` varies over (lax.cond's branches and
    concatenations need equal types inside shard_map)."""
    return pcast_varying(x, tuple(varying_axes(jax.typeof(ref)) - varying_axes(jax.typeof(x))))


def _chunks(ring, device, size):
    """(local start, length, global start) of each sequence chunk in `device`'s block of `size`
    rows: chunks device and 2n - 1 - device when load-balanced, else block `device`."""
    if not ring.balanced:
        return [(0, size, device * size)]
    half = size // 2
    return [(0, half, device * half), (half, half, (2 * ring.n - 1 - device) * half)]


def _valid_count(ring, lengths, device, size, lo, hi):
    """int32 [B]: how many of the local rows [lo, hi) of `device`'s block lie before the global
    valid lengths (None without lengths). Padding sits at the end of the global sequence, so in
    either layout the valid rows of a block, and of any of its row ranges, are a prefix of it."""
    if lengths is None:
        return None
    count = jnp.zeros_like(lengths)
    for start, length, global_start in _chunks(ring, device, size):
        first, last = max(start, lo), min(start + length, hi)
        if first < last:
            count = count + jnp.clip(lengths - (global_start + first - start), 0, last - first)
    return count.astype(jnp.int32)


def _cut(x, rows, cols, key_start):
    """The part of a bias or mask of this device's query rows against every key that pairs local
    rows [rows) with keys key_start + [cols) (key_start may be traced); broadcast axes stay 1."""
    if x is None:
        return None
    if x.shape[2] != 1:
        x = x[:, :, rows[0]:rows[1]]
    if x.shape[3] != 1 and cols[1] - cols[0] != x.shape[3]:
        x = jax.lax.dynamic_slice_in_dim(x, key_start + cols[0], cols[1] - cols[0], axis=3)
    return x


def _rows(x, start, stop):
    return None if x is None else x[:, start:stop]


def _pad_axis(x, axis, before, after, fill, ref):
    """x with `before` / `after` entries of `fill` around it along `axis`, typed like ref."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (before, after)
    return _vary_like(jnp.pad(x, pad, constant_values=fill), ref)


def _pad_rows(x, before, after, fill, ref):
    return _pad_axis(x, 1, before, after, fill, ref)


# What each kind of ring step computes: (query rows, key columns of the block as fractions of
# the block, causal); "skip" computes nothing.
_PIECES = {"full": ((0, 1), (0, 1), False), "diagonal": ((0, 1), (0, 1), True),
           "first_keys": ((0, 1), (0, 0.5), False),   # all queries, an earlier device's first chunk
           "last_queries": ((0.5, 1), (0, 1), False)}  # the second query chunk, a later device's block


class _Call(NamedTuple):
    """One kernel call of a ring step: local query rows and key columns of the block in hand,
    the causal flag, and int32 [2] global positions of its first row and key (None: none needed)."""
    rows: tuple
    cols: tuple
    causal: bool
    positions: Optional[jax.Array] = None


def _positions(shift, query, key):
    """int32 [2] (or [B, 2] with a per-batch shift) positions of a call whose first query row and
    key sit at global positions query and key, the query moved `shift` keys on. Only their
    difference places masks and ALiBi, so a negative shift moves the key on instead (positions
    are non-negative)."""
    if shift is None:
        return jnp.stack([query, key]).astype(jnp.int32)
    return jnp.stack([query + jnp.maximum(shift, 0), key + jnp.maximum(-shift, 0)],
                     axis=-1).astype(jnp.int32)


def _calls(ring, kind, T, S, rank, source, shift=None):
    """The kernel calls of one kind of ring step. Without positional features a kind is one call
    (in the load-balanced layout a local top-left causal mask on two chunks is the global one).
    With them each call must cover positions that are contiguous, so a kind is cut into one call
    per (query chunk, key chunk) pair, each placed at its global positions (queries moved on by
    the per-batch `shift` where bottom-right alignment needs it) and masked causally there; a pair
    causality leaves empty (a query chunk before a key chunk) is dropped."""
    (r0, r1), (c0, c1), causal = _PIECES[kind]
    rows, cols = (int(r0 * T), int(r1 * T)), (int(c0 * S), int(c1 * S))
    if not ring.positional:
        return [_Call(rows, cols, causal)]
    calls = []
    q_chunks, k_chunks = _chunks(ring, rank, T), _chunks(ring, source, S)
    for qi, (q_start, q_size, q_global) in enumerate(q_chunks):
        for ki, (k_start, k_size, k_global) in enumerate(k_chunks):
            lo, hi = max(rows[0], q_start), min(rows[1], q_start + q_size)
            first, last = max(cols[0], k_start), min(cols[1], k_start + k_size)
            if lo >= hi or first >= last or (kind == "diagonal" and ki > qi):
                continue
            positions = _positions(shift, q_global + lo - q_start, k_global + first - k_start)
            calls.append(_Call((lo, hi), (first, last), ring.causal, positions))
    return calls


def _visible(ring, call):
    """Traced: whether the window (and causality) leaves any pair of the call visible, for some
    batch element; None where nothing but the call's own masks can empty it (causality alone
    empties only pairs _calls already dropped, unless queries are shifted)."""
    if call.positions is None or (ring.window is None and not (ring.causal and ring.shifted)):
        return None
    left, right = ring.window if ring.window is not None else (None, None)
    if call.causal:
        right = 0 if right is None else min(right, 0)
    rows, cols = call.rows[1] - call.rows[0], call.cols[1] - call.cols[0]
    # key position minus query position over the call spans [lowest, highest]
    first_query, first_key = call.positions[..., 0], call.positions[..., 1]
    lowest = first_key - first_query - (rows - 1)
    highest = first_key + cols - 1 - first_query
    seen = lowest <= right
    if left is not None:
        seen &= highest >= -left
    return jnp.any(seen)


def _when_visible(ring, call, compute, empty):
    """compute() where the call may see something, else empty() (both traced alike)."""
    visible = _visible(ring, call)
    if visible is None:
        return compute()
    return jax.lax.cond(visible, compute, empty)


def _canonical(ring, q, k, kw, kv_ids, rank, source, call):
    """(MaskConfig, Extras) of one call of q against the block of `source`: the lengths clipped to
    it, the bias/mask cut to it, and its positions."""
    T, S = q.shape[1], k.shape[1]
    rows, cols = call.rows, call.cols
    return _options_for(
        ring, (q.shape[0], rows[1] - rows[0]) + q.shape[2:], cols[1] - cols[0], call.causal, kw,
        bias=_cut(kw.bias, rows, cols, source * S), mask=_cut(kw.mask, rows, cols, source * S),
        query_seq_lengths=_valid_count(ring, kw.q_lengths, rank, T, *rows),
        key_value_seq_lengths=_valid_count(ring, kw.kv_lengths, source, S, *cols),
        q_segment_ids=_rows(kw.q_ids, *rows), kv_segment_ids=_rows(kv_ids, *cols),
        positions=call.positions)


def _options_for(ring, q_shape, k_len, causal, kw, positions, **operands):
    """(MaskConfig, Extras) of one kernel call: the ring's static options, the ALiBi slopes and
    dropout seeds of the whole call, and this call's operands and positions."""
    config, extras = _options.canonicalize(
        q_shape, False, k_len=k_len, is_causal=causal, softcap=ring.softcap,
        deterministic=ring.deterministic, local_window_size=ring.window,
        alibi_slopes=kw.alibi_slopes, positions=positions, **operands)
    if ring.dropout_rate:
        config = dataclasses.replace(config, dropout_rate=ring.dropout_rate)
        extras = extras._replace(dropout_seeds=kw.dropout_seeds)
    return config, extras


def _unseen(q, Hv):
    """(out, lse) of rows that see no key: zero and -inf, float32."""
    o = _vary_like(jnp.zeros(q.shape[:3] + (Hv,), jnp.float32), q)
    return o, _vary_like(jnp.full(q.shape[:3], -jnp.inf, jnp.float32), q)


def _forward_kind(ring, kind, q, k, v, kw, kv_ids, rank, source):
    """(out float32, lse) of all of q against the block in hand, zero / -inf where unseen."""
    T, Hv = q.shape[1], v.shape[-1]
    if kind == "skip":
        return _unseen(q, Hv)
    result = None
    for call in _calls(ring, kind, T, k.shape[1], rank, source, kw.shift):
        (r0, r1), (c0, c1) = call.rows, call.cols

        def compute(call=call, r0=r0, r1=r1, c0=c0, c1=c1):
            config, extras = _canonical(ring, q, k, kw, kv_ids, rank, source, call)
            o, lse = attention_fwd_p.bind(q[:, r0:r1], k[:, c0:c1], v[:, c0:c1],
                                          *extra_operands(extras.bias, extras[1:]),
                                          scale=ring.scale, config=config,
                                          implementation=ring.implementation)
            return (_pad_rows(o.astype(jnp.float32), r0, T - r1, 0.0, q),
                    _pad_rows(lse, r0, T - r1, -jnp.inf, q))

        part = _when_visible(ring, call, compute, lambda: _unseen(q, Hv))
        result = part if result is None else _merge(*result, *part)
    return _unseen(q, Hv) if result is None else result


def _bias_block_shape(bias, T, S):
    """The shape of a bias's gradient against one block: [B|1, N|1, T|1, S|1]."""
    return bias.shape[:2] + (T if bias.shape[2] != 1 else 1, S if bias.shape[3] != 1 else 1)


def _backward_kind(ring, kind, q, k, v, o, lse, do, dlse, kw, kv_ids, rank, source):
    """Float32 (dq, dk, dv, dbias, dslopes) of one block, from the final output and LSE of the
    whole ring; dbias (None without bias) covers this device's rows and the block's keys, dslopes
    (None without ALiBi) is [B, N]."""
    T, S = q.shape[1], k.shape[1]
    zeros = lambda shape: _vary_like(jnp.zeros(shape, jnp.float32), q)  # noqa: E731

    def nothing():
        dbias = None if kw.bias is None else zeros(_bias_block_shape(kw.bias, T, S))
        dslopes = None if kw.alibi_slopes is None else zeros((q.shape[0], q.shape[2]))
        return zeros(q.shape), zeros(k.shape), zeros(v.shape), dbias, dslopes

    total = nothing()
    if kind == "skip":
        return total
    for call in _calls(ring, kind, T, S, rank, source, kw.shift):
        (r0, r1), (c0, c1) = call.rows, call.cols

        def compute(call=call, r0=r0, r1=r1, c0=c0, c1=c1):
            config, extras = _canonical(ring, q, k, kw, kv_ids, rank, source, call)
            rows = lambda x: x[:, r0:r1]  # noqa: E731
            dq, dk, dv, dbias, dslopes = attention_bwd_p.bind(
                rows(q), k[:, c0:c1], v[:, c0:c1], rows(o), rows(lse), rows(do), rows(dlse),
                *extra_operands(extras.bias, extras[1:]), scale=ring.scale, config=config,
                implementation=ring.implementation)
            dq, dk, dv = (x.astype(jnp.float32) for x in (dq, dk, dv))
            if kw.bias is not None:
                # Whether an axis is the bias's own follows the bias, not this result: a call of
                # one row or one key gives a size-1 axis either way.
                dbias = dbias.astype(jnp.float32)
                if kw.bias.shape[2] != 1:
                    dbias = _pad_axis(dbias, 2, r0, T - r1, 0.0, q)
                if kw.bias.shape[3] != 1:
                    dbias = _pad_axis(dbias, 3, c0, S - c1, 0.0, q)
                dbias = _vary_like(dbias, q)
            else:
                dbias = None
            dslopes = None if kw.alibi_slopes is None else _vary_like(dslopes.astype(jnp.float32), q)
            return (_pad_rows(dq, r0, T - r1, 0.0, q), _pad_rows(dk, c0, S - c1, 0.0, q),
                    _pad_rows(dv, c0, S - c1, 0.0, q), dbias, dslopes)

        grads = _when_visible(ring, call, compute, nothing)
        total = tuple(None if t is None else t + g for t, g in zip(total, grads))
    return total


def _step_kind(ring, step, rank):
    """What step `step` of the ring computes on device `rank` (traced): a static kind for steps
    every device treats alike, else (kind if the block comes from an earlier device, kind if
    from a later one) with the traced condition."""
    if not ring.causal or ring.shifted:  # shifted queries may see any block: the calls' masks decide
        return "full"
    if step == 0:
        return "diagonal"
    earlier = (rank - step) % ring.n < rank
    return (("first_keys", "last_queries") if ring.balanced else ("full", "skip")), earlier


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
    """Two partial attentions over disjoint key sets (float32), combined through their LSEs."""
    return merge_by_lse(jnp.stack([o, o_block]), jnp.stack([lse, lse_block]), axis=0)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ring_attention(q, k, v, kw, ring):
    return _ring_forward(q, k, v, kw, ring)


def _ring_forward(q, k, v, kw, ring):
    rank = jax.lax.axis_index(ring.axis_name)
    o = _vary_like(jnp.zeros(q.shape[:3] + (v.shape[-1],), jnp.float32), q)
    lse = _vary_like(jnp.full(q.shape[:3], -jnp.inf, jnp.float32), q)
    block = (k, v, kw.kv_ids)
    for step in range(ring.n):
        if step + 1 < ring.n:
            incoming = _send_to_next(ring, block)
        source = (rank - step) % ring.n
        o_block, lse_block = _run_step(
            ring, step, rank,
            lambda kind: _forward_kind(ring, kind, q, *block[:2], kw, block[2], rank, source))
        o, lse = _merge(o, lse, o_block, lse_block)
        if step + 1 < ring.n:
            block = incoming
    return o.astype(q.dtype), lse


def _ring_fwd(q, k, v, kw, ring):
    o, lse = named_residuals(*_ring_forward(q, k, v, kw, ring))
    return (o, lse), (q, k, v, kw, o, lse)


def _ring_bwd(ring, residuals, cotangents):
    q, k, v, kw, o, lse = residuals
    do, dlse = cotangents
    do = jnp.asarray(do, o.dtype)
    dlse = jnp.asarray(dlse, jnp.float32)
    rank = jax.lax.axis_index(ring.axis_name)
    S = k.shape[1]
    dq = _vary_like(jnp.zeros(q.shape, jnp.float32), q)
    # The bias belongs to this device's rows, so its gradient stays here: each step fills the
    # columns of the block in hand (every block passes once).
    dbias = None if kw.bias is None else _vary_like(jnp.zeros(kw.bias.shape, jnp.float32), q)
    # Per batch element and head; the slopes' own shape (shared by the batch or not) at the end.
    dslopes = None if kw.alibi_slopes is None else _vary_like(
        jnp.zeros((q.shape[0], q.shape[2]), jnp.float32), q)
    # Each block's dK/dV accumulator travels with the block and, after the last step, one more
    # hop brings it home to the block's owner.
    dkv = (_vary_like(jnp.zeros(k.shape, jnp.float32), q), _vary_like(jnp.zeros(v.shape, jnp.float32), q))
    block = (k, v, kw.kv_ids)
    for step in range(ring.n):
        if step + 1 < ring.n:
            incoming = _send_to_next(ring, block)
        source = (rank - step) % ring.n
        dq_block, dk_block, dv_block, dbias_block, dslopes_block = _run_step(
            ring, step, rank,
            lambda kind: _backward_kind(ring, kind, q, *block[:2], o, lse, do, dlse, kw, block[2],
                                        rank, source))
        dq = dq + dq_block
        if dslopes is not None:
            dslopes = dslopes + dslopes_block
        if dbias is not None:
            dbias = (dbias + dbias_block if dbias.shape[3] == 1 else
                     jax.lax.dynamic_update_slice_in_dim(dbias, dbias_block, source * S, axis=3))
        dkv = _send_to_next(ring, (dkv[0] + dk_block, dkv[1] + dv_block))
        if step + 1 < ring.n:
            block = incoming
    if dslopes is not None and kw.alibi_slopes.shape[0] == 1:
        dslopes = jnp.sum(dslopes, axis=0, keepdims=True)
    d_kw = _Keywords(bias=dbias, alibi_slopes=dslopes)
    return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype), d_kw


_ring_attention.defvjp(_ring_fwd, _ring_bwd)


def _keys_in_sequence_order(x, ring, axis):
    """A gathered key-indexed array from the load-balanced layout back to sequence order."""
    if x is None or x.shape[axis] == 1 or not ring.balanced:
        return x
    return load_balance(x, axis, ring.n, inverse=True)


def _causality_only(ring, kw):
    """Whether an all_gather call is causal with nothing else that masks or modifies a score:
    its query chunks can then run on the kernels' plain path (_plain_causal_chunks)."""
    return (ring.causal and not ring.positional and ring.softcap is None and
            all(x is None for x in (kw.q_ids, kw.kv_ids, kw.bias, kw.mask, kw.q_lengths, kw.kv_lengths)))


def _plain_causal_chunks(q, k_all, v_all, ring, rank):
    """(out, lse) of a causal all_gather call with causality alone. A query chunk at global rows
    [g, g + h) is a top-left causal call on its diagonal keys [g, g + h) and a full call on the
    keys before it, merged through their LSEs: both run on the kernels' plain path, where one
    call told its global positions would run the slower general path of the backward
    (docs/performance.md, "Several GPUs"). How many keys come before a chunk depends on the
    device, so each device's calls are one branch of a switch on its index."""
    T = q.shape[1]

    def call(q_chunk, first, stop, causal):
        config, extras = _options_for(ring, q_chunk.shape, stop - first, causal, _Keywords(), None)
        return attention(q_chunk, k_all[:, first:stop], v_all[:, first:stop], ring.scale, config,
                         extras, ring.implementation)

    def calls_of(device):
        outs, lses = [], []
        for start, size, first in _chunks(ring, device, T):
            q_chunk = q[:, start:start + size]
            o, lse = call(q_chunk, first, first + size, True)
            if first:
                o_before, lse_before = call(q_chunk, 0, first, False)
                o, lse = _merge(o.astype(jnp.float32), lse, o_before.astype(jnp.float32), lse_before)
            outs.append(_vary_like(o.astype(q.dtype), q))
            lses.append(_vary_like(lse, q))
        return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=1)

    return jax.lax.switch(rank, [partial(calls_of, device) for device in range(ring.n)])


def _all_gather_attention(q, k, v, kw, ring):
    gather = lambda x: None if x is None else jax.lax.all_gather(x, ring.axis_name, axis=1, tiled=True)  # noqa: E731
    # In sequence order a key's index is its position (and the bias/mask columns follow the keys).
    k_all, v_all, kv_ids_all = (_keys_in_sequence_order(gather(x), ring, 1)
                                for x in (k, v, kw.kv_ids))
    bias, mask = (_keys_in_sequence_order(x, ring, 3) for x in (kw.bias, kw.mask))
    rank = jax.lax.axis_index(ring.axis_name)
    if _causality_only(ring, kw):
        return _plain_causal_chunks(q, k_all, v_all, ring, rank)
    T, S_all = q.shape[1], k_all.shape[1]
    # Each query chunk is one call placed at its global position against every key (key 0 at 0):
    # causality, windows, ALiBi and dropout then see global positions, and the kernels' key
    # ranges skip the keys causality or a window hides.
    needs_positions = ring.causal or ring.positional
    outs, lses = [], []
    for start, size, global_start in _chunks(ring, rank, T):
        rows = (start, start + size)
        positions = _positions(kw.shift, global_start, 0) if needs_positions else None
        config, extras = _options_for(
            ring, (q.shape[0], size) + q.shape[2:], S_all, ring.causal, kw, positions,
            bias=_cut(bias, rows, (0, S_all), 0), mask=_cut(mask, rows, (0, S_all), 0),
            query_seq_lengths=_valid_count(ring, kw.q_lengths, rank, T, *rows),
            key_value_seq_lengths=kw.kv_lengths, q_segment_ids=_rows(kw.q_ids, *rows),
            kv_segment_ids=kv_ids_all)
        o, lse = attention(q[:, start:start + size], k_all, v_all, ring.scale, config, extras,
                           ring.implementation)
        outs.append(o)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=1)


def _check(query, key, value, axis_name, strategy, is_causal, load_balanced):
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


def _shift(local, B, T_total, S_total):
    """int32 [B]: the global valid keys minus the global valid queries, by which bottom-right
    alignment moves each batch element's queries along the keys."""
    def valid(lengths, total):
        return jnp.full((B,), total, jnp.int32) if lengths is None else jnp.clip(lengths, 0, total)
    return (valid(local.key_value_seq_lengths, S_total) -
            valid(local.query_seq_lengths, T_total)).astype(jnp.int32)


def _pairwise(x, name, query, key, n):
    """A bias or mask of this device's query rows against every key, as rank 4 [B|1, N|1, T|1,
    S_total|1] (float32 bias, bool mask), checked against the call."""
    if x is None:
        return None
    is_mask = name == "mask"
    if is_mask and isinstance(x, PackedMask):
        raise TypeError("context_parallel_attention takes a boolean mask, not a PackedMask (its "
                        "tiles describe one whole call and are not cut per block): pass "
                        "mask.unpack() sharded like the queries")
    (B, T, N, _), S_total = query.shape, n * key.shape[1]
    try:
        x = _options._bnts(x, name, B, N, T, S_total, is_mask)
    except ValueError:
        raise ValueError(
            f"{name} of shape {jnp.shape(x)} is not broadcastable to [B, N, T, S] = "
            f"{(B, N, T, S_total)}: this device's {T} query rows (sharded like the queries) "
            f"against all {S_total} keys of the global sequence (not sharded)") from None
    return x if is_mask else x.astype(jnp.float32)


def context_parallel_attention(query, key, value, *, axis_name, strategy="ring", load_balanced=True,
                               is_causal=False, scale=None, return_lse=False, bias=None, mask=None,
                               query_seq_lengths=None, key_value_seq_lengths=None,
                               q_segment_ids=None, kv_segment_ids=None, softcap=None,
                               causal_alignment="top_left", local_window_size=None,
                               alibi_slopes=None, dropout_rate=0.0, dropout_rng=None,
                               deterministic=False, implementation=None):
    """Attention over a sequence split along the mesh axis `axis_name`, inside `shard_map`.

    Each device passes its block of the sequence: query [B, T/n, N, H], key [B, S/n, K, H],
    value [B, S/n, K, Hv] (and segment ids [B, T/n], [B, S/n]), in sequence order, or with
    `load_balanced=True` and `is_causal=True` in the layout of `load_balance` (device i holds
    chunks i and 2n - 1 - i; load_balanced has no effect without is_causal, where every input,
    the bias and mask included, is in sequence order). The result is this device's block of
    flash_attention on the whole sequence, to float32 round-off, forward and gradients (bias
    included).

    Args:
      axis_name: the shard_map axis the sequence is split over.
      strategy: 'ring' (K/V blocks passed around with ppermute; O(S/n) memory) or 'all_gather'
        (K/V gathered once; cheaper when K/V are small, as with GQA).
      is_causal: causal attention over the global sequence (T = S per device).
      bias, mask: float / boolean, broadcastable to [B, N, T/n, S]: this device's query rows
        (sharded like the queries, in their layout) against every key of the global sequence
        (the key axis is not sharded), the keys in the order of the arrays passed, i.e. the
        concatenation of the devices' key blocks. For a global [B, N, T, S] bias of a
        load-balanced call that is load_balance(load_balance(bias, -2, n), -1, n) with the
        query axis sharded. Axes of size 1 broadcast (a [B, 1, 1, S] key bias is passed whole
        to every device). The bias is differentiable. A PackedMask is refused: pass its
        unpack().
      query_seq_lengths, key_value_seq_lengths: int32 [B], the global valid lengths (padding at
        the end of the global sequence, whatever the layout), the same on every device.
      local_window_size, alibi_slopes (differentiable; [N] or [B, N], the same on every
      device), dropout_rate, dropout_rng: as in flash_attention, at global positions: every
      kernel call is told where its first query row and key sit in the global sequence, so
      windows, ALiBi and the dropout mask are those of the single-device call (the same
      dropout_rng gives the same mask). Dropout with the ring
      needs the devices' key chunks (S/n, or S/2n load-balanced) to be multiples of 8, as the
      dropout stream draws 8 neighbouring keys at once; all_gather has no such limit.
      causal_alignment: as in flash_attention, with the global valid lengths: 'bottom_right'
        places query i at key position i + kv_len - q_len for the causal mask, the window and
        ALiBi, which each call gets through its positions. Dropout draws its mask at those
        positions, so it cannot join bottom-right alignment where that differs from top-left
        (lengths given, or T != S per device, with causality, a window or ALiBi): ValueError.
      scale, return_lse, q_segment_ids, kv_segment_ids (packed documents may span devices),
      softcap, deterministic, implementation: as in flash_attention.

    Returns:
      out [B, T/n, N, Hv], or (out, lse) with lse float32 [B, T/n, N].
    """
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    n = _check(query, key, value, axis_name, strategy, is_causal, load_balanced)
    if causal_alignment not in _options.ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {_options.ALIGNMENTS}, got {causal_alignment!r}")
    given_lengths = [name for name, x in (("query_seq_lengths", query_seq_lengths),
                                          ("key_value_seq_lengths", key_value_seq_lengths))
                     if x is not None]
    scale = _validate.check_scale(scale, query.shape[-1])
    implementation = _validate.check_implementation(implementation)
    # Validates the remaining keywords, segment ids and lengths on the local block.
    config, local = _options.canonicalize(
        query.shape, False, k_len=key.shape[1], is_causal=bool(is_causal),
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, softcap=softcap,
        local_window_size=local_window_size, alibi_slopes=alibi_slopes, dropout_rate=dropout_rate,
        dropout_rng=dropout_rng, deterministic=deterministic)
    window = None if config.window_left < 0 else (config.window_left, config.window_right)
    T, S = query.shape[1], key.shape[1]
    balanced = bool(load_balanced and is_causal)
    # Bottom-right alignment moves query i of batch element b to key position i + kv_len[b] -
    # q_len[b]; it differs from top-left only with lengths or T != S, and matters only to what
    # sees positions.
    aligned = [name for name, x in (("is_causal", is_causal or None), ("local_window_size", window),
                                    ("alibi_slopes", alibi_slopes)) if x is not None]
    shifted = bool(causal_alignment == "bottom_right" and aligned and (T != S or given_lengths))
    if shifted and config.dropout_rate:
        # The dropout stream draws at the positions each call is given, so they cannot also
        # carry the shift, and no per-block lengths keep the global kv_len - q_len.
        raise ValueError(
            f"context_parallel_attention: dropout_rate={config.dropout_rate} with "
            f"causal_alignment='bottom_right', {' and '.join(aligned)} and "
            f"{' and '.join(given_lengths) or f'{T} queries against {S} keys per device'} "
            "is not supported: each call's positions must be the dropout stream's own "
            "coordinates, so they cannot also move the queries by key length - query length; "
            "use causal_alignment='top_left' or no dropout")
    key_chunk = S // 2 if balanced else S
    if config.dropout_rate and strategy == "ring" and (balanced or n > 1) and key_chunk % 8:
        raise ValueError(f"context_parallel_attention: dropout_rate={config.dropout_rate} with "
                         f"strategy='ring' needs key chunks of a multiple of 8 keys (the dropout "
                         f"stream draws 8 neighbouring keys at once), got chunks of {key_chunk} "
                         f"(key block {key.shape}{', load-balanced' if balanced else ''}); use "
                         "strategy='all_gather' or a sequence length that divides accordingly")
    kw = _Keywords(local.q_segment_ids, local.kv_segment_ids, _pairwise(bias, "bias", query, key, n),
                   _pairwise(mask, "mask", query, key, n), local.query_seq_lengths,
                   local.key_value_seq_lengths, local.alibi_slopes, local.dropout_seeds,
                   _shift(local, query.shape[0], n * T, n * S) if shifted else None)
    if scale < 0:  # as in flash_attention: the kernels stabilise by the largest logit
        query, scale = -query, -scale
    elif scale == 0:
        query, scale = jnp.zeros_like(query), 1.0
    ring = _Ring(axis_name, n, bool(is_causal), balanced, scale,
                 None if softcap is None else float(softcap), bool(deterministic), implementation,
                 window, config.dropout_rate,
                 window is not None or alibi_slopes is not None or config.dropout_rate > 0 or shifted,
                 shifted)
    query, key, value, kw = vary_together(query, key, value, kw)
    if strategy == "ring":
        out, lse = _ring_attention(query, key, value, kw, ring)
    else:
        out, lse = _all_gather_attention(query, key, value, kw, ring)
    return (out, lse) if return_lse else out
