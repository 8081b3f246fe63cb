"""context_parallel_attention inside shard_map, with the sequence split over 2, 4 and 8 devices:
outputs, LSE and gradients equal flash_attention on the whole sequence on one device, for the ring
and the all-gather strategies, causal (load-balanced or not) and not, with GQA and segment ids of
documents that span devices, and with causality alone (which all_gather runs on the kernels' plain
path); and load_balance's layout."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_flashattn as jfa
from jax_flashattn._options import Extras
from conftest import COLLECTIVE, cpu_mesh
from util import fresh_seed, nested_eqns, random_qkv, rel_err

def problem(seed, B=2, T=64, N=4, K=2, H=16, dtype=jnp.float32):
    q, k, v = random_qkv(seed, B, T, T, N, K, H, dtype=dtype)
    rng = np.random.default_rng(seed)
    # Documents of random lengths, packed: their boundaries fall anywhere, across devices too.
    ids = jnp.asarray(np.sort(rng.integers(0, 5, (B, T)), axis=1), jnp.int32)
    do = jnp.asarray(rng.normal(size=q.shape), dtype)
    dlse = jnp.asarray(rng.normal(size=q.shape[:3]), jnp.float32)
    return q, k, v, ids, do, dlse


def context_parallel(mesh, n, *, layout, check_vma=True, segment_ids=True, **kw):
    """flash_attention's (out, lse) of global arrays, computed by context_parallel_attention with
    the sequence split over mesh axis 'cp' (reordered into and out of `layout`); the segment ids
    passed are used unless segment_ids=False."""
    order = (lambda x: jfa.load_balance(x, 1, n)) if layout == "balanced" else (lambda x: x)
    undo = (lambda x: jfa.load_balance(x, 1, n, inverse=True)) if layout == "balanced" else (lambda x: x)
    seq = P(None, "cp")
    ids_kw = (lambda ids: dict(q_segment_ids=ids, kv_segment_ids=ids)) if segment_ids else (lambda ids: {})

    def f(q, k, v, ids):
        body = jax.shard_map(
            lambda q, k, v, ids: jfa.context_parallel_attention(
                q, k, v, axis_name="cp", load_balanced=layout == "balanced", return_lse=True,
                **ids_kw(ids), **kw),
            mesh=mesh, in_specs=(seq,) * 4, out_specs=(seq, seq), check_vma=check_vma)
        out, lse = body(order(q), order(k), order(v), order(ids))
        return undo(out), undo(lse)
    return f


def single_device(q, k, v, ids, **kw):
    kw = {name: x for name, x in kw.items() if name != "strategy"}
    return jfa.flash_attention(q, k, v, return_lse=True, q_segment_ids=ids, kv_segment_ids=ids, **kw)


def forward_and_grads(f, q, k, v, ids, do, dlse):
    outs, vjp = jax.vjp(lambda q, k, v: f(q, k, v, ids), q, k, v)
    return outs, vjp((do, dlse))


def assert_matches(seed, got, ref, bound):
    (out, lse), grads = got
    (r_out, r_lse), r_grads = ref
    finite = np.isfinite(np.asarray(r_lse))
    assert np.array_equal(np.isfinite(np.asarray(lse)), finite), f"seed {seed}: masked rows differ"
    assert rel_err(out, r_out) <= bound, f"seed {seed}: out {rel_err(out, r_out)}"
    assert rel_err(np.where(finite, lse, 0), np.where(finite, r_lse, 0)) <= bound, f"seed {seed}: lse"
    for name, g, r in zip(("dq", "dk", "dv"), grads, r_grads):
        assert g.dtype == r.dtype and rel_err(g, r) <= 4 * bound, f"seed {seed}: {name} {rel_err(g, r)}"


CASES = [(n, strategy, causal) for n in (2, 4, 8) for strategy in ("ring", "all_gather")
         for causal in (False, True)]


@pytest.mark.parametrize("n,strategy,is_causal", CASES,
                         ids=[f"{n}dev-{s}-{'causal' if c else 'full'}" for n, s, c in CASES])
def test_matches_single_device(n, strategy, is_causal):
    mesh = cpu_mesh((n,), ("cp",))
    seed = fresh_seed()
    q, k, v, ids, do, dlse = problem(seed)
    kw = dict(strategy=strategy, is_causal=is_causal)
    got = jax.jit(lambda *a: forward_and_grads(context_parallel(mesh, n, layout="balanced", **kw), *a))(
        q, k, v, ids, do, dlse)
    ref = forward_and_grads(lambda q, k, v, ids: single_device(q, k, v, ids, **kw), q, k, v, ids, do, dlse)
    assert_matches(seed, got, ref, 2e-6)


def causal_only(mesh, n, layout, strategy, **kw):
    """context_parallel_attention's (out, lse) with causality and nothing else, on global arrays."""
    return context_parallel(mesh, n, layout=layout, segment_ids=False, strategy=strategy,
                            is_causal=True, **kw)


CAUSAL_ONLY = [(n, strategy, layout) for n in (2, 4, 8) for strategy in ("ring", "all_gather")
               for layout in ("balanced", "sequence")]


@pytest.mark.parametrize("n,strategy,layout", CAUSAL_ONLY,
                         ids=[f"{n}dev-{s}-{layout}" for n, s, layout in CAUSAL_ONLY])
def test_causality_alone_matches_single_device(n, strategy, layout):
    mesh = cpu_mesh((n,), ("cp",))
    seed = fresh_seed()
    q, k, v, ids, do, dlse = problem(seed, T=48)
    f = causal_only(mesh, n, layout, strategy)
    got = jax.jit(lambda *a: forward_and_grads(f, *a))(q, k, v, ids, do, dlse)
    ref = forward_and_grads(lambda q, k, v, ids: jfa.flash_attention(q, k, v, is_causal=True, return_lse=True),
                            q, k, v, ids, do, dlse)
    assert_matches(seed, got, ref, 2e-6)


def kernel_calls(f, *args):
    """(primitive name, config, operand shapes) of every attention kernel call f traces, the
    backward's included, in every branch of every switch."""
    jaxpr = jax.make_jaxpr(f)(*args)
    return [(e.primitive.name, e.params["config"], [x.aval.shape for x in e.invars])
            for e in nested_eqns(jaxpr.jaxpr) if e.primitive.name in ("jfa_attention_fwd", "jfa_attention_bwd")]


@pytest.mark.parametrize("layout", ["balanced", "sequence"])
def test_causal_all_gather_calls_are_plain(layout):
    """With causality alone, all_gather's kernel calls carry no positions (nor any other operand
    besides the tensors) and are top-left causal on a square diagonal block or full: the kernels'
    plain path, whose backward is faster than the general path's. A window needs positions."""
    mesh, n = cpu_mesh((4,), ("cp",)), 4
    q, k, v, ids, do, dlse = problem(0, T=32)
    tensors = {"jfa_attention_fwd": 3, "jfa_attention_bwd": 7}

    def calls(**kw):
        f = causal_only(mesh, n, layout, "all_gather", **kw)
        return kernel_calls(lambda *a: forward_and_grads(f, *a), q, k, v, ids, do, dlse)

    plain = calls()
    assert {name for name, _, _ in plain} == set(tensors)
    for name, config, shapes in plain:
        assert all(shape == () for shape in shapes[tensors[name]:]), (name, shapes)
        assert not config.bottom_right and config.window_left < 0
        # Causal calls are the diagonal blocks: as many keys as queries.
        assert not config.is_causal or shapes[0][1] == shapes[1][1], (name, config, shapes)
    windowed = calls(local_window_size=(5, 0))
    positions = Extras._fields.index("positions")
    assert windowed and all(shapes[tensors[name] + positions] != () for name, _, shapes in windowed)


@pytest.mark.parametrize("check_vma", [True, False], ids=["check_vma", "no_check_vma"])
@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_causal_in_sequence_order_and_other_keywords(strategy, check_vma):
    mesh = cpu_mesh((4,), ("cp",))
    seed = fresh_seed()
    q, k, v, ids, do, dlse = problem(seed, T=32, N=6, K=3)
    kw = dict(strategy=strategy, is_causal=True, softcap=5.0, scale=-0.3)
    f = context_parallel(mesh, 4, layout="sequence", check_vma=check_vma, **kw)
    got = jax.jit(lambda *a: forward_and_grads(f, *a))(q, k, v, ids, do, dlse)
    ref = forward_and_grads(lambda q, k, v, ids: single_device(q, k, v, ids, **kw), q, k, v, ids, do, dlse)
    assert_matches(seed, got, ref, 2e-6)


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_bfloat16_against_float32_reference(strategy):
    mesh = cpu_mesh((4,), ("cp",))
    seed = fresh_seed()
    q, k, v, ids, do, dlse = problem(seed, dtype=jnp.bfloat16)
    f = context_parallel(mesh, 4, layout="balanced", strategy=strategy, is_causal=True)
    got = jax.jit(lambda *a: forward_and_grads(f, *a))(q, k, v, ids, do, dlse)
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref = forward_and_grads(lambda q, k, v, ids: single_device(q, k, v, ids, is_causal=True),
                            up(q), up(k), up(v), ids, up(do), dlse)
    (out, lse), grads = got
    (r_out, r_lse), r_grads = ref
    assert rel_err(out, r_out) <= 2e-2, f"seed {seed}: out {rel_err(out, r_out)}"
    for name, g, r in zip(("dq", "dk", "dv"), grads, r_grads):
        assert g.dtype == jnp.bfloat16 and rel_err(g, r) <= 8e-2, f"seed {seed}: {name} {rel_err(g, r)}"


@pytest.mark.parametrize("strategy,expected", [("ring", {"collective-permute"}),
                                               ("all_gather", {"all-gather"})])
def test_communication_of_each_strategy(strategy, expected):
    mesh = cpu_mesh((4,), ("cp",))
    q, k, v, ids, do, dlse = problem(0, T=32)
    f = context_parallel(mesh, 4, layout="sequence", strategy=strategy, is_causal=True)
    hlo = jax.jit(f).lower(q, k, v, ids).compile().as_text()
    assert set(COLLECTIVE.findall(hlo)) == expected
    # The ring's forward sends K, V and the segment ids n - 1 times each.
    if strategy == "ring":
        assert len(re.findall(r"collective-permute(?:-start)?\(", hlo)) == 3 * 3


def test_load_balance_layout():
    x = jnp.arange(16)
    balanced = jfa.load_balance(x, 0, 4)
    # device i holds chunks i and 2n - 1 - i (chunks of 2 here)
    assert balanced.tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    assert jfa.load_balance(balanced, 0, 4, inverse=True).tolist() == list(range(16))
    y = jnp.arange(2 * 24 * 3).reshape(2, 24, 3)
    assert jnp.array_equal(jfa.load_balance(jfa.load_balance(y, -2, 3), 1, 3, inverse=True), y)
    with pytest.raises(ValueError, match="2·n = 10"):
        jfa.load_balance(x, 0, 5)


def test_bad_calls_name_the_argument():
    q, k, v, *_ = problem(0, T=16)
    with pytest.raises(ValueError, match="axis_name='cp'"):
        jfa.context_parallel_attention(q, k, v, axis_name="cp")
    mesh = cpu_mesh((2,), ("cp",))

    def call(**kw):
        f = jax.shard_map(lambda q, k, v: jfa.context_parallel_attention(q, k, v, axis_name="cp", **kw),
                          mesh=mesh, in_specs=(P(None, "cp"),) * 3, out_specs=P(None, "cp"))
        return f(q, k, v)

    with pytest.raises(ValueError, match="strategy"):
        call(strategy="tree")
    with pytest.raises(TypeError, match="'window'"):
        call(window=3)
    with pytest.raises(TypeError, match="load_balanced must be a bool"):
        call(load_balanced="yes", is_causal=True)
    with pytest.raises(ValueError, match="even"):
        jax.shard_map(lambda q, k, v: jfa.context_parallel_attention(q, k, v, axis_name="cp",
                                                                     is_causal=True),
                      mesh=mesh, in_specs=(P(None, "cp"),) * 3, out_specs=P(None, "cp"))(
            q[:, :14], k[:, :14], v[:, :14])
