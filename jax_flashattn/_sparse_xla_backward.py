"""sparse_attention's backward on CUDA GPUs as XLA operations, for deterministic=False: the CUDA
lowering of the backward primitive (per shard, inside the sharding rules and vmap's folds).

Per block of query positions: the selected key (and value) rows gathered, P recomputed from the
saved LSE, dP, dS = P∘(dP − D), then dQ = scale·dS·K, dK = scale·dSᵀ·Q and dV = Pᵀ·dO as einsums
in the input dtype with float32 accumulation (tensor cores), dK and dV scattered into float32
accumulators. The sparse backward kernel (cuda/sparse/backward.cu) runs on CUDA cores and at
DeepSeek's shapes is far slower than these tensor-core GEMMs; it stays the path of
deterministic=True, since XLA's scatter-add on a GPU adds in no fixed order.

Blocks bound the memory: the gathered rows and float32 temporaries of one block take at most
`block_bytes`.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from .sparse_reference import gather_rows, selection_valid


def _block_size(B, T, N, K, topk, H, Hv, itemsize, block_bytes):
    """Query positions per block: gathered rows, their float32 gradients and four [N, topk] float32
    arrays (logits, P, dP, dS) per position within block_bytes."""
    per_query = B * (K * topk * (H + Hv) * (itemsize + 4) + 4 * N * topk * 4)
    return max(1, min(T, block_bytes // per_query))


def _blocked(x, blocks, size, fill):
    """[B, T, ...] -> [blocks, B, size, ...], T padded with `fill` to blocks·size."""
    pad = blocks * size - x.shape[1]
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return jnp.moveaxis(x.reshape(x.shape[0], blocks, size, *x.shape[2:]), 1, 0)


def xla_backward(q, k, v, indices, o, lse, do, dlse, config, *, block_bytes=1 << 30):
    """(dq, dk, dv) of sparse_attention; dv is None when v is (V = k[..., :Hv]: dV lands in dk)."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G, topk, Hv = N // K, indices.shape[-1], config.value_head_dim
    dtype, f32 = q.dtype, jnp.float32
    # float32 inputs keep float32 products (XLA's default may round them to TF32 on a GPU).
    einsum = partial(jnp.einsum, preferred_element_type=f32,
                     precision=jax.lax.Precision.HIGHEST if dtype == f32 else None)
    delta = jnp.sum(do.astype(f32) * o.astype(f32), axis=-1) - dlse  # D = rowsum(dO∘O) − dLSE
    size = _block_size(B, T, N, K, topk, H, Hv, jnp.dtype(dtype).itemsize, block_bytes)
    blocks = -(-T // size)
    offset = S - T if config.bottom_right else 0
    batch, heads = jnp.arange(B)[:, None, None, None], jnp.arange(K)[None, None, :, None]

    def block(carry, xs):
        dk_acc, dv_acc = carry
        qb, dob, lseb, deltab, idxb, first = xs
        # Padding queries select nothing (indices -1).
        valid = selection_valid(idxb, S, is_causal=config.is_causal, positions=first + offset + jnp.arange(size))
        rows_k = gather_rows(k, idxb)
        rows_v = rows_k[..., :Hv] if v is None else gather_rows(v, idxb)
        qg, dog = qb.reshape(B, size, K, G, H), dob.reshape(B, size, K, G, Hv)
        lse_g = lseb.reshape(B, size, K, G, 1)
        live = valid[:, :, :, None, :] & jnp.isfinite(lse_g)
        logits = config.scale * einsum("btkgh,btkjh->btkgj", qg, rows_k)
        p = jnp.where(live, jnp.exp(jnp.where(live, logits - lse_g, 0.0)), 0.0)
        dp = einsum("btkgd,btkjd->btkgj", dog, rows_v)
        ds = (p * (dp - deltab.reshape(B, size, K, G, 1))).astype(dtype)
        dq = config.scale * einsum("btkgj,btkjh->btkgh", ds, rows_k)
        # Invalid slots have P = dS = 0: their rows (clipped into range) get zeros added.
        dk_rows = config.scale * einsum("btkgj,btkgh->btkjh", ds, qg)
        dv_rows = einsum("btkgj,btkgd->btkjd", p.astype(dtype), dog)
        slots = jnp.clip(idxb, 0, S - 1)
        if v is None:
            dk_rows = dk_rows + jnp.pad(dv_rows, [(0, 0)] * 4 + [(0, H - Hv)])
        else:
            dv_acc = dv_acc.at[batch, slots, heads].add(dv_rows)
        dk_acc = dk_acc.at[batch, slots, heads].add(dk_rows)
        return (dk_acc, dv_acc), dq.reshape(B, size, N, H)

    xs = (_blocked(q, blocks, size, 0), _blocked(do, blocks, size, 0), _blocked(lse, blocks, size, -jnp.inf),
          _blocked(delta, blocks, size, 0), _blocked(indices, blocks, size, -1), jnp.arange(blocks) * size)
    init = (jnp.zeros(k.shape, f32), None if v is None else jnp.zeros(v.shape, f32))
    (dk, dv), dq = jax.lax.scan(block, init, xs)
    dq = jnp.moveaxis(dq, 0, 1).reshape(B, blocks * size, N, H)[:, :T]
    return dq.astype(dtype), dk.astype(dtype), (None if v is None else dv.astype(dtype))
