"""Flax adapters: use jax_flashattn as the attention of flax.nnx / flax.linen MultiHeadAttention.

    import flax.nnx as nnx, jax_flashattn.flax as jfa_flax
    mha = nnx.MultiHeadAttention(num_heads=8, in_features=512, decode=False, rngs=nnx.Rngs(0),
                                 attention_fn=jfa_flax.attention_fn)

Flax calls `attention_fn(query, key, value, bias=None, mask=None, ..., dropout_rate, deterministic,
dtype, precision, module)` with BTNH inputs. Causal attention: flax.nnx passes its own
`is_causal` (`mha(x, is_causal=True)`); for flax.linen, which does not, give the module
`functools.partial(attention_fn, is_causal=True)` instead of a causal mask (a causal mask works
too, but is_causal also skips the masked tiles). Other jax_flashattn keywords (softcap,
alibi_slopes, local_window_size, ...) can be bound the same way with functools.partial.

Masks and biases of rank <= 4, broadcastable to [B, N, T, S], are passed to the kernels as they
are. Masks may have any dtype, as in Flax's own attention (nonzero = attend: `make_causal_mask`
gives float32), or be a jax_flashattn.PackedMask. Dropout (dropout_rate > 0 and not
deterministic) uses jax_flashattn's Philox stream keyed by Flax's dropout_rng: the same rate and
scaling as Flax, a different random mask, drawn per (batch, head) whatever broadcast_dropout says.
"""
from __future__ import annotations

import jax.numpy as jnp

from .attention import flash_attention
from .masks import PackedMask


def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                 dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                 precision=None, module=None, *, is_causal=False, implementation=None, **keywords):
    """A `flax.nnx.dot_product_attention`-compatible attention function on jax_flashattn.

    keywords: flash_attention's own keywords (bind them with functools.partial); anything else
    Flax may pass in the future is ignored.
    """
    del broadcast_dropout, precision, module
    ours = {name: value for name, value in keywords.items()
            if name in _FLASH_KEYWORDS}
    if mask is not None and not isinstance(mask, PackedMask):
        mask = jnp.asarray(mask)
        mask = mask if mask.dtype == jnp.bool_ else mask != 0
    if dtype is None:
        dtype = jnp.result_type(query, key, value)
    query, key, value = (x.astype(dtype) for x in (query, key, value))
    rate = 0.0 if deterministic else float(dropout_rate)
    return flash_attention(query, key, value, bias=bias, mask=mask, is_causal=is_causal,
                           implementation=implementation, dropout_rate=rate,
                           dropout_rng=dropout_rng if rate > 0 else None, **ours)


_FLASH_KEYWORDS = ("scale", "query_seq_lengths", "key_value_seq_lengths", "local_window_size",
                   "causal_alignment", "q_segment_ids", "kv_segment_ids", "softcap",
                   "alibi_slopes")
