"""paged_attention on sharded operands under jax.jit: the forward that hands the block table to the
kernel keeps a batch split (queries, tables, lengths) and a head split (queries and the pools' K/V
heads) with no collective, the results keep the query's layout, and values and gradients equal the
unsharded call's. Pools split along their pages or page rows are gathered."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_flashattn as jfa
from conftest import collectives, cpu_mesh, partitioner
from util import fresh_seed, rel_err

B, T, N, K, H, PAGE, PAGES_PER_SEQUENCE = 4, 2, 8, 4, 16, 16, 3


def paged_inputs(seed):
    """Queries, pools (a random page order, finite garbage past each length), table, lengths and
    cotangents."""
    rng = np.random.default_rng(seed)
    num_pages = B * PAGES_PER_SEQUENCE + 2
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    kc, vc = (rng.standard_normal((num_pages, PAGE, K, H)).astype(np.float32) for _ in range(2))
    table = rng.permutation(num_pages)[:B * PAGES_PER_SEQUENCE].reshape(B, -1).astype(np.int32)
    lengths = rng.integers(T, PAGE * PAGES_PER_SEQUENCE + 1, (B,)).astype(np.int32)
    do = rng.standard_normal((B, T, N, H)).astype(np.float32)
    dlse = rng.standard_normal((B, T, N)).astype(np.float32)
    return q, kc, vc, table, lengths, do, dlse


def attend(q, kc, vc, table, lengths):
    return jfa.paged_attention(q, kc, vc, table, lengths, is_causal=True, return_lse=True)


def forward_and_grads(q, kc, vc, table, lengths, do, dlse):
    out, pullback = jax.vjp(lambda q, kc, vc: attend(q, kc, vc, table, lengths), q, kc, vc)
    return out, pullback((do, dlse))


LAYOUTS = {  # (query spec, pool spec)
    "batch": (P("x"), P()),
    "heads": (P(None, None, "y"), P(None, None, "y")),
    "batch+heads": (P("x", None, "y"), P(None, None, "y")),
    "pools-split-along-pages": (P("x"), P("y")),
}


@pytest.mark.parametrize("shardy", [True, False], ids=["shardy", "gspmd"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_paged_forward_keeps_batch_and_head_splits(layout, shardy):
    mesh = cpu_mesh((2, 2), ("x", "y"))
    seed = fresh_seed()
    q, kc, vc, table, lengths, do, dlse = paged_inputs(seed)
    q_spec, pool_spec = LAYOUTS[layout]
    rows = P(q_spec[0]) if len(q_spec) else P()
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    args = [put(q, q_spec), put(kc, pool_spec), put(vc, pool_spec), put(table, rows), put(lengths, rows)]
    with partitioner(shardy):
        if pool_spec == P() or pool_spec[0] is None:  # pools whole along their pages: no collective
            assert collectives(attend, *args) == []
        out, lse = jax.jit(attend)(*args)
        got = jax.jit(forward_and_grads)(*args, put(do, q_spec), put(dlse, P(*q_spec[:3])))
    want = jax.jit(forward_and_grads)(q, kc, vc, table, lengths, do, dlse)
    for name, g, w in zip(("out", "lse", "dq", "dkey_cache", "dvalue_cache"),
                          jax.tree.leaves(got), jax.tree.leaves(want)):
        assert rel_err(g, w) <= 1e-5, f"seed {seed}: {name} {rel_err(g, w)}"
    assert rel_err(out, want[0][0]) <= 1e-6, f"seed {seed}: forward alone"
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, q_spec), 4)
    assert lse.sharding.is_equivalent_to(NamedSharding(mesh, P(*q_spec[:3])), 3)


def test_paged_forward_inside_shard_map():
    """Manual over the batch axis: each device runs the kernel on its sequences against the whole
    pool, equal to the unsharded call."""
    mesh = cpu_mesh((4,), ("x",))
    seed = fresh_seed()
    q, kc, vc, table, lengths, _, _ = paged_inputs(seed)
    fn = jax.shard_map(attend, mesh=mesh, in_specs=(P("x"), P(), P(), P("x"), P("x")),
                       out_specs=(P("x"), P("x")))
    got = jax.jit(fn)(q, kc, vc, table, lengths)
    want = jax.jit(attend)(q, kc, vc, table, lengths)
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-6, f"seed {seed}"
    assert np.all(np.isfinite(np.asarray(jnp.asarray(got[0]))))
