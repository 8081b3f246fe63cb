"""How the attention primitives run on a mesh under `jax.jit`: each call is partitioned into
per-device kernel calls (`custom_partitioning`, with a Shardy sharding rule and the GSPMD
callbacks, so it works with either partitioner; _partitioning.py holds the machinery, which the
sparse primitives share). Inside a `shard_map` that is manual over every mesh axis the kernels
simply run on the local blocks.

What each call keeps sharded, decided from the query's sharding:
  * batch and heads: kept, with no collective in either pass. Key/value heads split with the
    query heads (query head n uses key/value head n // G, so whole GQA groups stay together);
    when K does not divide by the head shards the heads are gathered instead. With one key/value
    head (MQA) the query heads are kept split and K/V replicated: each head shard holds a share of
    dK/dV, which the backward sums over the head shards, its one collective there.
  * query sequence: kept where each device's query positions can be offset to the global ones
    (below); K/V are then needed whole on every device, and the backward sums dK/dV over the
    query shards, the only collective.
  * key/value sequence and head dims: gathered. Sequence-sharded K/V also log a one-time warning
    that points to `context_parallel_attention`, which never gathers them.
Masks, biases, segment ids, lengths, slopes and dropout seeds are split along the axes they
share with the query; an operand broadcast over a sharded axis (size 1 there) is replicated
along it, and its gradient summed over that axis's devices. A PackedMask's bits and tiles split
along batch and heads only: its tile summaries cover 64 rows of the whole query sequence, so a
call with one keeps the query sequence whole.

The pack-mask primitive (jax_flashattn.pack_mask) is partitioned the same way: each device packs
its batch and head slices of the mask, with no collective; T and S stay whole.

Query offsets. A device holding queries [o, o + T_local) is given q_len' = clip(Lq - o, 0,
T_local) where the call has query lengths, and, where anything sees positions (a causal mask, a
window, ALiBi, dropout), the positions of its first query and key (jfa::MaskParams::positions),
with the call made top-left. Calls that place query i at key position i (top-left alignment, or
bottom-right with T = S and no lengths) get (o, 0): causality, windows, ALiBi and the dropout
stream then see the global positions. Other bottom-right calls place query i of batch element b
at key position i + Lk[b] - Lq[b] (valid lengths, clipped to S and T), so the device gets the
per-batch positions (o + d, 0) with d = Lk - Lq, or (o, -d) where d is negative (positions are
non-negative and only their difference places masks and ALiBi): exact for every mask and window.
Dropout draws its stream at the positions themselves, so bottom-right calls with a shift and
dropout keep the query sequence whole. Dropout draws its mask from the local head index, so with
dropout the heads stay whole.
"""
from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule
from jax.sharding import PartitionSpec as P

from ._mask_packing import pack_mask_kernel_p, pack_mask_p
from ._options import Extras
from ._partitioning import (bind_kernel, dim_axes, head_factors, named, outside_mesh,
                            register_partitioned, replication_order, shard_count, spec_entry)
from .primitives import (attention_bwd_kernel_p, attention_bwd_p, attention_fwd_kernel_p,
                         attention_fwd_p)

_log = logging.getLogger("jax_flashattn")
_FIELD = {name: i for i, name in enumerate(Extras._fields)}
_NUM_EXTRAS = len(Extras._fields)
_BWD_TENSORS = 7  # q, k, v, o, lse, do, dlse: the backward's operands before the extras


# ---- What stays sharded ----------------------------------------------------------------------

def _uses_positions(config, has_slopes) -> bool:
    return (config.is_causal or config.window_left >= 0 or config.window_right >= 0
            or has_slopes)


def _shifted(config, shapes) -> bool:
    """Whether the call places query i of batch element b at key position i + kv_len[b] -
    q_len[b] rather than i, and something sees it: bottom-right alignment with valid lengths or
    T != S, and a causal mask, a window or ALiBi (`shapes` are the operands' shapes)."""
    extras = shapes[-_NUM_EXTRAS:]
    lengths = extras[_FIELD["query_seq_lengths"]] or extras[_FIELD["key_value_seq_lengths"]]
    return (config.bottom_right and (shapes[0][1] != shapes[1][1] or bool(lengths))
            and _uses_positions(config, len(extras[_FIELD["alibi_slopes"]]) > 0))


def _query_offsets_supported(config, shapes) -> bool:
    """Whether a device holding a block of the query sequence can compute it on its own with
    the global positions (module docstring); `shapes` are the operands' shapes."""
    extras = shapes[-_NUM_EXTRAS:]
    if extras[_FIELD["mask_bits"]] or extras[_FIELD["positions"]]:
        return False
    # The dropout stream draws at the positions the device is given, which then cannot also
    # carry the shift of bottom-right alignment.
    return not (config.dropout_rate and _shifted(config, shapes))


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Mesh axes along which a call stays sharded: batch, query sequence, query heads and K/V
    heads (the query heads' axes, or none where one K/V head serves every query head: MQA)."""
    batch: tuple = ()
    query: tuple = ()
    heads: tuple = ()
    kv_heads: tuple = ()

    @property
    def kv_sum(self) -> tuple:
        """Mesh axes whose devices each hold a share of dK/dV: query shards and replicated K/V."""
        return self.query + tuple(a for a in self.heads if a not in self.kv_heads)


def _even(mesh, axes, size) -> tuple:
    """`axes` if they split `size` evenly, else none: an uneven split pads the last blocks with
    rows of no defined value, which the backward's sums over the split would add in."""
    return axes if size % shard_count(mesh, axes) == 0 else ()


def _plan(config, mesh, shapes, q_sharding, k_sharding) -> _Plan:
    (B, T, N, _), K = shapes[0], shapes[1][2]
    batch = _even(mesh, dim_axes(q_sharding, 4, 0), B)
    query = _even(mesh, dim_axes(q_sharding, 4, 1), T) if _query_offsets_supported(config, shapes) else ()
    heads = dim_axes(q_sharding, 4, 2)
    shards = shard_count(mesh, heads)
    if config.dropout_rate or N % shards or (K % shards and K != 1):
        heads = ()
    if dim_axes(k_sharding, 4, 1):
        _warn_kv_sequence_gathered()
    return _Plan(batch, query, heads, heads if K % shard_count(mesh, heads) == 0 else ())


_warned = []


def _warn_kv_sequence_gathered():
    if not _warned:
        _warned.append(True)
        _log.warning(
            "jax_flashattn: key/value are sharded along the sequence; the jitted attention "
            "gathers them on every device. For sequences split over devices use "
            "jax_flashattn.context_parallel_attention inside shard_map (ring or all-gather).")


def _operand_specs(plan, shapes, backward):
    """PartitionSpecs of every operand, in the primitive's order."""
    (B, T, N, _), S = shapes[0], shapes[1][1]
    b, t, n = spec_entry(plan.batch), spec_entry(plan.query), spec_entry(plan.heads)
    q4, kv4, rows = P(b, t, n, None), P(b, None, spec_entry(plan.kv_heads), None), P(b, t, n)
    specs = [q4, kv4, kv4] + ([q4, rows, q4, rows] if backward else [])
    extras = shapes[-_NUM_EXTRAS:]
    for name, shape in zip(Extras._fields, extras):
        if not shape:
            specs.append(P())
        elif name in ("bias", "mask"):
            specs.append(P(b if shape[0] == B else None, n if shape[1] == N else None,
                           t if shape[2] == T else None, None))
        elif name in ("mask_bits", "mask_tiles"):
            specs.append(P(b if shape[0] == B else None, n if shape[1] == N else None, None, None))
        elif name in ("query_seq_lengths", "key_value_seq_lengths"):
            specs.append(P(b))
        elif name == "q_segment_ids":
            specs.append(P(b, t))
        elif name in ("kv_segment_ids", "dropout_seeds", "positions", "block_table"):
            specs.append(P(b, None))
        else:  # alibi_slopes [1 or B, N]
            specs.append(P(b if shape[0] == B else None, n))
    return specs


def _result_specs(plan, shapes, backward):
    specs = _operand_specs(plan, shapes, backward)
    if not backward:
        return specs[0], P(*specs[0][:3])
    bias_spec = specs[_BWD_TENSORS]
    has_slopes = len(shapes[_BWD_TENSORS + _FIELD["alibi_slopes"]]) > 0
    b, n = spec_entry(plan.batch), spec_entry(plan.heads)
    return specs[0], specs[1], specs[2], bias_spec, P(b, n) if has_slopes else P()


def _broadcast_axes(plan, shape, full):
    """Mesh axes of the plan's (batch, heads, query) dims along which a [B|1, N|1, T|1, ...]
    operand is broadcast: its gradient is a partial sum on each of their devices."""
    axes = ()
    for dim, plan_axes in ((0, plan.batch), (1, plan.heads), (2, plan.query)):
        if shape[dim] != full[dim]:
            axes += plan_axes
    return axes


# ---- Per-device computation ------------------------------------------------------------------

def _offset_queries(operands, config, query_axes, total_queries, shifted):
    """The operands and config that make this device's queries sit at their global positions
    (module docstring, 'Query offsets')."""
    q, k = operands[0], operands[1]
    B, T_local = q.shape[:2]
    S = k.shape[1]
    extras = list(operands[-_NUM_EXTRAS:])
    q_lengths, kv_lengths = extras[_FIELD["query_seq_lengths"]], extras[_FIELD["key_value_seq_lengths"]]
    start = jax.lax.axis_index(query_axes) * T_local
    given_q = q_lengths.ndim != 0
    Lq = jnp.clip(q_lengths, 0, total_queries) if given_q else jnp.full((B,), total_queries, jnp.int32)
    local_q = jnp.clip(Lq - start, 0, T_local).astype(jnp.int32)
    if given_q:
        extras[_FIELD["query_seq_lengths"]] = local_q
    if not _uses_positions(config, extras[_FIELD["alibi_slopes"]].ndim != 0) and not config.dropout_rate:
        return list(operands[:-_NUM_EXTRAS]) + extras, config
    shift = 0
    if shifted:
        Lk = jnp.clip(kv_lengths, 0, S) if kv_lengths.ndim != 0 else S
        shift = Lk - Lq
    # Only the difference of the positions places masks and ALiBi, so a negative shift moves the
    # key position on instead (positions are non-negative).
    first = jnp.stack([start + jnp.maximum(shift, 0), jnp.maximum(-shift, 0)], axis=-1)
    extras[_FIELD["positions"]] = jnp.broadcast_to(first, (B, 2)).astype(jnp.int32)
    return list(operands[:-_NUM_EXTRAS]) + extras, dataclasses.replace(config, bottom_right=False)


def _forward_shard(plan, scale, config, implementation, total_queries, shifted):
    @outside_mesh
    def lower_fn(operands):
        operands, cfg = list(operands), config
        if plan.query:
            operands, cfg = _offset_queries(operands, config, plan.query, total_queries, shifted)
        return tuple(attention_fwd_kernel_p.bind(*operands, scale=scale, config=cfg,
                                                 implementation=implementation))
    return lower_fn


def _backward_shard(plan, scale, config, implementation, total_queries, shapes):
    B, T, N = shapes[0][:3]
    bias_shape = shapes[_BWD_TENSORS]
    shifted = _shifted(config, shapes)

    @outside_mesh
    def lower_fn(operands):
        operands, cfg = list(operands), config
        if plan.query:
            operands, cfg = _offset_queries(operands, config, plan.query, total_queries, shifted)
        dq, dk, dv, dbias, dslopes = attention_bwd_kernel_p.bind(
            *operands, scale=scale, config=cfg, implementation=implementation)
        if plan.kv_sum:  # each query block or head shard holds a share of every key's gradient
            dk, dv = jax.lax.psum((dk, dv), plan.kv_sum)
        if plan.query and dslopes.ndim:
            dslopes = jax.lax.psum(dslopes, plan.query)
        if bias_shape:
            axes = _broadcast_axes(plan, bias_shape, (B, N, T))
            if axes:
                dbias = jax.lax.psum(dbias, axes)
        return dq, dk, dv, dbias, dslopes
    return lower_fn


# ---- custom_partitioning callbacks -----------------------------------------------------------

def _decide(params, mesh, arg_shapes):
    operands = arg_shapes[0]
    shapes = tuple(tuple(x.shape) for x in operands)
    plan = _plan(dict(params)["config"], mesh, shapes, operands[0].sharding, operands[1].sharding)
    return plan, shapes


def _infer(backward):
    def infer_sharding_from_operands(shapes, params, mesh, arg_shapes, result_shape):
        plan, shapes = _decide(params, mesh, arg_shapes)
        return named(mesh, _result_specs(plan, shapes, backward))
    return infer_sharding_from_operands


def _partition(backward):
    def partition(shapes, params, mesh, arg_shapes, result_shape):
        plan, shapes = _decide(params, mesh, arg_shapes)
        total_queries = shapes[0][1]
        p = dict(params)
        scale, config, implementation = p["scale"], p["config"], p["implementation"]
        if backward:
            lower_fn = _backward_shard(plan, scale, config, implementation, total_queries, shapes)
        else:
            lower_fn = _forward_shard(plan, scale, config, implementation, total_queries,
                                      _shifted(config, shapes))
        args = (named(mesh, _operand_specs(plan, shapes, backward)),)
        return mesh, lower_fn, named(mesh, _result_specs(plan, shapes, backward)), args
    return partition


def _operand_factors(shapes, heads, kv_heads, backward, fresh):
    """Each operand's factor names per dimension, in the primitive's order; a dimension of size 1
    where the full size is larger (a broadcast axis) gets a factor of its own from fresh()."""
    (B, T, N, _), (S, K) = shapes[0], shapes[1][1:3]

    def dims(shape, names, full):
        return tuple(name if size == f else fresh() for size, name, f in zip(shape, names, full))

    mappings = [("b", "t", heads, "h"), ("b", "s", kv_heads, "h"), ("b", "s", kv_heads, "d")]
    if backward:  # o, lse, do, dlse
        mappings += [("b", "t", heads, "d"), ("b", "t", heads), ("b", "t", heads, "d"), ("b", "t", heads)]
    for name, shape in zip(Extras._fields, shapes[-_NUM_EXTRAS:]):
        if not shape:  # placeholder of an absent operand
            mappings.append(())
        elif name in ("bias", "mask"):
            mappings.append(dims(shape, ("b", heads, "t", "s"), (B, N, T, S)))
        elif name == "mask_bits":  # [B|1, N|1, T, words]
            mappings.append(dims(shape[:2], ("b", heads), (B, N)) + ("t", fresh()))
        elif name == "mask_tiles":  # [B|1, N|1, row blocks, chunks]
            mappings.append(dims(shape[:2], ("b", heads), (B, N)) + (fresh(), fresh()))
        elif name in ("query_seq_lengths", "key_value_seq_lengths"):
            mappings.append(("b",))
        elif name == "q_segment_ids":
            mappings.append(("b", "t"))
        elif name == "kv_segment_ids":
            mappings.append(("b", "s"))
        elif name in ("dropout_seeds", "positions", "block_table"):
            mappings.append(("b", fresh()))
        else:  # alibi_slopes [1 or B, N]
            mappings.append(dims(shape, ("b", heads), (B, N)))
    return mappings


def _sdy_rule(backward):
    """The Shardy rule: batch (b), query sequence (t) and heads pass through; head dims (h, d),
    the key sequence (s) and broadcast axes stay whole, and so do the query sequence and the
    heads where the call cannot keep them sharded (`_plan` makes the same choices)."""
    def rule(shapes, params, mesh, value_types, result_types):
        config = dict(params)["config"]
        factors = head_factors(mesh, shapes[0][2], shapes[1][2])
        heads, (kv_heads,) = factors.query, factors.coarse
        whole = ["h", "d", "s", *factors.rest]

        def fresh():
            whole.append(f"x{len(whole)}")
            return whole[-1]

        operands = _operand_factors(shapes, heads, kv_heads, backward, fresh)
        if backward:  # dq, dk, dv, d(bias), d(slopes)
            has_slopes = len(shapes[-_NUM_EXTRAS:][_FIELD["alibi_slopes"]]) > 0
            results = operands[:3] + [operands[_BWD_TENSORS], ("b", heads) if has_slopes else ()]
        else:  # o, lse
            results = [("b", "t", heads, "d"), ("b", "t", heads)]
        if not _query_offsets_supported(config, shapes):
            whole.append("t")
        if config.dropout_rate:
            whole += factors.names
        return SdyShardingRule(tuple(ArrayMapping(*m) for m in operands),
                               tuple(ArrayMapping(*m) for m in results),
                               need_replication_factors=replication_order(whole, operands + results),
                               **factors.sizes)
    return rule


for _prim, _kernel, _backward in ((attention_fwd_p, attention_fwd_kernel_p, False),
                                  (attention_bwd_p, attention_bwd_kernel_p, True)):
    register_partitioned(_prim, _kernel, partition=_partition(_backward),
                         infer_sharding_from_operands=_infer(_backward),
                         sharding_rule=_sdy_rule(_backward))


# ---- The pack-mask primitive -----------------------------------------------------------------

def _pack_spec(sharding):
    """The mask's batch and head sharding, T and S whole: how the mask, bits and tiles are split."""
    spec = tuple(getattr(sharding, "spec", ())) + (None,) * 4
    return P(spec[0], spec[1], None, None)


def _pack_infer(shapes, params, mesh, arg_shapes, result_shape):
    (mask,), = arg_shapes
    return named(mesh, [_pack_spec(mask.sharding)] * 2)


def _pack_partition(shapes, params, mesh, arg_shapes, result_shape):
    (mask,), = arg_shapes
    spec = _pack_spec(mask.sharding)
    lower_fn = outside_mesh(lambda operands: bind_kernel(pack_mask_kernel_p, operands, params))
    return mesh, lower_fn, named(mesh, [spec] * 2), (named(mesh, [spec]),)


def _pack_sdy_rule(shapes, params, mesh, value_types, result_types):
    return SdyShardingRule((ArrayMapping("b", "n", "t", "s"),),
                           (ArrayMapping("b", "n", "r", "w"), ArrayMapping("b", "n", "u", "c")),
                           need_replication_factors=("t", "s", "r", "w", "u", "c"))


register_partitioned(pack_mask_p, pack_mask_kernel_p, partition=_pack_partition,
                     infer_sharding_from_operands=_pack_infer, sharding_rule=_pack_sdy_rule)
