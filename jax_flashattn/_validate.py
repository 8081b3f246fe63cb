"""Trace-time checks of the public arguments: every bad input raises a ValueError or TypeError
that names the argument and shows the shapes."""
from __future__ import annotations

import numbers

import numpy as np
import jax
import jax.numpy as jnp

SUPPORTED_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)
IMPLEMENTATIONS = (None, "cpu", "cuda")


def concrete(x):
    """x as a NumPy array, or None while it is traced (its values then reach only the kernels)."""
    try:
        return np.asarray(x)
    except jax.errors.TracerArrayConversionError:
        return None


def check_qkv(query, key, value):
    """Checks ranks, dtypes and shapes of q (..TNH), k (..SKH), v (..SKHv); returns the dtype."""
    ranks = (query.ndim, key.ndim, value.ndim)
    if query.ndim not in (3, 4):
        raise ValueError(f"query must be BTNH (4-D) or TNH (3-D), got shape {query.shape}")
    if ranks != (query.ndim,) * 3:
        raise ValueError(f"query, key and value must have the same rank, got shapes "
                         f"{query.shape}, {key.shape}, {value.shape}")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not any(x.dtype == d for d in SUPPORTED_DTYPES):
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key and value must have one dtype, got {query.dtype}, "
                        f"{key.dtype}, {value.dtype}")
    *qb, T, N, H = query.shape
    *kb, S, K, Hk = key.shape
    *vb, Sv, Kv, Hv = value.shape
    if qb != kb or qb != vb:
        raise ValueError(f"query, key and value must have the same batch size, got shapes "
                         f"{query.shape}, {key.shape}, {value.shape}")
    if Hk != H:
        raise ValueError(f"key head dim must equal query head dim H={H}: query {query.shape}, "
                         f"key {key.shape}")
    if (Sv, Kv) != (S, K):
        raise ValueError(f"value must match key in length and heads: key {key.shape}, "
                         f"value {value.shape}")
    if H == 0 or Hv == 0:
        raise ValueError(f"head dims must be >= 1: query {query.shape}, value {value.shape}")
    if N == 0 or K == 0:
        raise ValueError(f"query and key/value need at least one head each, got N={N} query heads and "
                         f"K={K} key/value heads: query {query.shape}, key {key.shape}")
    if N % K != 0:
        raise ValueError(f"query heads N={N} must be a multiple of key/value heads K={K}: "
                         f"query {query.shape}, key {key.shape}")
    return query.dtype


def check_scale(scale, head_dim: int) -> float:
    """The softmax scale as a Python float (default 1/sqrt(H))."""
    if scale is None:
        return float(1.0 / np.sqrt(head_dim))
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        if getattr(scale, "shape", None) == () and getattr(scale, "dtype", None) is not None \
                and jnp.issubdtype(scale.dtype, jnp.floating):
            try:
                return float(scale)
            except Exception as e:  # a traced scalar cannot become a static float
                raise TypeError(f"scale must be a static Python float, not a traced value "
                                f"({type(scale).__name__})") from e
        raise TypeError(f"scale must be a float, got {type(scale).__name__}: {scale!r}")
    scale = float(scale)
    if not np.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def check_implementation(implementation):
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    return implementation
