"""The attention primitives: abstract evaluation and lowering to the FFI targets per platform.

Two primitives, both in the public layout (q BTNH, k BSKH, v BSKHv, lse BTN float32):
  attention_fwd_p(q, k, v)                        -> (o, lse)
  attention_bwd_p(q, k, v, o, lse, do, dlse)      -> (dq, dk, dv)
Parameters: scale (float), is_causal (bool), implementation (None, 'cpu' or 'cuda').
Inputs are validated by the public functions before they get here.
"""
from __future__ import annotations

from functools import partial

import numpy as np
import jax
import jax.numpy as jnp

from . import _ext
from ._compat import Primitive, ShapedArray, apply_primitive, mlir, replace_avals_out

attention_fwd_p = Primitive("jfa_attention_fwd")
attention_fwd_p.multiple_results = True
attention_bwd_p = Primitive("jfa_attention_bwd")
attention_bwd_p.multiple_results = True


def _fwd_abstract_eval(q, k, v, *, scale, is_causal, implementation):
    B, T, N, _ = q.shape
    Hv = v.shape[-1]
    return (ShapedArray((B, T, N, Hv), q.dtype), ShapedArray((B, T, N), jnp.float32))


def _bwd_abstract_eval(q, k, v, o, lse, do, dlse, *, scale, is_causal, implementation):
    return (ShapedArray(q.shape, q.dtype), ShapedArray(k.shape, k.dtype),
            ShapedArray(v.shape, v.dtype))


attention_fwd_p.def_impl(partial(apply_primitive, attention_fwd_p))
attention_bwd_p.def_impl(partial(apply_primitive, attention_bwd_p))
attention_fwd_p.def_abstract_eval(_fwd_abstract_eval)
attention_bwd_p.def_abstract_eval(_bwd_abstract_eval)


def _ffi_attrs(scale, is_causal):
    return dict(scale=np.float32(scale), is_causal=np.int32(bool(is_causal)))


def _require(platform: str, implementation):
    if implementation not in (None, platform):
        raise ValueError(
            f"jax_flashattn: implementation={implementation!r} was requested but this computation "
            f"runs on {platform!r}; place it on a {implementation} device or use "
            "implementation=None")


# ---- CPU -----------------------------------------------------------------------------------------

def _fwd_lowering_cpu(ctx, q, k, v, *, scale, is_causal, implementation):
    _require("cpu", implementation)
    return jax.ffi.ffi_lowering(_ext.FORWARD_TARGET)(ctx, q, k, v, **_ffi_attrs(scale, is_causal))


def _bwd_lowering_cpu(ctx, *args, scale, is_causal, implementation):
    _require("cpu", implementation)
    return jax.ffi.ffi_lowering(_ext.BACKWARD_TARGET)(ctx, *args, **_ffi_attrs(scale, is_causal))


mlir.register_lowering(attention_fwd_p, _fwd_lowering_cpu, platform="cpu")
mlir.register_lowering(attention_bwd_p, _bwd_lowering_cpu, platform="cpu")


# ---- CUDA ----------------------------------------------------------------------------------------

def _check_cuda(q_aval, v_aval):
    if not _ext.has_cuda():
        raise RuntimeError(
            "jax_flashattn was built without its CUDA kernels, so it cannot run on a GPU. "
            "Reinstall on a machine with nvcc (CUDA 12.3+) on the PATH: pip install . "
            "(see README, 'Building for a GPU').")
    if q_aval.dtype not in (jnp.float16, jnp.bfloat16):
        raise TypeError(
            f"jax_flashattn: the CUDA kernels take float16 or bfloat16 inputs, got {q_aval.dtype}; "
            "cast query, key and value (accumulation is float32 inside the kernel)")
    H, Hv = q_aval.shape[-1], v_aval.shape[-1]
    if H != Hv or _ext.cuda_head_dim(q_aval.dtype, H) != H:
        raise ValueError(
            f"jax_flashattn: no CUDA kernel for head dims H={H}, Hv={Hv} "
            f"(built: {_ext.build_info()['cuda_variants']})")


def _fwd_lowering_cuda(ctx, q, k, v, *, scale, is_causal, implementation):
    _require("cuda", implementation)
    _check_cuda(ctx.avals_in[0], ctx.avals_in[2])
    return jax.ffi.ffi_lowering(_ext.FORWARD_TARGET)(ctx, q, k, v, **_ffi_attrs(scale, is_causal))


def _bwd_lowering_cuda(ctx, *args, scale, is_causal, implementation):
    _require("cuda", implementation)
    q_aval, v_aval = ctx.avals_in[0], ctx.avals_in[2]
    _check_cuda(q_aval, v_aval)
    B, T, N, H = q_aval.shape
    # Workspace the kernels need, as extra results XLA allocates: the float32 dQ accumulator
    # and D = rowsum(dO∘O) − dLSE. Only dq, dk, dv are returned to JAX.
    workspace = (ShapedArray((B, T, N, H), jnp.float32), ShapedArray((B, N, T), jnp.float32))
    ctx = replace_avals_out(ctx, tuple(ctx.avals_out) + workspace)
    results = jax.ffi.ffi_lowering(_ext.BACKWARD_TARGET)(ctx, *args,
                                                         **_ffi_attrs(scale, is_causal))
    return results[:3]


mlir.register_lowering(attention_fwd_p, _fwd_lowering_cuda, platform="cuda")
mlir.register_lowering(attention_bwd_p, _bwd_lowering_cuda, platform="cuda")
