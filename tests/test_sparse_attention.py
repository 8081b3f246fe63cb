"""Top-k sparse attention and attn_dist on the CPU kernels: forward, LSE and every gradient against
the float32 reference written from the definition (gather, then softmax), on fresh random inputs
with invalid (-1, negative, >= S, causally hidden) and repeated indices; plus checks that do not
rest on the reference (dense equivalence, duplicated keys, probabilities summing to the group)."""
from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn as jfa
from jax_flashattn import _ext, _sparse_primitives, _sparse_xla_backward
from jax_flashattn.sparse_reference import attn_dist_reference, sparse_attention_reference
from util import BOUNDS, fresh_seed, rel_err


def random_case(seed, B, T, S, N, K, H, Hv, topk, dtype=jnp.float32, empty_rows=0):
    """q, k, v, indices (about a quarter invalid: -1, other negatives, >= S, int32 extremes) and cotangents; the
    first `empty_rows` query positions select nothing valid."""
    rng = np.random.default_rng(seed)  # numpy: no per-shape compilation of random ops
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32), dtype)  # noqa: E731
    q, k, v, do = normal(B, T, N, H), normal(B, S, K, H), normal(B, S, K, Hv), normal(B, T, N, Hv)
    dlse = jnp.asarray(rng.standard_normal((B, T, N), np.float32))
    indices = rng.integers(-S // 4 - 1, S + S // 4 + 1, (B, T, K, topk)).astype(np.int32)
    extremes = rng.random(indices.shape) < 0.05  # far out of range: a kernel must never follow them
    indices[extremes] = rng.choice(np.array([-2**31, 2**31 - 1], np.int32), int(extremes.sum()))
    indices[:, :empty_rows] = -1
    indices = jnp.asarray(indices)
    return q, k, v, indices, do, dlse


def check_against_reference(seed, shape, *, dtype=jnp.float32, shared_value=False, empty_rows=0, **kw):
    """Ours (jitted) against the reference: out, lse, dq, dk, dv; rows with no valid index must
    give out 0, lse -inf and zero dq. Returns ours (out, lse, grads)."""
    B, T, S, N, K, H, Hv, topk = shape
    q, k, v, indices, do, dlse = random_case(seed, *shape, dtype=dtype, empty_rows=empty_rows)
    ref_kw = {name: x for name, x in kw.items() if name != "deterministic"}  # the scatter order only
    if shared_value:
        def ours(q, k):
            return jfa.sparse_attention(q, k, None, indices, value_head_dim=Hv, return_lse=True, **kw)

        def ref(q, k):
            return sparse_attention_reference(q, k, None, indices, value_head_dim=Hv, **ref_kw)
        args = (q, k)
    else:
        def ours(q, k, v):
            return jfa.sparse_attention(q, k, v, indices, return_lse=True, **kw)

        def ref(q, k, v):
            return sparse_attention_reference(q, k, v, indices, **ref_kw)
        args = (q, k, v)

    @jax.jit  # one compiled program: the reference run eagerly would compile op by op
    def run(args, do, dlse):
        (out, lse), vjp = jax.vjp(ours, *args)
        (r_out, r_lse), r_vjp = jax.vjp(ref, *[a.astype(jnp.float32) for a in args])
        dlse = jnp.where(jnp.isfinite(r_lse), dlse, 0.0)
        return (out, lse, vjp((do, dlse))), (r_out, r_lse, r_vjp((do.astype(jnp.float32), dlse)))

    (out, lse, grads), (r_out, r_lse, r_grads) = run(args, do, dlse)
    empty = ~np.isfinite(np.asarray(r_lse))
    fwd_bound, grad_bound = BOUNDS[dtype]
    assert out.dtype == dtype and out.shape == (B, T, N, Hv) and lse.dtype == jnp.float32
    assert rel_err(out, r_out) <= fwd_bound, f"seed {seed}: out {rel_err(out, r_out)}"
    lse_np = np.asarray(lse)
    assert np.array_equal(np.isneginf(lse_np), empty), f"seed {seed}: rows with no valid index differ"
    assert not np.any(np.asarray(out, np.float32)[empty]), f"seed {seed}: empty rows must be 0"
    assert rel_err(np.where(empty, 0, lse_np), np.where(empty, 0, r_lse)) <= fwd_bound, f"seed {seed}: lse"
    for name, g, r in zip(("dq", "dk", "dv"), grads, r_grads):
        assert g.shape == r.shape and g.dtype == dtype, (name, g.shape, r.shape, g.dtype)
        assert rel_err(g, r) <= grad_bound, f"seed {seed}: {name} error {rel_err(g, r)}"
    assert not np.any(np.asarray(grads[0], np.float32)[empty]), f"seed {seed}: dq of empty rows"
    return out, lse, grads


# (B, T, S, N, K, H, Hv, topk): odd sizes, GQA and MQA, T = 1, T < S and T > S, topk > S (repeats
# for certain), topk = 1, Hv != H.
SHAPES = [
    (2, 7, 11, 6, 2, 16, 12, 5),
    (1, 1, 9, 4, 1, 8, 8, 13),
    (1, 13, 5, 3, 3, 20, 20, 7),
    (2, 9, 30, 8, 1, 24, 16, 1),
]


# Each shape with each causal mode would be 12 cases; every shape and every mode once keeps CI short.
CASES = [(SHAPES[0], None), (SHAPES[1], "bottom_right"), (SHAPES[2], "top_left"), (SHAPES[3], "bottom_right"),
         (SHAPES[0], "top_left")]


@pytest.mark.parametrize("shape, causal", CASES,
                         ids=lambda x: "B{}T{}S{}N{}K{}H{}Hv{}topk{}".format(*x) if isinstance(x, tuple) else str(x))
def test_matches_reference(shape, causal):
    kw = {} if causal is None else dict(is_causal=True, causal_alignment=causal)
    check_against_reference(fresh_seed(), shape, empty_rows=1, **kw)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_half_precision_on_the_cpu(dtype):
    check_against_reference(fresh_seed(), (1, 6, 40, 4, 2, 32, 32, 17), dtype=dtype, is_causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_value_none_shares_the_key_buffer(causal):
    # MLA's layout: one latent buffer, V its first Hv columns; both gradients land in key's.
    check_against_reference(fresh_seed(), (1, 5, 12, 4, 1, 24, 16, 9), shared_value=True, is_causal=causal)


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_all_keys_selected_is_dense_attention(alignment):
    """Selecting every key, in a random order, is dense attention (independent of the reference)."""
    seed = fresh_seed()
    B, T, S, N, K, H = 2, 6, 9, 4, 2, 16
    q, k, v, _, _, _ = random_case(seed, B, T, S, N, K, H, H, 1)
    order = jax.random.permutation(jax.random.key(seed + 1), S).astype(jnp.int32)
    indices = jnp.broadcast_to(order, (B, T, K, S))
    out, lse = jfa.sparse_attention(q, k, v, indices, is_causal=True, causal_alignment=alignment,
                                    return_lse=True)
    d_out, d_lse = jfa.flash_attention(q, k, v, is_causal=True, causal_alignment=alignment, return_lse=True)
    assert rel_err(out, d_out) <= 1e-5, f"seed {seed}"
    assert rel_err(lse, d_lse) <= 1e-5, f"seed {seed}"


def test_repeated_indices_count_as_often_as_they_appear():
    """Listing every selection twice leaves the softmax unchanged and adds log 2 to the LSE, and
    a key listed twice weighs as two keys."""
    seed = fresh_seed()
    q, k, v, indices, _, _ = random_case(seed, 1, 4, 10, 2, 1, 8, 8, 6)
    indices = jnp.abs(indices) % 10
    out, lse = jfa.sparse_attention(q, k, v, indices, return_lse=True)
    out2, lse2 = jfa.sparse_attention(q, k, v, jnp.concatenate([indices, indices], -1), return_lse=True)
    assert rel_err(out2, out) <= 1e-6 and rel_err(lse2, lse + np.log(2.0)) <= 1e-6, f"seed {seed}"
    twice = jnp.array([[[[3, 3, 5]]]], jnp.int32)
    out_twice = jfa.sparse_attention(q[:, :1], k, v, twice)
    logits = jnp.einsum("bnh,bjh->bnj", q[:, 0], k[:, jnp.array([3, 5]), 0]) / np.sqrt(8)
    weights = jax.nn.softmax(logits + jnp.log(jnp.array([2.0, 1.0])), axis=-1)
    expected = jnp.einsum("bnj,bjd->bnd", weights, v[:, jnp.array([3, 5]), 0])
    assert rel_err(out_twice[:, 0], expected) <= 1e-5, f"seed {seed}"


def test_rows_with_no_valid_index():
    q, k, v, _, _, _ = random_case(fresh_seed(), 1, 3, 4, 2, 1, 8, 8, 3)
    indices = jnp.array([[[[-1, 4, 9]], [[-5, 2, -1]], [[3, 3, 3]]]], jnp.int32)  # row 0: nothing valid
    out, lse = jfa.sparse_attention(q, k, v, indices, is_causal=True, causal_alignment="top_left",
                                    return_lse=True)
    # Causal top-left: row 1 (position 1) cannot see key 2, row 2 cannot see key 3.
    assert np.all(np.isneginf(np.asarray(lse))) and not np.any(np.asarray(out))
    loss = lambda q, k, v: jfa.sparse_attention(q, k, v, indices, is_causal=True,  # noqa: E731
                                                causal_alignment="top_left").sum()
    dq, dk, dv = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert not (np.any(np.asarray(dq)) or np.any(np.asarray(dk)) or np.any(np.asarray(dv)))


def test_vmap_any_in_axes_and_unbatched():
    seed = fresh_seed()
    B, T, S, N, K, H, topk = 3, 5, 8, 4, 2, 8, 4
    q, k, v, indices, _, _ = random_case(seed, B, T, S, N, K, H, H, topk)
    looped = jnp.stack([jfa.sparse_attention(q[b], k[0], v[b], indices[b]) for b in range(B)])
    # query and value mapped along different axes, key shared, indices mapped.
    mapped = jax.vmap(jfa.sparse_attention, in_axes=(1, None, 2, 0), out_axes=0)(
        jnp.moveaxis(q, 0, 1), k[0], jnp.moveaxis(v, 0, 2), indices)
    assert rel_err(mapped, looped) <= 1e-6, f"seed {seed}"
    ref = sparse_attention_reference(q[:1], k[:1], v[:1], indices[:1])[0][0]
    assert rel_err(looped[0], ref) <= 1e-5, f"seed {seed}"
    loss = lambda q, k, v: jnp.sum(jfa.sparse_attention(q, k, v, indices[0], is_causal=True) ** 2)  # noqa: E731
    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(0, None, 0)))(q, k[0], v)
    for b in range(B):
        for g, r in zip(grads, jax.grad(loss, argnums=(0, 1, 2))(q[b], k[0], v[b])):
            assert rel_err(g[b], r) <= 1e-5, f"seed {seed}"
    dist = jax.vmap(lambda q, k, i, l: jfa.attn_dist(q, k, i, l, head_group=2))(
        q, k, indices, jax.vmap(lambda *a: jfa.sparse_attention(*a, return_lse=True)[1])(q, k, v, indices))
    assert dist.shape == (B, N // 2, T, topk)


def test_inside_shard_map_with_replicated_keys():
    """Queries split over a mesh axis, keys and values replicated: the keys' gradient is summed over
    the devices (one CPU device here, so the mesh axis has size 1)."""
    from jax.sharding import Mesh, PartitionSpec as P
    q, k, v, indices, _, _ = random_case(fresh_seed(), 1, 4, 6, 2, 1, 8, 8, 3)
    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("x",))
    loss = lambda q, k, v, i: jnp.sum(jfa.sparse_attention(q, k, v, i) ** 2)  # noqa: E731
    sharded = jax.shard_map(jax.grad(loss, argnums=(0, 1)), mesh=mesh, in_specs=(P(None, "x"), P(), P(), P(None, "x")),
                            out_specs=(P(None, "x"), P()))
    for g, r in zip(jax.jit(sharded)(q, k, v, indices), jax.grad(loss, argnums=(0, 1))(q, k, v, indices)):
        assert rel_err(g, r) <= 1e-6


def test_deterministic_gradients_are_bitwise_repeatable():
    seed = fresh_seed()
    q, k, v, indices, do, _ = random_case(seed, 2, 9, 7, 4, 2, 16, 8, 11)
    grad = jax.jit(jax.grad(lambda q, k, v, det: jnp.sum(jfa.sparse_attention(q, k, v, indices, deterministic=det)
                                                         * do), argnums=(0, 1, 2)), static_argnums=3)
    first, again, default = grad(q, k, v, True), grad(q, k, v, True), grad(q, k, v, False)
    for a, b, c in zip(first, again, default):
        assert np.array_equal(np.asarray(a), np.asarray(b))
        assert rel_err(a, c) <= 1e-6, f"seed {seed}"


@pytest.mark.parametrize("lse_base", ["e", 2])
@pytest.mark.parametrize("causal", [False, True])
def test_attn_dist_matches_reference(lse_base, causal):
    seed = fresh_seed()
    B, T, S, N, K, H, topk = 2, 6, 10, 8, 2, 16, 7
    q, k, v, indices, _, _ = random_case(seed, B, T, S, N, K, H, H, topk, empty_rows=1)
    _, lse = jfa.sparse_attention(q, k, v, indices, is_causal=causal, return_lse=True)
    given = lse / np.log(2.0) if lse_base == 2 else lse
    dist = jax.jit(lambda q, k, i, l: jfa.attn_dist(q, k, i, l, head_group=4, lse_base=lse_base,
                                                   is_causal=causal))(q, k, indices, given)
    ref = attn_dist_reference(q, k, indices, lse, head_group=4, is_causal=causal)
    assert dist.shape == (B, 2, T, topk) and dist.dtype == jnp.float32
    assert rel_err(dist, ref) <= 1e-5, f"seed {seed}"
    # With the attention's own LSE each head's probabilities sum to 1 over its selection: a
    # group's row sums to head_group (0 for a row that saw nothing).
    sums = np.asarray(jnp.sum(dist, -1))
    expected = np.where(np.isfinite(np.asarray(lse)).reshape(B, T, 2, 4).all(-1), 4.0, 0.0).transpose(0, 2, 1)
    np.testing.assert_allclose(sums, expected, rtol=1e-5, atol=1e-6)
    if not causal:  # invalid slots give exactly 0; here group g is the G heads of key/value head g
        invalid = np.transpose(np.asarray((indices < 0) | (indices >= S)), (0, 2, 1, 3))
        assert not np.any(np.asarray(dist)[invalid])


def test_attn_dist_unbatched_and_no_gradient():
    q, k, v, indices, _, _ = random_case(fresh_seed(), 1, 4, 6, 4, 1, 8, 8, 3)
    _, lse = jfa.sparse_attention(q[0], k[0], v[0], indices[0], return_lse=True)
    assert jfa.attn_dist(q[0], k[0], indices[0], lse, head_group=2).shape == (2, 4, 3)
    g = jax.grad(lambda q: jfa.attn_dist(q, k[0], indices[0], lse, head_group=4).sum())(q[0])
    assert not np.any(np.asarray(g))


def test_indexer_kl_training_example():
    """docs/sparse-attention.md's example: an indexer trained towards attn_dist's target with the
    DSA KL loss over the selected keys; the loss falls."""
    B, T, S, N, H, Hi, topk = 1, 16, 16, 4, 16, 8, 8
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (B, S, 32))
    q = jax.random.normal(keys[1], (B, T, N, H))
    kv = jax.random.normal(keys[2], (B, S, 1, H))
    params = {"wq": 0.1 * jax.random.normal(keys[3], (32, Hi)), "wk": 0.1 * jax.random.normal(keys[4], (32, Hi))}
    # The selection: each query's topk latest visible keys (any selection works for the target).
    positions = jnp.arange(T)[:, None] - jnp.arange(topk)[None, :]
    indices = jnp.where(positions >= 0, positions, -1).astype(jnp.int32)[None, :, None, :]
    _, lse = jfa.sparse_attention(q, kv, None, indices, value_head_dim=H, is_causal=True, return_lse=True)
    target = jfa.attn_dist(q, kv, indices, lse, head_group=N, is_causal=True)[:, 0]      # [B, T, topk]
    target = target / jnp.maximum(jnp.sum(target, -1, keepdims=True), 1e-30)

    def indexer_loss(params):
        scores = jnp.einsum("bti,bsi->bts", x @ params["wq"], x @ params["wk"])
        picked = jnp.take_along_axis(scores, jnp.maximum(indices[:, :, 0], 0), axis=-1)
        log_p = jax.nn.log_softmax(jnp.where(indices[:, :, 0] >= 0, picked, -1e9), axis=-1)
        return jnp.sum(jnp.where(target > 0, target * (jnp.log(jnp.maximum(target, 1e-30)) - log_p), 0.0))

    step = jax.jit(lambda p: jax.tree.map(lambda w, g: w - 0.02 * g, p, jax.grad(indexer_loss)(p)))
    first = float(indexer_loss(params))
    for _ in range(30):
        params = step(params)
    assert float(indexer_loss(params)) < 0.5 * first


def test_empty_problems():
    q, k, v, indices, _, _ = random_case(0, 1, 3, 4, 2, 1, 8, 8, 2)
    out, lse = jfa.sparse_attention(q, k, v, indices[..., :0], return_lse=True)
    assert out.shape == (1, 3, 2, 8) and not np.any(np.asarray(out)) and np.all(np.isneginf(np.asarray(lse)))
    assert jfa.attn_dist(q, k, indices[..., :0], lse, head_group=2).shape == (1, 1, 3, 0)


def test_wider_integer_indices_out_of_range_are_invalid():
    q, k, v, indices, _, _ = random_case(fresh_seed(), 1, 3, 4, 2, 1, 8, 8, 2)
    indices = jnp.clip(indices, -4, 8)  # small negatives wrap to 252..255 in uint8: still invalid
    wide = indices.astype(jnp.uint8)
    assert rel_err(jfa.sparse_attention(q, k, v, wide), jfa.sparse_attention(q, k, v, indices)) == 0.0


def test_host_int64_indices_beyond_int32_are_invalid():
    """NumPy int64 indices past the int32 range select nothing (a JAX array made from them
    without jax_enable_x64 would wrap 2**32 + 1 to key 1 and -2**32 to key 0)."""
    q, k, v, _, _, _ = random_case(fresh_seed(), 1, 2, 4, 2, 1, 8, 8, 2)
    far = np.array([[[[2**32 + 1, -2**32]], [[2**33 + 3, 1]]]], np.int64)
    out, lse = jfa.sparse_attention(q, k, v, far, return_lse=True)
    assert not np.any(np.asarray(out[0, 0])) and np.all(np.isneginf(np.asarray(lse[0, 0])))
    only_key_1 = jfa.sparse_attention(q, k, v, jnp.array([[[[1, -1]]]], jnp.int32).repeat(2, axis=1))
    np.testing.assert_array_equal(np.asarray(out[0, 1]), np.asarray(only_key_1[0, 1]))
    lse_far = jfa.sparse_attention(q, k, v, far[..., :1], return_lse=True)[1]
    assert jfa.attn_dist(q, k, far, lse_far, head_group=2)[0, 0, 0].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("shared_value", [False, True])
def test_cuda_lowering(shared_value, monkeypatch):
    """Lowering for CUDA, forward, backward (both scatter modes) and attn_dist, works without a GPU
    (in a build without CUDA kernels it stops at the missing kernels, never before). The device is
    said not to take the tensor-core backward, so deterministic=False lowers to XLA's form
    (test_cuda_lowering_picks_the_backward has the other answer)."""
    monkeypatch.delenv("JFA_SPARSE_BACKWARD", raising=False)
    monkeypatch.setattr(_ext, "cuda_sparse_backward_tensor_cores", lambda *args: False)
    q, k, v, indices, _, _ = random_case(0, 1, 4, 6, 4, 1, 576, 512, 3, dtype=jnp.bfloat16)
    value = None if shared_value else v

    def fn(q, k, v):
        def loss(q, k, v):
            out, lse = jfa.sparse_attention(q, k, v, indices, value_head_dim=512 if v is None else None,
                                            deterministic=shared_value, return_lse=True)
            return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jfa.attn_dist(q, k, indices, lse, head_group=2))
        return jax.value_and_grad(loss, argnums=(0, 1))(q, k, v)

    try:
        text = jax.jit(fn).trace(q, k, value).lower(lowering_platforms=("cuda",)).as_text()
    except RuntimeError as e:
        assert "without its CUDA kernels" in str(e)
        return
    # deterministic=True (here with the shared value) runs the ordered kernels; otherwise, where the
    # tensor-core kernels do not take the call, the backward's GEMMs are XLA's (_sparse_xla_backward).
    for target in ("jfa_sparse_fwd", "jfa_attn_dist") + (("jfa_sparse_bwd",) if shared_value else ()):
        assert target in text
    assert ("jfa_sparse_bwd" in text) == shared_value


@pytest.mark.parametrize("deterministic, takes, budget, items", [
    (False, True, 1 << 30, 4 * 3),                 # every item fits: B·T·K of them
    (False, True, 5 * (2 * 4 * 128 * 2) + 100, 5),  # chunks of as many items as the budget holds
    (False, True, 1, 1),                           # never fewer than one
    (True, True, 1 << 30, 0),                      # the ordered kernels need none
    (False, False, 1 << 30, 0),                    # nor calls the tensor-core kernels do not take
])
def test_tensor_core_backward_weights_workspace(monkeypatch, deterministic, takes, budget, items):
    """The tensor-core backward's P and scale·dS workspace: [items, 2, N / K, topk in 64-slot blocks],
    as many (query position, key head) items as the byte budget holds, none where those kernels
    do not take the call; the device is asked with the call's dtype, heads, dims and topk."""
    monkeypatch.setattr(_sparse_primitives, "_SPARSE_WEIGHTS_BYTES", budget)
    asked = []
    monkeypatch.setattr(_ext, "cuda_sparse_backward_tensor_cores", lambda *args: asked.append(args) or takes)
    B, T, N, K, H, Hv, topk = 2, 2, 12, 3, 64, 48, 100
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.float16)
    k = jax.ShapeDtypeStruct((B, 7, K, H), jnp.float16)
    indices = jax.ShapeDtypeStruct((B, T, K, topk), jnp.int32)
    config = type("Config", (), {"deterministic": deterministic, "value_head_dim": Hv})()
    got = _sparse_primitives._weights_workspace(q, k, jnp.zeros((), jnp.float16), indices, config)
    assert got.shape == (min(items, B * T * K), 2, N // K, 128) and got.dtype == jnp.float16
    assert asked == ([] if deterministic else [(jnp.float16, N, K, H, Hv, topk, True)])


def test_cuda_tensor_core_backward_query():
    """The device's answer: never for float32 or head dims off the kernels' grid, never without CUDA
    kernels; DeepSeek V3.2's shape (bfloat16, 128 heads, 576/512) on a Hopper GPU, whose shared
    memory holds its tiles (GPUs with less, such as sm_86/sm_89, may answer no)."""
    takes = _ext.cuda_sparse_backward_tensor_cores
    assert not takes(jnp.float32, 128, 1, 576, 512, 2048, True)
    assert not takes(jnp.bfloat16, 128, 1, 68, 64, 2048, False)
    assert not takes(jnp.bfloat16, 128, 1, 640, 512, 2048, True)
    assert not takes(jnp.bfloat16, 128, 3, 576, 512, 2048, True)  # heads not a multiple of key heads
    if not _ext.has_cuda():
        assert not takes(jnp.bfloat16, 128, 1, 576, 512, 2048, True)
    elif jax.default_backend() == "gpu" and jax.devices()[0].compute_capability.startswith("9."):
        assert takes(jnp.bfloat16, 128, 1, 576, 512, 2048, True)
        assert takes(jnp.float16, 16, 2, 64, 64, 100, False)


@pytest.mark.parametrize("choice, kernel_takes, kernel_backward", [
    (None, True, True), (None, False, False), ("kernel", False, True), ("xla", True, False)])
def test_cuda_lowering_picks_the_backward(monkeypatch, choice, kernel_takes, kernel_backward):
    """The default backward is the tensor-core kernels' where they take the call, with the weights
    workspace sized for every (query position, key head) item; JFA_SPARSE_BACKWARD=kernel or xla
    forces one; any other value is refused by name. Lowering needs no kernels, so a build without
    them is told it has them."""
    if choice is None:
        monkeypatch.delenv("JFA_SPARSE_BACKWARD", raising=False)
    else:
        monkeypatch.setenv("JFA_SPARSE_BACKWARD", choice)
    monkeypatch.setattr(_ext, "has_cuda", lambda: True)
    monkeypatch.setattr(_ext, "cuda_sparse_backward_tensor_cores", lambda *args: kernel_takes)
    q, k, v, indices, _, _ = random_case(1, 1, 4, 6, 4, 1, 576, 512, 3, dtype=jnp.bfloat16)

    def grads():
        loss = lambda q, k, v: jnp.sum(jfa.sparse_attention(q, k, v, indices).astype(jnp.float32))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower(lowering_platforms=("cuda",))

    text = grads().as_text()
    assert ("jfa_sparse_bwd" in text) == kernel_backward
    assert ("tensor<4x2x4x64xbf16>" in text) == (kernel_backward and kernel_takes)
    monkeypatch.setenv("JFA_SPARSE_BACKWARD", "atomics")
    with pytest.raises(ValueError, match="JFA_SPARSE_BACKWARD must be one of auto, kernel, xla, got 'atomics'"):
        grads()


# (shape, shared value, causal alignment or None, dtype, block_bytes): one block, blocks that
# divide T, blocks that leave padding queries, blocks of one query; float16/bfloat16 as on a GPU.
XLA_BACKWARD_CASES = [
    ((2, 7, 11, 6, 2, 16, 12, 5), False, "bottom_right", jnp.float32, 1 << 30),
    ((2, 9, 30, 8, 1, 24, 16, 6), True, "top_left", jnp.float32, 21504),
    ((1, 13, 5, 3, 3, 20, 20, 7), False, None, jnp.float32, 9000),
    ((1, 6, 200, 16, 1, 64, 48, 129), True, "bottom_right", jnp.bfloat16, 100000),
    ((2, 17, 40, 8, 2, 32, 32, 9), False, "bottom_right", jnp.float16, 5000),
]


@pytest.mark.parametrize("shape, shared_value, causal, dtype, block_bytes", XLA_BACKWARD_CASES)
def test_xla_backward_matches_reference(shape, shared_value, causal, dtype, block_bytes):
    """The CUDA path's backward (XLA gathers, einsums and scatter-adds per block of queries), run
    here on the CPU, against the reference's gradients."""
    B, T, S, N, K, H, Hv, topk = shape
    seed = fresh_seed()
    q, k, v, indices, do, dlse = random_case(seed, *shape, dtype=dtype, empty_rows=1)
    v = None if shared_value else v
    kw = {} if causal is None else dict(is_causal=True, causal_alignment=causal)
    config = _sparse_primitives.SparseConfig(scale=H ** -0.5, is_causal=causal is not None,
                                             bottom_right=causal != "top_left", value_head_dim=Hv,
                                             deterministic=False)

    def ref(q, k, *v):
        return sparse_attention_reference(q, k, v[0] if v else None, indices, value_head_dim=Hv, **kw)

    args = (q, k) if shared_value else (q, k, v)
    (_, r_lse), r_vjp = jax.vjp(ref, *[a.astype(jnp.float32) for a in args])
    dlse = jnp.where(jnp.isfinite(r_lse), dlse, 0.0)
    r_grads = r_vjp((do.astype(jnp.float32), dlse))
    out, lse = jfa.sparse_attention(q, k, v, indices, value_head_dim=Hv if shared_value else None,
                                    return_lse=True, **kw)
    grads = jax.jit(lambda *a: _sparse_xla_backward.xla_backward(*a, config, block_bytes=block_bytes))(
        q, k, v, indices, out, lse, do, dlse)
    assert (grads[2] is None) == shared_value
    _, grad_bound = BOUNDS[dtype]
    for name, g, r in zip(("dq", "dk", "dv"), [g for g in grads if g is not None], r_grads):
        assert g.shape == r.shape and g.dtype == dtype, (name, g.shape, r.shape, g.dtype)
        assert rel_err(g, r) <= grad_bound / 4, f"seed {seed}: {name} error {rel_err(g, r)}"


def test_cuda_head_dim_limit_follows_sparse_gpu_h():
    header = pathlib.Path(__file__).resolve().parents[1] / "cuda" / "sparse" / "sparse_gpu.h"
    if not header.exists():
        pytest.skip("the CUDA sources are not next to the tests (an installed package)")
    match = re.search(r"inline constexpr int64_t kMaxHeadDim = (\d+);", header.read_text())
    assert match and int(match.group(1)) == _sparse_primitives._MAX_CUDA_HEAD_DIM


F32 = jnp.float32


@pytest.mark.parametrize("call, error, words", [
    (lambda: jfa.sparse_attention(jnp.ones((1, 2, 4, 8)), jnp.ones((1, 3, 3, 8)), jnp.ones((1, 3, 3, 8)),
                                  jnp.zeros((1, 2, 3, 1), jnp.int32)), ValueError, ["N=4", "K=3"]),
    (lambda: jfa.sparse_attention(jnp.ones((1, 2, 4, 8)), jnp.ones((1, 3, 2, 8)), jnp.ones((1, 3, 2, 8)),
                                  jnp.zeros((1, 2, 1, 5), jnp.int32)), ValueError, ["indices", "(1, 2, 1, 5)"]),
    (lambda: jfa.sparse_attention(jnp.ones((1, 2, 4, 8)), jnp.ones((1, 3, 2, 8)), jnp.ones((1, 3, 2, 8)),
                                  jnp.zeros((1, 2, 2, 5), F32)), TypeError, ["indices", "float32"]),
    (lambda: jfa.sparse_attention(jnp.ones((1, 2, 4, 8)), jnp.ones((1, 3, 2, 8)), None,
                                  jnp.zeros((1, 2, 2, 5), jnp.int32)), ValueError, ["value_head_dim", "H=8"]),
    (lambda: jfa.sparse_attention(jnp.ones((1, 2, 4, 8)), jnp.ones((1, 3, 2, 8)), None,
                                  jnp.zeros((1, 2, 2, 5), jnp.int32), value_head_dim=9), ValueError, ["9"]),
    (lambda: jfa.sparse_attention(jnp.ones((1, 2, 4, 8)), jnp.ones((1, 3, 2, 8)), jnp.ones((1, 4, 2, 8)),
                                  jnp.zeros((1, 2, 2, 5), jnp.int32)), ValueError, ["value", "(1, 4, 2, 8)"]),
    (lambda: jfa.sparse_attention(jnp.ones((1, 2, 4, 8)), jnp.ones((1, 3, 2, 6)), jnp.ones((1, 3, 2, 6)),
                                  jnp.zeros((1, 2, 2, 5), jnp.int32)), ValueError, ["key", "H=8"]),
    (lambda: jfa.sparse_attention(jnp.ones((1, 2, 4, 8)), jnp.ones((1, 3, 2, 8)), jnp.ones((1, 3, 2, 8)),
                                  jnp.zeros((1, 2, 2, 5), jnp.int32), causal_alignment="top"),
     ValueError, ["causal_alignment"]),
    (lambda: jfa.attn_dist(jnp.ones((1, 2, 4, 8)), jnp.ones((1, 3, 2, 8)), jnp.zeros((1, 2, 2, 5), jnp.int32),
                           jnp.zeros((1, 2, 4))), ValueError, ["head_group", "N=4"]),
    (lambda: jfa.attn_dist(jnp.ones((1, 2, 4, 8)), jnp.ones((1, 3, 2, 8)), jnp.zeros((1, 2, 2, 5), jnp.int32),
                           jnp.zeros((1, 4, 2)), head_group=2), ValueError, ["lse", "(1, 4, 2)"]),
    (lambda: jfa.attn_dist(jnp.ones((1, 2, 4, 8)), jnp.ones((1, 3, 2, 8)), jnp.zeros((1, 2, 2, 5), jnp.int32),
                           jnp.zeros((1, 2, 4)), head_group=2, lse_base=10), ValueError, ["lse_base"]),
], ids=["heads", "indices-shape", "indices-dtype", "value-none", "value-head-dim", "value-shape",
        "key-head-dim", "alignment", "head-group", "lse-shape", "lse-base"])
def test_errors_name_the_argument(call, error, words):
    with pytest.raises(error) as info:
        call()
    for word in words:
        assert word in str(info.value), str(info.value)


# ---- GPU (skipped without one; JFA_REQUIRE_GPU=1 makes the skip a failure) ------------------------

# (B, T, S, N, K, H, Hv, topk): odd sizes, GQA, T = 1, topk past S, topk not a multiple of the
# kernels' steps; DeepSeek V3.2's head dims (MLA: V is key[..., :512]) with 16 heads per key head
# (16-row tensor-core tiles) and with 128 (64-row tiles; on Hopper the wgmma kernel), and two key
# heads of 64 with topk one 64-slot block; a group of 32 in 64-row tiles; a group of 64 at H 128
# (the tensor-core backward's 64-head tiles).
GPU_CASES = [
    ((2, 33, 70, 8, 2, 64, 64, 40), False),
    ((1, 1, 9, 4, 1, 128, 128, 13), False),
    ((1, 17, 300, 4, 4, 96, 80, 130), False),
    ((1, 6, 200, 16, 1, 576, 512, 129), True),
    ((1, 5, 300, 128, 1, 576, 512, 200), True),
    ((2, 3, 150, 128, 2, 576, 512, 64), True),
    ((1, 7, 90, 64, 2, 64, 64, 70), False),
    ((1, 5, 120, 64, 1, 128, 128, 100), False),
]


# The three GPU backwards: XLA's (deterministic=False with JFA_SPARSE_BACKWARD=xla), the CUDA
# kernels' atomics (JFA_SPARSE_BACKWARD=kernel: tensor cores where they take it, as by default)
# and the ordered scatter.
BACKWARDS = ["xla", "kernel", "ordered"]


def use_backward(backward, monkeypatch):
    """The keywords and environment of one of BACKWARDS."""
    if backward != "ordered":
        monkeypatch.setenv("JFA_SPARSE_BACKWARD", backward)
    return dict(deterministic=backward == "ordered")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("shape, shared_value", GPU_CASES, ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_gpu_matches_reference(shape, shared_value, causal, backward, dtype, monkeypatch):
    kw = {} if causal is None else dict(is_causal=True, causal_alignment=causal)
    check_against_reference(fresh_seed(), shape, dtype=dtype, shared_value=shared_value, empty_rows=1,
                            **use_backward(backward, monkeypatch), **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("shape, shared_value, budget_items", [
    ((2, 5, 150, 128, 2, 576, 512, 70), True, 3),  # 20 items in chunks of 3 (the last one of 2)
    ((1, 4, 100, 288, 1, 64, 64, 90), False, 4),   # a group of 288: three head blocks in dK/dV's pass
])
def test_gpu_kernel_backward_in_chunks(shape, shared_value, budget_items, monkeypatch):
    """The tensor-core backward with a weights workspace smaller than the call: its passes run
    chunk by chunk, and dK/dV's pass splits a group of more than 128 heads."""
    B, T, S, N, K, H, Hv, topk = shape
    monkeypatch.setattr(_sparse_primitives, "_SPARSE_WEIGHTS_BYTES",
                        budget_items * 2 * (N // K) * (-(-topk // 64) * 64) * 2)
    check_against_reference(fresh_seed(), shape, dtype=jnp.bfloat16, shared_value=shared_value, empty_rows=1,
                            is_causal=True, **use_backward("kernel", monkeypatch))


@pytest.mark.gpu
@pytest.mark.parametrize("backward", BACKWARDS)
def test_gpu_float32_matches_reference(backward, monkeypatch):
    """float32 on the GPU: the CUDA-core forward, and a backward at float32's bounds (the XLA form's
    products in full float32, not TF32; the kernels' on CUDA cores)."""
    check_against_reference(fresh_seed(), (2, 9, 40, 8, 2, 64, 48, 21), dtype=jnp.float32, empty_rows=1,
                            is_causal=True, **use_backward(backward, monkeypatch))


@pytest.mark.gpu
def test_gpu_deterministic_gradients_are_bitwise_repeatable():
    q, k, v, indices, do, _ = random_case(fresh_seed(), 1, 40, 50, 8, 1, 64, 64, 37, dtype=jnp.bfloat16)
    # Every query selects the same few keys: many adds per key row, where order matters most.
    indices = indices % 5
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jfa.sparse_attention(q, k, v, indices, deterministic=True)
                                                    .astype(jnp.float32) * do), argnums=(0, 1, 2)))
    first, again = grad(q, k, v), grad(q, k, v)
    for a, b in zip(first, again):
        assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# (B, T, S, N, K, topk), head_group at H 576: two groups of 64 of one key head; groups of 128 within
# each of two key heads, with a partial last block; a group of 128 across two key heads of 64 (its
# two CTAs read different indices); topk one 64-slot block. On Hopper the wgmma kernel takes them
# all in float16/bfloat16; float32 runs on the CUDA-core kernel.
GPU_DIST_CASES = [((1, 9, 150, 128, 1, 70), 64), ((2, 5, 300, 256, 2, 129), 128), ((2, 5, 300, 128, 2, 129), 128),
                  ((1, 3, 80, 64, 1, 64), 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("lse_base", ["e", 2])
@pytest.mark.parametrize("shape, head_group", GPU_DIST_CASES, ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_gpu_attn_dist_matches_reference(shape, head_group, dtype, lse_base):
    seed = fresh_seed()
    B, T, S, N, K, topk = shape
    q, k, v, indices, _, _ = random_case(seed, B, T, S, N, K, 576, 8, topk, dtype=dtype, empty_rows=1)
    _, lse = jfa.sparse_attention(q, k, None, indices, value_head_dim=512, is_causal=True, return_lse=True)
    given = lse / np.log(2.0) if lse_base == 2 else lse
    dist = jax.jit(lambda *a: jfa.attn_dist(*a, head_group=head_group, lse_base=lse_base, is_causal=True))(
        q, k, indices, given)
    ref = attn_dist_reference(q.astype(jnp.float32), k.astype(jnp.float32), indices, lse, head_group=head_group,
                              is_causal=True)
    assert dist.shape == (B, N // head_group, T, topk)
    assert rel_err(dist, ref) <= 1e-4, f"seed {seed}: {rel_err(dist, ref)}"
