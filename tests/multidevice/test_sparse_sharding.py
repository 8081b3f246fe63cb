"""sparse_attention and attn_dist on sharded operands: under jax.jit, values and gradients equal the
unsharded call; batch and head sharding (whole GQA groups and attn_dist head groups per device)
compile to programs without collectives whose outputs and gradients keep the operands' sharding,
and so does a single K/V head (MQA, MLA) with the query heads split, save the dK/dV sum;
shardings the kernels cannot keep (sequences, topk, head dims, heads that would split a group)
are gathered and still exact; and jax.grad inside shard_map (check_vma=True) matches."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_flashattn as jfa
from conftest import collectives, cpu_mesh, partitioner
from util import fresh_seed, rel_err


def problem(seed, B=4, T=8, S=24, N=16, K=4, H=16, Hv=8, topk=6):
    """q, k, v, indices (about a fifth invalid, some repeated, one query row selecting nothing) and
    the cotangents of out and lse."""
    rng = np.random.default_rng(seed)  # numpy: no per-shape compilation of random ops
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))  # noqa: E731
    indices = rng.integers(-S // 5, S, (B, T, K, topk)).astype(np.int32)
    indices[:, 0, 0] = -1
    return (normal(B, T, N, H), normal(B, S, K, H), normal(B, S, K, Hv), jnp.asarray(indices),
            normal(B, T, N, Hv), normal(B, T, N))


def forward_and_grads(q, k, v, indices, do, dlse, **kw):
    """(out, lse) and the gradients of <out, do> + <lse, dlse> for q, k (and v unless it is None)."""
    def f(q, k, v=None):
        return jfa.sparse_attention(q, k, v, indices, return_lse=True, **kw)

    primals = (q, k) if v is None else (q, k, v)
    outs, vjp = jax.vjp(f, *primals)
    return outs, vjp((do, jnp.where(jnp.isfinite(outs[1]), dlse, 0.0)))


def distribution(q, k, indices, lse, head_group=2, is_causal=True):
    return jfa.attn_dist(q, k, indices, lse, head_group=head_group, is_causal=is_causal)


def put(mesh, x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def check_equal(sharded, unsharded, seed, bound=2e-6):
    for i, (x, ref) in enumerate(zip(jax.tree.leaves(sharded), jax.tree.leaves(unsharded))):
        x, ref = np.asarray(x), np.asarray(ref)
        finite = np.isfinite(ref)
        assert np.array_equal(np.isfinite(x), finite), f"seed {seed}: leaf {i} masks differ"
        err = rel_err(np.where(finite, x, 0), np.where(finite, ref, 0))
        assert err <= bound, f"seed {seed}: leaf {i} error {err}"


def assert_sharded_like(x, mesh, spec):
    assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), (x.sharding, spec)


# Query spec (keys, values, indices and cotangents follow it on batch and heads), attn_dist's spec.
LAYOUTS = {
    "batch": (P("x"), P("x")),
    "heads": (P(None, None, "y"), P(None, "y")),
    "batch+heads": (P("x", None, "y"), P("x", "y")),
}


@pytest.mark.parametrize("shardy", [True, False], ids=["shardy", "gspmd"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_batch_and_head_sharding_without_collectives(layout, shardy):
    mesh = cpu_mesh((2, 4), ("x", "y"))
    seed = fresh_seed()
    q, k, v, indices, do, dlse = problem(seed)  # GQA: 4 query heads per K/V head
    spec, dist_spec = LAYOUTS[layout]
    rows = P(*spec[:3])
    args = [put(mesh, x, spec) for x in (q, k, v, indices, do)] + [put(mesh, dlse, rows)]

    def f(q, k, v, indices, do, dlse):
        return forward_and_grads(q, k, v, indices, do, dlse, is_causal=True)

    def dist(q, k, indices, lse):
        return distribution(q, k, indices, lse)

    with partitioner(shardy):
        assert collectives(lambda q, k, v, i: jfa.sparse_attention(q, k, v, i), *args[:4]) == []
        assert collectives(f, *args) == []
        (out, lse), grads = jax.jit(f)(*args)
        assert collectives(dist, args[0], args[1], args[3], lse) == []
        dist_out = jax.jit(dist)(args[0], args[1], args[3], lse)
    (r_out, r_lse), r_grads = jax.jit(f)(q, k, v, indices, do, dlse)
    check_equal((out, lse, grads, dist_out),
                (r_out, r_lse, r_grads, jax.jit(dist)(q, k, indices, r_lse)), seed)
    assert_sharded_like(out, mesh, spec)
    assert_sharded_like(lse, mesh, rows)
    for g, x in zip(grads, args[:3]):
        assert g.sharding.is_equivalent_to(x.sharding, 4)
    assert_sharded_like(dist_out, mesh, dist_spec)


@pytest.mark.parametrize("shardy", [True, False], ids=["shardy", "gspmd"])
def test_shared_value_buffer_keeps_the_sharding(shardy):
    """value=None (V = key[..., :Hv], MLA's one buffer): both gradients land in key's, split alike."""
    mesh = cpu_mesh((2, 4), ("x", "y"))
    seed = fresh_seed()
    q, k, _, indices, do, dlse = problem(seed, K=8)
    spec = P("x", None, "y")
    args = [put(mesh, q, spec), put(mesh, k, spec), put(mesh, indices, spec), put(mesh, do, spec),
            put(mesh, dlse, P(*spec[:3]))]

    def f(q, k, indices, do, dlse):
        return forward_and_grads(q, k, None, indices, do, dlse, value_head_dim=do.shape[-1])

    with partitioner(shardy):
        assert collectives(f, *args) == []
        sharded = jax.jit(f)(*args)
    check_equal(sharded, jax.jit(f)(q, k, indices, do, dlse), seed)
    assert_sharded_like(sharded[1][1], mesh, spec)


@pytest.mark.parametrize("shardy", [True, False], ids=["shardy", "gspmd"])
@pytest.mark.parametrize("value", ["separate", "shared"])
def test_one_key_value_head_keeps_the_query_heads_split(value, shardy):
    """MQA (K = 1) and MLA's shared buffer: the query heads stay split and K/V, the indices and
    their gradients are replicated; the backward's one collective sums dK/dV over the head shards."""
    mesh = cpu_mesh((2, 4), ("x", "y"))
    seed = fresh_seed()
    q, k, v, indices, do, dlse = problem(seed, N=16, K=1)
    spec, kv_spec = P("x", None, "y"), P("x")
    kw = dict(is_causal=True)
    if value == "shared":
        v, kw = None, dict(kw, value_head_dim=do.shape[-1])
    args = [put(mesh, q, spec), put(mesh, k, kv_spec), None if v is None else put(mesh, v, kv_spec),
            put(mesh, indices, kv_spec), put(mesh, do, spec), put(mesh, dlse, P(*spec[:3]))]

    def f(q, k, v, indices, do, dlse):
        return forward_and_grads(q, k, v, indices, do, dlse, **kw)

    def forward(q, k, v, indices):
        return jfa.sparse_attention(q, k, v, indices, return_lse=True, **kw)

    with partitioner(shardy):
        assert collectives(forward, *args[:4]) == []
        assert collectives(f, *args) == ["all-reduce"]
        (out, lse), grads = jax.jit(f)(*args)
        assert collectives(distribution, args[0], args[1], args[3], lse) == []
        dist = jax.jit(distribution)(args[0], args[1], args[3], lse)
    (r_out, r_lse), r_grads = jax.jit(f)(q, k, v, indices, do, dlse)
    check_equal((out, lse, grads, dist),
                (r_out, r_lse, r_grads, jax.jit(distribution)(q, k, indices, r_lse)), seed)
    assert_sharded_like(out, mesh, spec)
    assert_sharded_like(grads[0], mesh, spec)
    for g in grads[1:]:
        assert_sharded_like(g, mesh, kv_spec)
    assert_sharded_like(dist, mesh, P("x", "y"))


def test_explicit_mesh_axes_keep_batch_and_heads():
    # jax.make_mesh's default axis type: the results' types carry the batch and head split.
    mesh = cpu_mesh((2, 4), ("x", "y"), jax.sharding.AxisType.Explicit)
    seed = fresh_seed()
    q, k, v, indices, do, dlse = problem(seed)
    spec = P("x", None, "y")

    def f(q, k, v, indices, do, dlse):
        (out, lse), grads = forward_and_grads(q, k, v, indices, do, dlse, is_causal=True)
        return (out, lse), grads, distribution(q, k, indices, lse)

    with jax.sharding.set_mesh(mesh):
        args = [put(mesh, x, spec) for x in (q, k, v, indices, do)] + [put(mesh, dlse, P(*spec[:3]))]
        assert collectives(f, *args) == []
        sharded = jax.jit(f)(*args)
    check_equal(sharded, jax.jit(f)(q, k, v, indices, do, dlse), seed)
    assert_sharded_like(sharded[2], mesh, P("x", "y"))


def test_heads_that_would_split_a_group_are_gathered():
    mesh = cpu_mesh((4,), ("y",))
    seed = fresh_seed()
    spec = P(None, None, "y")
    # 8 query heads over 2 K/V heads on 4 devices: whole GQA groups cannot go to each device.
    q, k, v, indices, do, dlse = problem(seed, N=8, K=2)
    args = ([put(mesh, q, spec)] + [put(mesh, x, P()) for x in (k, v, indices)]
            + [put(mesh, do, spec), put(mesh, dlse, spec)])
    sharded = jax.jit(forward_and_grads)(*args)
    check_equal(sharded, jax.jit(forward_and_grads)(q, k, v, indices, do, dlse), seed)

    # 4 K/V heads split fine, but attn_dist's 2 groups of 4 query heads cannot cover 4 devices.
    q, k, v, indices, do, dlse = problem(seed, N=8, K=4)
    lse = jfa.sparse_attention(q, k, v, indices, return_lse=True)[1]
    group4 = jax.jit(lambda q, k, i, lse: distribution(q, k, i, lse, head_group=4))
    dist = group4(put(mesh, q, spec), put(mesh, k, spec), put(mesh, indices, spec), put(mesh, lse, spec))
    check_equal(dist, group4(q, k, indices, lse), seed)


@pytest.mark.parametrize("shardy", [True, False], ids=["shardy", "gspmd"])
@pytest.mark.parametrize("spec", [P("x"), P(None, None, "x")], ids=["batch", "heads"])
def test_attn_dist_groups_sharing_only_part_of_the_kv_heads(spec, shardy):
    """12 heads, 4 K/V heads, 6 groups of 2: the head factor both coarse dimensions share (2)
    stands only inside compounds, whose size the Shardy rule must then give."""
    mesh = cpu_mesh((2,), ("x",))
    seed = fresh_seed()
    q, k, v, indices, _, _ = problem(seed, N=12, K=4)
    lse = jfa.sparse_attention(q, k, v, indices, return_lse=True, is_causal=True)[1]
    args = [put(mesh, x, spec if x.ndim == 4 else P(*spec[:3])) for x in (q, k, indices, lse)]
    with partitioner(shardy):
        dist = jax.jit(distribution)(*args)
    check_equal(dist, jax.jit(distribution)(q, k, indices, lse), seed)


def test_attn_dist_split_that_shardy_cannot_carry_follows_a_constraint():
    # 4 head groups on a 2×4 mesh, where 8 heads may split 8 ways: the result's group axis gets a
    # Shardy factor of its own, and the split it is asked for costs no collective.
    mesh = cpu_mesh((2, 4), ("x", "y"))
    seed = fresh_seed()
    q, k, v, indices, _, _ = problem(seed, N=8, K=4)
    lse = jfa.sparse_attention(q, k, v, indices, return_lse=True, is_causal=True)[1]
    spec = P("x", None, "y")
    args = [put(mesh, x, spec) for x in (q, k, indices, lse)]

    def pinned(q, k, indices, lse):
        dist = distribution(q, k, indices, lse)
        return jax.lax.with_sharding_constraint(dist, NamedSharding(mesh, P("x", "y")))

    assert collectives(pinned, *args) == []
    check_equal(jax.jit(pinned)(*args), jax.jit(distribution)(q, k, indices, lse), seed)


SEQUENCE_LAYOUTS = {  # specs of q, k and v, indices, cotangents: what the kernels cannot keep split
    "query-sequence": (P(None, "y"), P(), P(None, "y"), P(None, "y")),
    "key-sequence": (P(), P(None, "y"), P(), P()),
    "topk-and-head-dim": (P(None, None, None, "y"), P(None, None, None, "y"), P(None, None, None, "y"),
                          P(None, None, None, "y")),
}


@pytest.mark.parametrize("layout", list(SEQUENCE_LAYOUTS))
def test_other_shardings_are_gathered_and_exact(layout):
    mesh = cpu_mesh((4,), ("y",))
    seed = fresh_seed()
    q, k, v, indices, do, dlse = problem(seed, topk=8)
    q_spec, kv_spec, index_spec, row_spec = SEQUENCE_LAYOUTS[layout]
    args = [put(mesh, q, q_spec), put(mesh, k, kv_spec), put(mesh, v, kv_spec),
            put(mesh, indices, index_spec), put(mesh, do, row_spec), put(mesh, dlse, P(*row_spec[:3]))]

    def f(q, k, v, indices, do, dlse):
        (out, lse), grads = forward_and_grads(q, k, v, indices, do, dlse, is_causal=True)
        return (out, lse), grads, distribution(q, k, indices, lse)

    check_equal(jax.jit(f)(*args), jax.jit(f)(q, k, v, indices, do, dlse), seed)


SHARD_MAP_LAYOUTS = {  # specs of q, k and v, indices, attn_dist's result inside shard_map
    "batch": (P("x"), P("x"), P("x"), P("x")),
    "heads": (P(None, None, "x"), P(None, None, "x"), P(None, None, "x"), P(None, "x")),
    # Queries split, keys replicated: their gradients are summed over the devices.
    "query": (P(None, "x"), P(), P(None, "x"), P(None, None, "x")),
}


@pytest.mark.parametrize("layout", list(SHARD_MAP_LAYOUTS))
def test_inside_shard_map_with_check_vma(layout):
    mesh = cpu_mesh((4,), ("x",))
    seed = fresh_seed()
    q, k, v, indices, w_out, w_lse = problem(seed)
    q_spec, kv_spec, index_spec, dist_spec = SHARD_MAP_LAYOUTS[layout]
    # A device holding a block of the queries counts their positions from its own first row.
    kw = dict(is_causal=layout != "query")

    def loss(q, k, v, indices, w_out, w_lse):
        out, lse = jfa.sparse_attention(q, k, v, indices, return_lse=True, **kw)
        return jnp.sum(out * w_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse * w_lse, 0.0))

    def body(*args):
        return jax.grad(lambda *a: jax.lax.psum(loss(*a), "x"), argnums=(0, 1, 2))(*args)

    specs = (q_spec, kv_spec, kv_spec, index_spec, q_spec, P(*q_spec[:3]))
    grads = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs[:3],
                                  check_vma=True))(q, k, v, indices, w_out, w_lse)
    ref = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, indices, w_out, w_lse)
    check_equal(grads, ref, seed, bound=1e-5)

    def forward(q, k, v, indices):
        out, lse = jfa.sparse_attention(q, k, v, indices, return_lse=True, **kw)
        return out, lse, distribution(q, k, indices, lse, **kw)

    sharded = jax.jit(jax.shard_map(forward, mesh=mesh, in_specs=specs[:4],
                                    out_specs=(q_spec, P(*q_spec[:3]), dist_spec),
                                    check_vma=True))(q, k, v, indices)
    check_equal(sharded, jax.jit(forward)(q, k, v, indices), seed)
