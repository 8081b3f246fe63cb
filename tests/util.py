"""Shared test helpers: fresh random inputs, the float32 reference, relative errors."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_flashattn.reference import attention_reference

# Relative-error bounds against the float32 reference (DESIGN.md): forward, gradients.
BOUNDS = {jnp.float32: (1e-5, 4e-5), jnp.float16: (3e-3, 1.2e-2), jnp.bfloat16: (2e-2, 8e-2)}


def child_pytest_env(**overrides) -> dict:
    """The environment for a child pytest run: this one's, without pytest-xdist's worker variables
    (a child of a worker would take itself for one, and print no failures: tests/conftest.py)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_XDIST_")}
    env.update(overrides)
    return env


def fresh_seed() -> int:
    """A new seed each run (never the same inputs twice); failures print it."""
    return int.from_bytes(os.urandom(4), "little")


def random_qkv(seed, B, T, S, N, K, H, Hv=None, dtype=jnp.float32):
    Hv = H if Hv is None else Hv
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    shapes = ((B, T, N, H), (B, S, K, H), (B, S, K, Hv))
    return tuple(jax.random.normal(key, shape, jnp.float32).astype(dtype)
                 for key, shape in zip((kq, kk, kv), shapes))


def rel_err(x, ref, floor=1e-30) -> float:
    """|x - ref| / |ref| (Frobenius norms), the denominator at least `floor`."""
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    assert x.shape == ref.shape, (x.shape, ref.shape)
    assert np.all(np.isfinite(x)), "non-finite values in the result"
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), floor))


def nested_eqns(jaxpr):
    """Every equation of a jaxpr, nested ones (pjit, custom_vjp, shard_map, switch branches) included."""
    for e in jaxpr.eqns:
        yield e
        for p in e.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else [p]):
                inner = sub if hasattr(sub, "eqns") else getattr(sub, "jaxpr", None)  # Jaxpr or ClosedJaxpr
                if inner is not None:
                    yield from nested_eqns(getattr(inner, "jaxpr", inner))


def reference_with_grads(q, k, v, do, dlse, *, scale=None, is_causal=False):
    """Float32 reference (out, lse) and the gradients of <out, do> + <lse, dlse>."""
    up = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731

    def f(q, k, v):
        return attention_reference(q, k, v, scale=scale, is_causal=is_causal)

    (out, lse), vjp = jax.vjp(f, up(q), up(k), up(v))
    return out, lse, vjp((up(do), up(dlse)))


def compare_with_reference(seed, shape, kw, *, dtype=jnp.float32, bias=None, ref_kw=None):
    """Forward (out, lse) and the gradients of <out, do> + <lse, dlse> for q, k, v (and bias),
    ours (jitted) against the float32 reference with the same keywords; asserts the bounds.

    kw holds every keyword but bias; ref_kw, if given, replaces kw for the reference (dropout).
    ALiBi slopes in kw are differentiated too (both sides take the same slopes).
    Rows the reference leaves fully masked must give out = 0 and lse = -inf exactly.
    """
    import jax_flashattn as jfa
    B, T, S, N, K, H = shape
    q, k, v = random_qkv(seed, B, T, S, N, K, H, dtype=dtype)
    keys = jax.random.split(jax.random.key(seed + 1), 2)
    do = jax.random.normal(keys[0], (B, T, N, H)).astype(dtype)
    dlse = jax.random.normal(keys[1], (B, T, N), jnp.float32)
    ref_kw = kw if ref_kw is None else ref_kw
    slopes = kw.get("alibi_slopes")
    kw = {name: x for name, x in kw.items() if name != "alibi_slopes"}
    ref_kw = {name: x for name, x in ref_kw.items() if name != "alibi_slopes"}

    def ours(q, k, v, bias, slopes):
        return jfa.flash_attention(q, k, v, bias=bias, alibi_slopes=slopes, return_lse=True, **kw)

    def ref(q, k, v, bias, slopes):
        up = lambda x: None if x is None else jnp.asarray(x, jnp.float32)  # noqa: E731
        return attention_reference(up(q), up(k), up(v), bias=up(bias), alibi_slopes=slopes, **ref_kw)

    (out, lse), vjp = jax.vjp(jax.jit(ours), q, k, v, bias, slopes)
    (r_out, r_lse), r_vjp = jax.vjp(ref, q, k, v, bias, slopes)
    masked = ~np.isfinite(np.asarray(r_lse))
    dlse = jnp.where(masked, 0.0, dlse)
    grads, r_grads = vjp((do, dlse)), r_vjp((do.astype(jnp.float32), dlse))
    fwd_bound, grad_bound = BOUNDS[dtype]
    assert rel_err(out, r_out) <= fwd_bound, f"seed {seed}: out {rel_err(out, r_out)}"
    lse_np = np.asarray(lse)
    assert np.array_equal(~np.isfinite(lse_np), masked), f"seed {seed}: fully masked rows differ"
    assert np.all(np.isneginf(lse_np[masked])), f"seed {seed}: masked lse must be -inf"
    assert not np.any(np.asarray(out, np.float32)[masked]), f"seed {seed}: masked rows must be 0"
    assert rel_err(np.where(masked, 0, lse_np), np.where(masked, 0, r_lse)) <= fwd_bound, f"seed {seed}: lse"
    names = ("dq", "dk", "dv", "dbias", "dslopes")
    grads, r_grads = zip(*[(g, r) for g, r in zip(grads, r_grads) if g is not None])
    names = [name for name, x in zip(names, (q, k, v, bias, slopes)) if x is not None]
    # d(bias) of a bias broadcast over both T and S sums whole rows of dS, and a row of dS sums to
    # dlse (sum_j P_ij (dP_ij - D_i) = dlse_i): each element is a sum of random dlse_i over the
    # rows it covers, far smaller than its terms, and by chance near 0 (a scalar bias, float32,
    # T = 100, S = 130: relative errors of 4.7e-5, and 3.3e-4 for one seed). So its error is
    # measured against the size such a sum has on average, sqrt(sum of dlse_i^2), where that is
    # larger than the sum itself: the float32 rounding of P (from the saved LSE) is a fraction of
    # the terms, not of their sum.
    row_sums = bias is not None and bias.ndim == 4 and bias.shape[-2:] == (1, 1)
    for name, g, r in zip(names, grads, r_grads):
        assert g.shape == r.shape and g.dtype == r.dtype, (name, g.shape, r.shape, g.dtype, r.dtype)
        if name == "dbias" and row_sums:
            err = _row_sum_error(g, r, dlse, bias.shape)
            bound = max(grad_bound, 2e-4)
        else:
            err, bound = rel_err(g, r), grad_bound
        if name == "dslopes" and dtype != jnp.float32 and jax.default_backend() != "cpu":
            # d(slope) sums d(logit)·|pos_q - pos_k| over every pair, terms of both signs that largely
            # cancel, while the 16-bit rounding of O (in the backward's rowsum(dO·O)) adds an error of
            # one sign per row: relative to the sum it can reach 0.2 for one seed in bf16 (two heads;
            # seed 563773744 of test_mask_feature_on_gpu[tiles-alibi]: 0.23 on an H200, 0.19 with the
            # CPU kernels in bf16). The yardstick is then the CPU kernels' error in the same dtype, an
            # implementation checked in float32 to 4e-5 (tests/test_masks.py).
            cpu = jax.devices("cpu")[0]
            on_cpu = [None if x is None else jax.device_put(x, cpu) for x in (q, k, v, bias, slopes, do, dlse)]
            with jax.default_device(cpu):
                c_vjp = jax.vjp(jax.jit(ours), *on_cpu[:5])[1]
                c_g = c_vjp((on_cpu[5], on_cpu[6]))[4]
            bound = max(bound, 2 * rel_err(c_g, r) + grad_bound)
        assert err <= bound, f"seed {seed}: {name} error {err}"
    return out, lse, grads


def _row_sum_error(g, ref, dlse, bias_shape) -> float:
    """rel_err of a [B|1, N|1, 1, 1] d(bias), against at least the rms size of its sums of dlse."""
    sq = np.transpose(np.asarray(dlse, np.float64) ** 2, (0, 2, 1))[..., None]  # [B, N, T, 1]
    axes = tuple(a for a in range(4) if bias_shape[a] == 1)
    scale = np.sqrt(np.sum(sq, axis=axes, keepdims=True))
    return rel_err(g, ref, floor=max(float(np.linalg.norm(scale)), 1e-30))
