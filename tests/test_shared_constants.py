"""Constants that the Python lowering and the CUDA kernels must agree on (workspace shapes, the
segment summaries' chunk, the packed mask's chunks and tiles): the lowering sizes buffers the
kernels index, so a change on one side alone would make the FFI refuse every call (or, for the
chunks, skip the wrong tiles). Read from cuda/include/jfa/params.h and packed_mask.h, on the CPU,
so that CI catches the drift without a GPU."""
from __future__ import annotations

import pathlib
import re

import pytest

from jax_flashattn import _mask_packing, masks, primitives
from jax_flashattn._options import MaskConfig
from jax_flashattn._segment_chunks import CHUNK

HEADERS = pathlib.Path(__file__).resolve().parents[1] / "cuda" / "include" / "jfa"


def _cpp_constant(name, header="params.h"):
    path = HEADERS / header
    if not path.exists():
        pytest.skip("the CUDA sources are not next to the tests (an installed package)")
    match = re.search(rf"inline constexpr int(?:64_t)? {name} = (\d+);", path.read_text())
    assert match, f"{name} not found in {path}"
    return int(match.group(1))


def test_dq_workspace_shapes_follow_params_h():
    align, tall = _cpp_constant("kDqAccumRowAlign"), _cpp_constant("kDqAccumTallBlock")
    assert tall < align
    assert primitives._dq_accum_rows(1) == align
    assert primitives._dq_accum_rows(align + 1) == 2 * align
    # Whole tall blocks where they reach past the aligned rows: ceil(T / tall) · tall > T rounded up.
    for T in range(1, 2000):
        rows = primitives._dq_accum_rows(T)
        assert rows % 16 == 0 and rows >= -(-T // align) * align and rows >= -(-T // tall) * tall, T
    T = next(T for T in range(1, 2000) if -(-T // tall) * tall > -(-T // align) * align)
    assert primitives._dq_accum_rows(T) == -(-T // tall) * tall
    assert primitives._dkv_accum_rows(1) == align and primitives._dkv_accum_rows(align + 1) == 2 * align
    rows = _cpp_constant("kDqSemaphoreRows")
    assert primitives._dq_semaphores(rows) == 1
    assert primitives._dq_semaphores(rows + 1) == 2


def test_dq_lanes_follow_params_h():
    assert primitives._dq_lanes(MaskConfig(deterministic=True)) == _cpp_constant("kDqLanes")
    assert primitives._dq_lanes(MaskConfig(deterministic=False)) == 1


def test_segment_chunk_follows_params_h():
    assert CHUNK == _cpp_constant("kSegmentChunk")


def test_packed_mask_layout_follows_packed_mask_h():
    assert _mask_packing.CHUNK_KEYS == _cpp_constant("kMaskChunkKeys", "packed_mask.h")
    assert _mask_packing.CHUNK_WORDS == _cpp_constant("kMaskChunkWords", "packed_mask.h")
    assert _mask_packing.TILE_ROWS == _cpp_constant("kMaskTileRows", "packed_mask.h")
    kinds = re.search(r"enum class MaskTileKind : uint8_t \{ kEmpty = (\d), kPartial = (\d), kFull = (\d) \}",
                      (HEADERS / "packed_mask.h").read_text())
    assert kinds, "MaskTileKind not found in packed_mask.h"
    assert tuple(map(int, kinds.groups())) == (masks.EMPTY_TILE, masks.PARTIAL_TILE, masks.FULL_TILE)
