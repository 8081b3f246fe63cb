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
], ids=["rank", "head-dim", "n-not-multiple-of-k", "value-length", "value-heads", "batch"])
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
