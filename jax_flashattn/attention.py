"""The native entry point, `flash_attention`."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from . import _validate
from .autodiff import attention


def flash_attention(query, key, value, *, scale=None, is_causal=False, return_lse=False,
                    implementation=None):
    """Exact softmax attention, computed blockwise (FlashAttention-2) without a T×S buffer.

    Args:
      query: [B, T, N, H] or unbatched [T, N, H]; float32, float16 or bfloat16.
      key: [B, S, K, H] (or [S, K, H]); N must be a multiple of K (MHA, GQA, MQA).
      value: [B, S, K, Hv] (or [S, K, Hv]).
      scale: softmax scale applied to q·k; default 1/sqrt(H). A static Python float.
      is_causal: query i attends to keys j <= i (jax.nn's top-left alignment).
      return_lse: also return the log-sum-exp of the scaled logits, float32 [B, T, N]
        (natural log). It is differentiable: its cotangent flows into q and k.
      implementation: None (the best kernel for the device the computation runs on),
        'cpu' or 'cuda' (fail if the computation is placed elsewhere).

    Returns:
      out [B, T, N, Hv] in the query dtype, or (out, lse) with return_lse=True.

    Query rows that see no key give out = 0 and lse = -inf, with zero gradients.
    """
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    _validate.check_qkv(query, key, value)
    scale = _validate.check_scale(scale, query.shape[-1])
    implementation = _validate.check_implementation(implementation)
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    is_causal = bool(is_causal)

    unbatched = query.ndim == 3
    if unbatched:
        query, key, value = query[None], key[None], value[None]
    out, lse = attention(query, key, value, scale, is_causal, implementation)
    if unbatched:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out
