"""A call on one block of a longer sequence (the `positions` operand: where its query row 0 and key
0 sit, as context parallelism and sequence sharding call the kernels) against the whole sequence
with every other key masked out: causality, windows, ALiBi and the dropout stream must see the
global positions. Forward, LSE and every gradient, on the CPU and (marked gpu) the CUDA kernels."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn as jfa
from jax_flashattn import _options
from jax_flashattn.autodiff import attention
from util import fresh_seed, random_qkv, rel_err

# The whole sequence; the block's query rows and keys (the key start a multiple of 8, as dropout
# needs).
B, T_ALL, N, K, H = 2, 300, 4, 2, 64
ROWS, KEYS = (67, 167), (120, 212)

FEATURES = {
    "causal": dict(is_causal=True),
    "window": dict(local_window_size=(40, 9)),
    "alibi": dict(alibi_slopes=jnp.linspace(0.05, 0.4, N, dtype=jnp.float32)),
    "causal_window_alibi": dict(is_causal=True, local_window_size=(70, 0),
                                alibi_slopes=jnp.linspace(0.05, 0.4, N, dtype=jnp.float32)),
    "dropout": dict(dropout_rate=0.2),
    "causal_dropout_softcap": dict(is_causal=True, dropout_rate=0.1, softcap=3.0),
}


def _whole_and_block(feature, dtype, seed):
    """(whole, block): (out, lse, dq, dk, dv) of the whole sequence with only the block's keys
    visible, cut to the block, and of the block called with its positions."""
    q, k, v = random_qkv(seed, B, T_ALL, T_ALL, N, K, H, dtype=dtype)
    keywords = dict(FEATURES[feature])
    if keywords.get("dropout_rate"):
        keywords["dropout_rng"] = jax.random.key(seed + 1)
    (r0, r1), (c0, c1) = ROWS, KEYS
    do = jax.random.normal(jax.random.key(seed + 2), (B, r1 - r0, N, H), jnp.float32)
    dlse = jax.random.normal(jax.random.key(seed + 3), (B, r1 - r0, N), jnp.float32)
    key_visible = (jnp.arange(T_ALL) >= c0) & (jnp.arange(T_ALL) < c1)

    def whole(q, k, v):
        out, lse = jfa.flash_attention(q, k, v, mask=key_visible[None, None, None], return_lse=True,
                                       **keywords)
        return out[:, r0:r1], lse[:, r0:r1]

    def block(q, k, v):
        config, extras = _options.canonicalize(
            q.shape, False, k_len=k.shape[1], positions=jnp.array([r0, c0], jnp.int32), **keywords)
        return attention(q, k, v, 1.0 / np.sqrt(H), config, extras, None)

    def run(fn, q, k, v):
        (out, lse), vjp = jax.vjp(fn, q, k, v)
        return (out, lse) + vjp((do.astype(out.dtype), dlse))

    w = run(whole, q, k, v)
    w = w[:2] + (w[2][:, r0:r1], w[3][:, c0:c1], w[4][:, c0:c1])
    b = run(block, q[:, r0:r1], k[:, c0:c1], v[:, c0:c1])
    return w, b


def _check(feature, dtype, bound):
    seed = fresh_seed()
    whole, block = _whole_and_block(feature, dtype, seed)
    lse_w, lse_b = (np.asarray(x) for x in (whole[1], block[1]))
    assert np.array_equal(np.isfinite(lse_w), np.isfinite(lse_b)), f"seed {seed}: rows seeing no key differ"
    finite = np.isfinite(lse_w)
    assert np.abs(lse_w[finite] - lse_b[finite]).max() <= 10 * bound, f"seed {seed}: lse"
    for name, w, b in zip(("out", "lse", "dq", "dk", "dv"), whole, block):
        if name != "lse":
            assert rel_err(b, w) <= bound, f"seed {seed}: {name} {rel_err(b, w):.2e}"


@pytest.mark.parametrize("feature", list(FEATURES))
def test_block_sees_global_positions(feature):
    _check(feature, jnp.float32, 1e-5)


def test_positions_need_non_negative_values():
    q, k, v = random_qkv(0, 1, 8, 8, 1, 1, 16)
    config, extras = _options.canonicalize(q.shape, False, k_len=8, is_causal=True,
                                           positions=jnp.array([-1, 0], jnp.int32))
    with pytest.raises(Exception, match="positions must be non-negative"):
        jax.block_until_ready(attention(q, k, v, 0.25, config, extras, None))


def test_positions_shape_is_checked():
    with pytest.raises(ValueError, match=r"positions must be int32 \[2\] or \[B, 2\]"):
        _options.canonicalize((2, 8, 1, 16), False, k_len=8, positions=jnp.zeros((3,), jnp.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_block_sees_global_positions_gpu(feature, portable, monkeypatch):
    if portable:
        monkeypatch.setenv("JFA_FORCE_SM80", "1")
    _check(feature, jnp.bfloat16, 2e-2)
