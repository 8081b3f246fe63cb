"""Flax adapters: use jax_flashattn as the attention of flax.nnx / flax.linen MultiHeadAttention.

    import flax.nnx as nnx, jax_flashattn.flax as jfa_flax
    mha = nnx.MultiHeadAttention(num_heads=8, in_features=512, decode=False, rngs=nnx.Rngs(0),
                                 attention_fn=jfa_flax.attention_fn)

Flax calls `attention_fn(query, key, value, bias=None, mask=None, ..., dropout_rate, deterministic,
dtype, precision, module)` with BTNH inputs. Causal attention: flax.nnx passes its own
`is_causal` (`mha(x, is_causal=True)`); for flax.linen, which does not, give the module
`functools.partial(attention_fn, is_causal=True)` instead of a causal mask. This adapter runs jax_flashattn for the cases it
supports and says clearly what it does not (masks and dropout arrive with the masking issue).
"""
from __future__ import annotations

import jax.numpy as jnp

from .attention import flash_attention


def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                 dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                 precision=None, module=None, *, is_causal=False, implementation=None, **unused):
    """A `flax.nnx.dot_product_attention`-compatible attention function (no mask/bias/dropout)."""
    del broadcast_dropout, dropout_rng, precision, module, unused
    if bias is not None:
        raise NotImplementedError("jax_flashattn.flax.attention_fn: bias is not supported yet")
    if mask is not None:
        raise NotImplementedError(
            "jax_flashattn.flax.attention_fn: mask is not supported yet; for causal attention "
            "use functools.partial(attention_fn, is_causal=True) instead of a causal mask")
    if dropout_rate > 0.0 and not deterministic:
        raise NotImplementedError("jax_flashattn.flax.attention_fn: dropout is not supported yet")
    if dtype is not None:
        query, key, value = (x.astype(dtype) for x in (query, key, value))
    else:
        dtype = jnp.result_type(query, key, value)
        query, key, value = (x.astype(dtype) for x in (query, key, value))
    return flash_attention(query, key, value, is_causal=is_causal, implementation=implementation)
