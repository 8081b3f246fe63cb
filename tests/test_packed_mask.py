"""Bit-packed masks: pack_mask's bits and tile summaries against a NumPy model of the layout,
block_mask against packing its elements, and attention with a PackedMask (or a boolean mask, which
the CPU kernels pack) against the float32 reference given the boolean mask, forward and every
gradient, alone and with the other keywords, under jit, vmap, the drop-in, varlen and Flax."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn as jfa
from jax_flashattn import dropout
from jax_flashattn.masks import EMPTY_TILE, FULL_TILE, PARTIAL_TILE
from test_masks import combo_keywords
from util import compare_with_reference, fresh_seed, random_qkv, rel_err


# ---- The layout, in NumPy ----------------------------------------------------------------------

def numpy_bits(mask):
    """uint32 [..., T, ceil(S/128)*4]: key j = 128c + x at bit 2(x//8) + x%2 of word 4c + (x%8)//2."""
    S = mask.shape[-1]
    bits = np.zeros(mask.shape[:-1] + (-(-S // 128) * 4,), np.uint64)
    for j in range(S):
        c, x = divmod(j, 128)
        bits[..., 4 * c + (x % 8) // 2] |= mask[..., j].astype(np.uint64) << np.uint64(2 * (x // 8) + x % 2)
    return bits.astype(np.uint32)


def numpy_tiles(mask):
    """uint8 [..., ceil(T/64), ceil(S/128)]: 0 none, 2 all, 1 some of a tile's in-range elements."""
    T, S = mask.shape[-2:]
    tiles = np.zeros(mask.shape[:-2] + (-(-T // 64), -(-S // 128)), np.uint8)
    for r in range(tiles.shape[-2]):
        for c in range(tiles.shape[-1]):
            block = mask[..., 64 * r:64 * r + 64, 128 * c:128 * c + 128]
            tiles[..., r, c] = np.where(block.all((-2, -1)), FULL_TILE,
                                        np.where(block.any((-2, -1)), PARTIAL_TILE, EMPTY_TILE))
    return tiles


def random_mask(seed, shape, p):
    return np.random.default_rng(seed).random(shape) < p


def tile_pattern_mask(seed, shape):
    """A mask whose 64 x 128 tiles are each empty, full or random, so all three kinds occur, the
    last row block and chunk cut short by T and S."""
    rng = np.random.default_rng(seed)
    T, S = shape[-2:]
    kinds = rng.integers(0, 3, shape[:-2] + (-(-T // 64), -(-S // 128)))
    per_element = np.repeat(np.repeat(kinds, 64, -2), 128, -1)[..., :T, :S]
    return np.where(per_element == 2, rng.random(shape) < 0.5, per_element == 1)


@pytest.mark.parametrize("shape", [(1, 1), (3, 127), (64, 128), (65, 129), (2, 3, 70, 300)],
                         ids=lambda s: "x".join(map(str, s)))
def test_bits_follow_the_layout(shape):
    seed = fresh_seed()
    mask = random_mask(seed, shape, 0.5)
    packed = jfa.pack_mask(mask)
    lead = (1,) * (4 - len(shape)) + shape[:-2]
    assert packed.bits.shape == lead + (shape[-2], -(-shape[-1] // 128) * 4)
    assert packed.bits.dtype == jnp.uint32 and packed.tiles.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(packed.bits), numpy_bits(mask).reshape(packed.bits.shape),
                                  err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.asarray(packed.unpack()), mask.reshape(packed.shape))


def test_each_key_sets_the_bit_its_formula_names():
    """Word w, bit b of a chunk holds key x = 8 (b // 2) + 2 w + b % 2: one key at a time, in the
    second chunk of a row, sets that bit and no other."""
    for w in range(4):
        for b in range(32):
            mask = np.zeros((1, 300), bool)
            mask[0, 128 + 8 * (b // 2) + 2 * w + b % 2] = True
            bits = np.asarray(jfa.pack_mask(mask).bits).reshape(-1)
            expected = np.zeros(12, np.uint32)
            expected[4 + w] = np.uint32(1) << np.uint32(b)
            np.testing.assert_array_equal(bits, expected, err_msg=f"word {w} bit {b}")


@pytest.mark.parametrize("shape", [(2, 1, 130, 300), (1, 2, 64, 256), (1, 1, 1, 5)],
                         ids=lambda s: "x".join(map(str, s)))
def test_tiles_summarize_the_in_range_elements(shape):
    seed = fresh_seed()
    mask = tile_pattern_mask(seed, shape)
    tiles = np.asarray(jfa.pack_mask(mask).tiles)
    np.testing.assert_array_equal(tiles, numpy_tiles(mask), err_msg=f"seed {seed}")
    # Rows past T and keys past S do not count: a whole mask gives full tiles only.
    assert np.all(np.asarray(jfa.pack_mask(np.ones(shape, bool)).tiles) == FULL_TILE)


@pytest.mark.parametrize("block_size, T, S", [((64, 128), 130, 300), ((48, 80), 100, 250),
                                               (200, 130, 260), ((1, 7), 5, 20)])
def test_block_mask_is_the_packing_of_its_elements(block_size, T, S):
    seed = fresh_seed()
    bq, bk = (block_size, block_size) if isinstance(block_size, int) else block_size
    blocks = random_mask(seed, (2, 3, -(-T // bq), -(-S // bk)), 0.5)
    elements = np.repeat(np.repeat(blocks, bq, -2), bk, -1)[..., :T, :S]
    ours = jax.jit(lambda b: jfa.block_mask(b, block_size, q_len=T, kv_len=S))(blocks)
    packed = jfa.pack_mask(elements)
    assert (ours.q_len, ours.kv_len) == (T, S)
    np.testing.assert_array_equal(np.asarray(ours.bits), np.asarray(packed.bits), err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.asarray(ours.tiles), np.asarray(packed.tiles), err_msg=f"seed {seed}")


def test_block_mask_defaults_to_the_whole_grid():
    blocks = np.array([[True, False], [False, True]])
    packed = jfa.block_mask(blocks, (3, 5))
    assert packed.shape == (1, 1, 6, 10)
    np.testing.assert_array_equal(np.asarray(packed.unpack())[0, 0], np.kron(blocks, np.ones((3, 5), bool)))


def test_pack_mask_under_jit_and_vmap():
    seed = fresh_seed()
    masks = random_mask(seed, (3, 70, 200), 0.3)
    each = [jfa.pack_mask(m) for m in masks]
    mapped = jax.vmap(jfa.pack_mask)(masks)
    jitted = jax.jit(jfa.pack_mask)(masks[0])
    assert mapped.bits.shape == (3, 1, 1, 70, 8) and mapped.tiles.shape == (3, 1, 1, 2, 2)
    for i, one in enumerate(each):
        np.testing.assert_array_equal(np.asarray(mapped.bits[i]), np.asarray(one.bits))
        np.testing.assert_array_equal(np.asarray(mapped.tiles[i]), np.asarray(one.tiles))
    np.testing.assert_array_equal(np.asarray(jitted.bits), np.asarray(each[0].bits))


@pytest.mark.parametrize("call, error, words", [
    (lambda: jfa.pack_mask(jnp.ones((4, 8), jnp.float32)), TypeError, ["pack_mask", "bool", "float32"]),
    (lambda: jfa.pack_mask(jnp.ones((8,), bool)), ValueError, ["pack_mask", "(8,)"]),
    (lambda: jfa.block_mask(jnp.ones((2, 2), bool), (4, 4), q_len=9), ValueError, ["q_len=9", "3", "2"]),
    (lambda: jfa.block_mask(jnp.ones((2, 2), bool), (4, 0)), ValueError, ["block_size"]),
    (lambda: jfa.block_mask(jnp.ones((2, 2), jnp.int32), 4), TypeError, ["blocks", "int32"]),
], ids=["pack-dtype", "pack-rank", "block-q_len", "block-size", "block-dtype"])
def test_packing_errors_name_the_argument(call, error, words):
    with pytest.raises(error) as info:
        call()
    for w in words:
        assert w in str(info.value), str(info.value)


@pytest.mark.parametrize("T, S, words", [(9, 12, ["mask", "T=9", "T=8"]), (8, 13, ["mask", "S=13", "S=12"])])
def test_packed_mask_of_another_size_is_a_clear_error(T, S, words):
    q, k, v = random_qkv(0, 2, 8, 12, 4, 2, 16)
    packed = jfa.pack_mask(jnp.ones((T, S), bool))
    for fn in (jfa.flash_attention, jfa.dot_product_attention):
        with pytest.raises(ValueError) as info:
            jax.jit(lambda q, k, v, m: fn(q, k, v, mask=m))(q, k, v, packed)
        for w in words:
            assert w in str(info.value), str(info.value)


# ---- Attention with packed masks -----------------------------------------------------------------

SHAPE = (2, 130, 300, 4, 2, 32)   # T not a multiple of 64, S not of 128, GQA


def case_mask(name, seed, B, T, S, N):
    """The boolean mask of each case, [B|1, N|1, T, S]."""
    rng = np.random.default_rng(seed)
    if name.startswith("random"):
        return rng.random((B, N, T, S)) < float(name.split("-")[1])
    if name == "blocks":
        blocks = rng.random((B, 1, -(-T // 64), -(-S // 64))) < 0.5
        return np.repeat(np.repeat(blocks, 64, -2), 64, -1)[..., :T, :S]
    if name == "causal":
        return np.tril(np.ones((T, S), bool))[None, None]
    if name == "empty-rows":
        mask = rng.random((1, N, T, S)) < 0.7
        mask[..., 10:80, :] = False
        return mask
    if name == "tiles":
        return tile_pattern_mask(seed, (B, 1, T, S))
    shape = {"shared": (1, 1, T, S), "per-head": (1, N, T, S), "per-batch": (B, 1, T, S)}[name]
    return rng.random(shape) < 0.6


CASES = ["random-0.1", "random-0.5", "random-0.9", "blocks", "causal", "empty-rows", "tiles", "shared",
         "per-head", "per-batch"]


@pytest.mark.parametrize("case", CASES)
def test_packed_mask_matches_reference(case):
    seed = fresh_seed()
    B, T, S, N, K, H = SHAPE
    mask = case_mask(case, seed, B, T, S, N)
    compare_with_reference(seed, SHAPE, dict(mask=jfa.pack_mask(mask)), ref_kw=dict(mask=mask))


def test_boolean_mask_is_packed_inside_and_equals_the_packed_one():
    """On the CPU a boolean mask takes the packed path: the very same results as its PackedMask."""
    seed = fresh_seed()
    B, T, S, N, K, H = SHAPE
    q, k, v = random_qkv(seed, B, T, S, N, K, H)
    mask = jnp.asarray(tile_pattern_mask(seed, (1, N, T, S)))
    grad = jax.jit(jax.grad(lambda q, k, v, m: jnp.sum(jnp.sin(jfa.flash_attention(q, k, v, mask=m))),
                            argnums=(0, 1, 2)))
    for a, b in zip(grad(q, k, v, mask), grad(q, k, v, jfa.pack_mask(mask))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


COMBOS = [("causal", "q_lengths", "kv_lengths", "bottom_right"), ("causal_window", "segments", "softcap"),
          ("bottom_right_window", "alibi", "kv_lengths")]


@pytest.mark.parametrize("combo", COMBOS, ids="+".join)
def test_packed_mask_with_other_keywords(combo):
    seed = fresh_seed()
    B, T, S, N, K, H = SHAPE
    mask = case_mask("tiles", seed, B, T, S, N)
    kw = combo_keywords(combo, seed, B, T, S, N)
    bias = jax.random.normal(jax.random.key(seed + 5), (1, N, T, S))
    compare_with_reference(seed, SHAPE, dict(kw, mask=jfa.pack_mask(mask)), ref_kw=dict(kw, mask=mask),
                           bias=bias)


def test_packed_mask_with_dropout_and_deterministic():
    seed = fresh_seed()
    B, T, S, N, K, H = SHAPE
    mask = case_mask("random-0.5", seed, B, T, S, N)
    rng = jax.random.key(seed + 9)
    keep = dropout.keep_mask(rng, 0.3, (B, N, T, S))
    compare_with_reference(seed, SHAPE, dict(mask=jfa.pack_mask(mask), dropout_rate=0.3, dropout_rng=rng,
                                             deterministic=True, is_causal=True),
                           ref_kw=dict(mask=mask, dropout_rate=0.3, dropout_keep=keep, is_causal=True))


def test_summaries_decide_what_is_computed():
    """The kernels trust the tile summaries: tiles marked empty are skipped whatever their bits
    (every row sees nothing: 0, -inf, zero gradients), and tiles marked full are not tested (bits
    of 0 then hide nothing)."""
    seed = fresh_seed()
    B, T, S, N, K, H = SHAPE
    q, k, v = random_qkv(seed, B, T, S, N, K, H)
    ones = jfa.pack_mask(np.ones((T, S), bool))
    empty = jfa.PackedMask(ones.bits, jnp.full_like(ones.tiles, EMPTY_TILE), T, S)
    full = jfa.PackedMask(jnp.zeros_like(ones.bits), jnp.full_like(ones.tiles, FULL_TILE), T, S)

    def run(mask):
        f = lambda q, k, v: jfa.flash_attention(q, k, v, mask=mask, return_lse=True)  # noqa: E731
        (out, lse), vjp = jax.vjp(f, q, k, v)
        return out, lse, vjp((jnp.ones_like(out), jnp.ones_like(lse)))

    out, lse, grads = run(empty)
    assert not np.any(np.asarray(out)) and np.all(np.isneginf(np.asarray(lse)))
    assert not any(np.any(np.asarray(g)) for g in grads)
    for ours, plain in zip(jax.tree.leaves(run(full)), jax.tree.leaves(run(None))):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(plain))


def test_packed_mask_under_vmap_jit_and_unbatched():
    """A per-example PackedMask vmapped (in_axes 0) equals the batched call; packing inside the
    vmapped function too; unbatched calls take it without the batch axis."""
    seed = fresh_seed()
    V, T, S, N, K, H = 3, 70, 140, 2, 1, 16
    q, k, v = random_qkv(seed, V, T, S, N, K, H)
    masks = random_mask(seed, (V, N, T, S), 0.4)
    packed = jfa.pack_mask(masks)                            # bits [V, N, T, W]
    batched = jfa.flash_attention(q, k, v, mask=packed, is_causal=True)
    per_example = jax.tree.map(lambda x: x[:, None], packed)  # [V, 1, N, ...]: in_axes 0 leaves [1, N, ...]
    mapped = jax.jit(jax.vmap(lambda q, k, v, m: jfa.flash_attention(q, k, v, mask=m, is_causal=True)))(
        q, k, v, per_example)
    inside = jax.vmap(lambda q, k, v, m: jfa.flash_attention(q, k, v, mask=jfa.pack_mask(m), is_causal=True))(
        q, k, v, masks)
    second = jax.tree.map(lambda x: x[1], packed)           # bits [N, T, W]
    unbatched = jfa.flash_attention(q[1], k[1], v[1], mask=second, is_causal=True)
    for x in (mapped, inside):
        np.testing.assert_allclose(x, batched, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(unbatched), np.asarray(batched[1]))


def test_broadcast_mask_is_never_expanded():
    """A [1, 1, T, S] mask is packed once for every batch element and head: the compiled program
    holds no [B, N, T, S] array, boolean or otherwise."""
    B, T, S, N, K, H = 4, 96, 200, 8, 2, 16
    q, k, v = random_qkv(0, B, T, S, N, K, H)
    mask = jnp.asarray(random_mask(0, (1, 1, T, S), 0.5))
    for m in (mask, jfa.pack_mask(mask)):
        loss = lambda q, k, v, m: jnp.sum(jfa.flash_attention(q, k, v, mask=m))  # noqa: E731
        f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        text = f.lower(q, k, v, m).compile().as_text()
        assert f"{B},{N},{T},{S}" not in text.replace(" ", "")


def test_gpu_operands_are_packed_keeping_broadcast_axes():
    """The CUDA handlers take the mask bit-packed: a boolean mask becomes the bits and tiles that
    pack_mask gives, of its own leading shape, and a PackedMask's go through as they are."""
    from jax_flashattn._options import Extras
    from jax_flashattn.primitives import _cuda_extras
    mask = random_mask(fresh_seed(), (1, 1, 70, 300), 0.5)
    packed = jfa.pack_mask(mask)
    field = Extras._fields.index
    for given in ({"mask": jnp.asarray(mask)}, {"mask_bits": packed.bits, "mask_tiles": packed.tiles}):
        extras = {name: jnp.zeros((), jnp.int32) for name in Extras._fields}
        extras.update(given)
        operands = _cuda_extras(list(extras.values()), 70, 300)
        assert len(operands) == len(Extras._fields) - 1
        bits, tiles = operands[field("mask_bits") - 1], operands[field("mask_tiles") - 1]
        assert field("mask") < field("mask_bits")
        np.testing.assert_array_equal(np.asarray(bits), np.asarray(packed.bits))
        np.testing.assert_array_equal(np.asarray(tiles), np.asarray(packed.tiles))


def test_cuda_lowering_takes_a_packed_mask():
    """Lowering for CUDA accepts a PackedMask and pack_mask (in a build without CUDA kernels it
    stops at the missing kernels, never at the mask)."""
    q, k, v = (x.astype(jnp.bfloat16) for x in random_qkv(0, 2, 8, 12, 4, 2, 16))
    packed = jfa.pack_mask(jnp.ones((8, 12), bool))
    for fn, args in ((lambda q, k, v, m: jfa.flash_attention(q, k, v, mask=m), (q, k, v, packed)),
                     (lambda m: jfa.pack_mask(m), (jnp.ones((8, 12), bool),))):
        try:
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
        except RuntimeError as e:
            assert "without its CUDA kernels" in str(e)


# ---- The other entry points ----------------------------------------------------------------------

def test_dropin_and_varlen_take_a_packed_mask():
    seed = fresh_seed()
    B, T, S, N, K, H = 2, 40, 60, 4, 2, 16
    q, k, v = random_qkv(seed, B, T, S, N, K, H)
    mask = jnp.asarray(random_mask(seed, (B, 1, T, S), 0.6)) | jnp.eye(T, S, dtype=bool)
    packed = jfa.pack_mask(mask)
    np.testing.assert_allclose(jfa.dot_product_attention(q, k, v, mask=packed),
                               jax.nn.dot_product_attention(q, k, v, mask=mask), rtol=2e-5, atol=2e-6)
    cu = jnp.array([0, 33, 70], jnp.int32)
    qp, kp, vp = (x.reshape((-1,) + x.shape[2:])[:70] for x in random_qkv(seed + 1, 2, 35, 35, N, K, H))
    ours = jfa.varlen_attention(qp, kp, vp, cu, cu, max_seqlen_q=T, max_seqlen_k=S, mask=packed)
    boolean = jfa.varlen_attention(qp, kp, vp, cu, cu, max_seqlen_q=T, max_seqlen_k=S, mask=mask)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(boolean))


def test_flax_takes_a_float32_causal_mask():
    """Flax's idiom mha(x, mask=nnx.make_causal_mask(tokens)): a float32 [B, 1, T, T] mask, taken as
    Flax's own attention takes it (nonzero = attend), equal to is_causal=True."""
    nnx = pytest.importorskip("flax.nnx")
    from jax_flashattn.flax import attention_fn
    seed = fresh_seed() % 2**31
    x = jax.random.normal(jax.random.key(seed), (2, 70, 32))
    make = functools.partial(nnx.MultiHeadAttention, num_heads=4, in_features=32, qkv_features=64,
                             decode=False)
    ours, theirs = make(attention_fn=attention_fn, rngs=nnx.Rngs(seed)), make(rngs=nnx.Rngs(seed))
    mask = nnx.make_causal_mask(jnp.ones((2, 70)))
    assert mask.dtype == jnp.float32
    assert rel_err(ours(x, mask=mask), theirs(x, mask=mask)) <= 1e-5, f"seed {seed}"
    assert rel_err(ours(x, mask=mask), ours(x, is_causal=True)) <= 1e-6, f"seed {seed}"
    assert rel_err(ours(x, mask=jfa.pack_mask(mask != 0)), theirs(x, mask=mask)) <= 1e-5, f"seed {seed}"

