"""Dropout: the kernels' mask is a pure function of the key (jax_flashattn.dropout re-implements
it in NumPy, bit for bit), the same in forward and backward, with the right rate; outputs and
gradients match the reference given that mask."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn as jfa
from jax_flashattn import dropout
from test_masks import combo_keywords
from util import compare_with_reference, fresh_seed, random_qkv


def _kernel_keep_mask(rng, rate, B, N, T, S, **kw):
    """Reads the kernel's mask off the output: with q = 0 every key gets P = 1/S, and with
    V = the identity (Hv = S) output column j of query i is keep(i, j) / ((1 - rate)·S)."""
    q = jnp.zeros((B, T, N, 8))
    k = jnp.zeros((B, S, 1, 8))
    v = jnp.broadcast_to(jnp.eye(S)[None, :, None, :], (B, S, 1, S))
    out = jfa.flash_attention(q, k, v, dropout_rate=rate, dropout_rng=rng, **kw)
    return np.asarray(out > 0).transpose(0, 2, 1, 3)  # [B, N, T, S]


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_kernel_mask_is_the_numpy_philox_mask_bit_for_bit(rate):
    rng = jax.random.key(fresh_seed())
    B, N, T, S = 2, 3, 70, 67   # more than one tile of queries; S not a multiple of 8
    kept = _kernel_keep_mask(rng, rate, B, N, T, S)
    np.testing.assert_array_equal(kept, dropout.keep_mask(rng, rate, (B, N, T, S)))


def test_philox_known_answer():
    """Random123's published known-answer vector for Philox4x32-10."""
    out = dropout.philox4x32_10((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
                                0xA4093822, 0x299F31D0)
    assert [int(x) for x in out] == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_rate_statistics_and_key_determinism():
    seed = fresh_seed()
    B, N, T, S, rate = 2, 4, 64, 64, 0.3
    first = _kernel_keep_mask(jax.random.key(seed), rate, B, N, T, S)
    again = _kernel_keep_mask(jax.random.key(seed), rate, B, N, T, S)
    other = _kernel_keep_mask(jax.random.key(seed + 1), rate, B, N, T, S)
    np.testing.assert_array_equal(first, again)
    dropped = 1 - first.mean()
    n = first.size   # 32768 draws: 5 standard deviations is about 0.013
    assert abs(dropped - rate) < 5 * np.sqrt(rate * (1 - rate) / n), f"seed {seed}: {dropped}"
    assert 0.3 < (first != other).mean() < 0.5  # independent keys: about 2·0.3·0.7 = 0.42
    # heads, batch elements and queries get different masks
    assert (first[0, 0] != first[0, 1]).any() and (first[0] != first[1]).any()


def test_traced_key_under_jit_matches_eager():
    rng = jax.random.key(fresh_seed())
    q, k, v = random_qkv(fresh_seed(), 1, 30, 30, 2, 1, 16)
    f = lambda q, k, v, r: jfa.flash_attention(q, k, v, dropout_rate=0.2, dropout_rng=r)  # noqa
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(q, k, v, rng)), np.asarray(f(q, k, v, rng)))


@pytest.mark.parametrize("kw", [dict(), dict(is_causal=True, query_seq_lengths=[50, 9]),
                                dict(local_window_size=(10, 10), softcap=3.0)],
                         ids=["plain", "causal+lengths", "window+softcap"])
def test_forward_and_gradients_match_reference_with_the_same_mask(kw):
    check_dropout_against_reference(fresh_seed(), (2, 70, 45, 4, 2, 32), kw)


@pytest.mark.parametrize("combo", [("window", "segments", "q_lengths", "alibi_per_batch", "softcap"),
                                   ("causal_window", "segments", "alibi", "kv_lengths", "bottom_right")],
                         ids="+".join)
def test_dropout_with_masks_and_modifiers_combined(combo):
    """Dropout on top of test_masks' combinations (and a bias): its mask is still the NumPy one,
    applied after every other mask and modifier, forward and gradients."""
    seed, shape = fresh_seed(), (2, 70, 45, 4, 2, 32)
    B, T, S, N, K, H = shape
    check_dropout_against_reference(seed, shape, combo_keywords(combo, seed, B, T, S, N))


def check_dropout_against_reference(seed, shape, kw, dtype=jnp.float32):
    """Dropout (rate 0.25, with a bias) against the reference given the same keep mask."""
    B, T, S, N, K, H = shape
    rng, rate = jax.random.key(seed + 5), 0.25
    kw = {name: jnp.asarray(x, jnp.int32) if name.endswith("lengths") else x for name, x in kw.items()}
    keep = dropout.keep_mask(rng, rate, (B, N, T, S))
    bias = jax.random.normal(jax.random.key(seed + 6), (1, N, 1, S))
    compare_with_reference(seed, shape, dict(kw, dropout_rate=rate, dropout_rng=rng),
                           ref_kw=dict(kw, dropout_rate=rate, dropout_keep=keep), dtype=dtype, bias=bias)


def test_vmap_keeps_each_examples_mask():
    """The mask of example b does not depend on how examples are batched or vmapped."""
    rng = jax.random.key(fresh_seed())
    q, k, v = random_qkv(fresh_seed(), 3, 20, 20, 2, 1, 16)
    f = lambda q, k, v: jfa.flash_attention(q, k, v, dropout_rate=0.5, dropout_rng=rng)  # noqa
    mapped = jax.vmap(f)(q, k, v)                     # each instance is a batch of one
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(mapped[i]), np.asarray(f(q[i], k[i], v[i])))


def test_vmap_over_keys():
    keys = jax.random.split(jax.random.key(fresh_seed()), 2)
    q, k, v = random_qkv(fresh_seed(), 1, 20, 20, 2, 1, 16)
    f = lambda r: jfa.flash_attention(q, k, v, dropout_rate=0.5, dropout_rng=r)  # noqa
    mapped = jax.vmap(f)(keys)
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(mapped[i]), np.asarray(f(keys[i])))


def test_raw_uint32_key_and_rate_zero():
    q, k, v = random_qkv(fresh_seed(), 1, 9, 9, 2, 1, 16)
    raw = jax.random.PRNGKey(3)
    typed = jax.random.wrap_key_data(raw)
    np.testing.assert_array_equal(
        np.asarray(jfa.flash_attention(q, k, v, dropout_rate=0.4, dropout_rng=raw)),
        np.asarray(jfa.flash_attention(q, k, v, dropout_rate=0.4, dropout_rng=typed)))
    np.testing.assert_array_equal(
        np.asarray(jfa.flash_attention(q, k, v, dropout_rate=0.0, dropout_rng=typed)),
        np.asarray(jfa.flash_attention(q, k, v)))


def test_gradients_are_bitwise_reproducible():
    seed = fresh_seed()
    q, k, v = random_qkv(seed, 2, 70, 70, 4, 2, 32)
    bias = jax.random.normal(jax.random.key(seed), (1, 4, 70, 70))
    rng = jax.random.key(seed + 1)
    g = jax.jit(jax.grad(lambda q, k, v, b: jnp.sum(jfa.flash_attention(
        q, k, v, bias=b, dropout_rate=0.1, dropout_rng=rng, deterministic=True) ** 2),
        argnums=(0, 1, 2, 3)))
    first, second = g(q, k, v, bias), g(q, k, v, bias)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
