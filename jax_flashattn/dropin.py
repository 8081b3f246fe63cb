"""`dot_product_attention`: a drop-in for `jax.nn.dot_product_attention`, on our kernels.

Same names, order, shapes, dtypes and gradients as jax.nn. implementation='xla' or 'cudnn' hands
the call to jax.nn unchanged (for A/B comparisons in one line); None, 'cpu' or 'cuda' run
jax_flashattn. bias, mask, query_seq_lengths, key_value_seq_lengths and local_window_size have
jax.nn's meaning (the mask boolean, as jax.nn requires, or a jax_flashattn.PackedMask);
jax_flashattn's other keywords (causal_alignment, segment ids, softcap, ALiBi, dropout,
deterministic) follow as extra keyword-only arguments with flash_attention's meaning.
One deliberate difference: a query row with no key to attend to gives 0, where jax.nn averages
all values (rows beyond query_seq_lengths are 0 in both); its residual (return_residual=True)
is -inf, where jax.nn's is a large negative finite number.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from . import _options, _validate
from .autodiff import attention
from .masks import PackedMask

# Captured at import so that the pass-through still reaches jax.nn when a program has swapped
# jax.nn.dot_product_attention for this function.
_jax_nn_dot_product_attention = jax.nn.dot_product_attention

def _ensure_4d(x):
    x = jnp.asarray(x)
    return x.reshape((1,) * (4 - x.ndim) + x.shape) if x.ndim < 4 else x


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size=None, implementation=None, return_residual=False,
                          causal_alignment="top_left", q_segment_ids=None, kv_segment_ids=None,
                          softcap=None, alibi_slopes=None, dropout_rate=0.0, dropout_rng=None,
                          deterministic=False):
    """Scaled dot-product attention with `jax.nn.dot_product_attention`'s exact interface.

    query BTNH|TNH, key/value BSKH|SKH (same shape), N % K == 0. Returns the output in the
    query's shape, or (output, residual) with return_residual=True, where the residual is the
    log-sum-exp of the scaled logits in the key's dtype with a stopped gradient, shape BTN|TN
    (as jax.nn). See jax.nn.dot_product_attention for the arguments, and flash_attention for
    the keyword-only ones after return_residual.
    """
    if implementation in ("xla", "cudnn"):
        ours_only = {"causal_alignment": causal_alignment != "top_left",
                     "q_segment_ids": q_segment_ids is not None,
                     "kv_segment_ids": kv_segment_ids is not None, "softcap": softcap is not None,
                     "alibi_slopes": alibi_slopes is not None, "dropout_rate": dropout_rate != 0.0,
                     "deterministic": bool(deterministic)}
        used = [name for name, given in ours_only.items() if given]
        if isinstance(mask, PackedMask):
            used.append("mask (a PackedMask)")
        if used:
            raise ValueError(f"{', '.join(used)}: jax_flashattn keywords that jax.nn "
                             f"(implementation={implementation!r}) does not have")
        # return_residual only when asked: jax releases before 0.7 do not have the argument.
        extra = {"return_residual": True} if return_residual else {}
        return _jax_nn_dot_product_attention(
            query, key, value, bias, mask, scale=scale, is_causal=is_causal,
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=local_window_size, implementation=implementation, **extra)
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
    # jax.nn's dtype rules, with its ValueError (flash_attention's own checks raise TypeError).
    if mask is not None and not isinstance(mask, PackedMask) and jnp.result_type(mask) != jnp.bool_:
        raise ValueError(f"mask dtype should be bool, but got {jnp.result_type(mask)} (mask shape "
                         f"{jnp.shape(mask)}; a PackedMask is also accepted)")
    for name, lengths in (("query_seq_lengths", query_seq_lengths),
                          ("key_value_seq_lengths", key_value_seq_lengths)):
        if lengths is not None and jnp.result_type(lengths) != jnp.int32:
            raise ValueError(f"{name} dtype should be int32, but got {jnp.result_type(lengths)} "
                             f"(shape {jnp.shape(lengths)})")
    scale = _validate.check_scale(scale, H)
    # jax.nn's rank-4 requirement for bias and mask (after its own expansion of lower ranks).
    bias = None if bias is None else _ensure_4d(bias)
    mask = mask if mask is None or isinstance(mask, PackedMask) else _ensure_4d(mask)
    config, extras = _options.canonicalize(
        q.shape, False, k_len=S, is_causal=bool(is_causal), bias=bias, mask=mask,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, causal_alignment=causal_alignment,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, softcap=softcap,
        alibi_slopes=alibi_slopes, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
        deterministic=deterministic)
    out, lse = attention(q, k, v, scale, config, extras, implementation)
    out = out.reshape(output_shape)
    if return_residual:
        residual = jax.lax.stop_gradient(lse.astype(k.dtype)).reshape(output_shape[:-1])
        return out, residual
    return out


