"""The top-k sparse attention primitives: abstract evaluation, lowering to the FFI targets per
platform, and vmap rules. Operands in the public layout (q BTNH, k BSKH, v BSKHv, indices int32
BTK·topk, lse BTN float32):
  sparse_fwd_p(q, k, v, indices)                           -> (o, lse)
  sparse_bwd_p(q, k, v, indices, o, lse, do, dlse)         -> (dq, dk, dv)
  attn_dist_p(q, k, indices, lse)                          -> dist float32 [B, N // head_group, T, topk]
v is a rank-0 placeholder when V is k[..., :value_head_dim] (then dv is a rank-0 placeholder and dk
holds both gradients). Parameter `config` (SparseConfig) for the first two, scale, is_causal,
bottom_right and head_group for attn_dist. Inputs are validated by jax_flashattn.sparse first.

Each primitive has a per-device twin (sparse_fwd_kernel_p, sparse_bwd_kernel_p, attn_dist_kernel_p)
with the same operands and parameters, which this module lowers to the FFI targets; the primitives
themselves lower through _sparse_sharding.py, which partitions them over a mesh and binds the twins
per shard. vmap folds every mapped axis into B (placeholders stay as they are).
"""
from __future__ import annotations

import dataclasses
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from . import _ext
from ._compat import Primitive, apply_primitive, batching, mlir, not_mapped
from ._partitioning import dim_axes, shard_count, spec_entry
from ._sparse_xla_backward import xla_backward
from .primitives import _result, _spec


@dataclasses.dataclass(frozen=True)
class SparseConfig:
    scale: float
    is_causal: bool
    bottom_right: bool
    value_head_dim: int  # Hv: value's last dim, or the columns of key that serve as V
    deterministic: bool


sparse_fwd_p = Primitive("jfa_sparse_fwd")
sparse_fwd_p.multiple_results = True
sparse_bwd_p = Primitive("jfa_sparse_bwd")
sparse_bwd_p.multiple_results = True
attn_dist_p = Primitive("jfa_attn_dist")
sparse_fwd_kernel_p = Primitive("jfa_sparse_fwd_kernel")
sparse_fwd_kernel_p.multiple_results = True
sparse_bwd_kernel_p = Primitive("jfa_sparse_bwd_kernel")
sparse_bwd_kernel_p.multiple_results = True
attn_dist_kernel_p = Primitive("jfa_attn_dist_kernel")

for _prim in (sparse_fwd_p, sparse_bwd_p, attn_dist_p, sparse_fwd_kernel_p, sparse_bwd_kernel_p,
              attn_dist_kernel_p):
    _prim.def_impl(partial(apply_primitive, _prim))


def _fwd_abstract_eval(q, k, v, indices, *, config):
    B, T, N, _ = q.shape
    operands = (q, k, indices)
    return (_result(operands, (B, T, N, config.value_head_dim), q.dtype, _spec(q, (0, 1, 2)) + [None]),
            _result(operands, (B, T, N), jnp.float32, _spec(q, (0, 1, 2))))


def _bwd_abstract_eval(q, k, v, indices, o, lse, do, dlse, *, config):
    operands = (q, k, indices, o, do)
    dv = (_result(operands, v.shape, v.dtype, _spec(v, range(4))) if v.ndim else
          _result(operands, (), q.dtype, []))
    return (_result(operands, q.shape, q.dtype, _spec(q, range(4))),
            _result(operands, k.shape, k.dtype, _spec(k, range(4))), dv)


def whole_groups_per_shard(N, K, head_group, shards) -> bool:
    """Whether query heads split `shards` ways leave each device whole GQA groups (query head n uses
    K/V head n // (N / K)), the K/V heads split alike or, with one K/V head (MQA), replicated, and
    whole groups of head_group query heads (attn_dist's sums)."""
    return (K % shards == 0 or K == 1) and N % shards == 0 and (N // head_group) % shards == 0


def _dist_abstract_eval(q, k, indices, lse, *, scale, is_causal, bottom_right, head_group):
    B, T, N, _ = q.shape
    shape = (B, N // head_group, T, indices.shape[-1])
    # The head groups follow the query heads where their split keeps whole groups (Explicit axes).
    heads = dim_axes(q.sharding, 4, 2)
    kept = whole_groups_per_shard(N, k.shape[2], head_group, shard_count(q.sharding.mesh, heads))
    return _result((q, k, indices, lse), shape, jnp.float32,
                   _spec(q, (0,)) + [spec_entry(heads) if kept else None, None, None])


for _prim, _kernel, _abstract_eval in ((sparse_fwd_p, sparse_fwd_kernel_p, _fwd_abstract_eval),
                                      (sparse_bwd_p, sparse_bwd_kernel_p, _bwd_abstract_eval),
                                      (attn_dist_p, attn_dist_kernel_p, _dist_abstract_eval)):
    _prim.def_abstract_eval(_abstract_eval)
    _kernel.def_abstract_eval(_abstract_eval)


def _attrs(scale, is_causal, bottom_right):
    return dict(scale=np.float32(scale), is_causal=np.int32(bool(is_causal)),
                bottom_right=np.int32(bool(bottom_right)))


def _config_attrs(config):
    return dict(_attrs(config.scale, config.is_causal, config.bottom_right),
                value_head_dim=np.int64(config.value_head_dim))


# ---- CPU (the CUDA handlers of the forward and attn_dist take the same operands) -------------------

_ffi_fwd = jax.ffi.ffi_lowering(_ext.SPARSE_FORWARD_TARGET)
_ffi_bwd = jax.ffi.ffi_lowering(_ext.SPARSE_BACKWARD_TARGET)
_ffi_dist = jax.ffi.ffi_lowering(_ext.ATTN_DIST_TARGET)

mlir.register_lowering(
    sparse_fwd_kernel_p, lambda ctx, *args, config: _ffi_fwd(ctx, *args, **_config_attrs(config)),
    platform="cpu")
mlir.register_lowering(
    sparse_bwd_kernel_p, lambda ctx, *args, config: _ffi_bwd(ctx, *args, **_config_attrs(config),
                                                             deterministic=np.int32(config.deterministic)),
    platform="cpu")
mlir.register_lowering(
    attn_dist_kernel_p, lambda ctx, *args, scale, is_causal, bottom_right, head_group: _ffi_dist(
        ctx, *args, **_attrs(scale, is_causal, bottom_right), head_group=np.int64(head_group)),
    platform="cpu")


# ---- CUDA ----------------------------------------------------------------------------------------

_MAX_CUDA_HEAD_DIM = 2048  # jfa::sparse_gpu::kMaxHeadDim (cuda/sparse/sparse_gpu.h)


def _require_cuda(q_aval, value_head_dim):
    if q_aval.shape[-1] > _MAX_CUDA_HEAD_DIM or value_head_dim > _MAX_CUDA_HEAD_DIM:
        raise ValueError(f"sparse_attention: the CUDA kernels take head dims up to {_MAX_CUDA_HEAD_DIM}, "
                         f"got query {q_aval.shape} and Hv={value_head_dim}")
    if not _ext.has_cuda():
        raise RuntimeError(
            "jax_flashattn was built without its CUDA kernels, so sparse_attention cannot run on a GPU. "
            "Reinstall on a machine with nvcc and a GPU, or force the build with "
            "pip install . -C cmake.define.JFA_CUDA=ON (see README, 'Building for a GPU').")


def _cuda_forward(ctx, *args, config):
    _require_cuda(ctx.avals_in[0], config.value_head_dim)
    return _ffi_fwd(ctx, *args, **_config_attrs(config))


_BACKWARD_CHOICES = ("auto", "kernel", "xla")


def _backward_choice():
    """JFA_SPARSE_BACKWARD, read when a call is traced: auto (the default), kernel or xla."""
    choice = os.environ.get("JFA_SPARSE_BACKWARD", "auto")
    if choice not in _BACKWARD_CHOICES:
        raise ValueError(f"JFA_SPARSE_BACKWARD must be one of {', '.join(_BACKWARD_CHOICES)}, got {choice!r}")
    return choice


def _tensor_core_backward_takes(q, k, v, indices, config):
    """Whether the CUDA tensor-core backward takes the call on this device (never deterministic=True)."""
    return not config.deterministic and _ext.cuda_sparse_backward_tensor_cores(
        q.dtype, q.shape[2], k.shape[2], q.shape[3], config.value_head_dim, indices.shape[3], v.ndim == 0)


def _xla_backward_wanted(q, k, v, indices, config):
    """Which backward runs a CUDA call. deterministic=True: the CUDA kernels' ordered scatter (XLA's
    scatter-add has no fixed order). Otherwise the tensor-core kernels (two passes, float32 atomics)
    where they take the call, else XLA's tensor-core GEMMs (_sparse_xla_backward.py);
    JFA_SPARSE_BACKWARD=kernel or xla forces one of the two (kernel: the CUDA-core kernels where
    the tensor-core ones do not take it)."""
    if config.deterministic:
        return False
    choice = _backward_choice()
    if choice != "auto":
        return choice == "xla"
    return not _tensor_core_backward_takes(q, k, v, indices, config)


# Most bytes of P and scale·dS the tensor-core backward keeps at once: it takes (query position,
# key head) items in chunks of this size (1 MiB per item at DeepSeek V3.2's N 128, topk 2048).
_SPARSE_WEIGHTS_BYTES = 1 << 30


def _weights_workspace(q, k, v, indices, config):
    """The tensor-core backward's P and scale·dS, [items, 2, N / K, topk in 64-slot blocks] in q's dtype
    (jfa::sparse_gpu::SparseBackwardWorkspace::weights), for as many (query position, key head)
    items as _SPARSE_WEIGHTS_BYTES holds; no items where those kernels do not take the call."""
    B, T, K, topk = indices.shape
    group = q.shape[2] // K
    slots = -(-topk // 64) * 64
    per_item = 2 * group * slots * q.dtype.itemsize
    takes = _tensor_core_backward_takes(q, k, v, indices, config)
    items = min(B * T * K, max(1, _SPARSE_WEIGHTS_BYTES // per_item)) if takes else 0
    return jax.ShapeDtypeStruct((items, 2, group, slots), q.dtype)


def _cuda_backward_fn(q, k, v, indices, o, lse, do, dlse, *, config):
    if _xla_backward_wanted(q, k, v, indices, config):
        dq, dk, dv = xla_backward(q, k, v if v.ndim else None, indices, o, lse, do, dlse, config)
        return dq, dk, (jnp.zeros((), q.dtype) if dv is None else dv)
    B, S, K, H = k.shape
    Hv = config.value_head_dim
    shapes = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
              jax.ShapeDtypeStruct(v.shape if v.ndim else (), q.dtype),
              # Workspace: float32 accumulators of the scattered dK and dV (dV's folded into dK's
              # when V is part of K), zeroed by the kernels and rounded into dk and dv at the end;
              # D = rowsum(dO∘O) − dLSE per query row; the tensor-core kernels' P and scale·dS.
              jax.ShapeDtypeStruct((B, S, K, H), jnp.float32),
              jax.ShapeDtypeStruct((B, S, K, Hv) if v.ndim else (), jnp.float32),
              jax.ShapeDtypeStruct(lse.shape, jnp.float32),
              _weights_workspace(q, k, v, indices, config)]
    dq, dk, dv, _, _, _, _ = jax.ffi.ffi_call(_ext.SPARSE_BACKWARD_TARGET, shapes)(
        q, k, v, indices, o, lse, do, dlse, **_config_attrs(config),
        deterministic=np.int32(config.deterministic))
    return dq, dk, dv


_cuda_backward_lowered = mlir.lower_fun(_cuda_backward_fn, multiple_results=True)


def _cuda_backward(ctx, *args, config):
    _require_cuda(ctx.avals_in[0], config.value_head_dim)
    return _cuda_backward_lowered(ctx, *args, config=config)


def _cuda_dist(ctx, *args, scale, is_causal, bottom_right, head_group):
    _require_cuda(ctx.avals_in[0], 1)
    return _ffi_dist(ctx, *args, **_attrs(scale, is_causal, bottom_right), head_group=np.int64(head_group))


mlir.register_lowering(sparse_fwd_kernel_p, _cuda_forward, platform="cuda")
mlir.register_lowering(sparse_bwd_kernel_p, _cuda_backward, platform="cuda")
mlir.register_lowering(attn_dist_kernel_p, _cuda_dist, platform="cuda")


# ---- vmap ----------------------------------------------------------------------------------------

def _fold(a, d, size):
    """a with its mapped axis d (broadcast when unmapped) merged into its leading batch axis."""
    if a.ndim == 0:  # placeholder of an absent operand
        return a
    a = jnp.broadcast_to(a, (size,) + a.shape) if d is not_mapped else jnp.moveaxis(a, d, 0)
    return a.reshape((size * a.shape[1],) + a.shape[2:])


def _unfold(size, o):
    return o if o.ndim == 0 else o.reshape((size, o.shape[0] // size) + o.shape[1:])


def _batch_rule(prim):
    def rule(args, dims, **params):
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not not_mapped)
        outs = prim.bind(*[_fold(a, d, size) for a, d in zip(args, dims)], **params)
        if not prim.multiple_results:
            return _unfold(size, outs), 0
        return [_unfold(size, o) for o in outs], [not_mapped if o.ndim == 0 else 0 for o in outs]
    return rule


for _prim in (sparse_fwd_p, sparse_bwd_p, attn_dist_p):
    batching.primitive_batchers[_prim] = _batch_rule(_prim)
