"""DeepSeek-style top-k sparse attention: `sparse_attention` (each query attends only to the keys
an indexer selected) and `attn_dist` (the attention distribution over those keys, summed over
groups of query heads: the indexer's training target).

Both run as XLA FFI custom calls (C++ on the CPU, CUDA on NVIDIA GPUs); on GPUs the backward runs
on tensor-core kernels where they take the call, else as XLA's gathers and tensor-core einsums, and
on ordered CUDA-core kernels with deterministic=True. docs/sparse-attention.md describes the
semantics and what runs where.
"""
from __future__ import annotations

from functools import partial
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from . import _validate
from ._sparse_primitives import SparseConfig, attn_dist_p, sparse_bwd_p, sparse_fwd_p
from .autodiff import named_residuals, reverse_mode_only, vary_together

_ALIGNMENTS = ("top_left", "bottom_right")
_PLACEHOLDER = jnp.int32  # dtype of the rank-0 stand-in for value=None


def _check_flag(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a Python bool, got {type(value).__name__}: {value!r}")
    return bool(value)


def _check_alignment(causal_alignment):
    if causal_alignment not in _ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {_ALIGNMENTS}, got {causal_alignment!r}")
    return causal_alignment == "bottom_right"


def _check_float(name, x):
    if not any(x.dtype == d for d in _validate.SUPPORTED_DTYPES):
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype} {x.shape}")


def _check_query_key(fn, query, key):
    if query.ndim not in (3, 4):
        raise ValueError(f"{fn}: query must be [B, T, N, H] (or unbatched [T, N, H]), got shape {query.shape}")
    if key.ndim != query.ndim:
        raise ValueError(f"{fn}: key must have the rank of query ([B, S, K, H] or [S, K, H]), got query "
                         f"{query.shape}, key {key.shape}")
    _check_float("query", query)
    _check_float("key", key)
    if key.dtype != query.dtype:
        raise TypeError(f"{fn}: query and key must have one dtype, got {query.dtype}, {key.dtype}")
    *qb, T, N, H = query.shape
    *kb, S, K, Hk = key.shape
    if qb != kb:
        raise ValueError(f"{fn}: query and key must have the same batch size, got {query.shape}, {key.shape}")
    if Hk != H or H == 0:
        raise ValueError(f"{fn}: key head dim must equal query head dim H={H} >= 1: query {query.shape}, "
                         f"key {key.shape}")
    if K == 0 or N % K != 0:
        raise ValueError(f"{fn}: query heads N={N} must be a multiple of key heads K={K}: query "
                         f"{query.shape}, key {key.shape}")


def _check_indices(fn, indices, query, key):
    """indices as int32 [..., T, K, topk]; wider integers outside [0, S) become -1 (invalid)."""
    *qb, T, _, _ = query.shape
    S, K = key.shape[-3], key.shape[-2]
    if not isinstance(indices, jax.Array):
        # Host integers are mapped before they become a JAX array, which without jax_enable_x64
        # would wrap int64 values such as 2**32 + 1 into valid keys.
        host = np.asarray(indices)
        if np.issubdtype(host.dtype, np.integer) and host.dtype != np.int32:
            host = np.where((host >= 0) & (host < S), host, -1).astype(np.int32)
        indices = jnp.asarray(host)
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise TypeError(f"{fn}: indices must be an integer array (int32), got {indices.dtype} {indices.shape}")
    if indices.ndim != query.ndim or list(indices.shape[:-1]) != qb + [T, K]:
        want = ", ".join(str(d) for d in qb + [T, K]) + ", topk"
        raise ValueError(f"{fn}: indices must be [{want}] (batch, T of query {query.shape}, K of key "
                         f"{key.shape}, then topk), got {indices.shape}")
    if indices.dtype != jnp.int32:
        indices = jnp.where((indices >= 0) & (indices < S), indices, -1).astype(jnp.int32)
    return indices


def _check_value(value, key, value_head_dim):
    """(value or None, Hv) after checking value against key and value_head_dim."""
    H = key.shape[-1]
    if value is None:
        if (not isinstance(value_head_dim, numbers.Integral) or isinstance(value_head_dim, bool)
                or not 1 <= value_head_dim <= H):
            raise ValueError(f"sparse_attention: value=None needs value_head_dim, an int in [1, H={H}] "
                             f"(V = key[..., :value_head_dim]), got {value_head_dim!r}")
        return None, int(value_head_dim)
    value = jnp.asarray(value)
    _check_float("value", value)
    if value.dtype != key.dtype:
        raise TypeError(f"sparse_attention: value must have key's dtype {key.dtype}, got {value.dtype}")
    if value.ndim != key.ndim or value.shape[:-1] != key.shape[:-1] or value.shape[-1] == 0:
        raise ValueError(f"sparse_attention: value must match key in batch, length and heads "
                         f"([..., S, K, Hv], Hv >= 1): key {key.shape}, value {value.shape}")
    if value_head_dim is not None and value_head_dim != value.shape[-1]:
        raise ValueError(f"sparse_attention: value_head_dim={value_head_dim!r} differs from value's head dim: "
                         f"value {value.shape} (pass value_head_dim only with value=None)")
    return value, value.shape[-1]


def sparse_attention(query, key, value, indices, *, scale=None, is_causal=False,
                     causal_alignment="bottom_right", value_head_dim=None, return_lse=False,
                     deterministic=False):
    """Top-k sparse attention (DeepSeek's DSA): query t attends only to the keys `indices` selects.

    Args:
      query: [B, T, N, H] or unbatched [T, N, H]; float32, float16 or bfloat16.
      key: [B, S, K, H] (or [S, K, H]); N must be a multiple of K (MHA, GQA, MQA).
      value: [B, S, K, Hv], or None with `value_head_dim=Hv`: V = key[..., :Hv] (MLA's shared
        latent: one buffer, never copied; both gradients then land in key's).
      indices: int32 [B, T, K, topk]: the keys that the N/K query heads of each key/value head
        attend to at each query position. An index < 0 or >= S, or (with is_causal) after the
        query's position, is invalid and contributes nothing (pad with -1). Repeated indices
        count as often as they appear (gather, then softmax). Other integer dtypes are converted,
        out-of-range values becoming -1.
      scale: softmax scale, a static float; default 1/sqrt(H).
      is_causal: a selected key after the query's position is invalid.
      causal_alignment: 'bottom_right' (default: query t at position t + S - T, as when the
        queries are the last T of S tokens) or 'top_left' (query t at position t).
      value_head_dim: Hv when value is None.
      return_lse: also return the float32 natural-log LSE [B, T, N] (differentiable).
      deterministic: bitwise reproducible gradients: the scatter of dK/dV into the selected rows
        is summed in a fixed order (the CPU backward always is).

    Returns:
      out [B, T, N, Hv] in the query dtype, or (out, lse). A query with no valid index gives
      out = 0 and lse = -inf, with zero gradients.

    Differentiable in query, key and value (custom_vjp from the saved LSE); jit, vmap (any
    in_axes) and grad work. CPU: float32, float16, bfloat16 (float32 arithmetic). GPU: a
    tensor-core forward for float16/bfloat16 with H, Hv multiples of 8 up to 576/512 (CUDA cores
    otherwise); the backward on tensor-core kernels for the same calls where the device's shared
    memory holds their tiles, else as XLA gathers and einsums (JFA_SPARSE_BACKWARD=kernel or xla
    forces one), or with deterministic=True a CUDA-core kernel (docs/sparse-attention.md).
    """
    query, key = jnp.asarray(query), jnp.asarray(key)
    _check_query_key("sparse_attention", query, key)
    value, Hv = _check_value(value, key, value_head_dim)
    indices = _check_indices("sparse_attention", indices, query, key)
    config = SparseConfig(scale=_validate.check_scale(scale, query.shape[-1]),
                          is_causal=_check_flag("is_causal", is_causal),
                          bottom_right=_check_alignment(causal_alignment), value_head_dim=Hv,
                          deterministic=_check_flag("deterministic", deterministic))
    _check_flag("return_lse", return_lse)
    unbatched = query.ndim == 3
    if unbatched:
        query, key, indices = query[None], key[None], indices[None]
        value = None if value is None else value[None]
    out, lse = _sparse_attention(query, key, value, indices, config)
    if unbatched:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out


def _sparse_attention(q, k, v, indices, config):
    B, T, N, _ = q.shape
    if B * T * N * indices.shape[-1] == 0 or k.shape[1] == 0:  # nothing is selected anywhere
        return (jnp.zeros((B, T, N, config.value_head_dim), q.dtype),
                jnp.full((B, T, N), -jnp.inf, jnp.float32))
    # Inside shard_map: operands marked varying alike, so each gradient has its primal's type.
    q, k, v, indices = vary_together(q, k, v, indices)
    return _sparse_core(q, k, v, indices, config)


def _value_operand(v):
    return jnp.zeros((), _PLACEHOLDER) if v is None else v


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _sparse_core(q, k, v, indices, config):
    return tuple(sparse_fwd_p.bind(q, k, _value_operand(v), indices, config=config))


def _sparse_fwd(q, k, v, indices, config):
    o, lse = named_residuals(*sparse_fwd_p.bind(q, k, _value_operand(v), indices, config=config))
    return (o, lse), (q, k, v, indices, o, lse)


def _sparse_bwd(config, residuals, cotangents):
    q, k, v, indices, o, lse = residuals
    do, dlse = cotangents
    do = jnp.asarray(do, dtype=o.dtype)
    dlse = jnp.asarray(dlse, dtype=jnp.float32)
    dq, dk, dv = sparse_bwd_p.bind(q, k, _value_operand(v), indices, o, lse, do, dlse, config=config)
    return dq, dk, (None if v is None else dv), None


_sparse_core.defvjp(_sparse_fwd, _sparse_bwd)
reverse_mode_only(sparse_fwd_p, sparse_bwd_p)


def _check_lse_base(lse_base):
    if lse_base in ("e", "2", 2):
        return "e" if lse_base == "e" else "2"
    raise ValueError(f"attn_dist: lse_base must be 'e' (natural log) or 2 (log2, FlashMLA's first "
                     f"releases), got {lse_base!r}")


def attn_dist(query, key, indices, lse, *, scale=None, head_group=64, lse_base="e", is_causal=False,
              causal_alignment="bottom_right"):
    """The attention distribution over the selected keys, summed over groups of query heads: the
    target of DeepSeek's indexer loss.

    dist[b, g, t, j] = sum over heads n in group g (heads g·head_group ... (g+1)·head_group − 1) of
    exp(scale · q[b, t, n]·key[b, indices[b, t, n // (N/K), j]] − lse[b, t, n]).

    Args:
      query: [B, T, N, H] or unbatched [T, N, H]; key: [B, S, K, H]; indices: int32
        [B, T, K, topk], as for sparse_attention (the same validity rule: invalid slots give 0).
      lse: float [B, T, N]: the LSE of the attention these probabilities belong to (the main
        attention's, e.g. sparse_attention(..., return_lse=True)); rows where it is -inf give 0.
      scale: the softmax scale of that attention; default 1/sqrt(H).
      head_group: heads summed together (DeepSeek: 64); must divide N.
      lse_base: 'e' (natural log, jax_flashattn's) or 2 (FlashMLA's first releases:
        exp2(scale·log2(e)·q·k − lse)).
      is_causal, causal_alignment: as for sparse_attention.

    Returns:
      float32 [B, N // head_group, T, topk] (unbatched: [N // head_group, T, topk]).

    No gradient: it is a training target, so its inputs are treated as constants
    (jax.lax.stop_gradient); differentiate the indexer's side of the loss instead.
    """
    query, key = jnp.asarray(query), jnp.asarray(key)
    _check_query_key("attn_dist", query, key)
    indices = _check_indices("attn_dist", indices, query, key)
    lse = jnp.asarray(lse)
    if lse.shape != query.shape[:-1] or not jnp.issubdtype(lse.dtype, jnp.floating):
        raise ValueError(f"attn_dist: lse must be float [..., T, N] = {query.shape[:-1]} (query "
                         f"{query.shape}), got {lse.dtype} {lse.shape}")
    N = query.shape[-2]
    if (not isinstance(head_group, numbers.Integral) or isinstance(head_group, bool) or head_group < 1
            or N % head_group != 0):
        raise ValueError(f"attn_dist: head_group must be an int >= 1 that divides the query heads N={N} "
                         f"(query {query.shape}), got {head_group!r}")
    scale = _validate.check_scale(scale, query.shape[-1])
    bottom_right = _check_alignment(causal_alignment)
    is_causal = _check_flag("is_causal", is_causal)
    lse = lse.astype(jnp.float32)
    if _check_lse_base(lse_base) == "2":
        lse = lse * np.float32(np.log(2.0))
    query, key, lse = (jax.lax.stop_gradient(x) for x in (query, key, lse))
    unbatched = query.ndim == 3
    if unbatched:
        query, key, indices, lse = query[None], key[None], indices[None], lse[None]
    B, T, _, _ = query.shape
    topk = indices.shape[-1]
    if B * T * N * topk == 0 or key.shape[1] == 0:
        dist = jnp.zeros((B, N // head_group, T, topk), jnp.float32)
    else:
        dist = attn_dist_p.bind(query, key, indices, lse, scale=scale, is_causal=is_causal,
                                bottom_right=bottom_right, head_group=int(head_group))
    return dist[0] if unbatched else dist
