"""context_parallel_attention with valid lengths, a bias and a boolean mask: outputs, LSE and the
gradients of q, k, v and the bias equal flash_attention on the whole sequence on one device, for
both strategies, causal (load-balanced or in sequence order) and not, with GQA and segment ids;
and the calls it refuses."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_flashattn as jfa
from conftest import cpu_mesh
from util import fresh_seed, random_qkv, rel_err


def problem(seed, *, B=3, T=40, N=4, K=2, H=16, bias_shape=None, mask_shape=None):
    """Random q, k, v, segment ids, cotangents, a bias and a mask of the given shapes (None for
    none), and lengths that cut chunks anywhere: one batch element with fewer valid keys than
    queries, one with every query valid, one with arbitrary lengths."""
    q, k, v = random_qkv(seed, B, T, T, N, K, H)
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), axis=1), jnp.int32)
    q_len = np.array([rng.integers(T // 2, T), T, rng.integers(0, T + 1)])[:B]
    kv_len = np.array([rng.integers(1, q_len[0]), rng.integers(0, T), rng.integers(0, T + 1)])[:B]
    bias = None if bias_shape is None else jnp.asarray(rng.normal(size=bias_shape), jnp.float32)
    mask = None if mask_shape is None else jnp.asarray(rng.random(mask_shape) < 0.85)
    cotangents = (jnp.asarray(rng.normal(size=q.shape), jnp.float32),
                  jnp.asarray(rng.normal(size=q.shape[:3]), jnp.float32))
    return (q, k, v, ids, bias, mask, jnp.asarray(q_len, jnp.int32), jnp.asarray(kv_len, jnp.int32),
            cotangents)


def context_parallel(mesh, n, balanced, check_vma=True, **kw):
    """flash_attention's (out, lse) of global arrays (bias and mask [B|1, N|1, T|1, S|1] in
    sequence order), computed by context_parallel_attention over mesh axis 'cp': the inputs are
    put in the load-balanced layout (the bias and mask on both sequence axes), the query axis of
    the bias and mask is sharded like the queries, and their key axis is passed whole."""
    def arrange(x, axes, inverse=False):
        for axis in axes:
            if balanced and x is not None and x.shape[axis] != 1:
                x = jfa.load_balance(x, axis, n, inverse=inverse)
        return x

    def pairwise_spec(x):
        return P() if x is None or x.shape[2] == 1 else P(None, None, "cp")

    seq = P(None, "cp")

    def f(q, k, v, ids, bias, mask, q_len, kv_len):
        body = jax.shard_map(
            lambda q, k, v, ids, bias, mask, q_len, kv_len: jfa.context_parallel_attention(
                q, k, v, axis_name="cp", load_balanced=balanced, return_lse=True,
                q_segment_ids=ids, kv_segment_ids=ids, bias=bias, mask=mask,
                query_seq_lengths=q_len, key_value_seq_lengths=kv_len, **kw),
            mesh=mesh, in_specs=(seq,) * 4 + (pairwise_spec(bias), pairwise_spec(mask), P(), P()),
            out_specs=(seq, seq), check_vma=check_vma)
        out, lse = body(*(arrange(x, [1]) for x in (q, k, v, ids)), arrange(bias, [2, 3]),
                        arrange(mask, [2, 3]), q_len, kv_len)
        return arrange(out, [1], inverse=True), arrange(lse, [1], inverse=True)
    return f


def single_device(q, k, v, ids, bias, mask, q_len, kv_len, **kw):
    kw = {name: x for name, x in kw.items() if name != "strategy"}
    return jfa.flash_attention(q, k, v, return_lse=True, q_segment_ids=ids, kv_segment_ids=ids,
                               bias=bias, mask=mask, query_seq_lengths=q_len,
                               key_value_seq_lengths=kv_len, **kw)


def forward_and_grads(f, q, k, v, ids, bias, mask, q_len, kv_len, cotangents):
    """f's (out, lse) and the gradients of q, k, v (and the bias, when given)."""
    if bias is None:
        outs, vjp = jax.vjp(lambda q, k, v: f(q, k, v, ids, None, mask, q_len, kv_len), q, k, v)
    else:
        outs, vjp = jax.vjp(lambda q, k, v, bias: f(q, k, v, ids, bias, mask, q_len, kv_len),
                            q, k, v, bias)
    return outs, vjp(cotangents)


def assert_matches(seed, got, ref, bound=2e-6):
    (out, lse), grads = got
    (r_out, r_lse), r_grads = ref
    finite = np.isfinite(np.asarray(r_lse))
    assert np.array_equal(np.isfinite(np.asarray(lse)), finite), f"seed {seed}: masked rows differ"
    assert not np.any(np.asarray(out)[~finite]), f"seed {seed}: masked rows must be 0"
    assert rel_err(out, r_out) <= bound, f"seed {seed}: out {rel_err(out, r_out)}"
    assert rel_err(np.where(finite, lse, 0), np.where(finite, r_lse, 0)) <= bound, f"seed {seed}: lse"
    assert len(grads) == len(r_grads)
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, r_grads):
        assert g.shape == r.shape and g.dtype == r.dtype, (name, g.shape, r.shape)
        assert rel_err(g, r) <= 4 * bound, f"seed {seed}: {name} {rel_err(g, r)}"


# Which keywords each case passes: both lengths with a full bias and a per-head mask; only query
# lengths with a per-query-row bias (the bottom-right prefix path of all_gather) and a full mask;
# only key lengths with a key bias and a key-padding mask that every device holds whole.
KEYWORDS = {
    "lengths-bias-mask": dict(bias=(3, 4, 40, 40), mask=(1, 4, 40, 40), lengths=("q", "kv")),
    "q_lengths-row_bias": dict(bias=(3, 1, 40, 1), mask=(3, 4, 40, 40), lengths=("q",)),
    "kv_lengths-key_bias": dict(bias=(1, 4, 1, 40), mask=(3, 1, 1, 40), lengths=("kv",)),
}
LAYOUTS = {"causal-balanced": (True, True), "causal-sequence": (True, False),
           "full-sequence": (False, False)}
CASES = [(strategy, layout, keywords) for strategy in ("ring", "all_gather") for layout in LAYOUTS
         for keywords in KEYWORDS]


@pytest.mark.parametrize("strategy,layout,keywords", CASES, ids=["-".join(c) for c in CASES])
def test_matches_single_device(strategy, layout, keywords):
    n = 4
    mesh = cpu_mesh((n,), ("cp",))
    seed = fresh_seed()
    spec = KEYWORDS[keywords]
    q, k, v, ids, bias, mask, q_len, kv_len, cotangents = problem(
        seed, bias_shape=spec["bias"], mask_shape=spec["mask"])
    q_len = q_len if "q" in spec["lengths"] else None
    kv_len = kv_len if "kv" in spec["lengths"] else None
    is_causal, balanced = LAYOUTS[layout]
    kw = dict(strategy=strategy, is_causal=is_causal)
    args = (q, k, v, ids, bias, mask, q_len, kv_len, cotangents)
    got = jax.jit(lambda *a: forward_and_grads(context_parallel(mesh, n, balanced, **kw), *a))(*args)
    ref = forward_and_grads(lambda *a: single_device(*a, **kw), *args)
    assert_matches(seed, got, ref)


@pytest.mark.parametrize("n,check_vma", [(2, True), (8, True), (4, False)],
                         ids=["2dev", "8dev", "4dev-no_check_vma"])
@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_other_device_counts_and_check_vma(strategy, n, check_vma):
    mesh = cpu_mesh((n,), ("cp",))
    seed = fresh_seed()
    # The bias is shared by the batch; the key bias of check_vma=False is replicated (P()), whose
    # gradient is the sum of every device's share.
    bias_shape = (1, 6, 48, 48) if check_vma else (1, 6, 1, 48)
    q, k, v, ids, bias, mask, q_len, kv_len, cotangents = problem(
        seed, T=48, N=6, K=3, bias_shape=bias_shape, mask_shape=(3, 1, 48, 48))
    kw = dict(strategy=strategy, is_causal=True, softcap=4.0)
    args = (q, k, v, ids, bias, mask, q_len, kv_len, cotangents)
    f = context_parallel(mesh, n, True, check_vma, **kw)
    got = jax.jit(lambda *a: forward_and_grads(f, *a))(*args)
    ref = forward_and_grads(lambda *a: single_device(*a, **kw), *args)
    assert_matches(seed, got, ref)


@pytest.mark.parametrize("extra", ["plain", "alibi", "window"])
@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_chunks_of_one_row_with_a_full_bias(strategy, extra):
    """Two rows per device, load-balanced: every kernel call covers one query row or one key, so
    its d(bias) has size-1 axes that are still the bias's own (to be placed, not broadcast)."""
    n = 4
    mesh = cpu_mesh((n,), ("cp",))
    seed = fresh_seed()
    q, k, v, ids, bias, mask, q_len, kv_len, cotangents = problem(
        seed, B=2, T=2 * n, N=2, K=1, bias_shape=(2, 2, 2 * n, 2 * n))
    extras = {"plain": {}, "alibi": dict(alibi_slopes=jnp.array([0.3, 0.7])),
              "window": dict(local_window_size=(2, 1))}[extra]
    kw = dict(strategy=strategy, is_causal=True, **extras)
    args = (q, k, v, ids, bias, None, q_len, None, cotangents)
    got = jax.jit(lambda *a: forward_and_grads(context_parallel(mesh, n, True, **kw), *a))(*args)
    ref = forward_and_grads(lambda *a: single_device(*a, **kw), *args)
    assert_matches(seed, got, ref)


def test_bottom_right_without_causality_or_lengths_is_accepted():
    mesh = cpu_mesh((4,), ("cp",))
    seed = fresh_seed()
    q, k, v, ids, bias, mask, q_len, kv_len, cotangents = problem(seed, bias_shape=(3, 4, 40, 40))
    for kw, lengths in ((dict(is_causal=False), (q_len, kv_len)), (dict(is_causal=True), (None, None))):
        kw = dict(kw, strategy="ring", causal_alignment="bottom_right")
        args = (q, k, v, ids, bias, None, *lengths, cotangents)
        # Without causality the inputs are in sequence order whatever load_balanced says.
        f = context_parallel(mesh, 4, kw["is_causal"], **kw)
        got = jax.jit(lambda *a: forward_and_grads(f, *a))(*args)
        ref = forward_and_grads(lambda *a: single_device(*a, **kw), *args)
        assert_matches(seed, got, ref)


def refused(**kw):
    """context_parallel_attention on 2 devices with these keywords (local blocks of 8 of 16)."""
    mesh = cpu_mesh((2,), ("cp",))
    q, k, v = random_qkv(0, 2, 16, 16, 4, 2, 8)
    f = jax.shard_map(lambda q, k, v: jfa.context_parallel_attention(q, k, v, axis_name="cp", **kw),
                      mesh=mesh, in_specs=(P(None, "cp"),) * 3, out_specs=P(None, "cp"))
    return f(q, k, v)


def test_bad_bias_mask_and_lengths_name_the_argument():
    with pytest.raises(ValueError, match=r"bias of shape \(2, 4, 8, 8\).*\(2, 4, 8, 16\)"):
        refused(bias=jnp.zeros((2, 4, 8, 8)))  # the key axis must hold every key
    with pytest.raises(ValueError, match=r"mask of shape \(3, 1, 1, 16\)"):
        refused(mask=jnp.ones((3, 1, 1, 16), bool))
    with pytest.raises(TypeError, match="mask must be a boolean"):
        refused(mask=jnp.ones((1, 1, 1, 16), jnp.int32))
    with pytest.raises(TypeError, match="PackedMask.*unpack"):
        refused(mask=jfa.pack_mask(jnp.ones((1, 1, 8, 16), bool)))
    with pytest.raises(ValueError, match=r"key_value_seq_lengths must have shape \(2,\)"):
        refused(key_value_seq_lengths=jnp.ones((2, 1), jnp.int32))
    with pytest.raises(TypeError, match="query_seq_lengths must be int32"):
        refused(query_seq_lengths=jnp.ones(2, jnp.int64 if jax.config.jax_enable_x64 else jnp.float32))
