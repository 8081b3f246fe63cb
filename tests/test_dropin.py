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


OUR_KEYWORDS = ["causal_alignment", "q_segment_ids", "kv_segment_ids", "softcap", "alibi_slopes",
                "dropout_rate", "dropout_rng", "deterministic"]


def test_signature_is_jax_nn_signature():
    """Same names, kinds and defaults, in order (older jax lacks the trailing return_residual),
    then jax_flashattn's own keywords, keyword-only."""
    ours = [(p.name, p.kind, p.default)
            for p in inspect.signature(jfa.dot_product_attention).parameters.values()]
    theirs = [(p.name, p.kind, p.default)
              for p in inspect.signature(jax.nn.dot_product_attention).parameters.values()]
    assert ours[:len(theirs)] == theirs
    rest = ours[len(theirs) + (0 if _jax_nn_has_residual() else 1):]
    assert [name for name, _, _ in rest] == OUR_KEYWORDS
    assert all(kind == inspect.Parameter.KEYWORD_ONLY for _, kind, _ in rest)


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


def _nn_keywords(name, seed, B, T, S, N):
    rng = np.random.default_rng(seed)
    return {
        "bias_full": dict(bias=jnp.asarray(rng.normal(size=(B, N, T, S)), jnp.float32)),
        "bias_heads": dict(bias=jnp.asarray(rng.normal(size=(1, N, 1, S)), jnp.float32)),
        "bias_keys": dict(bias=jnp.asarray(rng.normal(size=(B, 1, 1, S)), jnp.float32)),
        "mask": dict(mask=jnp.asarray(rng.random((B, 1, T, S)) < 0.7) | jnp.eye(T, S, dtype=bool)),
        "mask_heads": dict(mask=jnp.asarray(rng.random((1, N, T, S)) < 0.7) | jnp.eye(T, S, dtype=bool)),
        # kv length >= query length: every valid query keeps a key (the diagonal), so no row is
        # fully masked (where jax.nn would average all values and we give 0).
        "lengths": dict(query_seq_lengths=jnp.asarray(rng.integers(1, T // 2, B), jnp.int32),
                        key_value_seq_lengths=jnp.asarray(rng.integers(T // 2, S + 1, B), jnp.int32)),
        "window": dict(local_window_size=(6, 2)),
        "window_int": dict(local_window_size=4),
    }[name]


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("names", [("bias_full",), ("bias_heads",), ("bias_keys", "mask"),
                                   ("mask_heads",), ("lengths",), ("window",),
                                   ("window_int", "lengths", "bias_heads")], ids="+".join)
def test_masks_and_bias_match_jax_nn(names, is_causal):
    """bias, mask, lengths and local_window_size with jax.nn's meaning: outputs and gradients
    (bias included) against jax.nn's XLA implementation in float32."""
    seed = fresh_seed()
    B, T, S, N, K, H = 2, 37, 37, 4, 2, 32   # jax.nn's causal mask and window need T == S here
    q, k, v = random_qkv(seed, B, T, S, N, K, H)
    kw = {}
    for i, name in enumerate(names):
        kw.update(_nn_keywords(name, seed + i, B, T, S, N))
    bias = kw.pop("bias", None)
    w = jax.random.normal(jax.random.key(seed + 9), (B, T, N, H))

    def loss(fn, q, k, v, bias):
        return jnp.sum(fn(q, k, v, bias, is_causal=is_causal, **kw) * w)

    xla = partial(jax.nn.dot_product_attention, implementation="xla")
    ours = jax.jit(jax.value_and_grad(partial(loss, jfa.dot_product_attention), argnums=(0, 1, 2, 3)))
    theirs = jax.value_and_grad(partial(loss, xla), argnums=(0, 1, 2, 3))
    (val, grads), (ref_val, ref_grads) = ours(q, k, v, bias), theirs(q, k, v, bias)
    out = jfa.dot_product_attention(q, k, v, bias, is_causal=is_causal, **kw)
    assert rel_err(out, xla(q, k, v, bias, is_causal=is_causal, **kw)) <= 1e-5, f"seed {seed}"
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
        if r is not None:
            # Or within float32 round-off of an exact zero: rows that see one key (query length 1,
            # causal) have dq = dk = 0 exactly in XLA, and P·(dP − D) rounds to ~1e-7 here.
            err = float(jnp.max(jnp.abs(g - r)))
            assert rel_err(g, r) <= 4e-5 or err <= 1e-5, f"seed {seed}: {name} {rel_err(g, r)}, max {err}"


def test_our_keywords_give_flash_attentions_results():
    """The drop-in's extra keywords (segment ids, alignment, softcap, ALiBi, dropout,
    deterministic) reach the kernels as flash_attention's do: the same outputs and gradients."""
    seed = fresh_seed()
    q, k, v = random_qkv(seed, 2, 40, 33, 4, 2, 16)
    ids_q = jnp.asarray(np.repeat([[0, 1]], 20, axis=1).repeat(2, 0), jnp.int32)
    ids_k = jnp.asarray((np.arange(33) >= 15).astype(np.int32)[None].repeat(2, 0))
    kw = dict(is_causal=True, causal_alignment="bottom_right", local_window_size=(20, 0), q_segment_ids=ids_q,
              kv_segment_ids=ids_k, softcap=5.0, alibi_slopes=jnp.array([0.1, 0.2, 0.3, 0.4]),
              dropout_rate=0.3, dropout_rng=jax.random.key(seed), deterministic=True)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v, **kw) ** 2)  # noqa: E731
    ours = jax.value_and_grad(loss(jfa.dot_product_attention), argnums=(0, 1, 2))(q, k, v)
    theirs = jax.value_and_grad(loss(jfa.flash_attention), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(ours[0]) > 0


def test_our_keywords_are_refused_by_the_jax_nn_passthrough():
    q, k, v = random_qkv(fresh_seed(), 1, 8, 8, 2, 2, 16)
    with pytest.raises(ValueError, match="softcap"):
        jfa.dot_product_attention(q, k, v, softcap=2.0, implementation="xla")
    packed = jfa.pack_mask(jnp.ones((1, 1, 8, 8), bool))
    with pytest.raises(ValueError, match="PackedMask"):
        jfa.dot_product_attention(q, k, v, mask=packed, implementation="xla")


def test_jax_nn_shape_rules():
    q, k, v = random_qkv(fresh_seed(), 1, 8, 8, 2, 2, 16, Hv=8)
    with pytest.raises(ValueError, match="value"):
        jfa.dot_product_attention(q, k, v)  # jax.nn requires value to match key exactly
    with pytest.raises(ValueError, match="query"):
        jfa.dot_product_attention(q.astype(jnp.bfloat16), k, k)


@pytest.mark.parametrize("keyword", ["mask", "query_seq_lengths", "key_value_seq_lengths"])
def test_jax_nn_dtype_rules_raise_its_value_error(keyword):
    """Where jax.nn raises ValueError for a dtype, so does the drop-in (code catching it keeps
    working); flash_attention itself raises TypeError."""
    q, k, v = random_qkv(fresh_seed(), 2, 8, 8, 2, 2, 16)
    bad = {"mask": jnp.ones((2, 1, 8, 8), jnp.float32), "query_seq_lengths": jnp.array([8, 5], jnp.int16),
           "key_value_seq_lengths": np.array([8, 5], np.uint32)}[keyword]
    for implementation in (None, "xla"):
        with pytest.raises(ValueError, match=f"{keyword} dtype should be"):
            jfa.dot_product_attention(q, k, v, implementation=implementation, **{keyword: bad})
    with pytest.raises(TypeError, match=keyword):
        jfa.flash_attention(q, k, v, **{keyword: bad})


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
