"""The differentiable attention core: a custom_vjp whose residuals are (q, k, v, o, lse).

The backward pass recomputes the softmax from the saved LSE inside the kernel, so no T×S tensor
exists in either direction. The LSE output is differentiable: its cotangent enters the backward
kernel as D = rowsum(dO∘O) − dLSE.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from .primitives import attention_bwd_p, attention_fwd_p


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def attention_core(q, k, v, scale, is_causal, implementation):
    """(o, lse) for q BTNH, k BSKH, v BSKHv; lse float32 BTN, natural log."""
    return tuple(attention_fwd_p.bind(q, k, v, scale=scale, is_causal=is_causal,
                                      implementation=implementation))


def _fwd(q, k, v, scale, is_causal, implementation):
    o, lse = attention_fwd_p.bind(q, k, v, scale=scale, is_causal=is_causal,
                                  implementation=implementation)
    return (o, lse), (q, k, v, o, lse)


def _bwd(scale, is_causal, implementation, residuals, cotangents):
    q, k, v, o, lse = residuals
    do, dlse = cotangents
    do = jnp.asarray(do, dtype=o.dtype)
    dlse = jnp.asarray(dlse, dtype=jnp.float32)
    dq, dk, dv = attention_bwd_p.bind(q, k, v, o, lse, do, dlse, scale=scale,
                                      is_causal=is_causal, implementation=implementation)
    return dq, dk, dv


attention_core.defvjp(_fwd, _bwd)


def attention(q, k, v, scale, is_causal, implementation):
    """attention_core, with empty problems answered here so kernels only see non-empty ones.

    With no keys (S == 0) every row sees nothing: out = 0, lse = -inf, zero gradients.
    """
    B, T, N, _ = q.shape
    S = k.shape[1]
    if B * T * N == 0 or S == 0:
        out = jnp.zeros((B, T, N, v.shape[-1]), q.dtype)
        lse = jnp.full((B, T, N), -jnp.inf, jnp.float32)
        return out, lse  # gradients of q, k, v are zeros: nothing here depends on them
    return attention_core(q, k, v, scale, is_causal, implementation)
