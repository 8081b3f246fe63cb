"""dot_product_attention behaves like jax.nn.dot_product_attention, computed by our kernels."""
from __future__ import annotations

import inspect
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn as jfa
from util import fresh_seed, random_qkv, rel_err


def _jax_nn_has_residual():
    return "return_residual" in inspect.signature(jax.nn.dot_product_attention).parameters


def test_signature_is_jax_nn_signature():
    """Same names, kinds and defaults, in order (older jax lacks the trailing return_residual)."""
    ours = [(p.name, p.kind, p.default)
            for p in inspect.signature(jfa.dot_product_attention).parameters.values()]
    theirs = [(p.name, p.kind, p.default)
              for p in inspect.signature(jax.nn.dot_product_attention).parameters.values()]
    assert ours[:len(theirs)] == theirs
    assert len(ours) == len(theirs) + (0 if _jax_nn_has_residual() else 1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(2, 33, 33, 4, 4, 64), (1, 17, 90, 8, 2, 32),
                                   (1, 70, 12, 4, 1, 128)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_matches_jax_nn_outputs_and_gradients(shape, is_causal, dtype):
    seed = fresh_seed()
    B, T, S, N, K, H = shape
    q, k, v = random_qkv(seed, B, T, S, N, K, H, dtype=dtype)
    w = jax.random.normal(jax.random.key(seed + 1), (B, T, N, H), jnp.float32)

    def run(fn, q, k, v):
        def loss(q, k, v):
            return jnp.sum(fn(q, k, v, is_causal=is_causal).astype(jnp.float32) * w)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v), fn(
            q, k, v, is_causal=is_causal)

    (_, grads), out = run(jfa.dot_product_attention, q, k, v)
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    (_, ref_grads), ref = run(lambda *a, **kw: jax.nn.dot_product_attention(
        *a, implementation="xla", **kw), *up)
    fwd_tol, grad_tol = (1e-5, 4e-5) if dtype == jnp.float32 else (2e-2, 8e-2)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, ref) <= fwd_tol, f"seed {seed}"
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) <= grad_tol, f"seed {seed}"


def test_unbatched_inputs():
    seed = fresh_seed()
    q, k, v = random_qkv(seed, 1, 21, 21, 4, 2, 32)
    out = jfa.dot_product_attention(q[0], k[0], v[0], is_causal=True)
    ref = jax.nn.dot_product_attention(q[0], k[0], v[0], is_causal=True)
    assert out.shape == (21, 4, 32) and rel_err(out, ref) <= 1e-5, f"seed {seed}"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=["float32", "float16"])
def test_return_residual_is_jax_nn_lse(dtype):
    """The residual: log-sum-exp in the key dtype, BTN, with a stopped gradient, as jax.nn."""
    if not _jax_nn_has_residual():
        pytest.skip("this jax.nn.dot_product_attention has no return_residual")
    seed = fresh_seed()
    q, k, v = random_qkv(seed, 2, 19, 29, 4, 2, 32, dtype=dtype)
    out, res = jfa.dot_product_attention(q, k, v, is_causal=True, return_residual=True)
    ref_out, ref_res = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                    return_residual=True, implementation="xla")
    assert res.shape == ref_res.shape == (2, 19, 4) and res.dtype == ref_res.dtype == dtype
    assert rel_err(res, ref_res) <= (1e-5 if dtype == jnp.float32 else 3e-3), f"seed {seed}"

    def lse_loss(fn, q):
        return jnp.sum(fn(q, k, v, return_residual=True)[1].astype(jnp.float32))

    assert not np.any(np.asarray(jax.grad(lambda q: lse_loss(jfa.dot_product_attention, q))(q)))


def test_default_scale_and_explicit_scale():
    seed = fresh_seed()
    q, k, v = random_qkv(seed, 1, 16, 16, 2, 2, 64)
    for scale in (None, 0.05):
        ours = jfa.dot_product_attention(q, k, v, scale=scale)
        ref = jax.nn.dot_product_attention(q, k, v, scale=scale)
        assert rel_err(ours, ref) <= 1e-5, f"seed {seed} scale {scale}"


def test_xla_passthrough_is_jax_nn():
    q, k, v = random_qkv(fresh_seed(), 1, 8, 8, 2, 2, 16)
    mask = jnp.tril(jnp.ones((1, 1, 8, 8), bool))
    ours = jfa.dot_product_attention(q, k, v, mask=mask, implementation="xla")
    ref = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))


@pytest.mark.parametrize("name, value", [
    ("bias", jnp.zeros((1, 2, 8, 8))), ("mask", jnp.ones((1, 2, 8, 8), bool)),
    ("query_seq_lengths", jnp.array([4], jnp.int32)),
    ("key_value_seq_lengths", jnp.array([4], jnp.int32)), ("local_window_size", 2)])
def test_not_yet_supported_arguments_are_named(name, value):
    q, k, v = random_qkv(fresh_seed(), 1, 8, 8, 2, 2, 16)
    with pytest.raises(NotImplementedError, match=name):
        jfa.dot_product_attention(q, k, v, **{name: value})


def test_jax_nn_shape_rules():
    q, k, v = random_qkv(fresh_seed(), 1, 8, 8, 2, 2, 16, Hv=8)
    with pytest.raises(ValueError, match="value"):
        jfa.dot_product_attention(q, k, v)  # jax.nn requires value to match key exactly
    with pytest.raises(ValueError, match="query"):
        jfa.dot_product_attention(q.astype(jnp.bfloat16), k, k)


def test_swapping_into_jax_nn_keeps_results(monkeypatch):
    """A program written against jax.nn gives the same results with ours swapped in."""
    seed = fresh_seed()
    q, k, v = random_qkv(seed, 2, 24, 24, 4, 2, 32)

    has_residual = _jax_nn_has_residual()  # of jax's own function, before the swap

    def program(q, k, v):
        h = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        if not has_residual:
            return jnp.sum(jax.nn.dot_product_attention(h, k, v) ** 2)
        h2, lse = jax.nn.dot_product_attention(h, k, v, return_residual=True)
        return jnp.sum(h2 ** 2) + jnp.sum(lse)

    expected = jax.value_and_grad(program, argnums=(0, 1, 2))(q, k, v)
    monkeypatch.setattr(jax.nn, "dot_product_attention", jfa.dot_product_attention)
    got = jax.value_and_grad(program, argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5)
    for g, r in zip(got[1], expected[1]):
        assert rel_err(g, r) <= 4e-5, f"seed {seed}"


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("use_vmap", [False, True], ids=["plain", "vmap"])
def test_jax_nn_test_style_calls(group, use_vmap):
    """As jax's own dot_product_attention tests call it: bias and mask passed positionally as
    None, vmapped with in_axes None for them, gradients through jax.vjp; GQA against repeated K/V."""
    seed = fresh_seed()
    B, T, S, N, H = 2, 128, 128, 4, 32
    q, k, v = random_qkv(seed, B, T, S, N, N // group, H, dtype=jnp.bfloat16)
    ct = jax.random.normal(jax.random.key(seed + 1), (B, T, N, H), jnp.bfloat16)
    ours = jfa.dot_product_attention
    if use_vmap:
        ours = jax.vmap(ours, in_axes=(0, 0, 0, None, None))
    out, pullback = jax.vjp(ours, q, k, v, None, None)
    grads = pullback(ct)[:3]
    k_rep, v_rep = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    ref, ref_pullback = jax.vjp(partial(jax.nn.dot_product_attention, implementation="xla"),
                                q, k_rep, v_rep, None, None)
    dq, dk, dv = ref_pullback(ct)[:3]
    dk = dk.reshape(B, S, N // group, group, H).sum(3)
    dv = dv.reshape(B, S, N // group, group, H).sum(3)
    for a, b in zip((out,) + tuple(grads), (ref, dq, dk, dv)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   atol=0.01, rtol=0.01, err_msg=f"seed {seed}")
