"""Attention on sharded operands under jax.jit: values and gradients equal the unsharded call,
outputs and gradients keep the operands' sharding, and the compiled program holds no collective
for batch and head sharding, and for query-sequence sharding and for query heads split over one
K/V head (MQA) none in the forward and only the dK/dV reduction in the backward."""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_flashattn as jfa
from jax_flashattn import sharding as jfa_sharding
from conftest import collectives, cpu_mesh, partitioner
from util import fresh_seed, random_qkv, rel_err

def forward_and_grads(q, k, v, do, dlse, differentiable=(), **kw):
    """(out, lse) and the gradients of <out, do> + <lse, dlse> for q, k, v and the keyword
    arrays named in `differentiable` (bias, alibi_slopes)."""
    names = tuple(differentiable)

    def f(q, k, v, *extra):
        return jfa.flash_attention(q, k, v, return_lse=True, **kw, **dict(zip(names, extra)))

    outs, vjp = jax.vjp(f, q, k, v, *[kw.pop(name) for name in names])
    return outs, vjp((do, dlse))


def put(mesh, x, spec):
    return None if x is None else jax.device_put(x, NamedSharding(mesh, spec))


def inputs(seed, B, T, S, N, K, H):
    q, k, v = random_qkv(seed, B, T, S, N, K, H)
    keys = jax.random.split(jax.random.key(seed + 1), 2)
    return q, k, v, jax.random.normal(keys[0], q.shape), jax.random.normal(keys[1], q.shape[:3])


def check_equal(sharded, unsharded, seed, bound=2e-6):
    for i, (x, ref) in enumerate(zip(jax.tree.leaves(sharded), jax.tree.leaves(unsharded))):
        x, ref = np.asarray(x), np.asarray(ref)
        finite = np.isfinite(ref)
        assert np.array_equal(np.isfinite(x), finite), f"seed {seed}: leaf {i} masks differ"
        assert rel_err(np.where(finite, x, 0), np.where(finite, ref, 0)) <= bound, \
            f"seed {seed}: leaf {i} error {rel_err(np.where(finite, x, 0), np.where(finite, ref, 0))}"


LAYOUTS = {  # query spec; keys and values follow on batch and heads
    "batch": P("x"),
    "heads": P(None, None, "y"),
    "batch+heads": P("x", None, "y"),
}


@pytest.mark.parametrize("shardy", [True, False], ids=["shardy", "gspmd"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_batch_and_head_sharding_without_collectives(layout, is_causal, shardy):
    mesh = cpu_mesh((2, 4), ("x", "y"))
    seed = fresh_seed()
    q, k, v, do, dlse = inputs(seed, 4, 32, 48, 8, 4, 16)  # GQA: 2 query heads per K/V head
    spec = LAYOUTS[layout]
    args = [put(mesh, x, spec) for x in (q, k, v, do)] + [put(mesh, dlse, P(*spec[:3]))]

    def f(*a):
        return forward_and_grads(*a, is_causal=is_causal)

    with partitioner(shardy):
        assert collectives(lambda q, k, v: jfa.flash_attention(q, k, v, is_causal=is_causal),
                           *args[:3]) == []
        assert collectives(f, *args) == []
        (out, lse), grads = jax.jit(f)(*args)
    (r_out, r_lse), r_grads = jax.jit(f)(q, k, v, do, dlse)
    check_equal((out, lse, grads), (r_out, r_lse, r_grads), seed)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec), 4)
    assert lse.sharding.is_equivalent_to(NamedSharding(mesh, P(*spec[:3])), 3)
    for g, x in zip(grads, args[:3]):
        assert g.sharding.is_equivalent_to(x.sharding, 4)


@pytest.mark.parametrize("shardy", [True, False], ids=["shardy", "gspmd"])
def test_vmap_behind_a_split_batch_axis_keeps_the_split(shardy):
    """vmap over an axis right behind a split batch axis ([B, V, T, N, H], in_axes=1) folds
    batch-major: the split stays a split of the folded batch, with no collective, forward and
    backward, and the results equal the unsplit call's."""
    mesh = cpu_mesh((4,), ("x",))
    seed = fresh_seed()
    B, V = 4, 3
    q, k, v, do, dlse = inputs(seed, B * V, 32, 48, 4, 2, 16)
    q, k, v, do = (x.reshape((B, V) + x.shape[1:]) for x in (q, k, v, do))
    spec = P("x")
    args = [put(mesh, x, spec) for x in (q, k, v, do)]

    def f(q, k, v, do):
        attend = jax.vmap(lambda q, k, v: jfa.flash_attention(q, k, v, is_causal=True),
                          in_axes=1, out_axes=1)
        out, pullback = jax.vjp(attend, q, k, v)
        return (out,) + pullback(do)

    with partitioner(shardy):
        assert collectives(f, *args) == []
        got = jax.jit(f)(*args)
    want = jax.jit(f)(q, k, v, do)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert rel_err(g, w) <= 1e-6, f"seed {seed}: {name}"
        assert g.sharding.is_equivalent_to(NamedSharding(mesh, spec), 5), name


MQA_LAYOUTS = {  # query spec on a 2x4 mesh; K/V follow on batch only
    "heads-2": P(None, None, "x"),
    "heads-4": P(None, None, "y"),
    "batch+heads-4": P("x", None, "y"),
    "query-2+heads-4": P(None, "x", "y"),  # dK/dV summed over both axes at once
}


@pytest.mark.parametrize("shardy", [True, False], ids=["shardy", "gspmd"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full-bias", "causal-alibi"])
@pytest.mark.parametrize("layout", list(MQA_LAYOUTS))
def test_one_key_value_head_keeps_the_query_heads_split(layout, is_causal, shardy):
    """MQA (K = 1): the query heads (and the bias's, mask's and slopes' head axes) stay split and
    K/V replicated; the backward's one collective sums dK/dV (and d(bias) over the batch split)."""
    mesh = cpu_mesh((2, 4), ("x", "y"))
    seed = fresh_seed()
    B, T, S, N, K, H = 4, 32, 48, 8, 1, 16
    q, k, v, do, dlse = inputs(seed, B, T, S, N, K, H)
    spec = MQA_LAYOUTS[layout]
    b, n = spec[0], spec[2]
    rng = np.random.default_rng(seed)
    if is_causal:
        extra = dict(alibi_slopes=(jnp.asarray(rng.uniform(0.05, 0.5, (N,)), jnp.float32), P(n)))
    else:  # a bias shared by the batch, a mask per batch element and head
        extra = dict(bias=(jnp.asarray(rng.normal(size=(1, N, T, S)), jnp.float32), P(None, n)),
                     mask=(jnp.asarray(rng.random((B, N, T, S)) < 0.8), P(b, n)))
    names = tuple(extra)
    differentiable = tuple(name for name in names if name != "mask")
    args = [put(mesh, q, spec), put(mesh, k, P(b)), put(mesh, v, P(b)), put(mesh, do, spec),
            put(mesh, dlse, P(*spec[:3]))] + [put(mesh, *extra[name]) for name in names]

    def f(q, k, v, do, dlse, *values):
        return forward_and_grads(q, k, v, do, dlse, differentiable, is_causal=is_causal,
                                 **dict(zip(names, values)))

    def forward(q, k, v, *values):
        return jfa.flash_attention(q, k, v, return_lse=True, is_causal=is_causal,
                                   **dict(zip(names, values)))

    with partitioner(shardy):
        assert collectives(forward, *args[:3], *args[5:]) == []
        assert collectives(f, *args) == ["all-reduce"]
        (out, lse), grads = jax.jit(f)(*args)
    (r_out, r_lse), r_grads = jax.jit(f)(q, k, v, do, dlse, *[extra[name][0] for name in names])
    check_equal((out, lse, grads), (r_out, r_lse, r_grads), seed, bound=1e-5)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec), 4)
    assert lse.sharding.is_equivalent_to(NamedSharding(mesh, P(*spec[:3])), 3)
    assert grads[0].sharding.is_equivalent_to(NamedSharding(mesh, spec), 4)
    for g in grads[1:3]:
        assert g.sharding.is_equivalent_to(NamedSharding(mesh, P(b)), 4)


def test_one_key_value_head_with_dropout_gathers_the_heads():
    # Dropout draws from the local head index, so split query heads would change the stream.
    mesh = cpu_mesh((4,), ("y",))
    seed = fresh_seed()
    q, k, v, do, dlse = inputs(seed, 2, 16, 16, 8, 1, 16)

    def f(q, k, v, do, dlse):
        return forward_and_grads(q, k, v, do, dlse, is_causal=True, dropout_rate=0.25,
                                 dropout_rng=jax.random.key(seed))

    spec = P(None, None, "y")
    sharded = jax.jit(f)(put(mesh, q, spec), put(mesh, k, P()), put(mesh, v, P()),
                         put(mesh, do, spec), put(mesh, dlse, spec))
    check_equal(sharded, jax.jit(f)(q, k, v, do, dlse), seed)


# Query-sequence sharding with K/V replicated: keywords whose positions each device offsets.
OFFSET_CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "causal-window-alibi": dict(is_causal=True, local_window_size=(5, 0), alibi_slopes="slopes"),
    "bottom-right-lengths": dict(is_causal=True, causal_alignment="bottom_right",
                                 query_seq_lengths="q_lengths", key_value_seq_lengths="kv_lengths"),
    # Through per-batch positions moved on by kv_len - q_len (negative for batch element 1).
    "bottom-right-lengths-two-sided-window-alibi": dict(
        causal_alignment="bottom_right", local_window_size=(3, 4), alibi_slopes="slopes",
        query_seq_lengths="q_lengths", key_value_seq_lengths="kv_lengths"),
    "top-left-q-lengths-segments": dict(is_causal=True, query_seq_lengths="q_lengths",
                                        q_segment_ids="q_ids", kv_segment_ids="kv_ids"),
    "right-less-window-softcap": dict(local_window_size=(7, 0), softcap=3.0),
    "lengths-bias-mask": dict(query_seq_lengths="q_lengths", key_value_seq_lengths="kv_lengths",
                              bias="bias", mask="mask"),
    # Through the positions of each device's first query (top-left calls).
    "two-sided-window": dict(local_window_size=(3, 4)),
    "top-left-kv-lengths-alibi": dict(is_causal=True, key_value_seq_lengths="kv_lengths",
                                      alibi_slopes="slopes"),
    "dropout-causal-window": dict(is_causal=True, local_window_size=(9, 0), dropout_rate=0.3,
                                  dropout_rng=jax.random.key(3)),
}


def keyword_arrays(seed, B, T, S, N):
    rng = np.random.default_rng(seed)
    return {
        "slopes": jnp.asarray(rng.uniform(0.05, 0.5, (N,)), jnp.float32),
        "q_lengths": jnp.asarray([T - 5, T - 2, T, 0][:B], jnp.int32),
        "kv_lengths": jnp.asarray([S - 3, S // 2, S, 7][:B], jnp.int32),
        "q_ids": jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), axis=1), jnp.int32),
        "kv_ids": jnp.asarray(np.sort(rng.integers(0, 3, (B, S)), axis=1), jnp.int32),
        "bias": jnp.asarray(rng.normal(size=(1, N, T, S)), jnp.float32),
        "mask": jnp.asarray(rng.random((B, 1, T, S)) < 0.8),
    }


QUERY_SHARDED_SPECS = {"q_ids": P(None, "y"), "bias": P(None, None, "y"), "mask": P(None, None, "y")}


@pytest.mark.parametrize("shardy", [True, False], ids=["shardy", "gspmd"])
@pytest.mark.parametrize("case", list(OFFSET_CASES))
def test_query_sequence_sharding_offsets_positions(case, shardy):
    mesh = cpu_mesh((4,), ("y",))
    seed = fresh_seed()
    B, T, S, N, K, H = 4, 32, 40, 4, 2, 16
    q, k, v, do, dlse = inputs(seed, B, T, S, N, K, H)
    arrays = keyword_arrays(seed, B, T, S, N)
    kw = {name: arrays[x] if isinstance(x, str) and x in arrays else x
          for name, x in OFFSET_CASES[case].items()}
    names = [name for name, x in OFFSET_CASES[case].items() if isinstance(x, str) and x in arrays]
    sharded_kw = {name: put(mesh, kw[name], QUERY_SHARDED_SPECS.get(OFFSET_CASES[case][name], P()))
                  for name in names}
    differentiable = tuple(name for name in ("bias", "alibi_slopes") if name in kw)
    args = [put(mesh, q, P(None, "y")), put(mesh, k, P()), put(mesh, v, P()),
            put(mesh, do, P(None, "y")), put(mesh, dlse, P(None, "y"))]

    def f(q, k, v, do, dlse, *values):
        return forward_and_grads(q, k, v, do, dlse, differentiable,
                                 **{**kw, **dict(zip(names, values))})

    def forward(q, k, v, *values):
        return jfa.flash_attention(q, k, v, return_lse=True, **{**kw, **dict(zip(names, values))})

    values = [sharded_kw[name] for name in names]
    with partitioner(shardy):
        assert collectives(forward, *args[:3], *values) == []
        assert collectives(f, *args, *values) == ["all-reduce"]  # dK/dV (and d(bias), d(slopes))
        (out, lse), grads = jax.jit(f)(*args, *values)
    (r_out, r_lse), r_grads = jax.jit(f)(q, k, v, do, dlse, *[kw[name] for name in names])
    check_equal((out, lse, grads), (r_out, r_lse, r_grads), seed, bound=1e-5)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "y")), 4)
    assert grads[0].sharding.is_equivalent_to(NamedSharding(mesh, P(None, "y")), 4)


def test_explicit_mesh_axes_keep_the_query_sequence_sharded():
    # jax.make_mesh's default axis type; the per-device offsets are computed outside its context.
    mesh = cpu_mesh((4,), ("y",), jax.sharding.AxisType.Explicit)
    seed = fresh_seed()
    B, T, S, N, K, H = 4, 32, 40, 4, 2, 16
    q, k, v, do, dlse = inputs(seed, B, T, S, N, K, H)
    arrays = keyword_arrays(seed, B, T, S, N)
    kw = dict(is_causal=True, causal_alignment="bottom_right", query_seq_lengths=arrays["q_lengths"],
              alibi_slopes=arrays["slopes"])

    def f(q, k, v, do, dlse, lengths, slopes):
        return forward_and_grads(q, k, v, do, dlse, ("alibi_slopes",),
                                 **dict(kw, query_seq_lengths=lengths, alibi_slopes=slopes))

    rows = P(None, "y")
    with jax.sharding.set_mesh(mesh):
        args = [put(mesh, q, rows), put(mesh, k, P()), put(mesh, v, P()), put(mesh, do, rows),
                put(mesh, dlse, rows), put(mesh, kw["query_seq_lengths"], P()),
                put(mesh, kw["alibi_slopes"], P())]
        assert collectives(f, *args) == ["all-reduce"]
        sharded = jax.jit(f)(*args)
    check_equal(sharded, jax.jit(f)(q, k, v, do, dlse, kw["query_seq_lengths"], kw["alibi_slopes"]),
                seed, bound=1e-5)
    assert sharded[0][0].sharding.is_equivalent_to(NamedSharding(mesh, rows), 4)


@pytest.mark.parametrize("slopes_shape", ["N", "BN"])
@pytest.mark.parametrize("q_spec,slopes_split", [(P(None, None, "y"), False), (P(), True),
                                                 (P("y"), False)], ids=["heads", "slopes-only", "batch"])
def test_explicit_mesh_axes_give_slopes_their_own_gradient_layout(q_spec, slopes_split, slopes_shape):
    """d(slopes) takes the slopes' own sharding, whichever way the query is split (custom_vjp
    requires a gradient typed as its primal)."""
    mesh = cpu_mesh((2,), ("y",), jax.sharding.AxisType.Explicit)
    seed = fresh_seed()
    B, T, S, N, K, H = 2, 8, 8, 4, 4, 8
    q, k, v, do, dlse = inputs(seed, B, T, S, N, K, H)
    slopes = keyword_arrays(seed, B, T, S, N)["slopes"]
    slopes = slopes if slopes_shape == "N" else jnp.stack([slopes, 2 * slopes])
    slopes_spec = P(*([None] * (slopes.ndim - 1) + ["y"])) if slopes_split else P()

    def f(q, k, v, do, dlse, slopes):
        return forward_and_grads(q, k, v, do, dlse, ("alibi_slopes",), is_causal=True, alibi_slopes=slopes)

    with jax.sharding.set_mesh(mesh):
        args = [put(mesh, q, q_spec), put(mesh, k, q_spec), put(mesh, v, q_spec), put(mesh, do, q_spec),
                put(mesh, dlse, P(*q_spec[:3])), put(mesh, slopes, slopes_spec)]
        sharded = jax.jit(f)(*args)
    assert sharded[1][3].sharding.is_equivalent_to(NamedSharding(mesh, slopes_spec), slopes.ndim)
    check_equal(sharded, jax.jit(f)(q, k, v, do, dlse, slopes), seed, bound=1e-5)


def _decode_case(rng):
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in
               ((4, 1, 8, 16), (4, 1024, 2, 16), (4, 1024, 2, 16)))
    lengths = rng.integers(1, 1025, (4,)).astype(np.int32)

    def f(q, k, v, lengths):
        return jfa.flash_attention(q, k, v, is_causal=True, causal_alignment="bottom_right",
                                   key_value_seq_lengths=lengths)
    return f, (q, k, v, lengths), (P("y"),) * 4


def _paged_case(rng):
    page, pages = 4, 12
    q = rng.standard_normal((4, 2, 4, 8)).astype(np.float32)
    caches = [rng.standard_normal((pages, page, 2, 8)).astype(np.float32) for _ in range(2)]
    table = rng.permutation(pages)[:12].reshape(4, 3).astype(np.int32)
    lengths = rng.integers(2, 13, (4,)).astype(np.int32)

    def f(q, key_cache, value_cache, table, lengths):
        return jfa.paged_attention(q, key_cache, value_cache, table, lengths, is_causal=True)
    return f, (q, *caches, table, lengths), (P("y"), P(), P(), P("y"), P("y"))


def _varlen_case(rng):
    q, k, v = (rng.standard_normal((16, 2, 8)).astype(np.float32) for _ in range(3))
    cu_q, cu_k = np.array([0, 5, 12], np.int32), np.array([0, 7, 16], np.int32)

    def f(q, k, v):
        return jfa.varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=7, max_seqlen_k=9, is_causal=True)
    return f, (q, k, v), (P("y"),) * 3


@pytest.mark.parametrize("case", [_decode_case, _paged_case, _varlen_case], ids=["decode", "paged", "varlen"])
def test_explicit_mesh_axes_with_gathers_and_decode_shapes(case):
    """Calls that gather rows (paged pages, varlen's padding) or would take the decode split, on
    operands split over Explicit axes: they trace, and values and gradients equal one device's."""
    mesh = cpu_mesh((2,), ("y",), jax.sharding.AxisType.Explicit)
    seed = fresh_seed()
    f, args, specs = case(np.random.default_rng(seed))
    floats = [i for i, x in enumerate(args) if x.dtype == np.float32]

    def loss(*args):  # the output rides along: a summed scalar can cancel and lose digits
        out = f(*args)
        return jnp.sum(jnp.sin(out)), out

    def value_and_grads(*args):
        (_, out), grads = jax.value_and_grad(loss, argnums=floats, has_aux=True)(*args)
        return out, grads

    with jax.sharding.set_mesh(mesh):
        sharded = jax.jit(value_and_grads)(*[put(mesh, x, spec) for x, spec in zip(args, specs)])
    check_equal(sharded, jax.jit(value_and_grads)(*args), seed, bound=1e-5)


FALLBACK_CASES = {  # query positions a device cannot offset: gathered, still exact
    "bottom-right-lengths-dropout": dict(is_causal=True, causal_alignment="bottom_right",
                                         key_value_seq_lengths="kv_lengths", dropout_rate=0.3,
                                         dropout_rng=jax.random.key(3)),
}


@pytest.mark.parametrize("case", list(FALLBACK_CASES))
def test_query_sequence_sharding_gathers_what_it_cannot_offset(case):
    mesh = cpu_mesh((4,), ("y",))
    seed = fresh_seed()
    B, T, S, N, K, H = 2, 32, 32, 4, 4, 16
    q, k, v, do, dlse = inputs(seed, B, T, S, N, K, H)
    arrays = keyword_arrays(seed, B, T, S, N)
    kw = {name: arrays[x] if isinstance(x, str) and x in arrays else x
          for name, x in FALLBACK_CASES[case].items()}

    def f(q, k, v, do, dlse):
        return forward_and_grads(q, k, v, do, dlse, **kw)

    sharded = jax.jit(f)(put(mesh, q, P(None, "y")), put(mesh, k, P()), put(mesh, v, P()),
                         put(mesh, do, P(None, "y")), put(mesh, dlse, P(None, "y")))
    check_equal(sharded, jax.jit(f)(q, k, v, do, dlse), seed, bound=1e-5)


def test_heads_that_do_not_split_by_group_are_gathered():
    # 8 query heads over 2 K/V heads on 4 devices: whole groups cannot go to each device.
    mesh = cpu_mesh((4,), ("y",))
    seed = fresh_seed()
    q, k, v, do, dlse = inputs(seed, 2, 16, 16, 8, 2, 16)

    def f(q, k, v, do, dlse):
        return forward_and_grads(q, k, v, do, dlse, is_causal=True)

    spec = P(None, None, "y")
    sharded = jax.jit(f)(put(mesh, q, spec), put(mesh, k, P()), put(mesh, v, P()),
                         put(mesh, do, spec), put(mesh, dlse, spec))
    check_equal(sharded, jax.jit(f)(q, k, v, do, dlse), seed)


UNEVEN_CASES = {  # devices, (B, T, N, K), the query split asked for with a sharding constraint
    "batch-2-over-4": (4, (2, 8, 2, 2), P("x")),
    "queries-2-over-4": (4, (1, 2, 2, 2), P(None, "x")),
    "queries-12-over-8-mqa": (8, (1, 12, 4, 1), P(None, "x")),
    "heads-12-over-8-gqa": (8, (2, 4, 12, 6), P(None, None, "x")),
}


@pytest.mark.parametrize("shardy", [True, False], ids=["shardy", "gspmd"])
@pytest.mark.parametrize("case", list(UNEVEN_CASES))
def test_uneven_splits_are_gathered_and_exact(case, shardy):
    """A split that does not divide its dimension (asked for inside jit, where XLA pads the last
    blocks with undefined rows) is gathered: the backward's sums over the split never add them."""
    n, (B, T, N, K), spec = UNEVEN_CASES[case]
    mesh = cpu_mesh((n,), ("x",))
    seed = fresh_seed()
    q, k, v, do, dlse = inputs(seed, B, T, 8, N, K, 8)
    bias = jax.random.normal(jax.random.key(seed + 2), (1, 1, 1, 8))

    def f(q, k, v, do, dlse, bias, constrain):
        if constrain:
            q, do = (jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec)) for x in (q, do))
            if spec == P("x"):  # keys and values follow a batch split
                k, v = (jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec)) for x in (k, v))
        return forward_and_grads(q, k, v, do, dlse, differentiable=("bias",), bias=bias, is_causal=True)

    try:
        with partitioner(shardy):
            sharded = jax.jit(f, static_argnums=6)(q, k, v, do, dlse, bias, True)
    except jax.errors.JaxRuntimeError as e:
        # Before jax 0.10 custom_partitioning refuses uneven Shardy shardings itself: loud, not wrong.
        if shardy and _jax_older_than(0, 10) and "not divisible by axis_size" in str(e):
            pytest.skip("this jax's custom_partitioning refuses uneven Shardy shardings")
        raise
    check_equal(sharded, jax.jit(f, static_argnums=6)(q, k, v, do, dlse, bias, False), seed)


def _jax_older_than(*version):
    return tuple(int(part) for part in jax.__version__.split(".")[:2]) < version


def test_operands_broadcast_over_sharded_axes_sum_their_gradients():
    mesh = cpu_mesh((2, 4), ("x", "y"))
    seed = fresh_seed()
    B, T, S, N, K, H = 4, 16, 24, 4, 4, 16
    q, k, v, do, dlse = inputs(seed, B, T, S, N, K, H)
    rng = np.random.default_rng(seed)
    bias = jnp.asarray(rng.normal(size=(1, 1, T, S)), jnp.float32)  # shared by batch and heads
    slopes = jnp.asarray(rng.uniform(0.05, 0.5, (N,)), jnp.float32)

    def f(q, k, v, do, dlse, bias, slopes):
        return forward_and_grads(q, k, v, do, dlse, ("bias", "alibi_slopes"), bias=bias,
                                 alibi_slopes=slopes, is_causal=True)

    spec = P("x", None, "y")
    args = [put(mesh, x, spec) for x in (q, k, v, do)] + [put(mesh, dlse, spec),
                                                          put(mesh, bias, P()), put(mesh, slopes, P("y"))]
    sharded = jax.jit(f)(*args)
    check_equal(sharded, jax.jit(f)(q, k, v, do, dlse, bias, slopes), seed, bound=1e-5)


def test_dropout_with_batch_sharding_keeps_global_coordinates():
    mesh = cpu_mesh((4,), ("x",))
    seed = fresh_seed()
    q, k, v, do, dlse = inputs(seed, 4, 16, 16, 4, 4, 16)

    def f(q, k, v, do, dlse):
        return forward_and_grads(q, k, v, do, dlse, dropout_rate=0.25,
                                 dropout_rng=jax.random.key(seed))

    args = [put(mesh, x, P("x")) for x in (q, k, v, do, dlse)]
    assert collectives(f, *args) == []
    check_equal(jax.jit(f)(*args), jax.jit(f)(q, k, v, do, dlse), seed)


def test_kv_sequence_sharding_gathers_and_warns_once(caplog, monkeypatch):
    mesh = cpu_mesh((4,), ("y",))
    monkeypatch.setattr(jfa_sharding, "_warned", [])
    seed = fresh_seed()
    q, k, v, do, dlse = inputs(seed, 2, 32, 32, 4, 2, 16)

    def f(q, k, v, do, dlse):
        return forward_and_grads(q, k, v, do, dlse, is_causal=True)

    args = [put(mesh, x, P(None, "y")) for x in (q, k, v, do, dlse)]
    with caplog.at_level(logging.WARNING, logger="jax_flashattn"):
        sharded = jax.jit(f)(*args)
    warnings = [r for r in caplog.records if "context_parallel_attention" in r.getMessage()]
    assert len(warnings) == 1
    check_equal(sharded, jax.jit(f)(q, k, v, do, dlse), seed, bound=1e-5)


def test_varlen_and_drop_in_keep_the_sharding():
    mesh = cpu_mesh((4,), ("x",))
    seed = fresh_seed()
    q, k, v = random_qkv(seed, 4, 32, 32, 4, 2, 16)
    out = jax.jit(lambda q, k, v: jfa.dot_product_attention(q, k, v, is_causal=True))(
        *[put(mesh, x, P("x")) for x in (q, k, v)])
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("x")), 4)
    check_equal(out, jfa.dot_product_attention(q, k, v, is_causal=True), seed)

    # Packed self-attention runs as one batch row with segment ids: its rows shard as queries.
    cu = jnp.asarray([0, 40, 90, 128], jnp.int32)
    x = jax.random.normal(jax.random.key(seed), (128, 4, 16))
    varlen = jax.jit(lambda x: jfa.varlen_attention(x, x, x, cu, None, max_seqlen_q=64,
                                                    max_seqlen_k=64, is_causal=True))
    check_equal(varlen(put(mesh, x, P("x"))), varlen(x), seed)


@pytest.mark.parametrize("shardy", [True, False], ids=["shardy", "gspmd"])
def test_packed_masks_split_along_batch_and_heads(shardy):
    """pack_mask of a sharded boolean mask packs each device's slices, and attention with the
    PackedMask keeps batch and head sharding: no collective in either pass."""
    mesh = cpu_mesh((2, 4), ("x", "y"))
    seed = fresh_seed()
    B, T, S, N, K, H = 4, 70, 140, 8, 4, 16
    q, k, v, do, dlse = inputs(seed, B, T, S, N, K, H)
    mask = jnp.asarray(np.random.default_rng(seed).random((B, N, T, S)) < 0.5)
    spec = P("x", None, "y")
    args = [put(mesh, x, spec) for x in (q, k, v, do)] + [put(mesh, dlse, P(*spec[:3])),
                                                          put(mesh, mask, P("x", "y"))]

    def f(q, k, v, do, dlse, mask):
        return forward_and_grads(q, k, v, do, dlse, mask=jfa.pack_mask(mask), is_causal=True)

    with partitioner(shardy):
        packed = jax.jit(jfa.pack_mask)(args[-1])
        assert collectives(jfa.pack_mask, args[-1]) == []
        assert collectives(f, *args) == []
        sharded = jax.jit(f)(*args)
    assert packed.bits.sharding.is_equivalent_to(NamedSharding(mesh, P("x", "y")), 4)
    np.testing.assert_array_equal(np.asarray(packed.bits), np.asarray(jfa.pack_mask(mask).bits))
    check_equal(sharded, jax.jit(f)(q, k, v, do, dlse, mask), seed)


def test_packed_mask_keeps_the_query_sequence_whole():
    """Tile summaries cover 64 rows of the whole sequence: with a PackedMask, queries sharded along
    the sequence are gathered (still exact)."""
    mesh = cpu_mesh((4,), ("y",))
    seed = fresh_seed()
    B, T, S, N, K, H = 2, 96, 70, 4, 2, 16
    q, k, v, do, dlse = inputs(seed, B, T, S, N, K, H)
    packed = jfa.pack_mask(np.random.default_rng(seed).random((B, 1, T, S)) < 0.6)

    def f(q, k, v, do, dlse, mask):
        return forward_and_grads(q, k, v, do, dlse, mask=mask, is_causal=True)

    rows = P(None, "y")
    sharded = jax.jit(f)(put(mesh, q, rows), put(mesh, k, P()), put(mesh, v, P()), put(mesh, do, rows),
                         put(mesh, dlse, rows), packed)
    check_equal(sharded, jax.jit(f)(q, k, v, do, dlse, packed), seed, bound=1e-5)
