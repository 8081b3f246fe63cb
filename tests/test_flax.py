"""jax_flashattn inside Flax modules: nnx and linen MultiHeadAttention with our attention_fn."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from util import fresh_seed, rel_err

flax = pytest.importorskip("flax")
from flax import linen, nnx  # noqa: E402

from jax_flashattn import flash_attention  # noqa: E402
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


def _linen_causal_pair(seed, T):
    """linen attention with is_causal bound to ours, Flax's own, their params, inputs and the
    causal mask that Flax's needs for the same result."""
    x = jax.random.normal(jax.random.key(seed), (2, T, 32))
    ours = linen.MultiHeadDotProductAttention(
        num_heads=4, qkv_features=64, attention_fn=functools.partial(attention_fn, is_causal=True))
    theirs = linen.MultiHeadDotProductAttention(num_heads=4, qkv_features=64)
    return ours, theirs, theirs.init(jax.random.key(seed), x), x, linen.make_causal_mask(jnp.ones((2, T)))


def test_linen_causal_via_partial_matches_causal_mask():
    ours, theirs, params, x, mask = _linen_causal_pair(fresh_seed() % 2**31, 23)
    assert rel_err(ours.apply(params, x), theirs.apply(params, x, mask=mask)) <= 1e-5


def test_linen_multi_head_attention_matches_default():
    seed = fresh_seed() % 2**31
    x = jax.random.normal(jax.random.key(seed), (2, 21, 32))
    ours = linen.MultiHeadDotProductAttention(num_heads=4, qkv_features=64,
                                              attention_fn=attention_fn)
    theirs = linen.MultiHeadDotProductAttention(num_heads=4, qkv_features=64)
    params = theirs.init(jax.random.key(seed), x)
    assert rel_err(ours.apply(params, x), theirs.apply(params, x)) <= 1e-5, f"seed {seed}"


def test_mask_and_bias_match_flax():
    """A padding-style mask and a bias through nnx MultiHeadAttention, as Flax computes them."""
    seed = fresh_seed() % 2**31
    x = jax.random.normal(jax.random.key(seed), (2, 13, 32))
    mask = jax.random.bernoulli(jax.random.key(seed + 1), 0.7, (2, 1, 13, 13)) | jnp.eye(13, dtype=bool)
    bias = jax.random.normal(jax.random.key(seed + 2), (1, 4, 13, 13))
    ours = _nnx_mha(seed, functools.partial(attention_fn, bias=bias))
    theirs = _nnx_mha(seed, functools.partial(nnx.dot_product_attention, bias=bias))
    assert rel_err(ours(x, mask=mask), theirs(x, mask=mask)) <= 1e-5, f"seed {seed}"


def test_dropout_rate_and_determinism():
    """Flax's dropout through nnx: off when deterministic, keyed by the module's rngs otherwise."""
    x = jax.random.normal(jax.random.key(0), (1, 16, 32))
    model = nnx.MultiHeadAttention(num_heads=4, in_features=32, qkv_features=64, decode=False,
                                   dropout_rate=0.5, rngs=nnx.Rngs(0, dropout=1),
                                   attention_fn=attention_fn)
    plain = _nnx_mha(0, attention_fn)
    nnx.update(plain, nnx.state(model, nnx.Param))
    assert rel_err(model(x, deterministic=True), plain(x)) <= 1e-6
    a, b = model(x, deterministic=False), model(x, deterministic=False)
    assert rel_err(a, b) > 1e-3  # the rng stream advanced: a new mask


def _reference(q, k, v, bias, mask):
    """float32 softmax attention over [batch..., T, N, H] with right-aligned broadcast bias/mask."""
    logits = jnp.einsum("...tnh,...snh->...nts", q, k) / q.shape[-1] ** 0.5 + bias
    logits = jnp.where(mask, logits, -jnp.inf)
    return jnp.einsum("...nts,...snh->...tnh", jax.nn.softmax(logits, axis=-1), v)


def test_several_batch_axes_fold_with_their_masks_and_biases():
    seed = fresh_seed() % 2**31
    kq, kk, kv, kb, km = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(kq, (2, 3, 13, 4, 16))
    k = jax.random.normal(kk, (2, 3, 17, 4, 16))
    v = jax.random.normal(kv, (2, 3, 17, 4, 16))
    bias = jax.random.normal(kb, (3, 4, 13, 17))                     # broadcast over the first axis
    mask = jax.random.bernoulli(km, 0.8, (2, 1, 1, 13, 17)).astype(jnp.float32)  # float, as Flax's
    mask = mask.at[..., 0].set(1.0)                                  # every row sees a key
    out = attention_fn(q, k, v, bias=bias, mask=mask)
    assert out.shape == (2, 3, 13, 4, 16)
    assert rel_err(out, _reference(q, k, v, bias, mask != 0)) <= 1e-5, f"seed {seed}"
    shared = jnp.ones((1, 1, 1, 13, 17), bool)                      # broadcast over every batch axis
    assert rel_err(attention_fn(q, k, v, mask=shared), _reference(q, k, v, 0.0, shared)) <= 1e-5
    grads = jax.grad(lambda q, k, v: jnp.sum(attention_fn(q, k, v, bias=bias) ** 2), (0, 1, 2))(q, k, v)
    expected = jax.grad(lambda q, k, v: jnp.sum(_reference(q, k, v, bias, True) ** 2), (0, 1, 2))(q, k, v)
    for g, e in zip(grads, expected):
        assert rel_err(g, e) <= 1e-4, f"seed {seed}"


def test_several_batch_axes_fold_bound_per_batch_keywords():
    """Lengths, segment ids and ALiBi slopes bound over Flax's batch axes ([2, 3, ...]) or given
    already folded ([6, ...]) give what the folded call gives."""
    seed = fresh_seed() % 2**31
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 3, T, 2, 8)), jnp.float32) for T in (11, 13, 13))
    lengths = jnp.asarray(rng.integers(1, 12, (2, 3)), jnp.int32)
    kv_lengths = jnp.asarray(rng.integers(1, 14, (2, 3)), jnp.int32)
    q_ids = jnp.asarray(np.sort(rng.integers(0, 2, (2, 3, 11)), axis=-1), jnp.int32)
    kv_ids = jnp.asarray(np.sort(rng.integers(0, 2, (2, 3, 13)), axis=-1), jnp.int32)
    slopes = jnp.asarray(rng.random((2, 3, 2)), jnp.float32)
    nested = dict(query_seq_lengths=lengths, key_value_seq_lengths=kv_lengths, q_segment_ids=q_ids,
                  kv_segment_ids=kv_ids, alibi_slopes=slopes)
    folded = {name: x.reshape((6,) + x.shape[2:]) for name, x in nested.items()}
    fold = lambda x: x.reshape((6,) + x.shape[2:])  # noqa: E731
    expected = flash_attention(fold(q), fold(k), fold(v), is_causal=True, **folded).reshape(q.shape[:-1] + (8,))
    for given in (nested, folded):
        out = functools.partial(attention_fn, is_causal=True, **given)(q, k, v)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


def test_nnx_sow_weights_records_flax_weights():
    seed = fresh_seed() % 2**31
    x = jax.random.normal(jax.random.key(seed), (2, 11, 32))
    ours, theirs = _nnx_mha(seed, attention_fn), _nnx_mha(seed, None)
    out = ours(x, sow_weights=True)
    assert rel_err(out, theirs(x, sow_weights=True)) <= 1e-5, f"seed {seed}"
    weights = nnx.state(ours, nnx.Intermediate)
    assert rel_err(jax.tree.leaves(weights)[0], jax.tree.leaves(nnx.state(theirs, nnx.Intermediate))[0]) <= 1e-6
    assert jax.tree.leaves(weights)[0].shape == (2, 4, 11, 11)


def test_linen_sow_weights_records_flax_weights_with_is_causal():
    seed = fresh_seed() % 2**31
    ours, theirs, params, x, mask = _linen_causal_pair(seed, 9)
    out, state = ours.apply(params, x, sow_weights=True, mutable=["intermediates"])
    expected, expected_state = theirs.apply(params, x, mask=mask, sow_weights=True, mutable=["intermediates"])
    assert rel_err(out, expected) <= 1e-5, f"seed {seed}"
    assert rel_err(jax.tree.leaves(state)[0], jax.tree.leaves(expected_state)[0]) <= 1e-6


def test_sow_weights_refuses_jax_flashattn_keywords():
    x = jnp.ones((1, 5, 32))
    mha = _nnx_mha(0, functools.partial(attention_fn, softcap=30.0))
    with pytest.raises(ValueError, match="sow_weights=True.*softcap"):
        mha(x, sow_weights=True)


def test_float64_runs_flax_own_attention():
    seed = fresh_seed() % 2**31
    with jax.enable_x64(True):
        kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
        q, k, v = (jax.random.normal(r, (2, 7, 4, 16), jnp.float64) for r in (kq, kk, kv))
        out = attention_fn(q, k, v, is_causal=True)
        assert out.dtype == jnp.float64
        causal = jnp.tril(jnp.ones((7, 7), bool))
        assert rel_err(out, nnx.dot_product_attention(q, k, v, mask=causal)) <= 1e-12, f"seed {seed}"
        with pytest.raises(ValueError, match="float64.*softcap"):
            attention_fn(q, k, v, softcap=5.0)


def _close_complex(out, expected):
    """rel_err would drop the imaginary part."""
    assert out.dtype == jnp.complex64
    assert jnp.max(jnp.abs(out - expected)) <= 1e-5 * jnp.max(jnp.abs(expected))


def test_complex_inputs_run_flax_own_attention():
    """The kernels take no complex dtype; each module family gets its own Flax attention, whose
    complex results differ (nnx's runs through jax.nn)."""
    re, im = jax.random.normal(jax.random.key(0), (2, 2, 6, 32))
    x = jax.lax.complex(re, im)
    ours = linen.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, attention_fn=attention_fn)
    theirs = linen.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)
    params = theirs.init(jax.random.key(1), x)
    _close_complex(ours.apply(params, x), theirs.apply(params, x))
    ours, theirs = _nnx_mha(0, attention_fn), _nnx_mha(0, None)
    _close_complex(ours(x), theirs(x))


@pytest.mark.parametrize("force_fp32", [True, False])
def test_linen_force_fp32_for_softmax_reaches_sown_weights(force_fp32):
    x = jax.random.uniform(jax.random.key(0), (2, 4))
    kwargs = dict(num_heads=2, qkv_features=4, force_fp32_for_softmax=force_fp32, dtype=jnp.bfloat16)
    ours = linen.MultiHeadDotProductAttention(**kwargs, attention_fn=attention_fn)
    params = ours.init(jax.random.key(1), x)
    out, state = ours.apply(params, x, mutable=["intermediates"], sow_weights=True)
    weights = state["intermediates"]["attention_weights"][0]
    assert weights.dtype == (jnp.float32 if force_fp32 else jnp.bfloat16)
    plain = linen.MultiHeadDotProductAttention(**kwargs)
    assert rel_err(out, plain.apply(params, x)) <= 1e-2


def test_linen_custom_einsums_run_flax_own_attention():
    """A custom einsum (AQT's quantized ones) changes the result; the kernels cannot run it."""
    def halved():
        return lambda spec, a, b: 0.5 * jnp.einsum(spec, a, b)
    x = jax.random.normal(jax.random.key(0), (2, 7, 8))
    kwargs = dict(num_heads=2, qkv_features=8, qk_attn_weights_einsum_cls=halved,
                  attn_weights_value_einsum_cls=lambda: jnp.einsum)
    ours = linen.MultiHeadDotProductAttention(**kwargs, attention_fn=attention_fn)
    theirs = linen.MultiHeadDotProductAttention(**kwargs)
    params = theirs.init(jax.random.key(1), x)
    expected = theirs.apply(params, x)
    plain = linen.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)
    assert rel_err(expected, plain.apply(params, x)) > 1e-3  # the einsum mattered
    assert rel_err(ours.apply(params, x), expected) <= 1e-6
    with pytest.raises(ValueError, match="mutually exclusive"):  # Flax's own check, on precision
        linen.MultiHeadDotProductAttention(**kwargs, precision=jax.lax.Precision.HIGHEST,
                                           attention_fn=attention_fn).apply(params, x)


def test_nnx_promote_dtype_is_applied():
    q = jax.random.normal(jax.random.key(0), (2, 5, 2, 8))
    to_bf16 = lambda arrays, dtype: tuple(a.astype(jnp.bfloat16) for a in arrays)  # noqa: E731
    out = attention_fn(q, q, q, promote_dtype=to_bf16)
    assert out.dtype == jnp.bfloat16
    assert rel_err(out, nnx.dot_product_attention(q, q, q, promote_dtype=to_bf16)) <= 1e-2


def test_flax_names_replaced_by_attention_fn_still_reach_flax_own_attention(monkeypatch):
    """Users may replace nnx/linen.dot_product_attention by ours; the fallbacks must not call ours back."""
    monkeypatch.setattr(nnx, "dot_product_attention", attention_fn)
    monkeypatch.setattr(linen, "dot_product_attention", attention_fn)
    x = jax.random.normal(jax.random.key(0), (2, 5, 32))
    out = _nnx_mha(0, attention_fn)(x, sow_weights=True)
    assert out.shape == (2, 5, 32)
    ours, _, params, x, _ = _linen_causal_pair(0, 5)
    out, state = ours.apply(params, x, sow_weights=True, mutable=["intermediates"])
    assert jax.tree.leaves(state)[0].shape == (2, 4, 5, 5)


@pytest.mark.parametrize("shapes, match", [
    (((2, 16, 4, 8), (16, 4, 8), (16, 4, 8)), "same rank"),
    (((2, 16, 4, 8), (3, 16, 4, 8), (3, 16, 4, 8)), "batch dims must match"),
    (((2, 16, 4, 8), (2, 16, 4, 8), (2, 15, 4, 8)), "lengths must match"),
    (((2, 16, 4, 8), (2, 16, 4, 7), (2, 16, 4, 8)), "depths must match"),
])
def test_shape_errors_carry_flax_messages(shapes, match):
    """The messages of nnx.dot_product_attention's own checks (its dropout path)."""
    q, k, v = (jnp.ones(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        attention_fn(q, k, v)


def test_nnx_decode_mode_with_flax_cache_matches_causal_call():
    """Flax's decode=True steps pass a mask over the cache's filled rows, one token per call."""
    seed = fresh_seed() % 2**31
    x = jax.random.normal(jax.random.key(seed), (2, 6, 32))
    model = nnx.MultiHeadAttention(num_heads=4, in_features=32, qkv_features=64, decode=True,
                                   rngs=nnx.Rngs(seed), attention_fn=attention_fn)
    model.init_cache(x.shape)
    step = nnx.jit(lambda model, token: model(token))
    cached = jnp.concatenate([step(model, x[:, i:i + 1]) for i in range(6)], axis=1)
    assert rel_err(cached, model(x, decode=False, is_causal=True)) <= 1e-5, f"seed {seed}"
