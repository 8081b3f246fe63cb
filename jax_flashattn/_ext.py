"""Loads the compiled extension and registers its XLA FFI targets for each platform it has.

Import has no side effects beyond the registration; `build_info()` says what was built.
"""
from __future__ import annotations

import functools
import re

import jax
from jax import export

from . import _jax_flashattn as _lib
from ._version import __version__

# The targets are registered under the handlers' names with the release appended: a program
# exported with jax.export names the targets it calls, so under another release it fails to find
# them instead of running them with other operands or meanings.
_RELEASE_SUFFIX = "_v" + re.sub(r"\W", "_", __version__)


def _target(handler: str) -> str:
    return handler + _RELEASE_SUFFIX


FORWARD_TARGET = _target("jfa_attention_fwd")
BACKWARD_TARGET = _target("jfa_attention_bwd")
PACK_MASK_TARGET = _target("jfa_pack_mask")
SPARSE_FORWARD_TARGET = _target("jfa_sparse_fwd")
SPARSE_BACKWARD_TARGET = _target("jfa_sparse_bwd")
ATTN_DIST_TARGET = _target("jfa_attn_dist")


@functools.cache
def register() -> None:
    for handler, capsule in _lib.cpu_targets().items():
        jax.ffi.register_ffi_target(_target(handler), capsule, platform="cpu")
    for handler, capsule in _lib.cuda_targets().items():
        jax.ffi.register_ffi_target(_target(handler), capsule, platform="CUDA")


def export_disabled_checks() -> list:
    """What `jax.export.export(..., disabled_checks=...)` needs for a program that calls
    jax_flashattn: JAX refuses to serialize custom calls it does not know to be stable, and this
    library's are stable only within one release (their names carry it). The exported program
    then runs where the same release of jax_flashattn is installed and imported."""
    return [export.DisabledSafetyCheck.custom_call(_target(handler)) for handler in _lib.cpu_targets()]


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


def cuda_paged_page_rows(head_dim: int) -> int:
    """Page sizes (multiples of the result) whose paged caches the Hopper forward reads in place
    at head_dim, or 0 where no Hopper kernel runs it (or the build has none)."""
    return int(_lib.cuda_paged_page_rows(int(head_dim)))


def cuda_sparse_backward_tensor_cores(dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                                      value_head_dim: int, topk: int, shares_values: bool) -> bool:
    """Whether the sparse backward's tensor-core kernels take a deterministic=False call on the
    current CUDA device: half-precision dtype, head dims on their grid, tiles within the device's
    shared memory. False without CUDA kernels or a device."""
    return bool(_lib.cuda_sparse_backward_tensor_cores(jax.numpy.dtype(dtype).name, int(num_heads),
                                                       int(num_kv_heads), int(head_dim), int(value_head_dim),
                                                       int(topk), bool(shares_values)))


def build_info() -> dict:
    return {
        "cpu": True,
        "cuda": has_cuda(),
        "cuda_variants": _lib.cuda_variants() or None,
    }


register()
