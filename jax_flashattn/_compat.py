"""Every JAX-internal name this package uses, in one place, with shims across JAX versions.

jax_flashattn supports jax >= 0.6. Public homes are preferred; a private `jax._src` import is a
last resort and lives only here.
"""
from __future__ import annotations

from jax.extend.core import Primitive  # noqa: F401  (jax >= 0.4.36)
from jax.interpreters import batching, mlir  # noqa: F401

try:  # jax.core.ShapedArray is the public name through the 0.x series.
    from jax.core import ShapedArray  # noqa: F401
except ImportError:  # pragma: no cover - future versions
    from jax._src.core import ShapedArray  # noqa: F401

# The batch dim of an operand vmap does not map (jax._src.interpreters.batching.not_mapped).
not_mapped = None

# Eager evaluation of a primitive: compile it alone and run it (what jax's own primitives do).
from jax._src.dispatch import apply_primitive  # noqa: E402,F401
