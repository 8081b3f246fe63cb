"""The differentiable attention core: a custom_vjp whose residuals are (q, k, v, o, lse) and the
extra operands.

The backward pass recomputes the softmax from the saved LSE inside the kernel (and regenerates
the dropout mask from its seeds), so no T×S tensor exists in either direction. The saved output
and LSE carry CHECKPOINT_NAME, so that a remat policy can keep them instead of running the
forward kernel again in the backward (docs/remat-and-export.md). The LSE output is
differentiable: its cotangent enters the backward kernel as D = rowsum(dO∘O) − dLSE. Of the extra
operands the bias (d(bias) = dS, reduced over its broadcast axes) and the ALiBi slopes
(d(slope) = −Σ dS·|pos_q − pos_k|, per batch element and head) are differentiable; masks,
lengths, segment ids and seeds get no gradient.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from . import decode
from ._compat import ad, pcast_varying, varying_axes
from ._explicit_sharding import explicit_spec, explicitly_sharded
from ._options import Extras
from .primitives import attention_bwd_p, attention_fwd_p

CHECKPOINT_NAME = "jax_flashattn"
_PLACEHOLDER = jnp.int32  # dtype of the rank-0 stand-in for an absent operand
_REST_SLOPES = Extras._fields.index("alibi_slopes") - 1  # its index in `rest` (Extras without bias)


def named_residuals(o, lse):
    """The forward's output and LSE under CHECKPOINT_NAME (a no-op outside jax.checkpoint): the
    policy `save_only_these_names(CHECKPOINT_NAME)` then saves them for the backward."""
    return checkpoint_name(o, CHECKPOINT_NAME), checkpoint_name(lse, CHECKPOINT_NAME)


def extra_operands(bias, rest):
    """The extra operands in Extras order, with rank-0 placeholders where absent."""
    extras = (bias,) + tuple(rest)
    return [jnp.zeros((), _PLACEHOLDER) if x is None else x for x in extras]


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def attention_core(q, k, v, bias, rest, scale, config, implementation):
    """(o, lse) for q BTNH, k BSKH, v BSKHv; lse float32 BTN, natural log. bias: float32 rank 4
    or None; rest: the other Extras fields (arrays or None)."""
    return tuple(attention_fwd_p.bind(q, k, v, *extra_operands(bias, rest), scale=scale,
                                      config=config, implementation=implementation))


def _fwd(q, k, v, bias, rest, scale, config, implementation):
    o, lse = named_residuals(*attention_fwd_p.bind(q, k, v, *extra_operands(bias, rest), scale=scale,
                                                   config=config, implementation=implementation))
    return (o, lse), (q, k, v, o, lse, bias, rest)


def _bwd(scale, config, implementation, residuals, cotangents):
    q, k, v, o, lse, bias, rest = residuals
    do, dlse = cotangents
    do = jnp.asarray(do, dtype=o.dtype)
    dlse = jnp.asarray(dlse, dtype=jnp.float32)
    dq, dk, dv, dbias, dslopes = attention_bwd_p.bind(q, k, v, o, lse, do, dlse,
                                                      *extra_operands(bias, rest), scale=scale,
                                                      config=config, implementation=implementation)
    slopes = rest[_REST_SLOPES]
    if slopes is not None:
        if slopes.shape[0] == 1:  # shared by the batch: sum its elements' shares
            dslopes = jnp.sum(dslopes, axis=0, keepdims=True)
        dslopes = like_sharding(dslopes, slopes)
    d_rest = tuple(dslopes if i == _REST_SLOPES and x is not None else None for i, x in enumerate(rest))
    return dq, dk, dv, (None if bias is None else dbias), d_rest


attention_core.defvjp(_fwd, _bwd)


def reverse_mode_only(*primitives):
    """Forward-mode differentiation of these primitives (jax.jvp of a gradient: jax.hessian,
    jax.jacfwd of jax.grad) raises an error that says so, instead of JAX's bare "rule not
    implemented": the kernels have a reverse-mode rule only, as cuDNN's attention does."""
    def rule(primals, tangents, **params):
        raise NotImplementedError(
            "jax_flashattn's attention has reverse-mode gradients only (jax.grad, jax.vjp, "
            "jax.jacrev); forward-mode differentiation (jax.jvp, jax.jacfwd, jax.hessian, "
            "jax.linearize) is not implemented. For higher derivatives use "
            "jax.nn.dot_product_attention(..., implementation='xla').")
    for primitive in primitives:
        ad.primitive_jvps[primitive] = rule


reverse_mode_only(attention_fwd_p, attention_bwd_p)


def attention(q, k, v, scale, config, extras: Extras, implementation):
    """attention_core, with empty problems answered here so kernels only see non-empty ones.

    With no keys (S == 0) every row sees nothing: out = 0, lse = -inf, zero gradients.
    """
    B, T, N, _ = q.shape
    S = k.shape[1]
    if B * T * N == 0 or S == 0:
        out = jnp.zeros((B, T, N, v.shape[-1]), q.dtype)
        lse = jnp.full((B, T, N), -jnp.inf, jnp.float32)
        return out, lse  # gradients of q, k, v (and bias) are zeros: nothing here depends on them
    q, scale = kernel_scale(q, scale)
    q, k, v, extras = vary_together(q, k, v, extras)

    def call(q, k, v, config, extras):
        return attention_core(q, k, v, extras.bias, tuple(extras[1:]), scale, config, implementation)

    # The split's reshapes and stacks carry no shardings, which Explicit mesh axes require.
    plan = None if explicitly_sharded(q, k, v) else decode.split_plan(q.shape, k.shape, config, extras,
                                                                       implementation)
    if plan is None:
        return call(q, k, v, config, extras)
    return jax.lax.platform_dependent(
        q, k, v, default=lambda q, k, v: call(q, k, v, config, extras),
        cuda=lambda q, k, v: decode.split_kv_attention(q, k, v, config, extras, plan, call))


def kernel_scale(q, scale):
    """(q, scale) with the same logits and a positive scale, which the kernels need."""
    if scale < 0:
        # The GPU kernels take the running max over the raw q·k and scale it afterwards, so with a
        # negative scale they would stabilise by the smallest logit instead of the largest (and
        # overflow past ~88 nats of range). q·k·scale = (-q)·k·|scale|; JAX differentiates the
        # negation.
        return -q, -scale
    if scale == 0:
        # Every logit is 0 before bias and ALiBi. The kernels fold the scale into their exp2 (where a
        # masked -inf times 0 is NaN) and the GPU forward divides additive terms by it, so they get
        # what computes the same logits exactly: q = 0 and scale 1. The gradients of q and k are 0
        # either way. (Only an inf or NaN in q differs: 0 · inf would be NaN, 0-valued q gives 0.)
        return jnp.zeros_like(q), 1.0
    return q, scale


def like_sharding(gradient, primal):
    """The gradient laid out as its primal, which custom_vjp requires of its type: with Explicit
    mesh axes the kernels type d(slopes) from the query's split, which the slopes need not share."""
    want, have = explicit_spec(primal), explicit_spec(gradient)
    if want == have:
        return gradient
    return jax.sharding.reshard(gradient, jax.sharding.PartitionSpec(*(want or ())))


def vary_together(*operands):
    """Inside shard_map, the operands marked as varying over every manual axis any of them varies
    over. The kernels' results vary over all of those axes, and custom_vjp requires each
    gradient to have its primal's type; an operand the same on every device (say K/V replicated
    over a query-sequence axis) thus enters as varying, and the transpose of that cast sums its
    gradient over the devices, which is its true gradient."""
    leaves, tree = jax.tree.flatten(operands)
    axes = [varying_axes(jax.typeof(x)) for x in leaves]
    union = frozenset().union(*axes)
    leaves = [pcast_varying(x, tuple(a for a in union if a not in own)) for x, own in zip(leaves, axes)]
    return jax.tree.unflatten(tree, leaves)
