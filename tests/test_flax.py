"""jax_flashattn inside Flax modules: nnx and linen MultiHeadAttention with our attention_fn."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from util import fresh_seed, rel_err

flax = pytest.importorskip("flax")
from flax import linen, nnx  # noqa: E402

from jax_flashattn.flax import attention_fn  # noqa: E402


def _nnx_mha(seed, fn):
    kwargs = {} if fn is None else {"attention_fn": fn}
    return nnx.MultiHeadAttention(num_heads=4, in_features=32, qkv_features=64, decode=False,
                                  rngs=nnx.Rngs(seed), **kwargs)


def test_nnx_multi_head_attention_matches_default():
    seed = fresh_seed() % 2**31
    x = jax.random.normal(jax.random.key(seed), (2, 37, 32))
    ours, theirs = _nnx_mha(seed, attention_fn), _nnx_mha(seed, None)
    assert rel_err(ours(x), theirs(x)) <= 1e-5, f"seed {seed}"

    def loss(model, x):
        return jnp.sum(model(x) ** 2)

    g_ours = nnx.grad(loss)(ours, x)
    g_theirs = nnx.grad(loss)(theirs, x)
    # One relative error over all parameters: some gradients (the key bias) are exactly zero
    # in exact arithmetic, so a per-leaf relative error would compare rounding noise.
    flat = lambda g: jnp.concatenate([x.ravel() for x in jax.tree.leaves(g)])  # noqa: E731
    assert rel_err(flat(g_ours), flat(g_theirs)) <= 1e-5, f"seed {seed}"


def test_nnx_is_causal_matches_causal_mask():
    seed = fresh_seed() % 2**31
    x = jax.random.normal(jax.random.key(seed), (1, 19, 32))
    ours, theirs = _nnx_mha(seed, attention_fn), _nnx_mha(seed, None)
    mask = nnx.make_causal_mask(jnp.ones((1, 19)))
    assert rel_err(ours(x, is_causal=True), theirs(x, mask=mask)) <= 1e-5, f"seed {seed}"


def test_linen_causal_via_partial_matches_causal_mask():
    seed = fresh_seed() % 2**31
    x = jax.random.normal(jax.random.key(seed), (2, 23, 32))
    ours = linen.MultiHeadDotProductAttention(
        num_heads=4, qkv_features=64, attention_fn=functools.partial(attention_fn, is_causal=True))
    theirs = linen.MultiHeadDotProductAttention(num_heads=4, qkv_features=64)
    params = theirs.init(jax.random.key(seed), x)
    mask = linen.make_causal_mask(jnp.ones((2, 23)))
    assert rel_err(ours.apply(params, x), theirs.apply(params, x, mask=mask)) <= 1e-5


def test_linen_multi_head_attention_matches_default():
    seed = fresh_seed() % 2**31
    x = jax.random.normal(jax.random.key(seed), (2, 21, 32))
    ours = linen.MultiHeadDotProductAttention(num_heads=4, qkv_features=64,
                                              attention_fn=attention_fn)
    theirs = linen.MultiHeadDotProductAttention(num_heads=4, qkv_features=64)
    params = theirs.init(jax.random.key(seed), x)
    assert rel_err(ours.apply(params, x), theirs.apply(params, x)) <= 1e-5, f"seed {seed}"


def test_unsupported_mask_is_named():
    x = jnp.ones((1, 5, 32))
    model = _nnx_mha(0, attention_fn)
    with pytest.raises(NotImplementedError, match="mask"):
        model(x, mask=jnp.ones((1, 1, 5, 5), bool))
