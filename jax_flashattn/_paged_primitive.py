"""The paged forward primitive: attention of q against key/value page pools read through a block
table, in place (no contiguous copy of the cache).

  paged_fwd_p(q, key_cache, value_cache, *extras) -> (o, lse)

q is [B, T, N, H]; the caches are pools [num_pages, page_size, K, H] and [..., Hv]; extras are the
operands of _options.Extras in order (rank-0 placeholders where absent) with block_table int32
[B, max_pages] present: the call is that of a [B, max_pages * page_size, K, H] cache whose rows
of sequence b are the pages block_table[b] in order. Parameters as attention_fwd_p's. It lowers
through _paged_sharding.py to the forward's per-device twin, attention_fwd_kernel_p, whose
handlers read the table (the CPU's after copying the pages, the Hopper kernels in place).
Forward only: paged.py's custom_vjp differentiates the gathered call instead.
"""
from __future__ import annotations

from functools import partial

import jax.numpy as jnp

from ._compat import Primitive, apply_primitive, batching, not_mapped
from ._options import Extras
from .autodiff import reverse_mode_only
from .batching import fold_into_batch, unfold_batch
from .primitives import _fwd_abstract_eval

paged_fwd_p = Primitive("jfa_paged_fwd")
paged_fwd_p.multiple_results = True
paged_fwd_p.def_impl(partial(apply_primitive, paged_fwd_p))
paged_fwd_p.def_abstract_eval(_fwd_abstract_eval)
reverse_mode_only(paged_fwd_p)

_TABLE = Extras._fields.index("block_table")
_SLOPES = Extras._fields.index("alibi_slopes")


def _batch_rule(args, dims, **params):
    """Every vmapped axis folds into the batch in front of it ([size, B] merged). Pools that are
    vmapped too are stacked into one pool, each instance's table offset to its own pages (its
    ids clamped into them first, so a bad id stays inside its instance's pool)."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not not_mapped)
    q, q_dim = args[0], dims[0]
    batch = q.shape[0] if q_dim is not_mapped else q.shape[1 if q_dim == 0 else 0]
    pools = list(args[1:3])
    offsets = None
    if dims[1] is not not_mapped or dims[2] is not not_mapped:
        pools = [jnp.broadcast_to(x, (size,) + x.shape) if d is not_mapped else jnp.moveaxis(x, d, 0)
                 for x, d in zip(pools, dims[1:3])]
        pages = pools[0].shape[1]
        pools = [x.reshape((size * pages,) + x.shape[2:]) for x in pools]
        offsets = (jnp.arange(size, dtype=jnp.int32) * pages, pages)
    extras = []
    for index, (a, d) in enumerate(zip(args[3:], dims[3:])):
        if index == _TABLE and offsets is not None:
            a = jnp.broadcast_to(a, (size,) + a.shape) if d is not_mapped else jnp.moveaxis(a, d, 0)
            starts, pages = offsets
            a = jnp.clip(a, 0, pages - 1) + starts[:, None, None]
            extras.append(a.reshape((size * a.shape[1],) + a.shape[2:]))
        else:
            extras.append(fold_into_batch(a, d, size, batch, index == _SLOPES, True, False))
    q = fold_into_batch(q, q_dim, size, batch, False, True, False)
    outs = paged_fwd_p.bind(q, *pools, *extras, **params)
    return [unfold_batch(size, o, False) for o in outs], [0, 0]


batching.primitive_batchers[paged_fwd_p] = _batch_rule
