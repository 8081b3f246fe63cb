"""`dot_product_attention`: a drop-in for `jax.nn.dot_product_attention`, on our kernels.

Same names, order, shapes, dtypes and gradients as jax.nn. implementation='xla' or 'cudnn' hands
the call to jax.nn unchanged (for A/B comparisons in one line); None, 'cpu' or 'cuda' run
jax_flashattn. One deliberate difference: a query row with no key to attend to gives 0, where
jax.nn averages all values.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from . import _validate
from .autodiff import attention

# Captured at import so that the pass-through still reaches jax.nn when a program has swapped
# jax.nn.dot_product_attention for this function.
_jax_nn_dot_product_attention = jax.nn.dot_product_attention

_NOT_YET = ("bias", "mask", "query_seq_lengths", "key_value_seq_lengths", "local_window_size")


def _ensure_4d(x):
    x = jnp.asarray(x)
    return x.reshape((1,) * (4 - x.ndim) + x.shape) if x.ndim < 4 else x


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size=None, implementation=None, return_residual=False):
    """Scaled dot-product attention with `jax.nn.dot_product_attention`'s exact interface.

    query BTNH|TNH, key/value BSKH|SKH (same shape), N % K == 0. Returns the output in the
    query's shape, or (output, residual) with return_residual=True, where the residual is the
    log-sum-exp of the scaled logits in the key's dtype with a stopped gradient, shape BTN|TN
    (as jax.nn). See jax.nn.dot_product_attention for the arguments.
    """
    if implementation in ("xla", "cudnn"):
        # return_residual only when asked: jax releases before 0.7 do not have the argument.
        extra = {"return_residual": True} if return_residual else {}
        return _jax_nn_dot_product_attention(
            query, key, value, bias, mask, scale=scale, is_causal=is_causal,
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=local_window_size, implementation=implementation, **extra)
    given = dict(bias=bias, mask=mask, query_seq_lengths=query_seq_lengths,
                 key_value_seq_lengths=key_value_seq_lengths,
                 local_window_size=local_window_size)
    for name in _NOT_YET:
        if given[name] is not None:
            raise NotImplementedError(
                f"jax_flashattn.dot_product_attention: {name} is not supported yet; use "
                f"implementation='xla' or 'cudnn' to run jax.nn for calls with {name}")
    implementation = _validate.check_implementation(implementation)

    output_shape = jnp.shape(query)
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not 1 <= jnp.ndim(x) <= 4:
            raise ValueError(f"{name} must be BTNH or TNH (at most 4-D), got shape {jnp.shape(x)}")
    q, k, v = _ensure_4d(query), _ensure_4d(key), _ensure_4d(value)
    # jax.nn's checks, in its order and with its meaning: value must match key exactly.
    B, S, K, H = k.shape
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"value shape/dtype should be {k.shape}/{k.dtype} (the key's): but got "
                         f"{v.shape}/{v.dtype}")
    if q.shape[0] != B or q.shape[-1] != H or q.dtype != k.dtype:
        raise ValueError(f"query shape/dtype should be ({B}, T, N, {H})/{k.dtype} to match key "
                         f"{k.shape}: but got {q.shape}/{q.dtype}")
    _validate.check_qkv(q, k, v)
    scale = _validate.check_scale(scale, H)
    out, lse = attention(q, k, v, scale, bool(is_causal), implementation)
    out = out.reshape(output_shape)
    if return_residual:
        residual = jax.lax.stop_gradient(lse.astype(k.dtype)).reshape(output_shape[:-1])
        return out, residual
    return out


