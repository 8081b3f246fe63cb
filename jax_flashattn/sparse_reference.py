"""Pure-jnp float32 references of top-k sparse attention and attn_dist, written from the
definition: gather the selected rows, then a dense softmax over them (memory T·topk·H: tests only).
The row gather and the slot validity rule also serve the CUDA backward's XLA form, per block of
queries (_sparse_xla_backward.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def gather_rows(x, indices):
    """x [B, S, K, D], indices [B, T, K, topk] -> [B, T, K, topk, D] (indices clipped into range)."""
    B, S, K, _ = x.shape
    safe = jnp.clip(indices, 0, max(S - 1, 0))
    return x[jnp.arange(B)[:, None, None, None], safe, jnp.arange(K)[None, None, :, None]]


def selection_valid(indices, S, *, is_causal=False, causal_alignment="bottom_right", positions=None):
    """bool [B, T, K, topk]: in [0, S) and, when causal, not after the query's position
    (`positions` [T], or t, plus S - T when bottom-right)."""
    T = indices.shape[1]
    valid = (indices >= 0) & (indices < S)
    if is_causal:
        if positions is None:
            positions = jnp.arange(T) + (S - T if causal_alignment == "bottom_right" else 0)
        valid &= indices <= positions[None, :, None, None]
    return valid


def _logits(q, k, indices, scale):
    """float32 logits [B, T, K, G, topk] of the G query heads of each key/value head."""
    B, T, N, H = q.shape
    K = k.shape[2]
    q = jnp.asarray(q, jnp.float32).reshape(B, T, K, N // K, H)
    keys = gather_rows(jnp.asarray(k, jnp.float32), indices)
    return scale * jnp.einsum("btkgh,btkjh->btkgj", q, keys, precision=jax.lax.Precision.HIGHEST)


def sparse_attention_reference(q, k, v, indices, *, scale=None, is_causal=False,
                               causal_alignment="bottom_right", value_head_dim=None):
    """(out [B, T, N, Hv], lse [B, T, N]) in float32; v=None means V = k[..., :value_head_dim]."""
    B, T, N, H = q.shape
    K = k.shape[2]
    scale = H ** -0.5 if scale is None else scale
    v = k[..., :value_head_dim] if v is None else v
    valid = selection_valid(indices, k.shape[1], is_causal=is_causal,
                            causal_alignment=causal_alignment)[:, :, :, None, :]
    logits = _logits(q, k, indices, scale)
    m = jax.lax.stop_gradient(jnp.max(jnp.where(valid, logits, -jnp.inf), axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    # Invalid slots enter exp as m (never overflowing), then get weight 0 and zero gradient.
    e = jnp.where(valid, jnp.exp(jnp.where(valid, logits, m) - m), 0.0)
    total = jnp.sum(e, axis=-1, keepdims=True)
    seen = total > 0
    safe_total = jnp.where(seen, total, 1.0)
    lse = jnp.where(seen, jnp.log(safe_total) + m, -jnp.inf)[..., 0]
    values = gather_rows(jnp.asarray(v, jnp.float32), indices)
    out = jnp.einsum("btkgj,btkjd->btkgd", e / safe_total, values, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(B, T, N, v.shape[-1]), lse.reshape(B, T, N)


def attn_dist_reference(q, k, indices, lse, *, scale=None, head_group=64, is_causal=False,
                        causal_alignment="bottom_right"):
    """float32 [B, N // head_group, T, topk] from a natural-log lse [B, T, N]."""
    B, T, N, H = q.shape
    K = k.shape[2]
    scale = H ** -0.5 if scale is None else scale
    valid = selection_valid(indices, k.shape[1], is_causal=is_causal,
                            causal_alignment=causal_alignment)[:, :, :, None, :]
    lse = jnp.asarray(lse, jnp.float32).reshape(B, T, K, N // K, 1)
    live = valid & jnp.isfinite(lse)
    probs = jnp.where(live, jnp.exp(jnp.where(live, _logits(q, k, indices, scale) - lse, 0.0)), 0.0)
    probs = probs.reshape(B, T, N // head_group, head_group, indices.shape[-1])
    return jnp.transpose(jnp.sum(probs, axis=3), (0, 2, 1, 3))
