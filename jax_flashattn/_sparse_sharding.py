"""How the top-k sparse primitives (sparse_attention's forward and backward, attn_dist) run on a
mesh under `jax.jit`: each call is partitioned into per-device kernel calls through the machinery
the dense attention uses (_partitioning.py: `custom_partitioning`, a Shardy sharding rule and the
GSPMD callbacks). Inside a `shard_map` that is manual over every mesh axis the kernels simply run
on the local blocks.

Every operand and result has the batch at axis 0 and heads at axis 2: query heads N for q, o, lse
and their cotangents, key/value heads K for k, v, their gradients and the indices [B, T, K, topk];
attn_dist's result [B, N // head_group, T, topk] has its head groups at axis 1. What each call
keeps sharded is decided from the query's sharding:
  * batch: kept, with no collective in either pass.
  * heads: kept, with no collective, where each device holds whole GQA groups (K divides by the
    head shards, as query head n uses K/V head n // (N / K)) and, for attn_dist, whole groups of
    head_group query heads (N // head_group divides by the head shards); gathered otherwise. With
    one K/V head (MQA, and MLA's shared buffer) the query heads are kept split and K/V, their
    indices and their gradients replicated: the backward sums dK/dV over the head shards, its one
    collective.
  * the query and key sequences, topk and the head dims: gathered, since a query's causal limit
    is its position in the whole sequence and its selected keys index the whole key sequence.
The MLA form (value=None, V the leading columns of key) passes a rank-0 placeholder for v and gets
one back for dv; both stay replicated.
"""
from __future__ import annotations

import jax
from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule
from jax.sharding import PartitionSpec as P

from ._partitioning import (bind_kernel, dim_axes, head_factors, named, outside_mesh,
                            register_partitioned, replication_order, shard_count, spec_entry)
from ._sparse_primitives import (attn_dist_kernel_p, attn_dist_p, sparse_bwd_kernel_p, sparse_bwd_p,
                                 sparse_fwd_kernel_p, sparse_fwd_p, whole_groups_per_shard)

_FORWARD, _BACKWARD, _DIST = "forward", "backward", "attn_dist"


def _head_group(kind, params):
    """Query heads a device must hold together beyond the GQA groups: attn_dist's head_group."""
    return dict(params)["head_group"] if kind == _DIST else 1


def _plan(kind, mesh, shapes, params, q_sharding):
    """The mesh axes along which the call stays sharded: (batch, query heads, K/V heads); the K/V
    heads are replicated where one K/V head serves every query head (MQA)."""
    B, N, K = shapes[0][0], shapes[0][2], shapes[1][2]
    batch, heads = dim_axes(q_sharding, 4, 0), dim_axes(q_sharding, 4, 2)
    batch = batch if B % shard_count(mesh, batch) == 0 else ()  # rows of padded blocks are undefined
    shards = shard_count(mesh, heads)
    if not whole_groups_per_shard(N, K, _head_group(kind, params), shards):
        heads = ()
    return batch, heads, heads if K % shards == 0 else ()


def _kv_indexed(kind):
    """Positions of the operands and of the results indexed by K/V heads (k, v, indices; dk, dv)."""
    if kind == _DIST:  # q, k, indices, lse -> dist
        return (1, 2), ()
    return (1, 2, 3), ((1, 2) if kind == _BACKWARD else ())


def _spec(shape, batch, heads, heads_dim=2):
    """An array's PartitionSpec: batch at axis 0, heads at heads_dim, every other axis whole."""
    if not shape:  # placeholder of the absent value
        return P()
    entries = [None] * len(shape)
    entries[0], entries[heads_dim] = spec_entry(batch), spec_entry(heads)
    return P(*entries)


def _specs(kind, plan, shapes, result_shapes):
    """(operand specs, result specs) of a call that stays sharded along the plan's axes."""
    batch, heads, kv_heads = plan
    kv_operands, kv_results = _kv_indexed(kind)
    operands = [_spec(shape, batch, kv_heads if i in kv_operands else heads)
                for i, shape in enumerate(shapes)]
    heads_dim = 1 if kind == _DIST else 2
    results = [_spec(shape, batch, kv_heads if i in kv_results else heads, heads_dim)
               for i, shape in enumerate(result_shapes)]
    return operands, results


def _decide(kind, shapes, params, mesh, arg_shapes, result_shape):
    plan = _plan(kind, mesh, shapes, params, arg_shapes[0][0].sharding)
    return plan, _specs(kind, plan, shapes, [tuple(x.shape) for x in result_shape])


def _infer(kind):
    def infer_sharding_from_operands(shapes, params, mesh, arg_shapes, result_shape):
        return named(mesh, _decide(kind, shapes, params, mesh, arg_shapes, result_shape)[1][1])
    return infer_sharding_from_operands


def _lower_fn(kind, kernel, params, plan):
    _, heads, kv_heads = plan
    # Replicated K/V heads (MQA) get a share of their gradient from each head shard.
    sum_over = heads if kind == _BACKWARD and heads and not kv_heads else ()

    @outside_mesh
    def lower_fn(operands):
        results = bind_kernel(kernel, operands, params)
        if not sum_over:
            return results
        dq, dk, dv = results
        return dq, jax.lax.psum(dk, sum_over), dv if dv.ndim == 0 else jax.lax.psum(dv, sum_over)
    return lower_fn


def _partition(kind, kernel):
    def partition(shapes, params, mesh, arg_shapes, result_shape):
        plan, (operand_specs, result_specs) = _decide(kind, shapes, params, mesh, arg_shapes,
                                                      result_shape)
        lower_fn = _lower_fn(kind, kernel, params, plan)
        return mesh, lower_fn, named(mesh, result_specs), (named(mesh, operand_specs),)
    return partition


def _sdy_rule(kind):
    """The Shardy rule: batch (b) and heads pass through; the sequences (t, s), topk (j) and head
    dims (h, d) stay whole, as `_plan` decides."""
    def rule(shapes, params, mesh, value_types, result_types):
        N, K = shapes[0][2], shapes[1][2]
        groups = (N // _head_group(kind, params),) if kind == _DIST else ()
        factors = head_factors(mesh, N, K, *groups)
        heads, kv_heads = factors.query, factors.coarse[0]
        q, rows, out = ("b", "t", heads, "h"), ("b", "t", heads), ("b", "t", heads, "d")
        k, indices = ("b", "s", kv_heads, "h"), ("b", "t", kv_heads, "j")
        if kind == _DIST:  # q, k, indices, lse -> dist
            operands = [q, k, indices, rows]
            results = [("b", factors.coarse[1], "t", "j")]
        else:
            v = ("b", "s", kv_heads, "d") if shapes[2] else ()
            operands = [q, k, v, indices]
            if kind == _BACKWARD:  # o, lse, do, dlse -> dq, dk, dv
                operands += [out, rows, out, rows]
                results = operands[:3]
            else:  # -> o, lse
                results = [out, rows]
        whole = ["t", "s", "j", "h", "d", *factors.rest]
        return SdyShardingRule(tuple(ArrayMapping(*m) for m in operands),
                               tuple(ArrayMapping(*m) for m in results),
                               need_replication_factors=replication_order(whole, operands + results),
                               **factors.sizes)
    return rule


for _prim, _kernel, _kind in ((sparse_fwd_p, sparse_fwd_kernel_p, _FORWARD),
                              (sparse_bwd_p, sparse_bwd_kernel_p, _BACKWARD),
                              (attn_dist_p, attn_dist_kernel_p, _DIST)):
    register_partitioned(_prim, _kernel, partition=_partition(_kind, _kernel),
                         infer_sharding_from_operands=_infer(_kind), sharding_rule=_sdy_rule(_kind))
