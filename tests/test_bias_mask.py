"""bias (with its gradient, reduced over broadcast axes) and boolean masks, broadcast along any
axes, against the float32 reference; under vmap and with the other masks."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn as jfa
from jax_flashattn.reference import attention_reference
from util import compare_with_reference, fresh_seed, random_qkv, rel_err

SHAPES = {"odd": (2, 17, 33, 4, 2, 32), "tiles": (2, 100, 130, 2, 1, 64)}

# Which axes of [B, N, T, S] the bias/mask has (the others are 1); "rank2" is a [T, S] array.
BROADCASTS = ["BNTS", "NTS", "BTS", "TS", "BN", "S", "T", "scalar", "rank2"]


def _shape(axes, B, N, T, S):
    if axes == "rank2":
        return (T, S)
    if axes == "scalar":
        return (1, 1, 1, 1)
    return tuple(d if a in axes else 1 for a, d in zip("BNTS", (B, N, T, S)))


@pytest.mark.parametrize("axes", BROADCASTS)
@pytest.mark.parametrize("shape", ["odd", "tiles"])
def test_bias_and_its_gradient(axes, shape):
    seed = fresh_seed()
    B, T, S, N, K, H = SHAPES[shape]
    bias = jax.random.normal(jax.random.key(seed + 7), _shape(axes, B, N, T, S))
    _, _, grads = compare_with_reference(seed, SHAPES[shape], dict(is_causal=shape == "odd"),
                                         bias=bias)
    assert grads[3].shape == bias.shape


@pytest.mark.parametrize("axes", ["BNTS", "BTS", "NTS", "TS", "S", "rank2"])
def test_boolean_mask(axes):
    seed = fresh_seed()
    B, T, S, N, K, H = SHAPES["tiles"]
    mask = jax.random.bernoulli(jax.random.key(seed + 7), 0.6, _shape(axes, B, N, T, S))
    compare_with_reference(seed, SHAPES["tiles"], dict(mask=mask))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
def test_bias_dtype_is_kept_for_its_gradient(dtype):
    seed = fresh_seed()
    q, k, v = random_qkv(seed, 1, 20, 24, 2, 2, 16, dtype=dtype)
    bias = jax.random.normal(jax.random.key(seed + 1), (1, 2, 20, 24)).astype(dtype)
    dbias = jax.grad(lambda b: jnp.sum(jfa.flash_attention(q, k, v, bias=b).astype(jnp.float32)
                                       ** 2))(bias)
    ref = jax.grad(lambda b: jnp.sum(attention_reference(q, k, v, bias=b)[0] ** 2))(
        bias.astype(jnp.float32))
    assert dbias.dtype == dtype
    assert rel_err(dbias, ref) <= 8e-2, f"seed {seed}"


def check_everything_at_once(seed, shape, window_left, kv_len1, dtype=jnp.float32):
    """bias and mask with every position mask, segment ids, softcap and ALiBi (B = 2)."""
    B, T, S, N, K, H = shape
    rng = np.random.default_rng(seed)
    ids_q = jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), 1), jnp.int32)
    ids_k = jnp.asarray(np.sort(rng.integers(0, 3, (B, S)), 1), jnp.int32)
    kw = dict(mask=jax.random.bernoulli(jax.random.key(seed + 3), 0.8, (1, N, T, S)),
              is_causal=True, causal_alignment="bottom_right", local_window_size=(window_left, 3),
              query_seq_lengths=jnp.array([T - 10, T], jnp.int32),
              key_value_seq_lengths=jnp.array([S, kv_len1], jnp.int32),
              q_segment_ids=ids_q, kv_segment_ids=ids_k, softcap=4.0,
              alibi_slopes=jnp.linspace(0.05, 0.3, N))
    bias = jax.random.normal(jax.random.key(seed + 4), (B, 1, T, S))
    compare_with_reference(seed, shape, kw, dtype=dtype, bias=bias)


def test_everything_at_once():
    check_everything_at_once(fresh_seed(), (2, 70, 90, 4, 2, 32), window_left=50, kv_len1=81)


@pytest.mark.parametrize("bias_axes", ["BNTS", "NTS"])
@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "shared"])
def test_bias_gradient_under_vmap(bias_axes, mapped):
    """vmap of grad: d(bias) per vmapped instance, whether the bias is mapped or shared."""
    seed = fresh_seed()
    V, B, T, S, N, K, H = 3, 2, 19, 23, 2, 1, 16
    q, k, v = random_qkv(seed, V * B, T, S, N, K, H)
    q, k, v = (x.reshape((V, B) + x.shape[1:]) for x in (q, k, v))
    shape = _shape(bias_axes, B, N, T, S)
    bias = jax.random.normal(jax.random.key(seed + 1), ((V,) if mapped else ()) + shape)
    mask = jax.random.bernoulli(jax.random.key(seed + 2), 0.7, (1, 1, T, S))

    def grad_of(fn):
        def one(q, k, v, b):
            return jax.grad(lambda b: jnp.sum(jnp.sin(fn(q, k, v, bias=b, mask=mask))), )(b)
        return jax.vmap(one, in_axes=(0, 0, 0, 0 if mapped else None))

    ours = grad_of(jfa.flash_attention)(q, k, v, bias)
    ref = grad_of(lambda *a, **kw: attention_reference(*a, **kw)[0])(q, k, v, bias)
    assert ours.shape == (V,) + shape
    assert rel_err(ours, ref) <= 4e-5, f"seed {seed}"
