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
into one for the kernels and unfolded in the output, masks, biases and bound per-batch keywords
(lengths, segment ids, ALiBi slopes [batch..., N]) with them (a mask or bias broadcast over every
batch axis stays unexpanded). Masks and biases broadcastable to
[batch..., N, T, S] are passed to the kernels as they are. Masks may have any dtype, as in Flax's
own attention (nonzero = attend: `make_causal_mask` gives float32), or be a
jax_flashattn.PackedMask. A query row whose mask lets it see no key gives 0, where Flax's
attention averages all the values. Dropout (dropout_rate > 0 and not
deterministic) uses jax_flashattn's Philox stream keyed by Flax's dropout_rng: the same rate and
scaling as Flax, a different random mask, drawn per (batch, head) whatever broadcast_dropout says.

Some calls run on Flax's own attention instead (only without jax_flashattn's own keywords):
`sow_weights=True`, which asks for the T x S attention weights that jax_flashattn never forms (Flax
sows them); dtypes other than float32, float16 and bfloat16 (float64 under jax_enable_x64,
complex64; nnx's and linen's modules each get their own, which differ), which the kernels do not
take; and linen's custom einsums (`qk_attn_weights_einsum_cls`,
`attn_weights_value_einsum_cls`, e.g. AQT's quantized ones). `precision` is not used by the kernels
(nor by Flax's own attention on its jax.nn path); `force_fp32_for_softmax` holds anyway, the
kernels' softmax being float32. Shape errors carry Flax's messages. In decode mode (a KV cache)
Flax passes a mask over the cache's filled rows, which the kernels take as any mask; for long
caches prefer the cache of docs/decoding.md.
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from .attention import flash_attention
from .masks import PackedMask


def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                 dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                 precision=None, module=None, *, is_causal=False, implementation=None,
                 promote_dtype=None, force_fp32_for_softmax=None, einsum_dot_general=None,
                 qk_attn_weights_einsum=None, attn_weights_value_einsum=None, **keywords):
    """A `flax.nnx.dot_product_attention`-compatible attention function on jax_flashattn.

    promote_dtype: as nnx's (casts query, key, value first). force_fp32_for_softmax,
    einsum_dot_general, qk_attn_weights_einsum, attn_weights_value_einsum: as linen's; the kernels
    always take the softmax in float32, and custom einsums run Flax's own attention.
    keywords: flash_attention's own keywords (bind them with functools.partial); anything else
    Flax may pass in the future is ignored.
    """
    ours = {name: value for name, value in keywords.items()
            if name in _FLASH_KEYWORDS}
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    _check_shapes(query, key, value)
    if promote_dtype is not None:
        query, key, value = promote_dtype((query, key, value), dtype=dtype)
        dtype = query.dtype
    if dtype is None:
        dtype = jnp.result_type(query, key, value)
    einsums = {name: fn for name, fn in (("einsum_dot_general", einsum_dot_general),
                                         ("qk_attn_weights_einsum", qk_attn_weights_einsum),
                                         ("attn_weights_value_einsum", attn_weights_value_einsum))
               if fn is not None}
    reason = ("sow_weights=True (the weights are the T x S matrix jax_flashattn never forms)"
              if module is not None else
              f"{sorted(einsums)} (the kernels run their own products)" if einsums else
              f"{jnp.dtype(dtype).name} (the kernels take float32, float16 and bfloat16)"
              if jnp.dtype(dtype) not in _KERNEL_DTYPES else None)
    if reason is not None:
        return _flax_own_attention(
            reason, query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
            deterministic, dtype, precision, module, is_causal, implementation, ours,
            dict(einsums, force_fp32_for_softmax=force_fp32_for_softmax))
    if mask is not None and not isinstance(mask, PackedMask):
        mask = jnp.asarray(mask)
        mask = mask if mask.dtype == jnp.bool_ else mask != 0
    query, key, value = (x.astype(dtype) for x in (query, key, value))
    batch_shape = query.shape[:-3]
    if len(batch_shape) > 1:
        query, key, value = (x.reshape((math.prod(batch_shape),) + x.shape[-3:]) for x in (query, key, value))
        bias, mask = (_fold_batch_axes(x, batch_shape) for x in (bias, mask))
        ours = _fold_per_batch_keywords(ours, batch_shape)
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


# flash_attention's per-batch keywords and the axes each has after the batch: lengths [B],
# segment ids [B, T|S], ALiBi slopes [B, N].
_PER_BATCH_TRAILING_AXES = {"query_seq_lengths": 0, "key_value_seq_lengths": 0,
                            "q_segment_ids": 1, "kv_segment_ids": 1, "alibi_slopes": 1}


def _fold_per_batch_keywords(keywords, batch_shape):
    """Per-batch keywords given over Flax's batch axes ([batch..., ...], broadcastable) folded into
    the kernels' one batch axis; those given already folded, or shared ([N] slopes), as they are."""
    folded = dict(keywords)
    for name, trailing in _PER_BATCH_TRAILING_AXES.items():
        if folded.get(name) is None:
            continue
        x = jnp.asarray(folded[name])
        if x.ndim == len(batch_shape) + trailing:
            rest = x.shape[x.ndim - trailing:]
            folded[name] = jnp.broadcast_to(x, batch_shape + rest).reshape((math.prod(batch_shape),) + rest)
    return folded


def _check_shapes(query, key, value):
    """Flax's own shape checks, with its messages, so code written against Flax's errors keeps working."""
    if not query.ndim == key.ndim == value.ndim:
        raise ValueError(f"q, k, v must have same rank, but got {query.ndim}, {key.ndim}, {value.ndim}.")
    if not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
        raise ValueError(f"q, k, v batch dims must match, but got shapes {query.shape}, {key.shape}, "
                         f"{value.shape}.")
    if key.shape[-3] != value.shape[-3]:
        raise ValueError(f"k, v lengths must match, but got {key.shape[-3]} and {value.shape[-3]}.")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"q, k depths must match, but got {query.shape[-1]} and {key.shape[-1]}.")


def _flax_own_attention(reason, query, key, value, bias, mask, broadcast_dropout, dropout_rng,
                        dropout_rate, deterministic, dtype, precision, module, is_causal, implementation,
                        ours, linen_only):
    """Flax's own attention, for the calls jax_flashattn's kernels cannot serve (`reason`); a
    module passed in sows its weights. Linen's modules and linen's own arguments (`linen_only`) take
    linen's attention, the rest nnx's."""
    if ours or implementation is not None or isinstance(mask, PackedMask):
        given = sorted(ours) + (["implementation"] if implementation is not None else []) + (
            ["mask=PackedMask"] if isinstance(mask, PackedMask) else [])
        raise ValueError(f"attention_fn: {reason} runs Flax's own attention, which takes none of {given}")
    # The defining modules, not flax.nnx / flax.linen, whose dot_product_attention a user may have
    # replaced with this function.
    from flax import nnx  # noqa: PLC0415 (Flax is optional for the package)
    from flax.nnx.nn import attention as nnx_attention  # noqa: PLC0415
    args = (query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate, deterministic,
            dtype, precision, module)
    # Linen's modules always pass force_fp32_for_softmax (nnx's never do), so its presence picks
    # linen's attention, whose results (complex ones included) differ from nnx's jax.nn path.
    linen_only = {name: x for name, x in linen_only.items() if x is not None}
    if not linen_only and (module is None or isinstance(module, nnx.Module)):
        return nnx_attention.dot_product_attention(*args, is_causal=is_causal)
    from flax.linen import attention as linen_attention  # noqa: PLC0415
    if is_causal:  # linen's attention has no is_causal: the top-left causal mask, as flash_attention's
        T, S = query.shape[-3], key.shape[-3]
        causal = jnp.tril(jnp.ones((T, S), bool))
        mask = causal if mask is None else jnp.logical_and(jnp.asarray(mask) != 0, causal)
        args = args[:4] + (mask,) + args[5:]
    return linen_attention.dot_product_attention(*args, **linen_only)


_KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
_FLASH_KEYWORDS = ("scale", "query_seq_lengths", "key_value_seq_lengths", "local_window_size",
                   "causal_alignment", "q_segment_ids", "kv_segment_ids", "softcap",
                   "alibi_slopes")
