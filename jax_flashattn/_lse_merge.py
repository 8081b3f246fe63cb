"""Partial attentions over disjoint key sets, merged through their log-sum-exps (context
parallelism's ring steps, decoding's key blocks)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def merge_by_lse(out, lse, axis):
    """The float32 outputs `out` [..., Hv] of partial attentions along `axis`, weighted by their
    LSEs `lse` (out's shape without Hv). Rows no part sees stay 0 and -inf, with finite
    gradients everywhere (jnp.logaddexp's gradient is NaN where every part is -inf)."""
    top = jax.lax.stop_gradient(jnp.max(lse, axis=axis, keepdims=True))  # the result does not depend on it
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weight = jnp.exp(lse - top)
    total = jnp.sum(weight, axis=axis)
    seen = total > 0
    total = jnp.where(seen, total, 1.0)
    merged = jnp.sum(out * weight[..., None], axis=axis) / total[..., None]
    return merged, jnp.where(seen, jnp.log(total) + jnp.squeeze(top, axis), -jnp.inf)
