"""The native entry point, `flash_attention`."""
from __future__ import annotations

import jax.numpy as jnp

from . import _options, _validate
from .autodiff import attention


def flash_attention(query, key, value, *, scale=None, is_causal=False, return_lse=False,
                    implementation=None, bias=None, mask=None, query_seq_lengths=None,
                    key_value_seq_lengths=None, local_window_size=None,
                    causal_alignment="top_left", q_segment_ids=None, kv_segment_ids=None,
                    softcap=None, alibi_slopes=None, dropout_rate=0.0, dropout_rng=None,
                    deterministic=False):
    """Exact softmax attention, computed blockwise (FlashAttention-2) without a T×S buffer.

    Args:
      query: [B, T, N, H] or unbatched [T, N, H]; float32, float16 or bfloat16.
      key: [B, S, K, H] (or [S, K, H]); N must be a multiple of K (MHA, GQA, MQA), both >= 1.
      value: [B, S, K, Hv] (or [S, K, Hv]).
      scale: softmax scale applied to q·k; default 1/sqrt(H). A static Python float.
      is_causal: query i attends to keys j <= i (j <= i + S - T with causal_alignment
        'bottom_right').
      return_lse: also return the log-sum-exp of the final logits, float32 [B, T, N]
        (natural log). It is differentiable: its cotangent flows into q, k and bias.
      implementation: None (the best kernel for the device the computation runs on),
        'cpu' or 'cuda' (fail if the computation is placed elsewhere).
      bias: float array broadcastable to [B, N, T, S] (any axis may be 1; rank < 4 is
        right-aligned), added to the scaled (and soft-capped) logits. Differentiable: its
        gradient has its shape. Never expanded to T×S when smaller.
      mask: bool array broadcastable to [B, N, T, S] (True = attend), or a PackedMask
        (jax_flashattn.pack_mask, block_mask) with T and S of this call, broadcast over B and N
        alike. Every kernel reads masks bit-packed (a boolean one is packed inside the call), skips
        the tiles its summaries mark empty and tests no element of those marked full.
      query_seq_lengths, key_value_seq_lengths: int32 [B]: valid lengths, padding at the end;
        negative values are a ValueError where known at trace time (traced ones count as 0).
      local_window_size: int w or (left, right): query at position p sees keys in
        [p - left, p + right] (jax.nn's meaning); with is_causal, the intersection.
      causal_alignment: 'top_left' (query i at position i) or 'bottom_right' (query i at
        position i + S - T, with S and T the valid lengths of each batch element). Positions
        the causal mask, the window and ALiBi alike.
      q_segment_ids, kv_segment_ids: int32 [B, T] and [B, S] (given together): packed
        sequences; a query sees a key only if their ids are equal.
      softcap: float > 0: logits ← softcap · tanh(logits / softcap) after scaling, before bias
        and masks.
      alibi_slopes: float [N] or [B, N]: adds -slope · |pos_q - pos_k| to the logits.
        Differentiable (learned slopes): d(slope) = -Σ d(logit) · |pos_q - pos_k|.
      dropout_rate: static float in [0, 1): dropout on the attention probabilities, with
        dropout_rng (a JAX PRNG key, may be traced). The mask is a pure function of the key and
        the (batch, head, query, key) coordinates (jax_flashattn.dropout), never stored; an
        element is dropped with probability floor(rate · 2^16) / 2^16 (16-bit uniforms), kept
        ones are scaled by 1 / (1 - rate).
      deterministic: require bitwise reproducible gradients (the CPU backward always is).

    Returns:
      out [B, T, N, Hv] in the query dtype, or (out, lse) with return_lse=True.

    Query rows that see no key (fully masked) give out = 0 and lse = -inf, with zero gradients.
    """
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    _validate.check_qkv(query, key, value)
    scale = _validate.check_scale(scale, query.shape[-1])
    implementation = _validate.check_implementation(implementation)

    unbatched = query.ndim == 3
    if unbatched:
        query, key, value = query[None], key[None], value[None]
    config, extras = _options.canonicalize(
        query.shape, unbatched, k_len=key.shape[1], is_causal=is_causal, bias=bias, mask=mask,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, causal_alignment=causal_alignment,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, softcap=softcap,
        alibi_slopes=alibi_slopes, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
        deterministic=deterministic)
    out, lse = attention(query, key, value, scale, config, extras, implementation)
    if unbatched:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out
