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

Inputs may have several leading batch axes, as Flax allows ([batch..., T, N, H]): they are folded
into one for the kernels and unfolded in the output, masks and biases with them (a mask or bias
broadcast over every batch axis stays unexpanded). Masks and biases broadcastable to
[batch..., N, T, S] are passed to the kernels as they are. Masks may have any dtype, as in Flax's own attention (nonzero = attend: `make_causal_mask`
gives float32), or be a jax_flashattn.PackedMask. Dropout (dropout_rate > 0 and not
deterministic) uses jax_flashattn's Philox stream keyed by Flax's dropout_rng: the same rate and
scaling as Flax, a different random mask, drawn per (batch, head) whatever broadcast_dropout says.

`sow_weights=True` asks for the T x S attention weights, which jax_flashattn never forms: Flax's
own attention then runs the call and sows them (only without jax_flashattn's own keywords).
"""
from __future__ import annotations

import math

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
    ours = {name: value for name, value in keywords.items()
            if name in _FLASH_KEYWORDS}
    if module is not None:  # sow_weights=True
        return _flax_attention_sowing_weights(
            query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate, deterministic,
            dtype, precision, module, is_causal, implementation, ours)
    if mask is not None and not isinstance(mask, PackedMask):
        mask = jnp.asarray(mask)
        mask = mask if mask.dtype == jnp.bool_ else mask != 0
    if dtype is None:
        dtype = jnp.result_type(query, key, value)
    query, key, value = (jnp.asarray(x).astype(dtype) for x in (query, key, value))
    batch_shape = query.shape[:-3]
    if len(batch_shape) > 1:
        query, key, value = (x.reshape((math.prod(batch_shape),) + x.shape[-3:]) for x in (query, key, value))
        bias, mask = (_fold_batch_axes(x, batch_shape) for x in (bias, mask))
    rate = 0.0 if deterministic else float(dropout_rate)
    out = flash_attention(query, key, value, bias=bias, mask=mask, is_causal=is_causal,
                          implementation=implementation, dropout_rate=rate,
                          dropout_rng=dropout_rng if rate > 0 else None, **ours)
    return out.reshape(batch_shape + out.shape[-3:]) if len(batch_shape) > 1 else out


def _fold_batch_axes(x, batch_shape):
    """A mask or bias [batch..., N|1, T|1, S|1] (right-aligned, as Flax broadcasts it) for the
    kernels' one batch axis: unexpanded where it is broadcast over every batch axis."""
    if x is None:
        return None
    if isinstance(x, PackedMask):
        raise ValueError(f"attention_fn: a PackedMask takes one batch axis; with batch axes {batch_shape} "
                         "pass a boolean mask [batch..., N, T, S]")
    x = jnp.asarray(x)
    if x.ndim <= 3:
        return x
    lead = (1,) * (len(batch_shape) + 3 - x.ndim) + x.shape[:-3]
    if math.prod(lead) == 1:
        return x.reshape((1,) + x.shape[-3:])
    x = jnp.broadcast_to(x.reshape(lead + x.shape[-3:]), batch_shape + x.shape[-3:])
    return x.reshape((math.prod(batch_shape),) + x.shape[-3:])


def _flax_attention_sowing_weights(query, key, value, bias, mask, broadcast_dropout, dropout_rng,
                                   dropout_rate, deterministic, dtype, precision, module, is_causal,
                                   implementation, ours):
    """Flax's own attention for a module that sows its weights: they are the T x S matrix."""
    if ours or implementation is not None or isinstance(mask, PackedMask):
        given = sorted(ours) + (["implementation"] if implementation is not None else []) + (
            ["mask=PackedMask"] if isinstance(mask, PackedMask) else [])
        raise ValueError("attention_fn: sow_weights=True runs Flax's own attention (the weights are "
                         f"the T x S matrix jax_flashattn never forms), which takes none of {given}")
    from flax import nnx  # noqa: PLC0415 (Flax is optional for the package)
    args = (query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate, deterministic,
            dtype, precision, module)
    if isinstance(module, nnx.Module):
        return nnx.dot_product_attention(*args, is_causal=is_causal)
    from flax import linen  # noqa: PLC0415
    if is_causal:  # linen's attention has no is_causal: the top-left causal mask, as flash_attention's
        T, S = query.shape[-3], key.shape[-3]
        causal = jnp.tril(jnp.ones((T, S), bool))
        mask = causal if mask is None else jnp.logical_and(jnp.asarray(mask) != 0, causal)
        args = args[:4] + (mask,) + args[5:]
    return linen.dot_product_attention(*args)


_FLASH_KEYWORDS = ("scale", "query_seq_lengths", "key_value_seq_lengths", "local_window_size",
                   "causal_alignment", "q_segment_ids", "kv_segment_ids", "softcap",
                   "alibi_slopes")
