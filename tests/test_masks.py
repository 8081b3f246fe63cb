"""Position masks and score modifiers of flash_attention against the float32 reference, forward
and gradients: lengths, local windows, causal alignment, segment ids, softcap, ALiBi — each
alone and in combination, at tile-aligned and odd sizes (tiles are 64 x 64)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn as jfa
from util import compare_with_reference, fresh_seed, random_qkv

SHAPES = {
    "odd": (2, 17, 33, 4, 2, 32),
    "tiles": (2, 130, 100, 2, 1, 64),   # several tiles each way, partial last tiles
    "wide": (1, 40, 200, 2, 2, 16),     # S >> T: bottom-right alignment matters
    "one": (2, 1, 17, 2, 1, 16),        # a single query
}


def _lengths(seed, B, full, low=0):
    return jnp.asarray(np.random.default_rng(seed).integers(low, full + 1, size=B), jnp.int32)


def _segments(seed, B, L, count):
    """Sorted (packed) segment ids with random boundaries."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.integers(0, L + 1, size=(B, count - 1)), axis=1)
    ids = (np.arange(L)[None, None, :] >= cuts[:, :, None]).sum(1)
    return jnp.asarray(ids, jnp.int32)


def _keywords(name, seed, B, T, S, N):
    """One feature's keywords for a problem of that size."""
    return {
        "causal": dict(is_causal=True),
        "q_lengths": dict(query_seq_lengths=_lengths(seed, B, T)),
        "kv_lengths": dict(key_value_seq_lengths=_lengths(seed + 1, B, S)),
        "window": dict(local_window_size=(9, 4)),
        "window_int": dict(local_window_size=3),
        "causal_window": dict(is_causal=True, local_window_size=(20, 0)),
        "bottom_right": dict(is_causal=True, causal_alignment="bottom_right"),
        "bottom_right_window": dict(causal_alignment="bottom_right", local_window_size=(5, 5)),
        "segments": dict(q_segment_ids=_segments(seed, B, T, 3),
                         kv_segment_ids=_segments(seed + 1, B, S, 3)),
        "softcap": dict(softcap=2.0),
        "alibi": dict(alibi_slopes=jnp.asarray(np.random.default_rng(seed).uniform(0.01, 0.5, N),
                                               jnp.float32)),
        "alibi_per_batch": dict(alibi_slopes=jnp.asarray(
            np.random.default_rng(seed).uniform(0.01, 0.5, (B, N)), jnp.float32), is_causal=True),
    }[name]


FEATURES = ["causal", "q_lengths", "kv_lengths", "window", "window_int", "causal_window",
            "bottom_right", "bottom_right_window", "segments", "softcap", "alibi",
            "alibi_per_batch"]


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("shape", ["odd", "tiles"])
def test_feature_alone(feature, shape):
    seed = fresh_seed()
    B, T, S, N, K, H = SHAPES[shape]
    compare_with_reference(seed, SHAPES[shape], _keywords(feature, seed, B, T, S, N))


COMBOS = [
    ("causal", "q_lengths", "kv_lengths", "bottom_right"),
    ("causal_window", "segments", "softcap"),
    ("bottom_right_window", "alibi", "kv_lengths"),
    ("window", "segments", "q_lengths", "alibi_per_batch", "softcap"),
]


def combo_keywords(combo, seed, B, T, S, N):
    """The keywords of several features together, each drawn from its own seed."""
    kw = {}
    for i, name in enumerate(combo):
        kw.update(_keywords(name, seed + 10 * i, B, T, S, N))
    return kw


def check_combined(seed, shape, combo, dtype=jnp.float32):
    B, T, S, N, K, H = shape
    compare_with_reference(seed, shape, combo_keywords(combo, seed, B, T, S, N), dtype=dtype)


def check_low_precision_combination(seed, shape, window, dtype):
    """Causal bottom-right with a window, softcap, kv lengths and ALiBi, in fp16/bf16."""
    B, T, S, N, K, H = shape
    kw = dict(is_causal=True, causal_alignment="bottom_right", local_window_size=(window, 0),
              softcap=5.0, key_value_seq_lengths=_lengths(seed, B, S, low=1),
              alibi_slopes=jnp.full((N,), 0.05, jnp.float32))
    compare_with_reference(seed, shape, kw, dtype=dtype)


def check_fully_masked_rows(seed, shape, q_len0, kv_len1, dtype=jnp.float32):
    """Batch element 0 has rows past its length (and, bottom-right, rows whose window holds no
    key); element 1 has no query at all: 0 / -inf / no gradient."""
    B, T, S, N, K, H = shape
    kw = dict(query_seq_lengths=jnp.array([q_len0, 0], jnp.int32), local_window_size=(0, 30),
              causal_alignment="bottom_right", key_value_seq_lengths=jnp.array([S, kv_len1], jnp.int32))
    out, lse, grads = compare_with_reference(seed, shape, kw, dtype=dtype)
    assert np.all(np.isneginf(np.asarray(lse[1])))
    assert not np.any(np.asarray(grads[0][1], np.float32))  # no gradient reaches the empty element


def check_masked_rows_pass_no_gradient(seed, shape, how, dtype=jnp.float32):
    """Rows emptied by a boolean mask or by a segment id no key has, with a bias, ALiBi, causality
    and dropout on: o = 0 and lse = -inf there, and cotangents on those rows alone (of o and of
    the LSE) give exactly zero dq, dk, dv and d(bias)."""
    B, T, S, N, K, H = shape
    q, k, v = random_qkv(seed, B, T, S, N, K, H, dtype=dtype)
    empty = np.zeros((B, T), bool)
    empty[0, T // 8: T // 3] = True
    empty[-1, T - T // 4:] = True
    if how == "mask":
        kw = dict(mask=jnp.asarray(np.broadcast_to(~empty[:, None, :, None], (B, 1, T, S))))
    else:
        kw = dict(q_segment_ids=jnp.asarray(np.where(empty, 7, 0), jnp.int32),
                  kv_segment_ids=jnp.zeros((B, S), jnp.int32))
    kw.update(is_causal=True, alibi_slopes=jnp.linspace(0.05, 0.3, N, dtype=jnp.float32),
              dropout_rate=0.2, dropout_rng=jax.random.key(seed + 3))
    bias = jax.random.normal(jax.random.key(seed + 1), (1, N, T, S)).astype(dtype)
    f = lambda q, k, v, b: jfa.flash_attention(q, k, v, bias=b, return_lse=True, **kw)  # noqa: E731
    (out, lse), vjp = jax.vjp(jax.jit(f), q, k, v, bias)
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    assert not np.any(out[empty]) and np.all(np.isneginf(lse[empty])), f"seed {seed}"
    assert np.all(np.isfinite(lse[~empty])), f"seed {seed}: rows that see keys"
    keys = jax.random.split(jax.random.key(seed + 2))
    do = (jax.random.normal(keys[0], out.shape) * empty[:, :, None, None]).astype(dtype)
    dlse = jax.random.normal(keys[1], lse.shape) * empty[:, :, None]
    for name, g in zip(("dq", "dk", "dv", "dbias"), vjp((do, dlse))):
        assert not np.any(np.asarray(g, np.float32)), f"seed {seed}: {name} of empty rows is not 0"


@pytest.mark.parametrize("how", ["mask", "segments"])
def test_rows_emptied_by_masks_pass_no_gradient(how):
    check_masked_rows_pass_no_gradient(fresh_seed(), (2, 40, 33, 2, 1, 16), how)


def check_zero_scale(seed, shape, alibi, dtype=jnp.float32):
    """scale = 0: attention uniform over each row's visible keys (ALiBi aside), forward and
    gradients (those of q and k exactly 0). Query ids alternate every 64 rows and keys change id
    once, so every kernel tile mixes two segments and some rows find the first key block they
    visit (the last) all the other segment's: a running max that starts at -inf."""
    B, T, S, N, K, H = shape
    kw = dict(scale=0.0, q_segment_ids=jnp.asarray(np.tile((np.arange(T) // 64) % 2, (B, 1)), jnp.int32),
              kv_segment_ids=jnp.asarray(np.tile(np.arange(S) >= S // 2, (B, 1)), jnp.int32))
    if alibi:
        kw["alibi_slopes"] = jnp.linspace(0.05, 0.3, N, dtype=jnp.float32)
    _, _, grads = compare_with_reference(seed, shape, kw, dtype=dtype)
    assert not np.any(np.asarray(grads[0], np.float32)) and not np.any(np.asarray(grads[1], np.float32))


@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
def test_zero_scale_with_segments(alibi):
    check_zero_scale(fresh_seed(), (2, 256, 300, 2, 1, 32), alibi)


@pytest.mark.parametrize("combo", COMBOS, ids="+".join)
@pytest.mark.parametrize("shape", ["odd", "tiles", "wide", "one"])
def test_features_combined(combo, shape):
    check_combined(fresh_seed(), SHAPES[shape], combo)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["float16", "bfloat16"])
def test_combined_low_precision(dtype):
    check_low_precision_combination(fresh_seed(), SHAPES["tiles"], 40, dtype)


def test_fully_masked_rows_are_zero_with_zero_gradients():
    """Query rows past their length, and rows whose window holds no key, give 0 / -inf / 0."""
    check_fully_masked_rows(fresh_seed(), (2, 20, 12, 2, 1, 16), q_len0=7, kv_len1=5)


def test_window_far_from_every_key_skips_all_tiles():
    """A window placed past the keys leaves nothing: every tile is skipped, rows are empty."""
    q, k, v = random_qkv(fresh_seed(), 1, 70, 70, 2, 2, 16)
    out, lse = jfa.flash_attention(q, k, v, local_window_size=(0, 0), return_lse=True,
                                   key_value_seq_lengths=jnp.array([3], jnp.int32))
    assert np.all(np.isneginf(np.asarray(lse[0, 3:])))
    assert np.all(np.isfinite(np.asarray(lse[0, :3])))
    assert not np.any(np.asarray(out[0, 3:]))


def test_window_past_short_keys_with_segments():
    """Rows whose window starts inside a tile lying past the key length see nothing there: such a
    tile is skipped before its segment ids are read (an empty key range inside the tile)."""
    seed = fresh_seed()
    B, T, N, H = 2, 300, 2, 16
    kw = dict(is_causal=True, local_window_size=(100, 0),
              key_value_seq_lengths=jnp.asarray([10, 37], jnp.int32),
              q_segment_ids=_segments(seed, B, T, 3), kv_segment_ids=_segments(seed + 1, B, T, 3))
    compare_with_reference(seed, (B, T, T, N, N, H), kw)


def test_segments_equal_block_diagonal_attention():
    """Two packed sequences give exactly what attending to each one separately gives."""
    seed = fresh_seed()
    q, k, v = random_qkv(seed, 1, 50, 50, 2, 2, 16)
    ids = jnp.asarray([[0] * 23 + [1] * 27], jnp.int32)
    packed = jfa.flash_attention(q, k, v, q_segment_ids=ids, kv_segment_ids=ids, is_causal=True)
    first = jfa.flash_attention(q[:, :23], k[:, :23], v[:, :23], is_causal=True)
    second = jfa.flash_attention(q[:, 23:], k[:, 23:], v[:, 23:], is_causal=True)
    np.testing.assert_allclose(packed, jnp.concatenate([first, second], 1), rtol=1e-5, atol=1e-6)


def test_masks_under_vmap_and_unbatched():
    """Per-example operands fold with vmap; unbatched calls take them without the batch axis."""
    seed = fresh_seed()
    V, T, S, N, K, H = 3, 21, 30, 2, 1, 16
    q, k, v = random_qkv(seed, V, T, S, N, K, H)
    lengths = _lengths(seed, V, S, low=1)
    seg_q, seg_k = _segments(seed, V, T, 2), _segments(seed + 1, V, S, 2)

    def one(q, k, v, n, sq, sk):
        return jfa.flash_attention(q, k, v, key_value_seq_lengths=n, q_segment_ids=sq,
                                   kv_segment_ids=sk, is_causal=True,
                                   causal_alignment="bottom_right")

    mapped = jax.vmap(one)(q, k, v, lengths, seg_q, seg_k)
    batched = jfa.flash_attention(q, k, v, key_value_seq_lengths=lengths, q_segment_ids=seg_q,
                                  kv_segment_ids=seg_k, is_causal=True,
                                  causal_alignment="bottom_right")
    np.testing.assert_allclose(mapped, batched, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(one(q[1], k[1], v[1], lengths[1], seg_q[1], seg_k[1])),
                                  np.asarray(batched[1]))
