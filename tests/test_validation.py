"""Every bad input raises a ValueError/TypeError at trace time that names the argument."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn as jfa

F32 = jnp.float32


def _arrays(qs, ks, vs, dtype=F32):
    return jnp.ones(qs, dtype), jnp.ones(ks, dtype), jnp.ones(vs, dtype)


@pytest.mark.parametrize("fn", [jfa.flash_attention, jfa.dot_product_attention],
                         ids=["flash_attention", "dot_product_attention"])
@pytest.mark.parametrize("shapes, error, words", [
    (((1, 1, 4, 2, 16),) * 3, ValueError, ["query", "(1, 1, 4, 2, 16)"]),
    (((1, 4, 2, 16), (1, 4, 2, 32), (1, 4, 2, 32)), ValueError, ["key", "16"]),
    (((1, 4, 3, 16), (1, 4, 2, 16), (1, 4, 2, 16)), ValueError, ["heads", "3"]),
    (((1, 4, 2, 16), (1, 4, 2, 16), (1, 5, 2, 16)), ValueError, ["value", "(1, 5, 2, 16)"]),
    (((1, 4, 4, 16), (1, 4, 2, 16), (1, 4, 1, 16)), ValueError, ["value"]),
    (((2, 4, 2, 16), (1, 4, 2, 16), (1, 4, 2, 16)), ValueError, ["query", "(2, 4, 2, 16)"]),
    (((1, 4, 0, 16), (1, 4, 1, 16), (1, 4, 1, 16)), ValueError, ["at least one head", "N=0", "(1, 4, 0, 16)"]),
    (((1, 4, 0, 16), (1, 4, 0, 16), (1, 4, 0, 16)), ValueError, ["at least one head", "K=0", "key (1, 4, 0, 16)"]),
], ids=["rank", "head-dim", "n-not-multiple-of-k", "value-length", "value-heads", "batch", "no-query-heads",
        "no-heads"])
def test_shape_errors_name_the_argument(fn, shapes, error, words):
    with pytest.raises(error) as info:
        jax.jit(fn)(*_arrays(*shapes))
    msg = str(info.value)
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("fn", [jfa.flash_attention, jfa.dot_product_attention])
def test_integer_dtype_is_a_type_error(fn):
    q, k, v = _arrays((1, 4, 2, 16), (1, 4, 2, 16), (1, 4, 2, 16), jnp.int32)
    with pytest.raises((TypeError, ValueError), match="query|int32"):
        fn(q, k, v)


def test_mixed_dtypes_rejected():
    q, k, v = _arrays((1, 4, 2, 16), (1, 4, 2, 16), (1, 4, 2, 16))
    with pytest.raises(TypeError, match="one dtype"):
        jfa.flash_attention(q, k.astype(jnp.bfloat16), v)


@pytest.mark.parametrize("scale", ["0.1", jnp.ones((2,)), True])
def test_non_float_scale_is_a_type_error(scale):
    q, k, v = _arrays((1, 4, 2, 16), (1, 4, 2, 16), (1, 4, 2, 16))
    with pytest.raises(TypeError, match="scale"):
        jfa.flash_attention(q, k, v, scale=scale)


def test_traced_scale_is_a_type_error():
    q, k, v = _arrays((1, 4, 2, 16), (1, 4, 2, 16), (1, 4, 2, 16))
    with pytest.raises(TypeError, match="scale"):
        jax.jit(lambda s: jfa.flash_attention(q, k, v, scale=s))(0.5)


def test_non_finite_scale_is_a_value_error():
    q, k, v = _arrays((1, 4, 2, 16), (1, 4, 2, 16), (1, 4, 2, 16))
    with pytest.raises(ValueError, match="scale"):
        jfa.flash_attention(q, k, v, scale=float("nan"))


def test_numpy_float_scale_is_accepted():
    q, k, v = _arrays((1, 4, 2, 16), (1, 4, 2, 16), (1, 4, 2, 16))
    assert jfa.flash_attention(q, k, v, scale=np.float32(0.25)).shape == (1, 4, 2, 16)


def test_unknown_implementation():
    q, k, v = _arrays((1, 4, 2, 16), (1, 4, 2, 16), (1, 4, 2, 16))
    with pytest.raises(ValueError, match="implementation"):
        jfa.flash_attention(q, k, v, implementation="tpu")


def test_cuda_implementation_on_cpu_is_a_clear_error():
    q, k, v = _arrays((1, 4, 2, 16), (1, 4, 2, 16), (1, 4, 2, 16))
    with pytest.raises(Exception, match="cuda"):
        jax.jit(lambda q, k, v: jfa.flash_attention(q, k, v, implementation="cuda"))(q, k, v)


def test_is_causal_must_be_bool():
    q, k, v = _arrays((1, 4, 2, 16), (1, 4, 2, 16), (1, 4, 2, 16))
    with pytest.raises(TypeError, match="is_causal"):
        jfa.flash_attention(q, k, v, is_causal="yes")


def test_failed_call_leaves_inputs_untouched():
    q, k, v = _arrays((1, 4, 2, 16), (1, 4, 2, 16), (1, 4, 2, 16))
    before = [np.asarray(x).copy() for x in (q, k, v)]
    with pytest.raises(ValueError):
        jfa.flash_attention(q, k[:, :, :1].repeat(3, axis=2), v)
    for b, x in zip(before, (q, k, v)):
        np.testing.assert_array_equal(b, np.asarray(x))


# ---- masking and training keywords ---------------------------------------------------------------

def _qkv():
    return _arrays((2, 8, 4, 16), (2, 12, 2, 16), (2, 12, 2, 16))


@pytest.mark.parametrize("kw, error, words", [
    (dict(query_seq_lengths=jnp.array([3.0, 4.0])),
     TypeError, ["query_seq_lengths", "int32"]),
    (dict(key_value_seq_lengths=jnp.array([3, 4, 5], jnp.int32)), ValueError,
     ["key_value_seq_lengths", "(3,)", "(2,)"]),
    (dict(key_value_seq_lengths=jnp.array([3, 4], jnp.uint32)),
     TypeError, ["key_value_seq_lengths", "int32"]),
    (dict(query_seq_lengths=jnp.array([-1, 4], jnp.int32)), ValueError,
     ["query_seq_lengths", ">= 0", "-1", "batch element 0", "(2,)"]),
    (dict(key_value_seq_lengths=np.array([12, -3], np.int32)), ValueError,
     ["key_value_seq_lengths", ">= 0", "-3", "batch element 1", "(2,)"]),
    (dict(q_segment_ids=jnp.zeros((2, 9), jnp.int32), kv_segment_ids=jnp.zeros((2, 12), jnp.int32)),
     ValueError, ["q_segment_ids", "(2, 9)", "(2, 8)"]),
    (dict(q_segment_ids=jnp.zeros((2, 8), jnp.int32)), ValueError, ["kv_segment_ids", "together"]),
    (dict(q_segment_ids=jnp.zeros((2, 8), jnp.int32), kv_segment_ids=jnp.zeros((2, 8), jnp.int32)),
     ValueError, ["kv_segment_ids", "(2, 8)", "(2, 12)"]),
    (dict(q_segment_ids=jnp.zeros((2, 8), jnp.float32), kv_segment_ids=jnp.zeros((2, 12), jnp.int32)),
     TypeError, ["q_segment_ids", "int32"]),
    (dict(softcap=0.0), ValueError, ["softcap", "0.0"]),
    (dict(softcap=-1.0), ValueError, ["softcap"]),
    (dict(dropout_rate=1.0, dropout_rng=jax.random.key(0)), ValueError, ["dropout_rate", "[0, 1)"]),
    (dict(dropout_rate=-0.1, dropout_rng=jax.random.key(0)), ValueError, ["dropout_rate"]),
    (dict(dropout_rate=0.1), ValueError, ["dropout_rng"]),
    (dict(dropout_rate=0.1, dropout_rng=jnp.zeros((3,), jnp.float32)), TypeError, ["dropout_rng"]),
    (dict(bias=jnp.zeros((2, 4, 8, 11))), ValueError, ["bias", "(2, 4, 8, 11)", "(2, 4, 8, 12)"]),
    (dict(bias=jnp.zeros((8, 12), jnp.int32)), TypeError, ["bias"]),
    (dict(mask=jnp.ones((8, 12), jnp.float32)), TypeError, ["mask", "bool"]),
    (dict(mask=jnp.ones((3, 1, 8, 12), bool)), ValueError, ["mask", "(3, 1, 8, 12)"]),
    (dict(local_window_size=-1), ValueError, ["local_window_size"]),
    (dict(local_window_size=(1, 2, 3)), ValueError, ["local_window_size"]),
    (dict(causal_alignment="bottom"), ValueError, ["causal_alignment", "bottom_right"]),
    (dict(alibi_slopes=jnp.ones((3,))), ValueError, ["alibi_slopes", "N=4"]),
    (dict(alibi_slopes=jnp.ones((4,), jnp.int32)), TypeError, ["alibi_slopes", "float", "int32"]),
    (dict(deterministic="yes"), TypeError, ["deterministic"]),
], ids=lambda x: "-".join(x) if isinstance(x, dict) else None)
def test_mask_keyword_errors_name_the_argument(kw, error, words):
    with pytest.raises(error) as info:
        jax.jit(lambda q, k, v: jfa.flash_attention(q, k, v, **kw))(*_qkv())
    for w in words:
        assert w in str(info.value), str(info.value)


def test_traced_lengths_are_not_checked_at_trace_time():
    """Values known only at run time reach the kernels, which count a negative length as 0."""
    q, k, v = _qkv()
    lengths = jnp.array([-1, 4], jnp.int32)
    out = jax.jit(lambda q, k, v, n: jfa.flash_attention(q, k, v, query_seq_lengths=n))(q, k, v, lengths)
    assert not np.any(np.asarray(out[0])) and np.any(np.asarray(out[1, :4]))


def test_negative_lengths_of_an_unbatched_call_show_its_shape():
    q, k, v = _arrays((8, 4, 16), (12, 2, 16), (12, 2, 16))
    with pytest.raises(ValueError, match=r"key_value_seq_lengths must be >= 0, got -2 .*shape \(\)"):
        jfa.flash_attention(q, k, v, key_value_seq_lengths=jnp.int32(-2))


def test_dropin_checks_our_keywords_too():
    with pytest.raises(ValueError, match="softcap"):
        jfa.dot_product_attention(*_qkv(), softcap=0.0)
    with pytest.raises(ValueError, match="dropout_rng"):
        jfa.dot_product_attention(*_qkv(), dropout_rate=0.1)
    with pytest.raises(ValueError, match=r"kv_segment_ids.*\(2, 12\).*got \(2, 8\)"):
        jfa.dot_product_attention(*_qkv(), q_segment_ids=jnp.zeros((2, 8), jnp.int32),
                                  kv_segment_ids=jnp.zeros((2, 8), jnp.int32))
    with pytest.raises(ValueError, match="alibi_slopes"):
        jfa.dot_product_attention(*_qkv(), alibi_slopes=jnp.ones((3,)))
    with pytest.raises(ValueError, match="query_seq_lengths must be >= 0"):
        jfa.dot_product_attention(*_qkv(), query_seq_lengths=jnp.array([2, -8], jnp.int32))


def test_kernel_checks_operands_again():
    """What reaches the C++ handler is checked there too: an ffi::Error, not a crash."""
    from jax_flashattn._options import Extras, MaskConfig
    from jax_flashattn.primitives import attention_fwd_p
    q, k, v = _qkv()
    none = {name: jnp.zeros((), jnp.int32) for name in Extras._fields}
    bad_lengths = dict(none, query_seq_lengths=jnp.array([1, 2, 3], jnp.int32))
    with pytest.raises(Exception, match="query_seq_lengths"):
        attention_fwd_p.bind(q, k, v, *bad_lengths.values(), scale=0.25, config=MaskConfig(),
                             implementation=None)
    with pytest.raises(Exception, match="dropout"):
        attention_fwd_p.bind(q, k, v, *none.values(), scale=0.25,
                             config=MaskConfig(dropout_rate=0.5), implementation=None)
    bad_tiles = dict(none, mask_bits=jnp.zeros((1, 1, 8, 4), jnp.uint32),
                     mask_tiles=jnp.zeros((1, 1, 2, 1), jnp.uint8))
    with pytest.raises(Exception, match=r"packed mask tiles.*\(1, 1, 1, 1\).*got \(1, 1, 2, 1\)"):
        attention_fwd_p.bind(q, k, v, *bad_tiles.values(), scale=0.25, config=MaskConfig(),
                             implementation=None)


@pytest.mark.parametrize("kw", [
    dict(softcap=2.0), dict(bias=jnp.zeros((8, 12))), dict(mask=jnp.ones((8, 12), bool)),
    dict(query_seq_lengths=jnp.array([3, 4], jnp.int32)), dict(local_window_size=3),
    dict(causal_alignment="bottom_right"), dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)),
    dict(deterministic=True),
], ids=lambda kw: next(iter(kw)))
def test_cuda_lowering_takes_mask_keywords(kw):
    """The CUDA kernels take every masking keyword: lowering for CUDA passes them on (in a build
    without CUDA kernels it stops at the missing kernels, never at the keyword)."""
    q, k, v = (x.astype(jnp.bfloat16) for x in _qkv())
    traced = jax.jit(lambda q, k, v: jfa.flash_attention(q, k, v, **kw)).trace(q, k, v)
    try:
        traced.lower(lowering_platforms=("cuda",))
    except RuntimeError as e:
        assert "without its CUDA kernels" in str(e)


def test_deterministic_gpu_backward_takes_a_full_shape_dbias():
    """On the GPU, d(bias) over a bias's broadcast axes is summed with float atomics; with
    deterministic=True the kernel instead returns d(bias) in the full [B, N, T, S] shape (no
    element has two contributions) and XLA sums the broadcast axes."""
    from jax_flashattn._options import MaskConfig
    from jax_flashattn.primitives import _dbias_shape
    q, k = jnp.zeros((2, 8, 4, 16)), jnp.zeros((2, 12, 2, 16))
    det = MaskConfig(deterministic=True)
    assert _dbias_shape(det, q, k, jnp.zeros((1, 4, 1, 12))) == (2, 4, 8, 12)
    assert _dbias_shape(det, q, k, jnp.zeros((2, 4, 8, 12))) == (2, 4, 8, 12)
    assert _dbias_shape(det, q, k, jnp.zeros(())) == ()  # no bias
    assert _dbias_shape(MaskConfig(), q, k, jnp.zeros((1, 4, 1, 12))) == (1, 4, 1, 12)
