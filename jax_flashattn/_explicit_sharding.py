"""Gathers of rows on arrays split over Explicit mesh axes (jax.sharding.AxisType.Explicit), where
JAX asks each gather for the sharding of its result instead of inferring one: paged_attention's
page gather and varlen_attention's padding go through here, and with Auto axes or no mesh they
are plain gathers."""
from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P


def explicit_spec(x):
    """x's PartitionSpec entries, one per dimension, where any dimension is split over Explicit
    mesh axes; None otherwise (Auto axes leave a traced value's spec empty)."""
    spec = tuple(getattr(jax.typeof(x).sharding, "spec", ()) or ())
    if not any(entry is not None for entry in spec):
        return None
    return spec + (None,) * (x.ndim - len(spec))


def explicitly_sharded(*arrays) -> bool:
    return any(explicit_spec(x) is not None for x in arrays)


def take_rows(x, index, mode="clip"):
    """x[index] along x's first axis (index an integer array of any shape; out-of-range entries
    clipped, negative ones to 0): the result is split as index is along its own axes and as x
    along the others, x's first axis being gathered whole first where it is split."""
    x_spec, index_spec = explicit_spec(x), explicit_spec(index)
    if x_spec is None and index_spec is None:
        return x.at[index].get(mode=mode, wrap_negative_indices=False)
    x_spec = x_spec or (None,) * x.ndim
    if x_spec[0] is not None:
        x = jax.sharding.reshard(x, P(None, *x_spec[1:]))
    out = P(*(index_spec or (None,) * index.ndim), *x_spec[1:])
    return x.at[index].get(mode=mode, wrap_negative_indices=False, out_sharding=out)


def whole_axes(x, axes):
    """x with the given axes unsplit (a no-op without Explicit axes), so that a reshape can merge
    them."""
    spec = explicit_spec(x)
    if spec is None or all(spec[a] is None for a in axes):
        return x
    return jax.sharding.reshard(x, P(*(None if a in axes else e for a, e in enumerate(spec))))
