"""The custom_partitioning machinery every partitioned primitive shares (sharding.py for the dense
attention and pack-mask primitives, _sparse_sharding.py for the top-k sparse ones): a primitive
lowers to a `custom_partitioning` call of its per-device twin, with a Shardy sharding rule and the
GSPMD callbacks, and the helpers below read and write the PartitionSpecs those callbacks trade.

Every callback receives the operands' shapes and the primitive's parameters (a tuple of
(name, value) pairs, static), then what custom_partitioning itself passes: the mesh and the
operands' and results' shapes or types.
"""
from __future__ import annotations

import functools
import itertools
import math
from typing import NamedTuple

import jax
from jax.experimental.custom_partitioning import CompoundFactor, custom_partitioning
from jax.sharding import NamedSharding

from ._compat import mlir, prim_requires_devices_during_lowering


# ---- PartitionSpecs --------------------------------------------------------------------------

def _axes(entry) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def spec_entry(axes):
    """The PartitionSpec entry that splits a dimension over the mesh axes `axes`."""
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def dim_axes(sharding, ndim, dim) -> tuple:
    """The mesh axes along which dimension `dim` of a rank-`ndim` array is split."""
    spec = tuple(getattr(sharding, "spec", ())) + (None,) * ndim
    return _axes(spec[dim])


def shard_count(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def named(mesh, specs):
    return tuple(NamedSharding(mesh, spec) for spec in specs)


# ---- Shardy factors --------------------------------------------------------------------------

class HeadFactors(NamedTuple):
    query: object      # the query-head dimension's factor (a name or a CompoundFactor)
    coarse: tuple      # each coarse dimension's factor
    sizes: dict        # sizes of the factors Shardy cannot infer from one dimension
    rest: tuple        # factors that must stay whole (what follows the shared one in a compound)
    names: tuple       # every factor above, to keep the heads whole where a call needs that


def _fits_every_head_split(mesh, size) -> bool:
    """Whether `size` divides by every number of shards the mesh can split heads into (the
    product of any of its axes; a split that does not divide the heads is uneven, and Shardy
    would carry it onto the tied dimension as sub-axes)."""
    axis_sizes = list(getattr(mesh, "shape", {}).values())
    for count in range(1, len(axis_sizes) + 1):
        for axes in itertools.combinations(axis_sizes, count):
            if size % math.prod(axes):
                return False
    return True


def head_factors(mesh, N, *coarse) -> HeadFactors:
    """Shardy factors of a query-head dimension of size N and of dimensions that group its heads
    into `coarse` blocks (key/value heads: query head n uses K/V head n // (N / K); attn_dist's head
    groups).

    Heads shard alike through a compound (shared, rest): the shared factor, the gcd of the coarse
    sizes that join it, leads each of their dimensions. Shardy splits a mesh axis into sub-axes
    where a factor does not divide by it (which custom_partitioning cannot express), so a coarse
    dimension joins the compound only where its size divides by every head split the mesh allows;
    elsewhere it gets a factor of its own and the partition callback matches it."""
    tied = [size for size in coarse if size != N and _fits_every_head_split(mesh, size)]
    shared = math.gcd(*tied) if tied else N
    if shared == 1:  # Shardy refuses a factor of size 1 inside a compound
        tied, shared = [], N
    query = "n" if shared == N else CompoundFactor("n", "n_rest")
    sizes = {} if shared == N else {"n_rest": N // shared}
    dims, own = [], []
    for i, size in enumerate(coarse):
        if size == N:
            dims.append(query)
        elif size == shared:
            dims.append("n")
        elif size in tied:
            dims.append(CompoundFactor("n", f"n{i}"))
            sizes[f"n{i}"] = size // shared
        else:
            dims.append(f"n{i}")
            own.append(f"n{i}")
    rest = tuple(sizes)
    if shared != N and "n" not in dims:  # "n" only inside compounds: Shardy needs its size
        sizes["n"] = shared
    return HeadFactors(query, tuple(dims), sizes, rest, ("n", *rest, *own))


def replication_order(whole, mappings):
    """The factors of `whole` that the mappings use, in the order they first appear (as Shardy
    wants its need-replication factors)."""
    order = []
    for mapping in mappings:
        for dim in mapping:
            for factor in (dim if isinstance(dim, CompoundFactor) else (dim,)):
                if factor in whole and factor not in order:
                    order.append(factor)
    return tuple(order)


# ---- Registration ----------------------------------------------------------------------------

def outside_mesh(lower_fn):
    """lower_fn traced outside the caller's mesh, since under `jax.set_mesh` with Explicit axes
    its jnp ops would leave sharding annotations in the already partitioned program."""
    @functools.wraps(lower_fn)
    def traced(operands):
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
            return lower_fn(operands)
    return traced


def bind_kernel(kernel, operands, params):
    """kernel's results on these operands, as a tuple whether it has one result or several."""
    outs = kernel.bind(*operands, **dict(params))
    return tuple(outs) if kernel.multiple_results else (outs,)


def _propagate_user_sharding(shapes, params, mesh, user_shape):
    """The results keep the shardings the user gave them."""
    return jax.tree.map(lambda x: x.sharding, user_shape)


def register_partitioned(prim, kernel, *, partition, infer_sharding_from_operands, sharding_rule):
    """Lowers `prim` to a custom_partitioning call that binds its per-device twin `kernel` (same
    operands and parameters) on each device's blocks, with the given callbacks."""
    def per_device(shapes, params, operands):
        return bind_kernel(kernel, operands, params)

    call = custom_partitioning(per_device, static_argnums=(0, 1))
    call.def_partition(partition=partition, infer_sharding_from_operands=infer_sharding_from_operands,
                       propagate_user_sharding=_propagate_user_sharding, sharding_rule=sharding_rule)

    def lower(*operands, **params):
        shapes = tuple(tuple(x.shape) for x in operands)
        return call(shapes, tuple(params.items()), tuple(operands))

    mlir.register_lowering(prim, mlir.lower_fun(lower, multiple_results=True))
    prim_requires_devices_during_lowering.add(prim)
