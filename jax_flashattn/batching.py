"""vmap rules for the attention primitives: every vmapped axis is folded into the batch axis B.

Operands with no mapped axis (in_axes=None) are broadcast along the new axis first, so any mix
of mapped and unmapped operands works; nested vmap folds one axis per level.
"""
from __future__ import annotations

import jax.numpy as jnp

from ._compat import batching, not_mapped
from .primitives import attention_bwd_p, attention_fwd_p


def _fold_into_batch(args, dims):
    """Moves each mapped axis to the front (broadcasting unmapped operands) and merges it with B."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not not_mapped)
    folded = []
    for a, d in zip(args, dims):
        if d is not_mapped:
            a = jnp.broadcast_to(a, (size,) + a.shape)
        else:
            a = jnp.moveaxis(a, d, 0)
        folded.append(a.reshape((size * a.shape[1],) + a.shape[2:]))
    return size, folded


def _unfold(size, outs):
    return [o.reshape((size, o.shape[0] // size) + o.shape[1:]) for o in outs]


def _batch_rule(prim):
    def rule(args, dims, **params):
        size, folded = _fold_into_batch(args, dims)
        outs = prim.bind(*folded, **params)
        return _unfold(size, outs), [0] * len(outs)
    return rule


batching.primitive_batchers[attention_fwd_p] = _batch_rule(attention_fwd_p)
batching.primitive_batchers[attention_bwd_p] = _batch_rule(attention_bwd_p)
