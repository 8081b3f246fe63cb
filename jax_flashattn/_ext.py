"""Loads the compiled extension and registers its XLA FFI targets for each platform it has.

Import has no side effects beyond the registration; `build_info()` says what was built.
"""
from __future__ import annotations

import functools

import jax

from . import _jax_flashattn as _lib

FORWARD_TARGET = "jfa_attention_fwd"
BACKWARD_TARGET = "jfa_attention_bwd"
PACK_MASK_TARGET = "jfa_pack_mask"
SPARSE_FORWARD_TARGET = "jfa_sparse_fwd"
SPARSE_BACKWARD_TARGET = "jfa_sparse_bwd"
ATTN_DIST_TARGET = "jfa_attn_dist"


@functools.cache
def register() -> None:
    for name, capsule in _lib.cpu_targets().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    for name, capsule in _lib.cuda_targets().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")


def has_cuda() -> bool:
    """True when the extension was built with the CUDA kernels."""
    return bool(_lib.cuda_targets())


def cuda_head_dim(head_dim: int) -> int:
    """Smallest head dim with a built CUDA kernel that is >= head_dim (-1 if none): every built
    head dim is built for every built dtype."""
    return int(_lib.cuda_head_dim(int(head_dim)))


def cuda_accum_cols(head_dim: int) -> int:
    """Columns of a row of the CUDA backward's float32 workspace for a built head dim: wider than
    head_dim where the Hopper kernels run it on their next larger kernel."""
    return int(_lib.cuda_accum_cols(int(head_dim)))


def build_info() -> dict:
    return {
        "cpu": True,
        "cuda": has_cuda(),
        "cuda_variants": _lib.cuda_variants() or None,
    }


register()
