"""How the paged forward primitive (_paged_primitive.py) runs on a mesh under `jax.jit`: each call is
partitioned into per-device forward kernel calls through the machinery the dense attention uses
(_partitioning.py). Inside a `shard_map` that is manual over every mesh axis the kernel simply
runs on the local blocks.

What stays sharded, decided from the query's sharding:
  * batch: kept (the query, block table, lengths, positions and per-batch slopes split with it),
    no collective; the page pools are needed whole, since any sequence may own any page.
  * heads: kept where each device holds whole GQA groups (the pools' K/V heads split alike, or
    replicated with one K/V head), no collective; gathered otherwise.
  * the query sequence, pages, page rows, table entries and head dims: gathered.
"""
from __future__ import annotations

from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule
from jax.sharding import PartitionSpec as P

from ._options import Extras
from ._paged_primitive import paged_fwd_p
from ._partitioning import (bind_kernel, dim_axes, head_factors, named, outside_mesh,
                            register_partitioned, replication_order, shard_count, spec_entry)
from ._sparse_primitives import whole_groups_per_shard
from .primitives import attention_fwd_kernel_p

_TENSORS = 3  # q, key_cache, value_cache: the operands before the extras


def _plan(mesh, shapes, q_sharding):
    """(batch axes, query-head axes, K/V-head axes) along which the call stays sharded."""
    B, N, K = shapes[0][0], shapes[0][2], shapes[1][2]
    batch, heads = dim_axes(q_sharding, 4, 0), dim_axes(q_sharding, 4, 2)
    batch = batch if B % shard_count(mesh, batch) == 0 else ()  # rows of padded blocks are undefined
    shards = shard_count(mesh, heads)
    if not whole_groups_per_shard(N, K, 1, shards):
        heads = ()
    return batch, heads, heads if K % shard_count(mesh, heads) == 0 else ()


def _specs(plan, shapes):
    """(operand specs, result specs) of a call that stays sharded along the plan's axes."""
    b, n, kv = (spec_entry(axes) for axes in plan)
    B = shapes[0][0]
    operands = [P(b, None, n, None), P(None, None, kv, None), P(None, None, kv, None)]
    for name, shape in zip(Extras._fields, shapes[_TENSORS:]):
        if not shape:
            operands.append(P())
        elif name == "key_value_seq_lengths":
            operands.append(P(b))
        elif name in ("positions", "block_table"):
            operands.append(P(b, None))
        elif name == "alibi_slopes":  # [1 or B, N]
            operands.append(P(b if shape[0] == B else None, n))
        else:
            raise ValueError(f"jax_flashattn: a paged call takes no {name} operand")
    return operands, [P(b, None, n, None), P(b, None, n)]


def _decide(mesh, arg_shapes):
    shapes = tuple(tuple(x.shape) for x in arg_shapes[0])
    return _specs(_plan(mesh, shapes, arg_shapes[0][0].sharding), shapes)


def _infer(shapes, params, mesh, arg_shapes, result_shape):
    return named(mesh, _decide(mesh, arg_shapes)[1])


def _partition(shapes, params, mesh, arg_shapes, result_shape):
    operand_specs, result_specs = _decide(mesh, arg_shapes)

    @outside_mesh
    def lower_fn(operands):
        return bind_kernel(attention_fwd_kernel_p, operands, params)
    return mesh, lower_fn, named(mesh, result_specs), (named(mesh, operand_specs),)


def _sdy_rule(shapes, params, mesh, value_types, result_types):
    """The Shardy rule: batch (b) and heads pass through; the query sequence (t), pages (p), page
    rows (r), table entries (m), head dims (h, d) and broadcast axes stay whole."""
    (B, _, N, _), K = shapes[0], shapes[1][2]
    factors = head_factors(mesh, N, K)
    heads, kv_heads = factors.query, factors.coarse[0]
    whole = ["t", "p", "r", "h", "d", "m", *factors.rest]
    operands = [("b", "t", heads, "h"), ("p", "r", kv_heads, "h"), ("p", "r", kv_heads, "d")]
    for name, shape in zip(Extras._fields, shapes[_TENSORS:]):
        if not shape:
            operands.append(())
        elif name == "key_value_seq_lengths":
            operands.append(("b",))
        elif name == "block_table":
            operands.append(("b", "m"))
        elif name == "positions":
            whole.append("u")
            operands.append(("b", "u"))
        else:  # alibi_slopes [1 or B, N]
            if shape[0] != B:
                whole.append("w")
            operands.append(("b" if shape[0] == B else "w", heads))
    results = [("b", "t", heads, "d"), ("b", "t", heads)]
    return SdyShardingRule(tuple(ArrayMapping(*m) for m in operands),
                           tuple(ArrayMapping(*m) for m in results),
                           need_replication_factors=replication_order(whole, operands + results),
                           **factors.sizes)


register_partitioned(paged_fwd_p, attention_fwd_kernel_p, partition=_partition,
                     infer_sharding_from_operands=_infer, sharding_rule=_sdy_rule)
