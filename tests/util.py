"""Shared test helpers: fresh random inputs, the float32 reference, relative errors."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_flashattn.reference import attention_reference

# Relative-error bounds against the float32 reference (DESIGN.md): forward, gradients.
BOUNDS = {jnp.float32: (1e-5, 4e-5), jnp.float16: (3e-3, 1.2e-2), jnp.bfloat16: (2e-2, 8e-2)}


def fresh_seed() -> int:
    """A new seed each run (never the same inputs twice); failures print it."""
    return int.from_bytes(os.urandom(4), "little")


def random_qkv(seed, B, T, S, N, K, H, Hv=None, dtype=jnp.float32):
    Hv = H if Hv is None else Hv
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    shapes = ((B, T, N, H), (B, S, K, H), (B, S, K, Hv))
    return tuple(jax.random.normal(key, shape, jnp.float32).astype(dtype)
                 for key, shape in zip((kq, kk, kv), shapes))


def rel_err(x, ref) -> float:
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    assert x.shape == ref.shape, (x.shape, ref.shape)
    assert np.all(np.isfinite(x)), "non-finite values in the result"
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def reference_with_grads(q, k, v, do, dlse, *, scale=None, is_causal=False):
    """Float32 reference (out, lse) and the gradients of <out, do> + <lse, dlse>."""
    up = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731

    def f(q, k, v):
        return attention_reference(q, k, v, scale=scale, is_causal=is_causal)

    (out, lse), vjp = jax.vjp(f, up(q), up(k), up(v))
    return out, lse, vjp((up(do), up(dlse)))
