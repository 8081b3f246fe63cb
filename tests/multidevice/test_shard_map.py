"""The public functions inside shard_map, with check_vma=True (JAX's default, which types how values
vary over the manual axes) and check_vma=False: outputs, LSE and gradients equal the unsharded call,
for operands split over the batch and for queries split with K/V (and a bias) replicated."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_flashattn as jfa
from conftest import cpu_mesh
from util import fresh_seed, random_qkv, rel_err


def loss_and_grads_in_shard_map(loss, mesh, specs, check_vma, args, num_diff):
    """Gradients of the sum over devices of loss(*args) w.r.t. its first num_diff arguments,
    computed inside shard_map. With check_vma=False JAX does not track replication, so the
    gradients of replicated arguments are summed by hand."""
    diff = tuple(range(num_diff))

    def body(*a):
        if check_vma:
            return jax.grad(lambda *x: jax.lax.psum(loss(*x), "x"), argnums=diff)(*a)
        grads = jax.grad(loss, argnums=diff)(*a)
        return tuple(g if spec != P() else jax.lax.psum(g, "x") for g, spec in zip(grads, specs))

    f = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=tuple(specs[:num_diff]),
                      check_vma=check_vma)
    return jax.jit(f)(*args)


def weighted(out, lse, w_out, w_lse):
    return jnp.sum(out * w_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse * w_lse, 0.0))


def assert_close(xs, refs, seed, bound=2e-6):
    for i, (x, ref) in enumerate(zip(xs, refs)):
        assert rel_err(x, ref) <= bound, f"seed {seed}: item {i} error {rel_err(x, ref)}"


@pytest.mark.parametrize("check_vma", [True, False], ids=["check_vma", "no_check_vma"])
@pytest.mark.parametrize("layout", ["batch", "query"])
def test_flash_attention_in_shard_map(layout, check_vma):
    mesh = cpu_mesh((4,), ("x",))
    seed = fresh_seed()
    B, T, S, N, K, H = 4, 32, 24, 4, 2, 16
    q, k, v = random_qkv(seed, B, T, S, N, K, H)
    rng = np.random.default_rng(seed)
    w_out = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    w_lse = jnp.asarray(rng.normal(size=q.shape[:3]), jnp.float32)
    bias = jnp.asarray(rng.normal(size=(1, N, 1, S)), jnp.float32)  # replicated either way
    slopes = jnp.asarray(rng.uniform(0.05, 0.5, (N,)), jnp.float32)
    # Split over the batch every keyword is exact per device; split over the queries (K/V
    # replicated) the positions are the device's own, so only position-free keywords apply.
    kw = dict(is_causal=True, alibi_slopes=None) if layout == "batch" else dict(softcap=4.0)
    row = P("x") if layout == "batch" else P(None, "x")
    kv = P("x") if layout == "batch" else P()

    def loss(q, k, v, bias, slopes, w_out, w_lse):
        keywords = dict(kw, alibi_slopes=slopes) if layout == "batch" else kw
        out, lse = jfa.flash_attention(q, k, v, bias=bias, return_lse=True, **keywords)
        return weighted(out, lse, w_out, w_lse)

    specs = (row, kv, kv, P(), P(), row, row)
    args = (q, k, v, bias, slopes, w_out, w_lse)
    grads = loss_and_grads_in_shard_map(loss, mesh, specs, check_vma, args, 5)
    ref = jax.grad(loss, argnums=tuple(range(5)))(*args)
    if layout != "batch":
        grads, ref = grads[:4], ref[:4]  # no slopes in this layout: their gradient is 0
    assert_close(grads, ref, seed, bound=1e-5)

    forward = jax.shard_map(lambda q, k, v, bias: jfa.flash_attention(q, k, v, bias=bias,
                                                                       return_lse=True,
                                                                       **dict(kw, alibi_slopes=None)),
                            mesh=mesh, in_specs=(row, kv, kv, P()), out_specs=(row, row),
                            check_vma=check_vma)
    out = jax.jit(forward)(q, k, v, bias)
    assert_close(out, jfa.flash_attention(q, k, v, bias=bias, return_lse=True,
                                          **dict(kw, alibi_slopes=None)), seed)


@pytest.mark.parametrize("check_vma", [True, False], ids=["check_vma", "no_check_vma"])
def test_drop_in_and_varlen_in_shard_map(check_vma):
    mesh = cpu_mesh((4,), ("x",))
    seed = fresh_seed()
    q, k, v = random_qkv(seed, 4, 16, 16, 4, 4, 16)
    w = jax.random.normal(jax.random.key(seed + 2), q.shape)

    def drop_in(q, k, v, w):
        return jnp.sum(jfa.dot_product_attention(q, k, v, is_causal=True) * w)

    specs = (P("x"),) * 4
    grads = loss_and_grads_in_shard_map(drop_in, mesh, specs, check_vma, (q, k, v, w), 3)
    assert_close(grads, jax.grad(drop_in, argnums=(0, 1, 2))(q, k, v, w), seed)

    # Each device packs its own rows (the same offsets everywhere).
    cu = jnp.asarray([0, 10, 25, 32], jnp.int32)
    x = jax.random.normal(jax.random.key(seed + 3), (4 * 32, 4, 16))
    wx = jax.random.normal(jax.random.key(seed + 4), x.shape)

    def varlen(x, wx, cu):
        out = jfa.varlen_attention(x, x, x, cu, None, max_seqlen_q=16, max_seqlen_k=16, is_causal=True)
        return jnp.sum(out * wx)

    specs = (P("x"), P("x"), P())
    grads = loss_and_grads_in_shard_map(varlen, mesh, specs, check_vma, (x, wx, cu), 1)
    ref = jnp.concatenate([jax.grad(varlen)(x[i * 32:(i + 1) * 32], wx[i * 32:(i + 1) * 32], cu)
                           for i in range(4)])
    assert_close(grads, (ref,), seed)
