"""Context parallelism under jax.checkpoint (the ring's saved output and LSE carry CHECKPOINT_NAME,
so the policy that saves them runs no second ring in the backward) and jax.export of programs whose
attention runs inside shard_map (sharded jit calls lower through custom_partitioning, whose Python
callbacks jax.export cannot serialize: docs/remat-and-export.md)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_flashattn as jfa
from jax_flashattn import _ext
from conftest import cpu_mesh
from util import fresh_seed, random_qkv

SAVE_ATTENTION = jax.checkpoint_policies.save_only_these_names(jfa.CHECKPOINT_NAME)


def _ring(mesh, **kw):
    seq = P(None, "cp")
    return jax.shard_map(lambda q, k, v: jfa.context_parallel_attention(q, k, v, axis_name="cp", **kw),
                         mesh=mesh, in_specs=(seq,) * 3, out_specs=seq)


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_saved_context_parallel_attention_is_not_run_again(strategy):
    n = 4
    mesh = cpu_mesh((n,), ("cp",))
    q, k, v = random_qkv(fresh_seed(), 2, 16 * n, 16 * n, 4, 2, 16)
    attention = _ring(mesh, strategy=strategy, is_causal=True)

    def loss(policy):
        def body(q, k, v):
            return jnp.sum(jnp.cos(attention(jnp.sin(q), k, v)) ** 2)
        body = body if policy is None else jax.checkpoint(body, policy=policy)
        return jax.jit(jax.value_and_grad(body, argnums=(0, 1, 2)))

    def forward_calls(fn):
        return fn.lower(q, k, v).as_text().count(f"@{_ext.FORWARD_TARGET}(")

    once = forward_calls(loss(None))
    assert once >= 1
    assert forward_calls(loss(jax.checkpoint_policies.nothing_saveable)) == 2 * once
    assert forward_calls(loss(SAVE_ATTENTION)) == once
    for got, want in zip(jax.tree.leaves(loss(SAVE_ATTENTION)(q, k, v)), jax.tree.leaves(loss(None)(q, k, v))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["heads", "context_parallel"])
def test_exported_shard_map_program_matches(layout):
    pytest.importorskip("flatbuffers", reason="jax.export's serialization needs flatbuffers")
    n = 4
    mesh = cpu_mesh((n,), ("cp",))
    q, k, v = random_qkv(fresh_seed(), 2, 16 * n, 16 * n, 4, 4, 16)
    if layout == "heads":
        spec = P(None, None, "cp")
        fn = jax.shard_map(lambda q, k, v: jfa.flash_attention(q, k, v, is_causal=True), mesh=mesh,
                           in_specs=(spec,) * 3, out_specs=spec)
    else:
        spec = P(None, "cp")
        fn = _ring(mesh, is_causal=True)
    args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
    exported = export.export(jax.jit(fn), disabled_checks=jfa.export_disabled_checks())(*args)
    restored = export.deserialize(exported.serialize(vjp_order=1))
    assert restored.nr_devices == n
    np.testing.assert_array_equal(np.asarray(restored.call(*args)), np.asarray(jax.jit(fn)(*args)))
    cotangent = jnp.ones(q.shape, q.dtype)
    got = jax.vjp(restored.call, *args)[1](cotangent)
    want = jax.vjp(fn, *args)[1](cotangent)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
