"""Every JAX-internal name this package uses, in one place, with shims across JAX versions.

jax_flashattn supports jax >= 0.8.2 (pyproject.toml says why). Public homes are preferred; a private `jax._src` import is a
last resort and lives only here.
"""
from __future__ import annotations

import jax
from jax.extend.core import Primitive  # noqa: F401  (jax >= 0.4.36)
from jax.interpreters import ad, batching, mlir  # noqa: F401

# The batch dim of an operand vmap does not map (jax._src.interpreters.batching.not_mapped).
not_mapped = None

# Eager evaluation of a primitive: compile it alone and run it (what jax's own primitives do).
from jax._src.dispatch import apply_primitive  # noqa: E402,F401

# ---- Multi-device ------------------------------------------------------------------------------

# Primitives whose lowering holds a custom_partitioning call must be lowered with their devices
# known (jax's rule for any primitive wrapping custom_partitioning).
from jax._src.dispatch import prim_requires_devices_during_lowering  # noqa: E402,F401


def varying_axes(aval) -> frozenset:
    """The manual mesh axes (inside shard_map) over which a value varies: `aval.vma` before jax
    0.10, `aval.manual_axis_type.varying` from 0.10 on; empty outside shard_map."""
    vma = getattr(aval, "vma", None)
    if vma is None:
        mat = getattr(aval, "manual_axis_type", None)
        vma = getattr(mat, "varying", None)
    return frozenset(vma or ())


def pcast_varying(x, axes):
    """x marked as varying over the manual axes `axes` (a no-op for none): `jax.lax.pcast(...,
    to='varying')` from jax 0.10, `jax.lax.pvary` before. Its transpose is a psum, which is what
    sums the gradient of a replicated operand over the devices that used it."""
    axes = tuple(axes)
    if not axes:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axes, to="varying")
    return jax.lax.pvary(x, axes)  # pragma: no cover - jax < 0.10
