"""vmap rules for the attention primitives: every vmapped axis is folded into the batch axis B,
in front of it or behind it as the query's vmapped axis lies (behind: no copy, and a split of B
stays a split).

Operands with no mapped axis (in_axes=None) are broadcast along the new axis first, so any mix
of mapped and unmapped operands works; nested vmap folds one axis per level. The extra operands
(_options.Extras) fold the same way, with two exceptions: rank-0 placeholders (absent operands)
stay as they are, and a bias, mask (boolean or packed) or slope table shared by the batch
(leading axis 1) stays shared when it is not mapped — except the bias of the backward pass, which
is expanded so that d(bias) comes back per vmapped instance.

The pack-mask primitive packs each (batch, head) slice on its own: a vmapped axis folds into its
leading axis and unfolds from its results.
"""
from __future__ import annotations

import jax.numpy as jnp

from ._compat import batching, not_mapped
from ._mask_packing import pack_mask_p
from ._options import Extras
from .primitives import attention_bwd_p, attention_fwd_p

# Extras whose leading axis may be 1 (shared by the batch) rather than B.
_SHAREABLE = {Extras._fields.index(name)
              for name in ("bias", "mask", "mask_bits", "mask_tiles", "alibi_slopes")}


def fold_into_batch(a, d, size, batch, shareable, keep_shared, batch_major):
    """Operand `a` (mapped along d, or not_mapped) with the vmapped axis folded into its batch
    axis: instance-major ([size, B] merged) or, with batch_major, batch-major ([B, size] merged)."""
    if a.ndim == 0:
        return a
    if shareable and d is not_mapped and a.shape[0] == 1 and keep_shared:
        return a
    if batch_major:
        a = (jnp.broadcast_to(a[:, None], (a.shape[0], size) + a.shape[1:]) if d is not_mapped
             else jnp.moveaxis(a, d, 1))
        if shareable and a.shape[0] == 1:
            a = jnp.broadcast_to(a, (batch, size) + a.shape[2:])
        return a.reshape((a.shape[0] * size,) + a.shape[2:])
    a = jnp.broadcast_to(a, (size,) + a.shape) if d is not_mapped else jnp.moveaxis(a, d, 0)
    if shareable and a.shape[1] == 1:
        a = jnp.broadcast_to(a, (size, batch) + a.shape[2:])
    return a.reshape((size * a.shape[1],) + a.shape[2:])


def unfold_batch(size, o, batch_major):
    """A folded result back to [size, B, ...] (or [B, size, ...] batch-major)."""
    if batch_major:
        return o.reshape((o.shape[0] // size, size) + o.shape[1:])
    return o.reshape((size, o.shape[0] // size) + o.shape[1:])


def _batch_rule(prim, num_tensors):
    def rule(args, dims, **params):
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not not_mapped)
        q, qd = args[0], dims[0]
        batch = q.shape[0] if qd is not_mapped else q.shape[1 if qd == 0 else 0]
        # The fold follows the query: a vmapped axis after its batch axis (in_axes >= 1) folds
        # batch-major, so an axis right behind B folds with a reshape alone and a split of B
        # stays a split of the folded axis; a leading one (in_axes=0) folds in front of B.
        batch_major = qd is not not_mapped and qd >= 1
        out_dim = 1 if batch_major else 0
        folded = []
        for index, (a, d) in enumerate(zip(args, dims)):
            extra = index - num_tensors
            keep_shared = not (prim is attention_bwd_p and extra == 0)
            folded.append(fold_into_batch(a, d, size, batch, extra in _SHAREABLE, keep_shared, batch_major))
        outs = prim.bind(*folded, **params)
        if prim is attention_fwd_p:
            return [unfold_batch(size, o, batch_major) for o in outs], [out_dim] * len(outs)
        dq, dk, dv, dbias, dslopes = outs
        out = [unfold_batch(size, o, batch_major) for o in (dq, dk, dv)]
        # d(slopes) is per batch element ([B, N]) whatever the slopes' shape: it unfolds like dq.
        dslopes, slopes_dim = ((dslopes, not_mapped) if dslopes.ndim == 0
                               else (unfold_batch(size, dslopes, batch_major), out_dim))
        bias = args[num_tensors]
        if bias.ndim == 0:
            return out + [dbias, dslopes], [out_dim] * 3 + [not_mapped, slopes_dim]
        dbias = unfold_batch(size, dbias, batch_major)
        bias_batch = bias.shape[0] if dims[num_tensors] is not_mapped else \
            jnp.moveaxis(bias, dims[num_tensors], 0).shape[1]
        if bias_batch == 1:  # the instance's bias was shared by its batch: sum its gradient
            dbias = jnp.sum(dbias, axis=1 - out_dim, keepdims=True)
        return out + [dbias, dslopes], [out_dim] * 4 + [slopes_dim]
    return rule


batching.primitive_batchers[attention_fwd_p] = _batch_rule(attention_fwd_p, 3)
batching.primitive_batchers[attention_bwd_p] = _batch_rule(attention_bwd_p, 7)


def _pack_mask_rule(args, dims, *, q_len, kv_len):
    mask = jnp.moveaxis(args[0], dims[0], 0)
    size, lead = mask.shape[0], mask.shape[1]
    outs = pack_mask_p.bind(mask.reshape((size * lead,) + mask.shape[2:]), q_len=q_len, kv_len=kv_len)
    return [o.reshape((size, lead) + o.shape[1:]) for o in outs], [0, 0]


batching.primitive_batchers[pack_mask_p] = _pack_mask_rule
