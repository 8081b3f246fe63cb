"""The attention primitives: abstract evaluation and lowering to the FFI targets per platform.

Two primitives, both in the public layout (q BTNH, k BSKH, v BSKHv, lse BTN float32):
  attention_fwd_p(q, k, v, *extras)                        -> (o, lse)
  attention_bwd_p(q, k, v, o, lse, do, dlse, *extras)      -> (dq, dk, dv, dbias, dslopes)
extras are the operands of _options.Extras in order (bias, a boolean mask or a PackedMask's bits
and tiles, lengths, segment ids, ALiBi slopes, dropout seeds), each a rank-0 placeholder where
absent; dbias is float32 in the bias's shape, dslopes float32 [B, N] (per batch element, also for
slopes shared by the batch), each a rank-0 placeholder without its operand. Parameters: scale (float), config (_options.MaskConfig),
implementation (None, 'cpu' or 'cuda'). Inputs are validated by the public functions first.

Each primitive has a per-device twin (attention_fwd_kernel_p, attention_bwd_kernel_p) with the
same operands, which this module lowers to the FFI targets; the primitives themselves lower
through sharding.py, which partitions them over a mesh and binds the twins per shard.
"""
from __future__ import annotations

from functools import partial

import numpy as np
import jax
import jax.numpy as jnp

from . import _ext
from ._compat import Primitive, apply_primitive, mlir, varying_axes
from ._mask_packing import lower_packing, pack_mask_kernel_p, packed_shapes
from ._options import Extras
from ._segment_chunks import segment_chunks

attention_fwd_p = Primitive("jfa_attention_fwd")
attention_fwd_p.multiple_results = True
attention_bwd_p = Primitive("jfa_attention_bwd")
attention_bwd_p.multiple_results = True
attention_fwd_kernel_p = Primitive("jfa_attention_fwd_kernel")
attention_fwd_kernel_p.multiple_results = True
attention_bwd_kernel_p = Primitive("jfa_attention_bwd_kernel")
attention_bwd_kernel_p.multiple_results = True


def _result(operands, shape, dtype, spec):
    """A result's abstract value: inside shard_map it varies over the manual axes of the most
    varying operand (a bare ShapedArray would claim it is the same on every device, and
    custom_vjp's type check rejects gradients typed that way); `spec` lays it out on the mesh
    as the operands' entries it names (Explicit axes)."""
    like = max(operands, key=lambda a: len(varying_axes(a)))
    sharding = jax.sharding.NamedSharding(like.sharding.mesh, jax.sharding.PartitionSpec(*spec))
    return like.update(shape=tuple(shape), dtype=dtype, weak_type=False, sharding=sharding)


def _spec(aval, dims):
    """The mesh axes of aval's dimensions `dims` (None for an unsharded one)."""
    spec = tuple(aval.sharding.spec) + (None,) * aval.ndim
    return [spec[d] for d in dims]


def _fwd_abstract_eval(q, k, v, *extras, scale, config, implementation):
    B, T, N, _ = q.shape
    Hv = v.shape[-1]
    operands = (q, k, v) + extras
    return (_result(operands, (B, T, N, Hv), q.dtype, _spec(q, (0, 1, 2)) + [None]),
            _result(operands, (B, T, N), jnp.float32, _spec(q, (0, 1, 2))))


_SLOPES = Extras._fields.index("alibi_slopes")


def _dslopes_shape(q, extras):
    return () if extras[_SLOPES].ndim == 0 else (q.shape[0], q.shape[2])


def _bwd_abstract_eval(q, k, v, o, lse, do, dlse, *extras, scale, config, implementation):
    bias = extras[0]
    operands = (q, k, v, o, lse, do, dlse) + extras
    dslopes_shape = _dslopes_shape(q, extras)
    return (_result(operands, q.shape, q.dtype, _spec(q, range(4))),
            _result(operands, k.shape, k.dtype, _spec(k, range(4))),
            _result(operands, v.shape, v.dtype, _spec(v, range(4))),
            _result(operands, bias.shape, jnp.float32, _spec(bias, range(bias.ndim))),
            _result(operands, dslopes_shape, jnp.float32, _spec(q, (0, 2))[:len(dslopes_shape)]))


for _prim in (attention_fwd_p, attention_bwd_p, attention_fwd_kernel_p, attention_bwd_kernel_p):
    _prim.def_impl(partial(apply_primitive, _prim))
attention_fwd_p.def_abstract_eval(_fwd_abstract_eval)
attention_bwd_p.def_abstract_eval(_bwd_abstract_eval)
attention_fwd_kernel_p.def_abstract_eval(_fwd_abstract_eval)
attention_bwd_kernel_p.def_abstract_eval(_bwd_abstract_eval)


def _ffi_attrs(scale, is_causal):
    return dict(scale=np.float32(scale), is_causal=np.int32(bool(is_causal)))


def _mask_ffi_attrs(scale, config):
    return dict(_ffi_attrs(scale, config.is_causal), bottom_right=np.int32(config.bottom_right),
                window_left=np.int64(config.window_left), window_right=np.int64(config.window_right),
                softcap=np.float32(config.softcap), dropout_rate=np.float32(config.dropout_rate))


def _require(platform: str, implementation):
    if implementation not in (None, platform):
        raise ValueError(
            f"jax_flashattn: implementation={implementation!r} was requested but this computation "
            f"runs on {platform!r}; place it on a {implementation} device or use "
            "implementation=None")


# ---- CPU -----------------------------------------------------------------------------------------

# The handlers of both platforms take every extra operand but the boolean mask (rank-0 placeholders
# included) and config's attributes: their kernels read masks bit-packed, so a boolean mask is
# packed in the lowering, by the pack-mask kernel, into the bits and tiles a PackedMask would bring
# (its tile summaries are what lets the kernels skip empty tiles and test no element of full ones).
# The CUDA handlers then take the segment-id summaries (_segment_chunks.py) and their workspace
# results.

_NUM_EXTRAS = len(Extras._fields)
_HANDLER_EXTRAS = tuple(name for name in Extras._fields if name != "mask")


def _cpu_lowering(target):
    lowered = jax.ffi.ffi_lowering(target)

    def rule(ctx, *args, scale, config, implementation):
        _require("cpu", implementation)
        tensors = len(args) - _NUM_EXTRAS
        extras = dict(zip(Extras._fields, zip(args[tensors:], ctx.avals_in[tensors:])))
        mask, mask_aval = extras["mask"]
        if mask_aval.ndim:
            T, S = ctx.avals_in[0].shape[1], ctx.avals_in[1].shape[1]
            values, avals = lower_packing(ctx, mask, mask_aval, T, S)
            extras["mask_bits"], extras["mask_tiles"] = zip(values, avals)
        operands, avals_in = zip(*(list(zip(args[:tensors], ctx.avals_in[:tensors])) +
                                   [extras[name] for name in _HANDLER_EXTRAS]))
        return lowered(ctx.replace(avals_in=avals_in), *operands, **_mask_ffi_attrs(scale, config))
    return rule


mlir.register_lowering(attention_fwd_kernel_p, _cpu_lowering(_ext.FORWARD_TARGET), platform="cpu")
mlir.register_lowering(attention_bwd_kernel_p, _cpu_lowering(_ext.BACKWARD_TARGET), platform="cpu")


# ---- CUDA ----------------------------------------------------------------------------------------
# The CUDA kernels are built for a few head dims (JFA_HDIMS) with H == Hv. Other head dims up to 256
# are padded with zeros up to the next built one inside the lowering: zero columns of q and k leave
# the logits unchanged, zero columns of v give zero output columns, which are sliced off, and the
# same holds for every gradient. The scale stays the caller's (1/sqrt of the unpadded H).

def _cuda_head_dim(q_aval, v_aval) -> int:
    if not _ext.has_cuda():
        raise RuntimeError(
            "jax_flashattn was built without its CUDA kernels, so it cannot run on a GPU. "
            "Reinstall on a machine with nvcc and a GPU, or force the build with "
            "pip install . -C cmake.define.JFA_CUDA=ON (see README, 'Building for a GPU').")
    if q_aval.dtype not in (jnp.float16, jnp.bfloat16):
        raise TypeError(
            f"jax_flashattn: the CUDA kernels take float16 or bfloat16 inputs, got {q_aval.dtype}; "
            "cast query, key and value (softmax and accumulation are float32 inside the kernel)")
    H, Hv = q_aval.shape[-1], v_aval.shape[-1]
    padded = _ext.cuda_head_dim(max(H, Hv))
    if padded < 0:
        raise ValueError(
            f"jax_flashattn: no CUDA kernel for head dims H={H}, Hv={Hv}; this build has "
            f"{_ext.build_info()['cuda_variants']} (head dims above 256 are not supported)")
    return padded


def _dq_semaphores(T):
    # dQ semaphores per (batch, head) of the deterministic backward: jfa::kDqSemaphoreRows rows each.
    return -(-T // 64)


def _dq_lanes(config):
    # Copies of the dQ accumulator: jfa::kDqLanes with deterministic=True (cuda/sm80/dq_accum.h).
    return 2 if config.deterministic else 1


def _dq_accum_rows(T):
    # Query rows of the dQ accumulator, padded as jfa::AttentionParams::dq_accum_rows() expects:
    # to whole blocks of 128 rows (kDqAccumRowAlign) and of 80 (kDqAccumTallBlock, params.h).
    return max(-(-T // align) * align for align in (128, 80))


def _dkv_accum_rows(S):
    # Key rows of the dK/dV workspace: whole 128-key blocks (kDqAccumRowAlign, dkv_accum_rows(),
    # params.h).
    return -(-S // 128) * 128


def _pad_last(x, size):
    return x if x.shape[-1] == size else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def _cuda_extras(extras, q_len, kv_len):
    """The CUDA handlers' extra operands: a boolean mask packed on the device into the bits and
    tiles a PackedMask would bring, keeping its broadcast B and N axes."""
    extras = dict(zip(Extras._fields, extras))
    if extras["mask"].ndim:
        extras["mask_bits"], extras["mask_tiles"] = pack_mask_kernel_p.bind(extras["mask"], q_len=q_len,
                                                                            kv_len=kv_len)
    return [extras[name] for name in _HANDLER_EXTRAS]


def _segment_operands(extras):
    """The segment-id summaries the CUDA handlers take after the extras (placeholders without)."""
    q_ids, kv_ids = extras[Extras._fields.index("q_segment_ids")], extras[Extras._fields.index("kv_segment_ids")]
    if q_ids.ndim == 0:
        return q_ids, kv_ids
    return segment_chunks(q_ids, kv_ids)


def _cuda_forward(q, k, v, *extras, scale, config):
    Hp = _cuda_head_dim(q.aval, v.aval)
    B, T, N, _ = q.shape
    # The third result is workspace: the tile counter of the Hopper kernel's dynamic scheduler.
    o, lse, _ = jax.ffi.ffi_call(
        _ext.FORWARD_TARGET,
        (jax.ShapeDtypeStruct((B, T, N, Hp), q.dtype), jax.ShapeDtypeStruct((B, T, N), jnp.float32),
         jax.ShapeDtypeStruct((1,), jnp.int32)),
    )(_pad_last(q, Hp), _pad_last(k, Hp), _pad_last(v, Hp), *_cuda_extras(extras, T, k.shape[1]),
      *_segment_operands(extras), **_mask_ffi_attrs(scale, config))
    return o[..., : v.shape[-1]], lse


def _cuda_backward(q, k, v, o, lse, do, dlse, *extras, scale, config):
    Hp = _cuda_head_dim(q.aval, v.aval)
    B, T, N, _ = q.shape
    padded = [_pad_last(x, Hp) for x in (q, k, v, o)]
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in padded[:3]]
    # d(bias): float32 in the bias's shape as on the CPU, or full-shape (_dbias_shape); a rank-0
    # placeholder without a bias.
    shapes.append(jax.ShapeDtypeStruct(_dbias_shape(config, q, k, extras[0]), jnp.float32))
    # d(ALiBi slopes): partial sums per 64 keys (jfa::kDslopeKeys), added up below in a fixed order.
    slopes = extras[_SLOPES].ndim != 0
    shapes.append(jax.ShapeDtypeStruct((B, N, -(-k.shape[1] // 64)) if slopes else (), jnp.float32))
    # Workspace the kernels need, as extra results XLA allocates (nothing is allocated per call):
    # the float32 dQ accumulator, and per query row D = rowsum(dO∘O) − dLSE and LSE·log2 e (the
    # Hopper backward's), in padded rows (jfa::AttentionParams::softmax_d, lse_log2).
    # With deterministic=True, a semaphore per dQ tile and lane orders the adds (zeroed by the
    # kernels), and the accumulator has a copy per lane.
    # Their rows span the Hopper kernel's head dim where it runs Hp on a wider kernel (H 96 on
    # the H 128 one): _ext.cuda_accum_cols.
    lanes, cols = _dq_lanes(config), _ext.cuda_accum_cols(Hp)
    shapes += [jax.ShapeDtypeStruct((lanes, B, N, _dq_accum_rows(T), cols), jnp.float32),
               jax.ShapeDtypeStruct((2, B, N, _dq_accum_rows(T)), jnp.float32),
               jax.ShapeDtypeStruct((lanes, B, N, _dq_semaphores(T)), jnp.int32)]
    # Causal GQA without deterministic=True: float32 dK and dV partial sums of the Hopper backward,
    # which runs a group's query heads in CTAs of their own there (a rank-0 placeholder otherwise).
    K, S = k.shape[2], k.shape[1]
    gqa = N > K and config.is_causal and not config.deterministic
    shapes.append(jax.ShapeDtypeStruct((2, B, K, _dkv_accum_rows(S), cols) if gqa else (), jnp.float32))
    # With a mask, its bits by key (the Hopper backward's, cuda/sm90/bwd_mask_columns.h): per
    # unbroadcast (batch, head) of the bits, S rounded up to 128 rows of T's words; else rank 0.
    handler_extras = _cuda_extras(extras, T, S)
    bits = handler_extras[_HANDLER_EXTRAS.index("mask_bits")]
    key_bits = packed_shapes(bits.shape[:2], _dkv_accum_rows(S), T)[0] if bits.ndim else ()
    shapes.append(jax.ShapeDtypeStruct(key_bits, jnp.uint32))
    dq, dk, dv, dbias, dslopes, *_ = jax.ffi.ffi_call(_ext.BACKWARD_TARGET, shapes)(
        *padded, lse, _pad_last(do, Hp), dlse, *handler_extras,
        *_segment_operands(extras), **_mask_ffi_attrs(scale, config),
        deterministic=np.int32(config.deterministic))
    if dbias.shape != extras[0].shape:  # full-shape d(bias): sum the bias's broadcast axes here
        broadcast = tuple(a for a in range(4) if extras[0].shape[a] == 1 and dbias.shape[a] != 1)
        dbias = jnp.sum(dbias, axis=broadcast, keepdims=True)
    if slopes:
        dslopes = jnp.sum(dslopes, axis=-1)
    return dq[..., : q.shape[-1]], dk[..., : k.shape[-1]], dv[..., : v.shape[-1]], dbias, dslopes


def _dbias_shape(config, q, k, bias):
    """The kernel's d(bias) result: the bias's own shape, its broadcast axes summed with float
    atomics; with deterministic=True, the full [B, N, T, S] instead, where every element is added
    once onto zero (exact), and XLA then sums the broadcast axes (a reduction with a fixed order).
    That costs a float32 [B, N, T, S] buffer in the backward, as a full-shape bias would."""
    if config.deterministic and bias.ndim == 4:
        B, T, N = q.shape[:3]
        return (B, N, T, k.shape[1])
    return bias.shape


def _cuda_lowering(fn):
    lowered = mlir.lower_fun(fn, multiple_results=True)

    def rule(ctx, *args, scale, config, implementation):
        _require("cuda", implementation)
        return lowered(ctx, *args, scale=scale, config=config)
    return rule


mlir.register_lowering(attention_fwd_kernel_p, _cuda_lowering(_cuda_forward), platform="cuda")
mlir.register_lowering(attention_bwd_kernel_p, _cuda_lowering(_cuda_backward), platform="cuda")
