"""jit, vmap (any in_axes, nested, of grad), jacrev, the jaxpr, and the compiled memory."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn as jfa
from jax_flashattn.reference import attention_reference
from util import fresh_seed, random_qkv, rel_err


def _ref_out(q, k, v, **kw):
    return attention_reference(q, k, v, **kw)[0]


def test_jit_and_eager_agree():
    q, k, v = random_qkv(fresh_seed(), 2, 31, 45, 4, 2, 64)
    eager = jfa.flash_attention(q, k, v, is_causal=True)
    jitted = jax.jit(jfa.flash_attention, static_argnames=("is_causal",))(q, k, v, is_causal=True)
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))


@pytest.mark.parametrize("in_axes", [(0, 0, 0), (0, None, None), (None, 0, 0), (2, 1, 1),
                                     (None, None, 0)], ids=str)
def test_vmap_any_in_axes(in_axes):
    """vmap over unbatched TNH inputs with every mix of mapped and unmapped operands."""
    seed = fresh_seed()
    V, T, S, N, K, H = 3, 19, 27, 4, 2, 32
    q, k, v = random_qkv(seed, V, T, S, N, K, H)  # leading axis: the mapped one

    def place(x, axis):
        return x[0] if axis is None else jnp.moveaxis(x, 0, axis)

    args = [place(x, a) for x, a in zip((q, k, v), in_axes)]
    f = lambda q, k, v: jfa.flash_attention(q, k, v, is_causal=True, return_lse=True)  # noqa
    out, lse = jax.vmap(f, in_axes=in_axes)(*args)
    full = [x if a is not None else jnp.broadcast_to(x[0], x.shape) for x, a in
            zip((q, k, v), in_axes)]
    ref_out, ref_lse = attention_reference(*full, is_causal=True)
    assert rel_err(out, ref_out) <= 1e-5 and rel_err(lse, ref_lse) <= 1e-5, f"seed {seed}"


@pytest.mark.parametrize("bias_mapped", [False, True], ids=["shared-bias", "mapped-bias"])
def test_vmap_behind_the_batch_axis_with_every_operand(bias_mapped):
    """vmap over an axis behind the batch axis ([B, V, T, N, H], in_axes=1: folded batch-major)
    equals a loop over the instances, forward and the gradients of q, k, v, the bias and the
    slopes, with segment ids mapped, lengths, slopes and the dropout key shared."""
    seed = fresh_seed()
    B, V, T, S, N, K, H = 2, 3, 13, 17, 4, 2, 16
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.moveaxis(x.reshape((V, B) + x.shape[1:]), 0, 1)
               for x in random_qkv(seed, V * B, T, S, N, K, H))
    bias = jnp.asarray(rng.normal(size=(B, V, 1, T, S) if bias_mapped else (1, N, T, S)), jnp.float32)
    q_ids = jnp.asarray(np.sort(rng.integers(0, 2, (B, V, T)), axis=-1), jnp.int32)
    kv_ids = jnp.asarray(np.sort(rng.integers(0, 2, (B, V, S)), axis=-1), jnp.int32)
    slopes = jnp.asarray(rng.uniform(0.05, 0.5, (N,)), jnp.float32)
    lengths = jnp.asarray([S, S - 5], jnp.int32)
    weights = jnp.asarray(rng.normal(size=(B, V, T, N, H)), jnp.float32)

    def attend(q, k, v, bias, q_ids, kv_ids, slopes):
        return jfa.flash_attention(q, k, v, bias=bias, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                                   alibi_slopes=slopes, key_value_seq_lengths=lengths, is_causal=True,
                                   dropout_rate=0.25, dropout_rng=jax.random.key(seed % 1000))

    bias_axis = 1 if bias_mapped else None

    def vmapped(q, k, v, bias, slopes):
        out = jax.vmap(attend, in_axes=(1, 1, 1, bias_axis, 1, 1, None), out_axes=1)(
            q, k, v, bias, q_ids, kv_ids, slopes)
        return jnp.sum(out * weights), out

    def looped(q, k, v, bias, slopes):
        out = jnp.stack([attend(q[:, i], k[:, i], v[:, i], bias[:, i] if bias_mapped else bias,
                                q_ids[:, i], kv_ids[:, i], slopes) for i in range(V)], axis=1)
        return jnp.sum(out * weights), out

    grads, out = jax.grad(vmapped, argnums=(0, 1, 2, 3, 4), has_aux=True)(q, k, v, bias, slopes)
    ref_grads, ref_out = jax.grad(looped, argnums=(0, 1, 2, 3, 4), has_aux=True)(q, k, v, bias, slopes)
    assert rel_err(out, ref_out) <= 1e-6, f"seed {seed}: out"
    for name, g, r in zip(("dq", "dk", "dv", "dbias", "dslopes"), grads, ref_grads):
        assert g.shape == r.shape and rel_err(g, r) <= 1e-5, f"seed {seed}: {name} {rel_err(g, r)}"


def test_nested_vmap():
    seed = fresh_seed()
    q, k, v = random_qkv(seed, 6, 17, 23, 2, 1, 32)
    shaped = [x.reshape((2, 3) + x.shape[1:]) for x in (q, k, v)]
    out = jax.vmap(jax.vmap(jfa.flash_attention))(*shaped)  # maps over TNH
    ref = _ref_out(q, k, v).reshape(out.shape)
    assert rel_err(out, ref) <= 1e-5, f"seed {seed}"


def test_vmap_of_grad():
    seed = fresh_seed()
    q, k, v = random_qkv(seed, 3, 15, 21, 4, 2, 32)

    def loss(fn, q, k, v):
        return jnp.sum(jnp.tanh(fn(q, k, v)))

    ours = jax.vmap(jax.grad(lambda q, k, v: loss(jfa.flash_attention, q, k, v),
                             argnums=(0, 1, 2)))(q, k, v)
    ref = jax.grad(lambda q, k, v: loss(_ref_out, q, k, v), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(ours, ref):
        assert rel_err(g, r) <= 4e-5, f"seed {seed}"


def test_grad_of_vmap_with_unmapped_keys():
    seed = fresh_seed()
    q, k, v = random_qkv(seed, 4, 11, 13, 2, 2, 16)

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.sin(jax.vmap(fn, in_axes=(0, None, None))(q, k, v)))

    ours = jax.grad(loss(jfa.flash_attention), argnums=(0, 1, 2))(q, k[0], v[0])
    ref = jax.grad(loss(lambda q, k, v: _ref_out(q[None], k[None], v[None])[0]),
                   argnums=(0, 1, 2))(q, k[0], v[0])
    for g, r in zip(ours, ref):
        assert rel_err(g, r) <= 4e-5, f"seed {seed}"


def test_jacrev_matches_reference():
    seed = fresh_seed()
    q, k, v = random_qkv(seed, 1, 5, 6, 2, 1, 4)
    ours = jax.jacrev(lambda q, k, v: jfa.flash_attention(q, k, v, is_causal=True),
                      argnums=(0, 1, 2))(q, k, v)
    ref = jax.jacrev(lambda q, k, v: _ref_out(q, k, v, is_causal=True), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(ours, ref):
        assert rel_err(g, r) <= 4e-5, f"seed {seed}"


def test_jaxpr_shows_our_primitives():
    q, k, v = random_qkv(fresh_seed(), 1, 8, 8, 2, 2, 16)
    fwd = str(jax.make_jaxpr(jfa.flash_attention)(q, k, v))
    assert "jfa_attention_fwd" in fwd
    grad = str(jax.make_jaxpr(jax.grad(lambda q: jnp.sum(jfa.flash_attention(q, k, v))))(q))
    assert "jfa_attention_bwd" in grad and "dot_general" not in grad


def test_compiled_memory_has_no_txs_buffer():
    """Temporaries of the compiled forward+backward stay far below one T×S float32 matrix."""
    T = S = 2048
    q, k, v = random_qkv(fresh_seed(), 1, T, S, 2, 2, 64)

    def loss(q, k, v):
        return jnp.sum(jfa.flash_attention(q, k, v, is_causal=True))

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
    stats = compiled.memory_analysis()
    if stats is None:
        pytest.skip("this backend reports no memory analysis")
    assert stats.temp_size_in_bytes < T * S * 4 // 4, stats.temp_size_in_bytes
    # The same check on jax.nn's XLA path does find such a buffer (the check can fail).
    peer = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jax.nn.dot_product_attention(
        q, k, v, is_causal=True)), argnums=(0, 1, 2))).lower(q, k, v).compile()
    assert peer.memory_analysis().temp_size_in_bytes >= T * S * 4


@pytest.mark.parametrize("slopes_shape,mapped", [("N", False), ("N", True), ("BN", False)],
                         ids=["shared", "mapped", "per_batch"])
def test_alibi_slope_gradient_under_vmap(slopes_shape, mapped):
    """vmap of grad: d(slopes) per vmapped instance, summed over the batch for [N] slopes; the
    slopes' dtype (bfloat16 here) is kept for their gradient."""
    seed = fresh_seed()
    V, B, T, S, N, K, H = 2, 3, 21, 30, 4, 2, 16
    q, k, v = random_qkv(seed, V * B, T, S, N, K, H)
    q, k, v = (x.reshape((V, B) + x.shape[1:]) for x in (q, k, v))
    rng = np.random.default_rng(seed)
    shape = (N,) if slopes_shape == "N" else (B, N)
    slopes = jnp.asarray(rng.uniform(0.05, 0.5, ((V,) if mapped else ()) + shape), jnp.bfloat16)

    def loss(fn):
        return lambda s, q, k, v: jnp.sum(jnp.tanh(fn(q, k, v, s)))

    ours_fn = lambda q, k, v, s: jfa.flash_attention(q, k, v, is_causal=True, alibi_slopes=s)  # noqa
    ref_fn = lambda q, k, v, s: _ref_out(q, k, v, is_causal=True, alibi_slopes=s.astype(jnp.float32))  # noqa
    in_axes = (0 if mapped else None, 0, 0, 0)
    ours = jax.vmap(jax.grad(loss(ours_fn)), in_axes=in_axes)(slopes, q, k, v)
    ref = jax.vmap(jax.grad(loss(ref_fn)), in_axes=in_axes)(slopes.astype(jnp.float32), q, k, v)
    assert ours.dtype == jnp.bfloat16 and ours.shape == (V,) + shape
    assert rel_err(ours, ref) <= 1e-2, f"seed {seed}: {rel_err(ours, ref)}"  # bfloat16 rounding


@pytest.mark.parametrize("function", ["flash_attention", "sparse_attention"])
def test_forward_mode_of_the_gradient_says_it_is_unsupported(function):
    """jax.hessian / jacfwd(grad) reach the kernels' primitives in forward mode: a clear error,
    not JAX's bare "differentiation rule not implemented"."""
    q, k, v = random_qkv(fresh_seed(), 1, 9, 9, 2, 1, 16)
    if function == "flash_attention":
        loss = lambda q: jnp.sum(jfa.flash_attention(q, k, v, is_causal=True))  # noqa: E731
    else:
        indices = jnp.zeros((1, 9, 1, 4), jnp.int32)
        loss = lambda q: jnp.sum(jfa.sparse_attention(q, k, v, indices))  # noqa: E731
    with pytest.raises(NotImplementedError, match="reverse-mode gradients only.*jax.hessian"):
        jax.hessian(loss)(q)
