"""A pure-jnp float32 reference of exactly what the kernels compute (T×S memory: tests only)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def attention_reference(query, key, value, *, scale=None, is_causal=False):
    """(out, lse) in float32 for q BTNH, k BSKH, v BSKHv (GQA by head grouping).

    Rows with no visible key give out = 0 and lse = -inf, as the kernels do.
    """
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (query, key, value))
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(H) if scale is None else scale
    qg = q.reshape(B, T, K, N // K, H)
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k, precision="highest") * scale
    visible = jnp.ones((T, S), bool)
    if is_causal:
        visible = jnp.arange(S)[None, :] <= jnp.arange(T)[:, None]
    logits = jnp.where(visible, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    lse = jnp.log(denom) + m
    p = p / jnp.where(denom == 0, 1.0, denom)
    out = jnp.einsum("bkgts,bskh->btkgh", p, v, precision="highest")
    out = out.reshape(B, T, N, v.shape[-1])
    lse = jnp.moveaxis(lse[..., 0].reshape(B, N, T), 1, 2)
    return out, lse
