"""Gradients of flash_attention (through out and the differentiable LSE) against the reference."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn as jfa
from util import BOUNDS, fresh_seed, random_qkv, reference_with_grads, rel_err

SHAPES = [
    (2, 17, 17, 4, 4, 64, 64),
    (1, 1, 255, 4, 2, 64, 64),
    (1, 255, 1, 4, 1, 64, 64),
    (1, 255, 1000, 8, 2, 128, 128),
    (1, 1000, 255, 4, 1, 32, 32),
    (1, 17, 33, 2, 2, 256, 256),
    (1, 100, 130, 6, 3, 80, 48),
]


def _vjp_ours(q, k, v, do, dlse, is_causal):
    f = lambda q, k, v: jfa.flash_attention(q, k, v, is_causal=is_causal, return_lse=True)  # noqa
    (out, lse), vjp = jax.vjp(f, q, k, v)
    return out, lse, vjp((do, dlse))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16],
                         ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}S{}N{}K{}H{}Hv{}".format(*s))
def test_gradients_match_reference(shape, is_causal, dtype):
    seed = fresh_seed()
    B, T, S, N, K, H, Hv = shape
    q, k, v = random_qkv(seed, *shape, dtype=dtype)
    do = jax.random.normal(jax.random.key(seed + 1), (B, T, N, Hv)).astype(dtype)
    dlse = jax.random.normal(jax.random.key(seed + 2), (B, T, N), jnp.float32)
    _, _, grads = jax.jit(_vjp_ours, static_argnums=5)(q, k, v, do, dlse, is_causal)
    _, _, ref_grads = reference_with_grads(q, k, v, do, dlse, is_causal=is_causal)
    bound = BOUNDS[dtype][1]
    for name, g, r, x in zip("qkv", grads, ref_grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
        assert rel_err(g, r) <= bound, f"seed {seed}: d{name} error {rel_err(g, r)}"


def test_lse_gradient_alone():
    """A loss of the LSE only: its cotangent must reach q and k (and nothing reaches v)."""
    seed = fresh_seed()
    q, k, v = random_qkv(seed, 1, 45, 70, 4, 2, 64)
    u = jax.random.normal(jax.random.key(seed + 3), (1, 45, 4))

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v) * u)

    ours = jax.grad(lambda *a: loss(lambda *b: jfa.flash_attention(*b, return_lse=True)[1], *a),
                    argnums=(0, 1, 2))(q, k, v)
    _, _, ref = reference_with_grads(q, k, v, jnp.zeros((1, 45, 4, 64)), u)
    for name, g, r in zip("qk", ours[:2], ref[:2]):
        assert rel_err(g, r) <= 4e-5, f"seed {seed}: d{name}"
    assert not np.any(np.asarray(ours[2]))


def test_gradients_finite_differences():
    """Directional derivative of a scalar loss matches central differences (float32)."""
    seed = fresh_seed()
    q, k, v = random_qkv(seed, 1, 9, 13, 2, 1, 8)
    w = jax.random.normal(jax.random.key(seed + 4), (1, 9, 2, 8))

    def loss(q, k, v):
        out, lse = jfa.flash_attention(q, k, v, is_causal=True, return_lse=True)
        return jnp.sum(out * w) + jnp.sum(jnp.sin(lse))

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    dirs = random_qkv(seed + 5, 1, 9, 13, 2, 1, 8)
    eps = 1e-2
    plus = loss(*(x + eps * d for x, d in zip((q, k, v), dirs)))
    minus = loss(*(x - eps * d for x, d in zip((q, k, v), dirs)))
    numeric = (plus - minus) / (2 * eps)
    analytic = sum(jnp.sum(g * d) for g, d in zip(grads, dirs))
    np.testing.assert_allclose(analytic, numeric, rtol=2e-3, atol=2e-3)


def test_gradients_of_unbatched_inputs():
    seed = fresh_seed()
    q, k, v = random_qkv(seed, 1, 21, 34, 4, 4, 32)
    do = jax.random.normal(jax.random.key(seed + 6), (21, 4, 32))
    f = lambda q, k, v: jfa.flash_attention(q, k, v, is_causal=True)  # noqa: E731
    _, vjp = jax.vjp(f, q[0], k[0], v[0])
    grads = vjp(do)
    _, _, ref = reference_with_grads(q, k, v, do[None], jnp.zeros((1, 21, 4)), is_causal=True)
    for g, r in zip(grads, ref):
        assert rel_err(g, r[0]) <= 4e-5, f"seed {seed}"
