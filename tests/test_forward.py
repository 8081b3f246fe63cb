"""Forward output and LSE of flash_attention against the float32 reference (CPU kernels)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn as jfa
from jax_flashattn.reference import attention_reference
from util import BOUNDS, fresh_seed, random_qkv, rel_err

# (B, T, S, N, K, H, Hv): odd sizes, T != S, T = 1, S = 1, GQA, MQA, Hv != H, head dims 32..256.
SHAPES = [
    (2, 17, 17, 4, 4, 64, 64),
    (1, 1, 1, 2, 2, 32, 32),
    (1, 1, 255, 4, 2, 64, 64),
    (1, 255, 1, 4, 1, 64, 64),
    (2, 255, 1000, 8, 2, 128, 128),
    (1, 1000, 255, 4, 1, 96, 96),
    (1, 17, 33, 2, 2, 256, 256),
    (1, 100, 130, 3, 3, 80, 48),
    (3, 64, 64, 6, 3, 40, 40),
]
DTYPES = [jnp.float32, jnp.float16, jnp.bfloat16]


def _ids(shape):
    return "B{}T{}S{}N{}K{}H{}Hv{}".format(*shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_forward_and_lse_match_reference(shape, is_causal, dtype):
    seed = fresh_seed()
    q, k, v = random_qkv(seed, *shape, dtype=dtype)
    out, lse = jax.jit(lambda q, k, v: jfa.flash_attention(
        q, k, v, is_causal=is_causal, return_lse=True))(q, k, v)
    ref_out, ref_lse = attention_reference(q, k, v, is_causal=is_causal)

    assert out.shape == (shape[0], shape[1], shape[3], shape[6]) and out.dtype == dtype
    assert lse.shape == (shape[0], shape[1], shape[3]) and lse.dtype == jnp.float32
    bound = BOUNDS[dtype][0]
    assert rel_err(out, ref_out) <= bound, f"seed {seed}: out error {rel_err(out, ref_out)}"
    # LSE is computed in float32 from the (rounded) inputs whatever their dtype.
    assert rel_err(lse, ref_lse) <= 1e-5, f"seed {seed}: lse error {rel_err(lse, ref_lse)}"


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_low_precision_error_within_twice_jax_nn(dtype):
    """Our error in fp16/bf16 is at most 2x that of jax.nn (xla) in the same dtype, + a bit."""
    seed = fresh_seed()
    q, k, v = random_qkv(seed, 2, 300, 300, 8, 2, 64, dtype=dtype)
    ref, _ = attention_reference(q, k, v, is_causal=True)
    ours = jfa.flash_attention(q, k, v, is_causal=True)
    peer = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    assert rel_err(ours, ref) <= 2 * rel_err(peer, ref) + 1e-4, f"seed {seed}"


def test_scale_is_applied():
    seed = fresh_seed()
    q, k, v = random_qkv(seed, 1, 33, 47, 2, 2, 64)
    ref, ref_lse = attention_reference(q, k, v, scale=0.37)
    out, lse = jfa.flash_attention(q, k, v, scale=0.37, return_lse=True)
    assert rel_err(out, ref) <= 1e-5 and rel_err(lse, ref_lse) <= 1e-5, f"seed {seed}"


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_negative_scale_with_wide_logits(is_causal):
    """scale < 0 makes the largest logit the most negative q·k; with logits hundreds of nats
    apart a kernel that stabilised by the largest q·k instead would overflow. Gradients too."""
    seed = fresh_seed()
    q, k, v = random_qkv(seed, 1, 70, 300, 2, 2, 64)
    k = k * jnp.linspace(8.0, 1.0, 300)[None, :, None, None]
    do = jax.random.normal(jax.random.key(seed + 1), q.shape)
    f = lambda q, k, v: jfa.flash_attention(q, k, v, scale=-0.5, is_causal=is_causal)  # noqa: E731
    r = lambda q, k, v: attention_reference(q, k, v, scale=-0.5, is_causal=is_causal)[0]  # noqa: E731
    out, vjp = jax.vjp(f, q, k, v)
    ref, ref_vjp = jax.vjp(r, q, k, v)
    assert rel_err(out, ref) <= 1e-5, f"seed {seed}: out {rel_err(out, ref)}"
    for name, g, gr in zip("qkv", vjp(do), ref_vjp(do)):
        assert rel_err(g, gr) <= 4e-5, f"seed {seed}: d{name} {rel_err(g, gr)}"


def test_unbatched_layout_matches_batched():
    seed = fresh_seed()
    q, k, v = random_qkv(seed, 1, 37, 51, 4, 2, 64)
    out, lse = jfa.flash_attention(q[0], k[0], v[0], is_causal=True, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, is_causal=True)
    assert out.shape == (37, 4, 64) and lse.shape == (37, 4)
    assert rel_err(out, ref[0]) <= 1e-5 and rel_err(lse, ref_lse[0]) <= 1e-5, f"seed {seed}"


def test_causal_rows_see_only_earlier_keys():
    """Changing key/value j must not change outputs of queries i < j (top-left alignment)."""
    seed = fresh_seed()
    q, k, v = random_qkv(seed, 1, 40, 60, 2, 2, 32)
    out = jfa.flash_attention(q, k, v, is_causal=True)
    k2 = k.at[:, 20:].set(7.0)
    v2 = v.at[:, 20:].set(-3.0)
    out2 = jfa.flash_attention(q, k2, v2, is_causal=True)
    np.testing.assert_array_equal(np.asarray(out[:, :20]), np.asarray(out2[:, :20]))
    assert not np.allclose(np.asarray(out[:, 20:]), np.asarray(out2[:, 20:]))


def test_empty_key_sequence_gives_zero_output_and_neg_inf_lse():
    q, k, v = random_qkv(fresh_seed(), 2, 5, 0, 2, 1, 16)
    out, lse = jfa.flash_attention(q, k, v, return_lse=True)
    assert out.shape == (2, 5, 2, 16) and not np.any(np.asarray(out))
    assert np.all(np.isneginf(np.asarray(lse)))


@pytest.mark.parametrize("B, T", [(0, 5), (2, 0)], ids=["no-batch", "no-queries"])
def test_empty_batch_or_queries_give_empty_outputs_and_zero_gradients(B, T):
    q, k, v = random_qkv(fresh_seed(), B, T, 7, 2, 1, 16)
    out, lse = jfa.flash_attention(q, k, v, return_lse=True)
    assert out.shape == (B, T, 2, 16) and lse.shape == (B, T, 2)
    grads = jax.grad(lambda q, k, v: jfa.flash_attention(q, k, v).sum(), (0, 1, 2))(q, k, v)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert not any(np.any(np.asarray(g)) for g in grads)


def test_outputs_are_written_everywhere_for_large_values():
    """Large logits stress the online-softmax rescaling; the result stays finite and exact."""
    seed = fresh_seed()
    q, k, v = random_qkv(seed, 1, 130, 300, 2, 2, 64)
    q = q * 30.0
    out, lse = jfa.flash_attention(q, k, v, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v)
    assert rel_err(out, ref) <= 1e-4 and rel_err(lse, ref_lse) <= 1e-5, f"seed {seed}"
