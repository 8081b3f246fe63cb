"""Rematerialisation (jax.checkpoint, nnx.remat): the kernels' saved output and LSE carry
jax_flashattn.CHECKPOINT_NAME, so the policy save_only_these_names(CHECKPOINT_NAME) keeps them and
the backward runs no second forward kernel, while a policy that saves nothing runs it again;
the gradients are the same either way."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn as jfa
from jax_flashattn import _ext
from util import fresh_seed

POLICIES = jax.checkpoint_policies
SAVE_ATTENTION = POLICIES.save_only_these_names(jfa.CHECKPOINT_NAME)


def _normal(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape, np.float32))


def _dense_case(rng):
    B, T, S, N, K, H = 2, 37, 45, 4, 2, 32
    q, k, v = _normal(rng, B, T, N, H), _normal(rng, B, S, K, H), _normal(rng, B, S, K, H)
    bias = _normal(rng, 1, N, T, S)
    slopes = jnp.abs(_normal(rng, N))

    def attention(q, k, v, bias, slopes):
        return jfa.flash_attention(q, k, v, bias=bias, alibi_slopes=slopes, is_causal=True,
                                   causal_alignment="bottom_right")
    return attention, (q, k, v, bias, slopes), _ext.FORWARD_TARGET


def _sparse_case(rng):
    B, T, S, N, K, H, topk = 1, 23, 50, 4, 1, 32, 20
    q, k, v = _normal(rng, B, T, N, H), _normal(rng, B, S, K, H), _normal(rng, B, S, K, H)
    indices = jnp.asarray(rng.integers(-2, S, (B, T, K, topk)).astype(np.int32))

    def attention(q, k, v):
        return jfa.sparse_attention(q, k, v, indices, is_causal=True)
    return attention, (q, k, v), _ext.SPARSE_FORWARD_TARGET


def _loss_and_grads(attention, args, policy):
    """The value and the gradients of every argument of a small loss around the attention (a
    nonlinearity before, so that the policy decides what the backward recomputes)."""
    def loss(*args):
        out = attention(jnp.sin(args[0]), *args[1:])
        return jnp.sum(jnp.cos(out) ** 2)
    if policy is not None:
        loss = jax.checkpoint(loss, policy=policy)
    return jax.value_and_grad(loss, argnums=tuple(range(len(args))))


def _calls(text, target):
    return text.count(f"@{target}(")


@pytest.mark.parametrize("case", [_dense_case, _sparse_case], ids=["flash_attention", "sparse_attention"])
def test_named_policy_runs_the_forward_kernel_once(case):
    attention, args, forward_target = case(np.random.default_rng(fresh_seed()))
    expected = jax.jit(_loss_and_grads(attention, args, None))(*args)
    for policy, forward_calls in ((POLICIES.nothing_saveable, 2), (SAVE_ATTENTION, 1),
                                  (POLICIES.save_from_both_policies(
                                      POLICIES.dots_with_no_batch_dims_saveable, SAVE_ATTENTION), 1)):
        fn = jax.jit(_loss_and_grads(attention, args, policy))
        assert _calls(fn.lower(*args).as_text(), forward_target) == forward_calls, policy
        for got, want in zip(jax.tree.leaves(fn(*args)), jax.tree.leaves(expected)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_scanned_layers_keep_the_saved_attention_in_the_compiled_program():
    """Layers under lax.scan, each rematerialised, as models are trained: XLA cannot merge the
    backward scan's recomputed forward with the forward scan's, so the policy decides whether the
    compiled program holds the forward kernel twice or once."""
    rng = np.random.default_rng(fresh_seed())
    L, B, T, N, H = 3, 2, 40, 2, 16
    x, weights = _normal(rng, B, T, N, H), 0.2 * _normal(rng, L, H, H)

    def loss(weights, x, policy):
        def layer(h, w):
            y = jnp.einsum("btnh,hg->btng", h, w)
            return h + jfa.flash_attention(y, y, y, is_causal=True), None
        h, _ = jax.lax.scan(jax.checkpoint(layer, policy=policy), x, weights)
        return jnp.sum(h ** 2)

    results = {}
    for name, policy, forward_calls in (("nothing", POLICIES.nothing_saveable, 2),
                                        ("attention", SAVE_ATTENTION, 1)):
        fn = jax.jit(jax.value_and_grad(lambda w, x, policy=policy: loss(w, x, policy)))
        compiled = fn.lower(weights, x).compile().as_text()
        assert compiled.count(f'custom_call_target="{_ext.FORWARD_TARGET}"') == forward_calls, name
        assert compiled.count(f'custom_call_target="{_ext.BACKWARD_TARGET}"') == 1, name
        results[name] = fn(weights, x)
    for got, want in zip(jax.tree.leaves(results["attention"]), jax.tree.leaves(results["nothing"])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_flax_remat_with_the_attention_policy():
    nnx = pytest.importorskip("flax.nnx")
    from jax_flashattn.flax import attention_fn

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.attention = nnx.MultiHeadAttention(num_heads=4, in_features=32, decode=False,
                                                    attention_fn=attention_fn, rngs=rngs)

        def __call__(self, x):
            return x + self.attention(x, mask=nnx.make_causal_mask(x[..., 0]))

    block = Block(nnx.Rngs(fresh_seed() % 2**31))
    x = _normal(np.random.default_rng(fresh_seed()), 2, 24, 32)
    graphdef, params = nnx.split(block)

    def loss(params, x, policy):
        def run(params, x):
            return nnx.merge(graphdef, params)(x)
        if policy is not None:
            run = nnx.remat(run, policy=policy)
        return jnp.sum(run(params, x) ** 2)

    expected = jax.jit(jax.value_and_grad(lambda p, x: loss(p, x, None)))(params, x)
    fn = jax.jit(jax.value_and_grad(lambda p, x: loss(p, x, SAVE_ATTENTION)))
    assert _calls(fn.lower(params, x).as_text(), _ext.FORWARD_TARGET) == 1
    for got, want in zip(jax.tree.leaves(fn(params, x)), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
