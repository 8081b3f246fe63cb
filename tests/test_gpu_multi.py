"""Several GPUs of one host (skipped with fewer than 2): batch- and head-split calls compile to
programs with no collective and give the one-GPU result; context_parallel_attention over every
GPU (ring and all_gather, causal load-balanced and not, GQA, chunks that are not whole tiles)
matches the float32 reference, forward and gradients, as the one-GPU call does; windows, ALiBi,
lengths, documents spanning GPUs and dropout cross the GPUs through the kernels' positions and give
the one-GPU call's result (the same dropout mask); top-k sparse attention split over batch and
heads runs with no collective."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_flashattn as jfa
from util import BOUNDS, fresh_seed, random_qkv, reference_with_grads, rel_err

pytestmark = pytest.mark.gpu
BF16 = jnp.bfloat16
COLLECTIVE = re.compile(r"all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute")


@pytest.fixture
def gpus():
    devices = jax.devices("gpu")
    if len(devices) < 2:
        pytest.skip(f"needs 2 GPUs or more, JAX sees {len(devices)}")
    return devices


def forward_and_grads(f, cotangent):
    def run(q, k, v):
        out, pullback = jax.vjp(f, q, k, v)
        return (out,) + pullback(cotangent)
    return run


@pytest.mark.parametrize("split", ["batch", "heads"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_batch_and_head_splits_run_without_collectives(gpus, split, is_causal):
    seed, n = fresh_seed(), len(gpus)
    B, T, N, K, H = (2 * n, 333, 4, 2, 128) if split == "batch" else (2, 333, 4 * n, 2 * n, 128)
    q, k, v = random_qkv(seed, B, T, T, N, K, H, dtype=BF16)
    do = jax.random.normal(jax.random.key(seed + 1), q.shape, BF16)
    spec = P("d") if split == "batch" else P(None, None, "d")
    sharding = NamedSharding(Mesh(np.array(gpus), ("d",)), spec)
    # Ordered dQ adds: unordered float32 atomics round differently from run to run (~1e-5 in bf16).
    step = jax.jit(lambda q, k, v, do: forward_and_grads(
        lambda q, k, v: jfa.flash_attention(q, k, v, is_causal=is_causal, deterministic=True), do)(q, k, v))
    placed = [jax.device_put(x, sharding) for x in (q, k, v, do)]
    hlo = step.lower(*placed).compile().as_text()
    assert not COLLECTIVE.findall(hlo), f"{split} split: {sorted(set(COLLECTIVE.findall(hlo)))}"
    results = step(*placed)
    assert all(r.sharding.is_equivalent_to(sharding, r.ndim) for r in results)
    whole = step(*(jax.device_put(x, gpus[0]) for x in (q, k, v, do)))
    for name, got, want in zip(["out", "dq", "dk", "dv"], results, whole):
        assert rel_err(got, want) == 0, f"seed {seed}: {name} {split} split vs one GPU"


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_context_parallel_matches_float32_reference(gpus, strategy, is_causal):
    # 2n chunks of 200 rows: no chunk is a whole number of tiles.
    seed, n = fresh_seed(), len(gpus)
    B, T, N, K, H = 1, 400 * n, 4, 2, 128
    q, k, v = random_qkv(seed, B, T, T, N, K, H, dtype=BF16)
    do = jax.random.normal(jax.random.key(seed + 1), q.shape, BF16)
    layout = (lambda x: jfa.load_balance(x, 1, n)) if is_causal else (lambda x: x)
    undo = (lambda x: jfa.load_balance(x, 1, n, inverse=True)) if is_causal else (lambda x: x)
    mesh, seq = Mesh(np.array(gpus), ("cp",)), P(None, "cp")
    attend = jax.shard_map(
        lambda q, k, v: jfa.context_parallel_attention(q, k, v, axis_name="cp", strategy=strategy,
                                                       is_causal=is_causal),
        mesh=mesh, in_specs=(seq,) * 3, out_specs=seq)
    placed = [jax.device_put(layout(x), NamedSharding(mesh, seq)) for x in (q, k, v, do)]
    results = jax.jit(lambda q, k, v, do: forward_and_grads(attend, do)(q, k, v))(*placed)
    ref_out, _, ref_grads = reference_with_grads(q, k, v, do, jnp.zeros(q.shape[:3]), is_causal=is_causal)
    one_gpu = jax.jit(lambda q, k, v: forward_and_grads(
        lambda q, k, v: jfa.flash_attention(q, k, v, is_causal=is_causal), do)(q, k, v))(q, k, v)
    out_bound, grad_bound = BOUNDS[BF16]
    for i, (name, want) in enumerate(zip(["out", "dq", "dk", "dv"], (ref_out,) + tuple(ref_grads))):
        got = undo(jax.device_put(results[i], gpus[0]))
        bound = out_bound if i == 0 else grad_bound
        err, err_one = rel_err(got, want), rel_err(one_gpu[i], want)
        # As close to the reference as the one-GPU call, up to bf16 rounding of the merge.
        assert err <= bound and err <= 1.5 * err_one + 1e-3, (
            f"seed {seed}: {name} {strategy} on {n} GPUs {err:.2e}, one GPU {err_one:.2e}")


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_context_parallel_positions_match_one_gpu(gpus, strategy):
    # Window, ALiBi, dropout, key lengths and documents spanning GPUs, load-balanced causal:
    # the kernels get each call's global positions, so the one-GPU call's result and dropout mask.
    seed, n = fresh_seed(), len(gpus)
    B, T, N, K, H = 2, 256 * n, 4, 2, 128
    q, k, v = random_qkv(seed, B, T, T, N, K, H, dtype=BF16)
    rng = np.random.default_rng(seed)
    do = jnp.asarray(rng.normal(size=q.shape), BF16)
    ids = jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), axis=1), jnp.int32)
    slopes = jnp.asarray(rng.uniform(0.02, 0.3, (N,)), jnp.float32)
    lengths = jnp.asarray([T - 37, rng.integers(T // 2, T)], jnp.int32)
    keywords = dict(is_causal=True, local_window_size=(300, 0), dropout_rate=0.2,
                    dropout_rng=jax.random.key(seed + 1))

    def one_gpu(q, k, v):
        return jfa.flash_attention(q, k, v, alibi_slopes=slopes, key_value_seq_lengths=lengths,
                                   q_segment_ids=ids, kv_segment_ids=ids, **keywords)

    mesh = Mesh(np.array(gpus), ("cp",))
    seq = P(None, "cp")
    attend = jax.shard_map(
        lambda q, k, v, ids: jfa.context_parallel_attention(
            q, k, v, axis_name="cp", strategy=strategy, alibi_slopes=slopes,
            key_value_seq_lengths=lengths, q_segment_ids=ids, kv_segment_ids=ids, **keywords),
        mesh=mesh, in_specs=(seq,) * 4, out_specs=seq)
    lb = lambda x: jfa.load_balance(x, 1, n)  # noqa: E731
    placed = [jax.device_put(lb(x), NamedSharding(mesh, seq)) for x in (q, k, v, do, ids)]
    results = jax.jit(lambda q, k, v, do, ids: forward_and_grads(
        lambda q, k, v: attend(q, k, v, ids), do)(q, k, v))(*placed)
    whole = jax.jit(lambda q, k, v: forward_and_grads(one_gpu, do)(q, k, v))(q, k, v)
    out_bound, grad_bound = BOUNDS[BF16]
    for i, name in enumerate(["out", "dq", "dk", "dv"]):
        got = jfa.load_balance(jax.device_put(results[i], gpus[0]), 1, n, inverse=True)
        err = rel_err(got, whole[i])
        # A different dropout mask or position would differ by tens of percent.
        assert err <= (out_bound if i == 0 else grad_bound) / 2, f"seed {seed}: {name} {strategy} {err:.2e}"


@pytest.mark.parametrize("split", ["batch", "heads"])
def test_sparse_attention_splits_run_without_collectives(gpus, split):
    """sparse_attention split over batch (MLA's shapes, V the key's first columns) or over whole GQA
    groups of heads (a separate V): the tensor-core forward and the backward's XLA gathers, einsums
    and scatter-adds run on each GPU's slice with no collective and give the one-GPU values (the
    scatter-adds' float32 order is not fixed, hence a bound rather than equality)."""
    seed, n = fresh_seed(), len(gpus)
    rng = np.random.default_rng(seed)
    shared = split == "batch"
    if shared:
        (B, T, S, N, K, H, Hv, topk), spec = (2 * n, 65, 300, 64, 1, 576, 512, 200), P("d")
    else:
        (B, T, S, N, K, H, Hv, topk), spec = (1, 65, 300, 32 * n, 2 * n, 128, 128, 130), P(None, None, "d")
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32), BF16)  # noqa: E731
    q, k, v, do = normal(B, T, N, H), normal(B, S, K, H), normal(B, S, K, Hv), normal(B, T, N, Hv)
    indices = jnp.asarray(rng.integers(-8, S + 8, (B, T, K, topk)).astype(np.int32))

    def attention(q, k, v, indices):
        value = None if shared else v
        return jfa.sparse_attention(q, k, value, indices, value_head_dim=Hv if shared else None, is_causal=True)

    @jax.jit
    def step(q, k, v, indices, do):
        out, pullback = jax.vjp(lambda q, k, v: attention(q, k, v, indices), q, k, v)
        return (out,) + pullback(do)

    sharding = NamedSharding(Mesh(np.array(gpus), ("d",)), spec)
    placed = [jax.device_put(x, sharding) for x in (q, k, v, indices, do)]
    hlo = step.lower(*placed).compile().as_text()
    assert not COLLECTIVE.findall(hlo), f"{split} split: {sorted(set(COLLECTIVE.findall(hlo)))}"
    results = step(*placed)
    whole = step(*(jax.device_put(x, gpus[0]) for x in (q, k, v, indices, do)))
    for name, got, want in zip(["out", "dq", "dk", "dv"], results, whole):
        if name == "dv" and shared:
            continue  # V is part of K: its gradient is in dk, dv is zeros
        assert got.sharding.is_equivalent_to(sharding, got.ndim), name
        assert rel_err(got, want) <= 1e-2, f"seed {seed}: {name} {split} split vs one GPU: {rel_err(got, want)}"
