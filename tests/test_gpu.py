"""The CUDA kernels on a GPU: forward, LSE and gradients against the float32 reference, with the
error bounded by twice that of jax.nn (cuDNN where it takes the shape, else XLA) in the same dtype.

Everything runs through the default dispatch: on an sm90 GPU the Hopper forward and backward, masks,
score modifiers, dropout and deterministic=True included; head dims between the Hopper kernels'
64/128/256 run on the next wider one. The tests named `portable` force the portable kernels with JFA_FORCE_SM80=1 (read
at each dispatch), so both paths are covered.

Run on a GPU machine with JFA_REQUIRE_GPU=1 so that a missing GPU or CUDA build fails instead of
skipping (README, "Developing")."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn as jfa
from util import BOUNDS, fresh_seed, random_qkv, reference_with_grads, rel_err

pytestmark = pytest.mark.gpu

# (B, T, S, N, K, H, Hv): odd sizes, T = 1, S = 1, T != S, GQA, MQA, every built head dim and
# some that are padded up (40, 80, Hv != H).
SHAPES = [
    (2, 17, 17, 4, 4, 64, 64),
    (1, 1, 255, 4, 2, 64, 64),
    (1, 255, 1, 4, 1, 128, 128),
    (2, 255, 1000, 8, 2, 128, 128),
    (1, 1000, 255, 4, 1, 96, 96),
    (1, 17, 33, 2, 2, 256, 256),
    (1, 300, 300, 2, 1, 192, 192),
    (1, 64, 64, 4, 4, 32, 32),
    (1, 100, 130, 6, 3, 80, 80),
    (1, 50, 70, 2, 2, 64, 40),
    (2, 1024, 1024, 8, 2, 128, 128),
    # Past the Hopper forward's short-sequence tiles (cuda/sm90/fwd_launch.h: 128 x 128 for H 64
    # causal up to T = 1536 and H 128 non-causal up to S = 2048; the default tiles beyond).
    (1, 1600, 2100, 4, 2, 64, 64),
    (1, 300, 2100, 4, 4, 128, 128),
]
DTYPES = [jnp.float16, jnp.bfloat16]
# Absolute slack added to 2 x the peer's error (forward; gradients take 4x).
SLACK = {jnp.float16: 1e-3, jnp.bfloat16: 4e-3}


def _peer(q, k, v, is_causal):
    """jax.nn in the same dtype: cuDNN where it supports the call, else XLA."""
    if q.shape[-1] == v.shape[-1]:
        try:
            return jax.nn.dot_product_attention(q, k, v, is_causal=is_causal,
                                                implementation="cudnn")
        except Exception:  # cuDNN rejects some head dims / lengths
            pass
    B, T, N, H = q.shape
    Hv = v.shape[-1]
    if H != Hv:  # jax.nn needs Hv == H: pad v, slice the output
        v = jnp.pad(v, [(0, 0)] * 3 + [(0, H - Hv)])
    return jax.nn.dot_product_attention(q, k, v, is_causal=is_causal,
                                        implementation="xla")[..., :Hv]


def _ids(s):
    return "B{}T{}S{}N{}K{}H{}Hv{}".format(*s)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_forward_matches_reference(shape, is_causal, dtype):
    seed = fresh_seed()
    q, k, v = random_qkv(seed, *shape, dtype=dtype)
    f = jax.jit(lambda q, k, v: jfa.flash_attention(q, k, v, is_causal=is_causal,
                                                    return_lse=True, implementation="cuda"))
    out, lse = f(q, k, v)
    ref_out, ref_lse, _ = reference_with_grads(q, k, v, jnp.zeros(out.shape, dtype),
                                               jnp.zeros(lse.shape), is_causal=is_causal)
    peer_err = rel_err(_peer(q, k, v, is_causal), ref_out)
    err = rel_err(out, ref_out)
    assert out.dtype == dtype and lse.dtype == jnp.float32
    assert err <= 2 * peer_err + SLACK[dtype], f"seed {seed}: {err} vs jax.nn {peer_err}"
    assert rel_err(lse, ref_lse) <= 1e-4, f"seed {seed}: lse {rel_err(lse, ref_lse)}"


# Shapes for the forced portable forward: every sm90 head dim, odd lengths, GQA.
PORTABLE_SHAPES = [
    (2, 17, 17, 4, 4, 64, 64),
    (2, 255, 1000, 8, 2, 128, 128),
    (1, 17, 33, 2, 2, 256, 256),
]


def wide_growing_logits(seed, dtype):
    """q, k, v whose logits span hundreds of nats, the largest of each row growing block after
    block in the order the kernels walk the keys (the sm90 forward from the last block down: its
    running max stays stale until it grows by 2^8, cuda/sm90/softmax.h)."""
    q, k, v = random_qkv(seed, 1, 300, 1000, 4, 2, 128, dtype=dtype)
    ramp = jnp.linspace(8.0, 1.0, 1000, dtype=jnp.float32)[None, :, None, None]
    return q, (k.astype(jnp.float32) * ramp).astype(dtype), v


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("scale", [0.5, -0.5], ids=["positive", "negative"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_wide_logits_and_negative_scale_on_gpu(is_causal, scale, dtype):
    """A running max that grows past the rescaling threshold on most blocks, and a negative scale
    (whose largest logit comes from the most negative q·k), forward and gradients."""
    seed = fresh_seed()
    q, k, v = wide_growing_logits(seed, dtype)
    do = jax.random.normal(jax.random.key(seed + 1), q.shape).astype(dtype)
    dlse = jax.random.normal(jax.random.key(seed + 2), q.shape[:3], jnp.float32)
    f = lambda q, k, v: jfa.flash_attention(q, k, v, scale=scale, is_causal=is_causal,  # noqa: E731
                                            return_lse=True, implementation="cuda")
    (out, lse), vjp = jax.vjp(f, q, k, v)
    grads = vjp((do, dlse))
    ref_out, ref_lse, ref_grads = reference_with_grads(q, k, v, do, dlse, scale=scale, is_causal=is_causal)
    fwd_bound, grad_bound = BOUNDS[dtype]
    assert rel_err(out, ref_out) <= fwd_bound, f"seed {seed}: out {rel_err(out, ref_out)}"
    assert rel_err(lse, ref_lse) <= 1e-4, f"seed {seed}: lse {rel_err(lse, ref_lse)}"
    for name, g, r in zip("qkv", grads, ref_grads):
        assert rel_err(g, r) <= grad_bound, f"seed {seed}: d{name} {rel_err(g, r)}"


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", PORTABLE_SHAPES, ids=_ids)
def test_forward_portable_kernel_forced(shape, is_causal, monkeypatch):
    """JFA_FORCE_SM80=1 runs the portable forward; it and the default (Hopper on sm90) agree."""
    seed = fresh_seed()
    dtype = jnp.bfloat16
    q, k, v = random_qkv(seed, *shape, dtype=dtype)
    call = lambda q, k, v: jfa.flash_attention(q, k, v, is_causal=is_causal, return_lse=True,  # noqa: E731
                                               implementation="cuda")
    default_out, default_lse = jax.jit(call)(q, k, v)
    monkeypatch.setenv("JFA_FORCE_SM80", "1")
    out, lse = jax.jit(lambda q, k, v: call(q, k, v))(q, k, v)  # a fresh jit: dispatched again
    ref_out, ref_lse, _ = reference_with_grads(q, k, v, jnp.zeros(out.shape, dtype),
                                               jnp.zeros(lse.shape), is_causal=is_causal)
    peer_err = rel_err(_peer(q, k, v, is_causal), ref_out)
    for o, l in ((out, lse), (default_out, default_lse)):
        assert rel_err(o, ref_out) <= 2 * peer_err + SLACK[dtype], f"seed {seed}"
        assert rel_err(l, ref_lse) <= 1e-4, f"seed {seed}"
    assert rel_err(default_lse, lse) <= 1e-5, f"seed {seed}"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_gradients_match_reference(shape, is_causal, dtype):
    seed = fresh_seed()
    B, T, S, N, K, H, Hv = shape
    q, k, v = random_qkv(seed, *shape, dtype=dtype)
    do = jax.random.normal(jax.random.key(seed + 1), (B, T, N, Hv)).astype(dtype)
    dlse = jax.random.normal(jax.random.key(seed + 2), (B, T, N), jnp.float32)

    ours = jax.jit(lambda q, k, v: jax.vjp(
        lambda q, k, v: jfa.flash_attention(q, k, v, is_causal=is_causal, return_lse=True,
                                            implementation="cuda"), q, k, v)[1]((do, dlse)))(q, k, v)
    _, _, ref = reference_with_grads(q, k, v, do, dlse, is_causal=is_causal)
    # The peer's gradient error, from its output cotangent alone (jax.nn's LSE is not
    # differentiable): a fair yardstick of bf16/fp16 rounding in the backward pass.
    peer = jax.vjp(lambda q, k, v: _peer(q, k, v, is_causal), q, k, v)[1](do)
    _, _, ref_do = reference_with_grads(q, k, v, do, jnp.zeros_like(dlse), is_causal=is_causal)
    for name, g, r, p, rp, x in zip("qkv", ours, ref, peer, ref_do, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
        bound = 2 * rel_err(p, rp) + 4 * SLACK[dtype]
        assert rel_err(g, r) <= bound, f"seed {seed}: d{name} {rel_err(g, r)} > {bound}"


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", PORTABLE_SHAPES + [(1, 1000, 255, 4, 1, 64, 64)], ids=_ids)
def test_gradients_portable_backward_forced(shape, is_causal, monkeypatch):
    """JFA_FORCE_SM80=1 runs the portable backward; its gradients and the default's (the Hopper
    backward on sm90) both match the reference, and each other."""
    seed = fresh_seed()
    dtype = jnp.bfloat16
    B, T, S, N, K, H, Hv = shape
    q, k, v = random_qkv(seed, *shape, dtype=dtype)
    do = jax.random.normal(jax.random.key(seed + 1), (B, T, N, Hv)).astype(dtype)
    dlse = jax.random.normal(jax.random.key(seed + 2), (B, T, N), jnp.float32)

    def grads():  # a fresh jit each time: dispatched again
        return jax.jit(lambda q, k, v: jax.vjp(
            lambda q, k, v: jfa.flash_attention(q, k, v, is_causal=is_causal, return_lse=True,
                                                implementation="cuda"), q, k, v)[1]((do, dlse)))(q, k, v)

    default = grads()
    monkeypatch.setenv("JFA_FORCE_SM80", "1")
    portable = grads()
    _, _, ref = reference_with_grads(q, k, v, do, dlse, is_causal=is_causal)
    _, grad_bound = BOUNDS[dtype]
    for name, a, b, r in zip("qkv", default, portable, ref):
        assert rel_err(a, r) <= grad_bound, f"seed {seed}: d{name} (default) {rel_err(a, r)}"
        assert rel_err(b, r) <= grad_bound, f"seed {seed}: d{name} (portable) {rel_err(b, r)}"
        assert rel_err(a, b) <= grad_bound, f"seed {seed}: d{name} default vs portable {rel_err(a, b)}"


def test_vmap_and_unbatched_on_gpu():
    seed = fresh_seed()
    q, k, v = random_qkv(seed, 3, 70, 90, 4, 2, 64, dtype=jnp.bfloat16)
    out = jax.jit(jax.vmap(lambda q, k, v: jfa.flash_attention(q, k, v, is_causal=True),
                           in_axes=(0, None, None)))(q, k[0], v[0])
    ref, _, _ = reference_with_grads(q, jnp.broadcast_to(k[:1], k.shape),
                                     jnp.broadcast_to(v[:1], v.shape), jnp.zeros(q.shape),
                                     jnp.zeros(q.shape[:3]), is_causal=True)
    assert rel_err(out, ref) <= 2e-2, f"seed {seed}"


def test_dropin_runs_our_kernel_on_gpu():
    q, k, v = random_qkv(fresh_seed(), 2, 128, 128, 4, 4, 64, dtype=jnp.bfloat16)
    hlo = jax.jit(lambda q, k, v: jfa.dot_product_attention(q, k, v, is_causal=True)).lower(
        q, k, v).as_text()
    assert "jfa_attention_fwd" in hlo
    ours = jfa.dot_product_attention(q, k, v, is_causal=True)
    theirs = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    assert rel_err(ours, theirs) <= 2e-2


def test_float32_on_gpu_is_a_clear_type_error():
    q, k, v = random_qkv(fresh_seed(), 1, 16, 16, 2, 2, 64)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        jax.jit(jfa.flash_attention)(q, k, v)


def test_head_dim_above_256_is_a_clear_error():
    q, k, v = random_qkv(fresh_seed(), 1, 16, 16, 2, 2, 320, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="head dims"):
        jax.jit(jfa.flash_attention)(q, k, v)


def test_cpu_implementation_on_gpu_is_a_clear_error():
    q, k, v = random_qkv(fresh_seed(), 1, 16, 16, 2, 2, 64, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="implementation='cpu'"):
        jax.jit(lambda q, k, v: jfa.flash_attention(q, k, v, implementation="cpu"))(q, k, v)


def test_repeated_calls_are_deterministic_in_forward():
    q, k, v = random_qkv(fresh_seed(), 1, 512, 512, 4, 4, 128, dtype=jnp.bfloat16)
    f = jax.jit(lambda q, k, v: jfa.flash_attention(q, k, v, is_causal=True))
    np.testing.assert_array_equal(np.asarray(f(q, k, v).astype(jnp.float32)),
                                  np.asarray(f(q, k, v).astype(jnp.float32)))


# ---- Masks, bias, soft-capping, ALiBi, dropout ---------------------------------------------------
# The CPU feature tests again, in bfloat16 on the GPU, against the same float32 reference (the
# bounds of util.BOUNDS). On sm90 they take the Hopper kernels' general paths, forward (with dropout
# its dropout kernel) and backward (cuda/sm90/bwd_general.h). The `portable ... forced` tests cover
# the portable kernels at a Hopper head dim.

from jax_flashattn import dropout as _dropout  # noqa: E402
from test_bias_mask import BROADCASTS, _shape as _bias_shape, check_everything_at_once  # noqa: E402
from test_dropout import check_dropout_against_reference  # noqa: E402
from test_masks import (COMBOS, FEATURES, SHAPES as MASK_SHAPES, _keywords, check_combined,  # noqa: E402
                        check_fully_masked_rows, check_low_precision_combination,
                        check_masked_rows_pass_no_gradient, check_zero_scale, combo_keywords)
from util import compare_with_reference  # noqa: E402

# Kernel tiles are larger on the GPU (forward 128 x 64..128, backward 64..128 x 64..128): "big"
# has several tiles each way and partial last tiles at head dim 128.
GPU_MASK_SHAPES = dict(MASK_SHAPES, big=(2, 300, 520, 4, 2, 128))
BF16 = jnp.bfloat16


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("shape", ["odd", "tiles", "big"])
def test_mask_feature_on_gpu(feature, shape):
    seed = fresh_seed()
    B, T, S, N, K, H = GPU_MASK_SHAPES[shape]
    compare_with_reference(seed, GPU_MASK_SHAPES[shape], _keywords(feature, seed, B, T, S, N), dtype=BF16)


@pytest.mark.parametrize("combo", COMBOS, ids="+".join)
@pytest.mark.parametrize("shape", ["odd", "tiles", "wide", "one", "big"])
def test_mask_features_combined_on_gpu(combo, shape):
    check_combined(fresh_seed(), GPU_MASK_SHAPES[shape], combo, dtype=BF16)


@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
@pytest.mark.parametrize("H", [64, 128, 256])
def test_zero_scale_with_segments_on_gpu(H, alibi):
    check_zero_scale(fresh_seed(), (2, 256, 300, 2, 1, H), alibi, dtype=BF16)


@pytest.mark.parametrize("combo", [("bottom_right_window", "alibi", "kv_lengths"), ("causal_window", "softcap")],
                         ids="+".join)
@pytest.mark.parametrize("H", [64, 256])
def test_mask_features_past_short_sequences_on_gpu(combo, H):
    """Past T = 1536 the Hopper forward's general path takes its long-sequence tiles (H 64:
    192 x 112 with three consumers; cuda/sm90/fwd_launch.h)."""
    check_combined(fresh_seed(), (1, 1700, 1800, 4, 2, H), combo, dtype=BF16)


def _scattered_segments(seed, B, L):
    """Runs of 1 to 300 positions with random ids of three: one id holds several runs of keys."""
    rng = np.random.default_rng(seed)
    ids = np.repeat(rng.integers(0, 3, size=(B, L)), rng.integers(1, 301, size=L), axis=1)[:, :L]
    return jnp.asarray(ids, jnp.int32)


@pytest.mark.parametrize("kind", ["packed", "scattered"])
@pytest.mark.parametrize("H", [64, 128])
def test_segment_ids_past_short_sequences_on_gpu(kind, H):
    """Segment ids alone take a kernel of their own (cuda/sm90/fwd_launch.h; H 64: the 192 x 128 tile).
    Rows whose segment the summaries prove one key range fold it into their position bounds
    (cuda/sm90/mask_policies.h, tile_rows): packed sequences that start and end on 16-key chunks (the
    first two of batch row 0); the others, and scattered ids, keep the per-key test."""
    seed = fresh_seed()
    if kind == "packed":
        shape = (2, 1700, 1700, 4, 2, H)
        lengths = ([256, 400, 37, 1007], [1000, 700])
        ids = jnp.asarray(np.stack([np.repeat(np.arange(len(n)), n) for n in lengths]), jnp.int32)
        kw = dict(q_segment_ids=ids, kv_segment_ids=ids, is_causal=True)
    else:
        shape = (2, 1700, 1800, 4, 2, H)
        kw = dict(q_segment_ids=_scattered_segments(seed, 2, 1700),
                  kv_segment_ids=_scattered_segments(seed + 1, 2, 1800))
    compare_with_reference(seed, shape, kw, dtype=BF16)


@pytest.mark.parametrize("combo", [("causal", "q_lengths", "kv_lengths", "bottom_right"),
                                   ("bottom_right_window", "alibi", "kv_lengths"), ("segments", "softcap")],
                         ids="+".join)
def test_mask_features_portable_forward_forced(combo, monkeypatch):
    """JFA_FORCE_SM80=1: the portable forward's and backward's general paths at head dim 128
    (Hopper's otherwise)."""
    monkeypatch.setenv("JFA_FORCE_SM80", "1")
    check_combined(fresh_seed(), GPU_MASK_SHAPES["big"], combo, dtype=BF16)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_mask_combined_both_dtypes_on_gpu(dtype):
    check_low_precision_combination(fresh_seed(), GPU_MASK_SHAPES["big"], 140, dtype)


def test_fully_masked_rows_on_gpu():
    """Rows past their length and rows whose window holds no key: o = 0, lse = -inf, no grads."""
    check_fully_masked_rows(fresh_seed(), (2, 150, 140, 2, 1, 64), q_len0=70, kv_len1=5, dtype=BF16)


@pytest.mark.parametrize("how", ["mask", "segments"])
@pytest.mark.parametrize("H", [64, 128])
def test_rows_emptied_by_masks_pass_no_gradient_on_gpu(how, H):
    check_masked_rows_pass_no_gradient(fresh_seed(), (2, 300, 260, 4, 2, H), how, dtype=BF16)


@pytest.mark.parametrize("axes", BROADCASTS)
@pytest.mark.parametrize("shape", ["odd", "big"])
def test_bias_and_its_gradient_on_gpu(axes, shape):
    seed = fresh_seed()
    B, T, S, N, K, H = GPU_MASK_SHAPES[shape]
    bias = jax.random.normal(jax.random.key(seed + 7), _bias_shape(axes, B, N, T, S))
    _, _, grads = compare_with_reference(seed, GPU_MASK_SHAPES[shape], dict(is_causal=shape == "odd"),
                                         dtype=BF16, bias=bias)
    assert grads[3].shape == bias.shape


@pytest.mark.parametrize("axes", ["BNTS", "BTS", "NTS", "TS", "S", "rank2"])
def test_boolean_mask_on_gpu(axes):
    seed = fresh_seed()
    B, T, S, N, K, H = GPU_MASK_SHAPES["big"]
    mask = jax.random.bernoulli(jax.random.key(seed + 7), 0.6, _bias_shape(axes, B, N, T, S))
    compare_with_reference(seed, GPU_MASK_SHAPES["big"], dict(mask=mask), dtype=BF16)


# Bit-packed masks: pack_mask's CUDA kernels against the NumPy model of the layout, and attention
# with a PackedMask against the reference from its boolean mask (the GPU kernels read the bits and
# tile summaries, as the CPU ones do: tests/test_packed_mask.py).

from test_packed_mask import (CASES as PACKED_CASES, case_mask, numpy_bits, numpy_tiles,  # noqa: E402
                              tile_pattern_mask)


# Rows of 300 and 1000 keys are read byte by byte, rows of 256, 1040 and 4096 keys (multiples of 16)
# in 16-byte pieces, 1040's last chunk cut short.
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 130, 300), (1, 2, 200, 1000), (1, 1, 64, 256),
                                   (1, 2, 130, 1040), (2, 1, 70, 4096)],
                         ids=lambda s: "x".join(map(str, s)))
def test_pack_mask_kernel_on_gpu(shape):
    seed = fresh_seed()
    mask = tile_pattern_mask(seed, shape)
    packed = jax.jit(jfa.pack_mask)(jnp.asarray(mask))
    assert {d.platform for d in packed.bits.devices()} == {"gpu"}
    np.testing.assert_array_equal(np.asarray(packed.bits), numpy_bits(mask), err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.asarray(packed.tiles), numpy_tiles(mask), err_msg=f"seed {seed}")
    mapped = jax.vmap(jfa.pack_mask)(jnp.asarray(mask.reshape((-1,) + shape[2:])))
    np.testing.assert_array_equal(np.asarray(mapped.bits).reshape(packed.bits.shape), np.asarray(packed.bits))


@pytest.mark.parametrize("case", PACKED_CASES)
def test_packed_mask_on_gpu(case):
    seed = fresh_seed()
    B, T, S, N, K, H = GPU_MASK_SHAPES["big"]
    mask = case_mask(case, seed, B, T, S, N)
    compare_with_reference(seed, GPU_MASK_SHAPES["big"], dict(mask=jfa.pack_mask(mask)),
                           ref_kw=dict(mask=mask), dtype=BF16)


@pytest.mark.parametrize("H", [64, 128])
def test_block_mask_with_other_keywords_on_gpu(H):
    seed = fresh_seed()
    shape = (2, 300, 520, 4, 2, H)
    B, T, S, N, K, H = shape
    blocks = np.random.default_rng(seed).random((B, N, 3, 5)) < 0.5
    packed = jfa.block_mask(blocks, (100, 120), q_len=T, kv_len=S)
    kw = combo_keywords(("causal_window", "segments", "softcap"), seed, B, T, S, N)
    bias = jax.random.normal(jax.random.key(seed + 5), (1, N, T, S))
    compare_with_reference(seed, shape, dict(kw, mask=packed), ref_kw=dict(kw, mask=packed.unpack()),
                           dtype=BF16, bias=bias)


@pytest.mark.parametrize("H", [64, 128, 256])
@pytest.mark.parametrize("per_head", [False, True])
def test_block_sparse_mask_on_gpu(H, per_head):
    """A block mask whose kept 128 x 128 blocks leave empty key blocks inside a query tile's range
    and whole rows of blocks empty: the kernels skip those (forward: neither loaded nor computed;
    backward: the query blocks a key block's CTA walks past, loaded, computed nor added) and must
    still match the reference, per head (GQA groups whose heads see different blocks) or shared."""
    seed = fresh_seed()
    shape = (2, 700, 1100, 4, 2, H)
    B, T, S, N, K, H = shape
    blocks = np.random.default_rng(seed).random((B, N if per_head else 1, 6, 9)) < 0.3
    blocks[:, :, 2] = False  # a row of blocks that sees nothing
    blocks[:, :, 0, 8] = True
    packed = jfa.block_mask(blocks, 128, q_len=T, kv_len=S)
    compare_with_reference(seed, shape, dict(mask=packed), ref_kw=dict(mask=packed.unpack()), dtype=BF16)


@pytest.mark.parametrize("H", [64, 128, 256])
@pytest.mark.parametrize("extra", ["dropout", "alibi", "causal", "deterministic"])
def test_block_sparse_mask_with_keywords_on_gpu(H, extra):
    """The backward's skipped steps with the state that follows its walk: dropout's keep bits (made
    a step ahead), ALiBi's d(slope) sums (kept per step parity), causal GQA's CTAs of one query head
    each (a head whose walk is all skipped adds nothing) and deterministic=True (which walks every
    step: each is a turn of the ordered dQ adds)."""
    seed = fresh_seed()
    shape = (2, 700, 1100, 4, 2, H)
    B, T, S, N, K, H = shape
    rng = np.random.default_rng(seed)
    blocks = rng.random((B, N, 6, 9)) < 0.3
    blocks[:, :, 2] = False
    blocks[:, 1, :, :4] = False  # one head of the first group sees nothing of the causal part
    blocks[:, :, 0, 8] = True
    packed = jfa.block_mask(blocks, 128, q_len=T, kv_len=S)
    mask = packed.unpack()
    kw, ref_kw = {}, {}
    if extra == "dropout":
        key = jax.random.key(seed + 9)
        kw = dict(dropout_rate=0.3, dropout_rng=key)
        ref_kw = dict(dropout_rate=0.3, dropout_keep=_dropout.keep_mask(key, 0.3, (B, N, T, S)))
    elif extra == "alibi":
        kw = ref_kw = dict(alibi_slopes=jnp.asarray(rng.uniform(0.01, 0.1, (N,)), jnp.float32))
    elif extra == "causal":
        kw = ref_kw = dict(is_causal=True)
    else:
        kw, ref_kw = dict(deterministic=True), {}
    compare_with_reference(seed, shape, dict(kw, mask=packed), ref_kw=dict(ref_kw, mask=mask), dtype=BF16)


def test_mask_of_more_slices_than_a_grid_axis_holds_on_gpu():
    # A mask per batch element of 66000: more (batch, head) slices than a grid's y or z axis holds
    # (65535), which the backward's transposer of the bits must still cover on its flat grid.
    seed = fresh_seed()
    shape = (66000, 8, 8, 1, 1, 64)
    mask = jax.random.bernoulli(jax.random.key(seed + 7), 0.5, (66000, 1, 8, 8))
    compare_with_reference(seed, shape, dict(mask=jfa.pack_mask(mask)), ref_kw=dict(mask=mask), dtype=BF16)


def test_long_runs_of_empty_blocks_on_gpu():
    """Runs of more than 32 empty steps and blocks, past one warp-wide search of the summaries:
    key blocks whose visible query blocks are 60 apart (the backward's walk) and query blocks
    whose visible key blocks are 61 apart (the forward's), the two heads of the GQA group differing
    in one block."""
    seed = fresh_seed()
    shape = (1, 62 * 128, 62 * 128 + 50, 2, 1, 128)
    B, T, S, N, K, H = shape
    blocks = np.zeros((B, N, 62, 63), bool)
    blocks[:, :, [0, 61], :] = True      # every key block: query blocks 0 and 61 only
    blocks[:, :, :, [0, 62]] = True      # every query block: key blocks 0 and 62 only
    blocks[:, 1, 30, 31] = True          # and one lone block of one head in the middle
    packed = jfa.block_mask(blocks, 128, q_len=T, kv_len=S)
    compare_with_reference(seed, shape, dict(mask=packed), ref_kw=dict(mask=packed.unpack()), dtype=BF16)

def test_everything_at_once_on_gpu():
    check_everything_at_once(fresh_seed(), (2, 170, 190, 4, 2, 64), window_left=90, kv_len1=131, dtype=BF16)


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_dropout_mask_is_the_numpy_philox_mask_on_gpu(rate):
    """The GPU kernel's mask, read off the output (q = 0: P = 1/S; V = identity), is
    jax_flashattn.dropout.keep_mask bit for bit: the CPU's stream, same counters."""
    rng = jax.random.key(fresh_seed())
    # Several query tiles; S is not a multiple of 4 or of a key tile, and at most 128 so that the
    # identity V fits the head dims of a restricted developer build (JFA_HDIMS=64;128).
    B, N, T, S = 2, 3, 200, 119
    q = jnp.zeros((B, T, N, 64), BF16)
    k = jnp.zeros((B, S, 1, 64), BF16)
    v = jnp.broadcast_to(jnp.eye(S, dtype=BF16)[None, :, None, :], (B, S, 1, S))
    out = jax.jit(lambda q, k, v: jfa.flash_attention(q, k, v, dropout_rate=rate, dropout_rng=rng))(q, k, v)
    kept = np.asarray(out.astype(jnp.float32) > 0).transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(kept, _dropout.keep_mask(rng, rate, (B, N, T, S)))


@pytest.mark.parametrize("rate", [0.1, 0.6])
@pytest.mark.parametrize("H,S", [(128, 119), (256, 250)])
def test_dropout_mask_of_the_hopper_forward(rate, H, S):
    """The same bit-for-bit check where the forward can run on the Hopper kernel (head dim of q,
    k and v alike: V is the identity padded to H columns). S = 250 spans four of its 64-key tiles
    at H 256 and ends inside a 4-key Philox group."""
    rng = jax.random.key(fresh_seed())
    B, N, T = 2, 3, 200
    q = jnp.zeros((B, T, N, H), BF16)
    k = jnp.zeros((B, S, 1, H), BF16)
    v = jnp.broadcast_to(jnp.eye(S, H, dtype=BF16)[None, :, None, :], (B, S, 1, H))
    out = jax.jit(lambda q, k, v: jfa.flash_attention(q, k, v, dropout_rate=rate, dropout_rng=rng))(q, k, v)
    kept = np.asarray(out[..., :S].astype(jnp.float32) > 0).transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(kept, _dropout.keep_mask(rng, rate, (B, N, T, S)))
    # The kept ones carry 1 / (S (1 - rate)): the keep scale is applied once.
    np.testing.assert_allclose(np.asarray(out[..., :S].astype(jnp.float32)).max(), 1 / (S * (1 - rate)), rtol=1e-2)


@pytest.mark.parametrize("kw", [dict(), dict(is_causal=True, query_seq_lengths=[150, 9]),
                                dict(local_window_size=(40, 40), softcap=3.0)],
                         ids=["plain", "causal+lengths", "window+softcap"])
@pytest.mark.parametrize("H", [64, 128, 256])
def test_dropout_forward_and_gradients_on_gpu(kw, H):
    check_dropout_against_reference(fresh_seed(), (2, 170, 145, 4, 2, H), kw, dtype=BF16)


@pytest.mark.parametrize("H", [64, 128])
def test_dropout_gradients_portable_backward_forced(H, monkeypatch):
    """JFA_FORCE_SM80=1: the portable kernels with dropout at a Hopper head dim; the same Philox stream
    as the Hopper kernels' (the default), whose gradients it matches."""
    seed = fresh_seed()
    shape = (2, 170, 300, 4, 2, H)
    q, k, v = random_qkv(seed, *shape, dtype=BF16)
    do = jax.random.normal(jax.random.key(seed + 1), q.shape).astype(BF16)
    kw = dict(is_causal=True, dropout_rate=0.3, dropout_rng=jax.random.key(seed + 2),
              alibi_slopes=jnp.full((4,), 0.03), implementation="cuda")

    def grads():  # a fresh jit each time: dispatched again
        return jax.jit(lambda q, k, v: jax.vjp(lambda q, k, v: jfa.flash_attention(q, k, v, **kw), q, k, v)[1](do))(
            q, k, v)

    default = grads()
    monkeypatch.setenv("JFA_FORCE_SM80", "1")
    portable = grads()
    _, grad_bound = BOUNDS[BF16]
    for name, a, b in zip("qkv", default, portable):
        assert rel_err(a, b) <= grad_bound, f"seed {seed}: d{name} default vs portable {rel_err(a, b)}"
    check_dropout_against_reference(seed, shape, dict(is_causal=True), dtype=BF16)


@pytest.mark.parametrize("combo", [("causal", "segments", "alibi"), ("bottom_right_window", "kv_lengths")],
                         ids="+".join)
def test_dropout_with_masks_past_one_tile_on_gpu(combo):
    """Dropout with other features on several query and key tiles of the Hopper kernels (H 128)."""
    seed = fresh_seed()
    B, T, S, N, K, H = GPU_MASK_SHAPES["big"]
    rng, rate = jax.random.key(seed + 5), 0.2
    kw = combo_keywords(combo, seed, B, T, S, N)
    keep = _dropout.keep_mask(rng, rate, (B, N, T, S))
    compare_with_reference(seed, GPU_MASK_SHAPES["big"], dict(kw, dropout_rate=rate, dropout_rng=rng),
                           ref_kw=dict(kw, dropout_rate=rate, dropout_keep=keep), dtype=BF16)


# deterministic=True: plain (every lower key tile adds to a dQ tile), causal with GQA, and the
# general path, whose turns are counted per tile (window, segment ids, lengths, full-shape bias);
# at each Hopper backward layout's head dim: H 64 and 128 (a dQ writer warp makes the ordered adds)
# and H 256 (the MMA threads add, a turn keeper warp orders them).
DETERMINISTIC_CASES = {
    "plain": (dict(), None),
    # More key tiles than query tiles (9 or 18 key tiles, 1 or 2 query tiles): long chains of turns at
    # each query tile, split over the accumulator's lanes at H 64 and H 256.
    "few_queries": (dict(), "few_queries"),
    "causal_gqa": (dict(is_causal=True), None),
    "window_segments_lengths": (dict(local_window_size=(70, 20), key_value_seq_lengths=[400, 333]), "segments"),
    "bias_dropout": (dict(dropout_rate=0.2), "bias"),
    # Broadcast biases: d(bias) comes back full-shape and XLA sums the broadcast axes.
    "bias_shared_by_batch": (dict(is_causal=True), "bias_1NTS"),
    "bias_per_key": (dict(), "bias_B11S"),
    "alibi_window": (dict(is_causal=True, local_window_size=(300, 0)), "alibi"),  # d(slopes) too
}


@pytest.mark.parametrize("H", [64, 128, 256])
@pytest.mark.parametrize("case", list(DETERMINISTIC_CASES))
def test_deterministic_gradients_are_bitwise_reproducible_on_gpu(case, H):
    """The dQ adds in key-tile order: two runs give the same bits, and match the reference."""
    seed = fresh_seed()
    B, T, S, N, K = 2, 700, 430, 4, 2
    kw, extra = DETERMINISTIC_CASES[case]
    if extra == "few_queries":
        T, S = 90, 1100
    if "key_value_seq_lengths" in kw:
        kw = dict(kw, key_value_seq_lengths=jnp.asarray(kw["key_value_seq_lengths"], jnp.int32))
    kw = dict(kw, deterministic=True)
    if extra == "segments":
        ids_q = jnp.asarray(np.repeat(np.arange(4), -(-T // 4))[None, :T].repeat(B, 0), jnp.int32)
        ids_k = jnp.asarray(np.repeat(np.arange(4), -(-S // 4))[None, :S].repeat(B, 0), jnp.int32)
        kw.update(q_segment_ids=ids_q, kv_segment_ids=ids_k)
    if "dropout_rate" in kw:
        kw["dropout_rng"] = jax.random.key(seed + 7)
    bias_shapes = {"bias": (B, N, T, S), "bias_1NTS": (1, N, T, S), "bias_B11S": (B, 1, 1, S)}
    bias = (jax.random.normal(jax.random.key(seed + 3), bias_shapes[extra], jnp.float32)
            if extra in bias_shapes else None)
    slopes = jnp.linspace(0.02, 0.3, N, dtype=jnp.float32) if extra == "alibi" else None
    q, k, v = random_qkv(seed, B, T, S, N, K, H, dtype=BF16)
    do = jax.random.normal(jax.random.key(seed + 1), (B, T, N, H)).astype(BF16)

    @jax.jit
    def grads(q, k, v, bias, slopes):
        return jax.vjp(lambda q, k, v, b, s: jfa.flash_attention(q, k, v, bias=b, alibi_slopes=s, **kw),
                       q, k, v, bias, slopes)[1](do)

    first, second = grads(q, k, v, bias, slopes), grads(q, k, v, bias, slopes)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"seed {seed}")
    if "dropout_rate" not in kw:  # the reference has no dropout stream of its own here
        if slopes is not None:
            kw = dict(kw, alibi_slopes=slopes)
        ref_kw = {name: x for name, x in kw.items() if name != "deterministic"}
        compare_with_reference(seed, (B, T, S, N, K, H), kw, dtype=BF16, bias=bias, ref_kw=ref_kw)


# ---- Head dims between the Hopper kernels' ------------------------------------------------------
# On sm90, H 32, 96 and 192 (and the head dims padded up to them, 80 here) run on the next wider
# Hopper kernel (cuda/sm90/api.h, kernel_head_dim): TMA fills the missing columns with zeros and
# clips the stores, and the backward's float32 workspace spans the kernel's width. Each of both
# passes' paths at those widths: the plain and causal kernels (causal GQA adds its dK and dV
# through that workspace), the general path with everything, dropout's kernel, deterministic=True.

def _between_case(case, seed, shape):
    B, T, S, N, K, H = shape
    if case == "everything":
        check_everything_at_once(seed, shape, window_left=90, kv_len1=131, dtype=BF16)
    elif case == "dropout":
        check_dropout_against_reference(seed, shape, dict(is_causal=True), dtype=BF16)
    elif case == "deterministic":
        compare_with_reference(seed, shape, dict(is_causal=True, deterministic=True), dtype=BF16,
                               ref_kw=dict(is_causal=True))
    else:
        compare_with_reference(seed, shape, dict(is_causal=case == "causal_gqa"), dtype=BF16)


@pytest.mark.parametrize("case", ["plain", "causal_gqa", "everything", "dropout", "deterministic"])
@pytest.mark.parametrize("H", [32, 80, 96, 192])
def test_head_dims_between_hopper_kernels_on_gpu(H, case):
    _between_case(case, fresh_seed(), (2, 300, 520, 4, 2, H))


# ---- varlen_attention: both ways (packed self-attention as segment ids, else padded) ----------

def _check_varlen_on_gpu(seed, q_lens, k_lens, same_packing, kw):
    """varlen_attention in bfloat16 against the float32 reference run on each sequence alone:
    output, LSE and gradients. same_packing passes the very cu_seqlens array twice."""
    from jax_flashattn.reference import attention_reference
    from util import BOUNDS
    cu_of = lambda lens: jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)  # noqa: E731
    cu_q = cu_of(q_lens)
    cu_k = cu_q if same_packing else cu_of(k_lens)
    N, K, H = 4, 2, 64
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (int(cu_q[-1]), N, H)).astype(BF16)
    k = jax.random.normal(keys[1], (int(cu_k[-1]), K, H)).astype(BF16)
    v = jax.random.normal(keys[2], (int(cu_k[-1]), K, H)).astype(BF16)
    w = jax.random.normal(keys[3], q.shape)

    def ours(q, k, v):
        out, lse = jfa.varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens),
                                        return_lse=True, **kw)
        return jnp.sum(out.astype(jnp.float32) * w), (out, lse)

    def theirs(q, k, v):
        outs, lses = [], []
        for b in range(len(q_lens)):
            sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
            o, l = attention_reference(q[None, sq], k[None, sk], v[None, sk], **kw)
            outs.append(o[0])
            lses.append(l[0])
        out = jnp.concatenate(outs)
        return jnp.sum(out * w), (out, jnp.concatenate(lses))

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    (_, (r_out, r_lse)), r_grads = jax.value_and_grad(theirs, argnums=(0, 1, 2), has_aux=True)(*up)
    fwd_bound, grad_bound = BOUNDS[BF16]
    assert rel_err(out, r_out) <= fwd_bound, f"seed {seed}"
    assert rel_err(lse, r_lse) <= 1e-4, f"seed {seed}"
    for g, r in zip(grads, r_grads):
        assert rel_err(g, r) <= grad_bound, f"seed {seed}"


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("kw", [dict(is_causal=True), dict(local_window_size=(90, 0), alibi_slopes=jnp.full((4,), 0.05))],
                         ids=["causal", "window+alibi"])
def test_varlen_on_gpu(packed, kw):
    """Self-attention over a packing of uneven sequences (several kernel tiles each): packed (the
    same cu_seqlens twice: segment ids) or padded (an equal copy)."""
    lens = [130, 1, 517, 64, 300]
    _check_varlen_on_gpu(fresh_seed(), lens, lens, packed, kw)


def test_cross_packed_varlen_on_gpu():
    """Two different packings (cross-attention, no positions): one unpadded batch row with segment
    ids of different lengths on each side."""
    _check_varlen_on_gpu(fresh_seed(), [130, 1, 517, 64], [200, 77, 3, 390], False, dict(softcap=5.0))


# ---- Sharding and context parallelism on one GPU ------------------------------------------------
# The partitioned paths (jax_flashattn/sharding.py, context_parallel.py) on a 1-device mesh of the
# GPU, against the plain call: the CUDA kernels under custom_partitioning and inside shard_map.
# tests/multidevice/ covers several (CPU) devices.

@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_sharded_and_context_parallel_on_one_gpu(strategy):
    seed = fresh_seed()
    B, T, N, K, H = 2, 300, 4, 2, 128
    q, k, v = random_qkv(seed, B, T, T, N, K, H, dtype=BF16)
    do = jax.random.normal(jax.random.key(seed + 1), q.shape).astype(BF16)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    spec = jax.sharding.PartitionSpec("x")

    def plain(q, k, v):
        return jfa.flash_attention(q, k, v, is_causal=True)

    def ring(q, k, v):
        return jax.shard_map(lambda q, k, v: jfa.context_parallel_attention(
            q, k, v, axis_name="x", strategy=strategy, is_causal=True), mesh=mesh,
            in_specs=(jax.sharding.PartitionSpec(None, "x"),) * 3,
            out_specs=jax.sharding.PartitionSpec(None, "x"))(q, k, v)

    def grads(f, *args):
        out, vjp = jax.vjp(f, *args)
        return (out,) + vjp(do)

    ref = jax.jit(lambda q, k, v: grads(plain, q, k, v))(q, k, v)
    placed = [jax.device_put(x, jax.sharding.NamedSharding(mesh, spec)) for x in (q, k, v)]
    sharded = jax.jit(lambda q, k, v: grads(plain, q, k, v))(*placed)
    cp = jax.jit(lambda q, k, v: grads(ring, q, k, v))(q, k, v)
    _, grad_bound = BOUNDS[BF16]
    for name, r, a, b in zip(["out", "dq", "dk", "dv"], ref, sharded, cp):
        assert rel_err(a, r) <= 1e-6, f"seed {seed}: {name} sharded vs plain {rel_err(a, r)}"
        assert rel_err(b, r) <= grad_bound, f"seed {seed}: {name} {strategy} vs plain {rel_err(b, r)}"


@pytest.mark.parametrize("layout", ["keys", "batch"])
def test_operands_past_2_31_elements_on_gpu(layout):
    """K and V of more than 2^31 elements each (4.3 and 6.4 GB in bf16): every offset into them, and
    into dK and dV, must be 64-bit. "keys": one sequence of 131080 keys x 128 heads, so a row's
    offset passes 2^31; "batch": three sequences, so the batch offset of the third does. The
    forward and the gradients of the last and first heads equal those of the same call on those
    heads alone (operands far below 2^31, which the other tests check against the reference);
    deterministic=True makes the dQ adds, and so the comparison, exact."""
    B, S = (1, 131080) if layout == "keys" else (3, 65544)
    T, N, H = 192, 128, 128
    assert B * S * N * H > 2**31 and (layout == "keys" or (B - 1) * S * N * H > 2**31)
    limit = (jax.devices("gpu")[0].memory_stats() or {}).get("bytes_limit", 0)
    if limit < 40e9:
        pytest.skip(f"needs about 30 GB of GPU memory, {limit / 1e9:.0f} GB available")
    keys = jax.random.split(jax.random.key(fresh_seed()), 4)
    q = jax.random.normal(keys[0], (B, T, N, H), BF16)
    k = jax.random.normal(keys[1], (B, S, N, H), BF16)
    v = jax.random.normal(keys[2], (B, S, N, H), BF16)
    do = jax.random.normal(keys[3], (B, T, N, H), BF16)

    @jax.jit
    def forward_and_grads(q, k, v, do):
        out, vjp = jax.vjp(lambda q, k, v: jfa.flash_attention(q, k, v, deterministic=True), q, k, v)
        return (out,) + vjp(do)

    whole = forward_and_grads(q, k, v, do)
    for heads in (slice(N - 2, N), slice(0, 2)):
        alone = forward_and_grads(q[:, :, heads], k[:, :, heads], v[:, :, heads], do[:, :, heads])
        for name, big, small in zip(("out", "dq", "dk", "dv"), whole, alone):
            np.testing.assert_array_equal(np.asarray(big[:, :, heads]), np.asarray(small),
                                          err_msg=f"{name}, heads {heads}")
