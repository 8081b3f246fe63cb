"""The pack-mask primitive: a boolean mask [Bm, Nm, T|1, S|1] (axes of size 1 broadcast) → the two
arrays of a PackedMask (jax_flashattn.masks; layout: cuda/include/jfa/packed_mask.h):
  bits  uint32 [Bm, Nm, T, ceil(S / 128) · 4]
  tiles uint8  [Bm, Nm, ceil(T / 64), ceil(S / 128)]
a kernel of its own on each platform (C++ on the CPU, CUDA on the GPU); parameters q_len (T) and
kv_len (S), static.

pack_mask_p lowers through sharding.py, which partitions it along Bm and Nm and binds the per-device
twin pack_mask_kernel_p, lowered here to the FFI targets; batching.py folds vmapped axes into Bm.
`lower_packing` lets another lowering (the CPU attention's, for a boolean mask) emit the packing
inline.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from . import _ext
from ._compat import Primitive, apply_primitive, mlir

CHUNK_KEYS = 128   # jfa::kMaskChunkKeys: keys per chunk of words
CHUNK_WORDS = 4    # jfa::kMaskChunkWords: words per chunk, one per quad lane
TILE_ROWS = 64     # jfa::kMaskTileRows: query rows per tile summary

pack_mask_p = Primitive("jfa_pack_mask")
pack_mask_p.multiple_results = True
pack_mask_kernel_p = Primitive("jfa_pack_mask_kernel")
pack_mask_kernel_p.multiple_results = True


def packed_shapes(lead, q_len, kv_len):
    """(bits shape, tiles shape) of a PackedMask with leading axes `lead` ([Bm, Nm])."""
    chunks = -(-kv_len // CHUNK_KEYS)
    return tuple(lead) + (q_len, chunks * CHUNK_WORDS), tuple(lead) + (-(-q_len // TILE_ROWS), chunks)


def _abstract_eval(mask, *, q_len, kv_len):
    # The results are laid out on the mesh like the mask's Bm and Nm (Explicit axes); T and S whole.
    spec = (tuple(mask.sharding.spec) + (None,) * 4)[:2] + (None, None)
    sharding = NamedSharding(mask.sharding.mesh, P(*spec))
    bits, tiles = packed_shapes(mask.shape[:2], q_len, kv_len)
    return [mask.update(shape=shape, dtype=dtype, weak_type=False, sharding=sharding)
            for shape, dtype in ((bits, jnp.uint32), (tiles, jnp.uint8))]


for _prim in (pack_mask_p, pack_mask_kernel_p):
    _prim.def_impl(partial(apply_primitive, _prim))
    _prim.def_abstract_eval(_abstract_eval)

_ffi_rule = jax.ffi.ffi_lowering(_ext.PACK_MASK_TARGET)


def _lowering(ctx, mask, *, q_len, kv_len):
    return _ffi_rule(ctx, mask, q_len=np.int64(q_len), kv_len=np.int64(kv_len))


def _cuda_lowering(ctx, mask, *, q_len, kv_len):
    if not _ext.has_cuda():
        raise RuntimeError(
            "jax_flashattn was built without its CUDA kernels, so it cannot pack a mask on a GPU. "
            "Reinstall on a machine with nvcc and a GPU (see README, 'Building for a GPU').")
    return _lowering(ctx, mask, q_len=q_len, kv_len=kv_len)


mlir.register_lowering(pack_mask_kernel_p, _lowering, platform="cpu")
mlir.register_lowering(pack_mask_kernel_p, _cuda_lowering, platform="cuda")


def lower_packing(ctx, mask, mask_aval, q_len, kv_len):
    """Emits the CPU packing of `mask` (an MLIR value of type mask_aval) inside another lowering
    rule; returns [bits, tiles] and their avals."""
    avals = _abstract_eval(mask_aval, q_len=q_len, kv_len=kv_len)
    values = _lowering(ctx.replace(avals_in=[mask_aval], avals_out=avals), mask, q_len=q_len, kv_len=kv_len)
    return values, avals
