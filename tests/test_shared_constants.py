"""Constants that the Python lowering and the CUDA kernels must agree on (workspace shapes, the
segment summaries' chunk): the lowering sizes buffers the kernels index, so a change on one side
alone would make the FFI refuse every call (or, for the chunk, skip the wrong tiles). Read from
cuda/include/jfa/params.h, on the CPU, so that CI catches the drift without a GPU."""
from __future__ import annotations

import pathlib
import re

import pytest

from jax_flashattn import primitives
from jax_flashattn._options import MaskConfig
from jax_flashattn._segment_chunks import CHUNK

PARAMS_H = pathlib.Path(__file__).resolve().parents[1] / "cuda" / "include" / "jfa" / "params.h"


def _cpp_constant(name):
    if not PARAMS_H.exists():
        pytest.skip("the CUDA sources are not next to the tests (an installed package)")
    match = re.search(rf"inline constexpr int(?:64_t)? {name} = (\d+);", PARAMS_H.read_text())
    assert match, f"{name} not found in {PARAMS_H}"
    return int(match.group(1))


def test_dq_workspace_shapes_follow_params_h():
    align = _cpp_constant("kDqAccumRowAlign")
    assert primitives._dq_accum_rows(1) == align
    assert primitives._dq_accum_rows(align + 1) == 2 * align
    rows = _cpp_constant("kDqSemaphoreRows")
    assert primitives._dq_semaphores(rows) == 1
    assert primitives._dq_semaphores(rows + 1) == 2


def test_dq_lanes_follow_params_h():
    assert primitives._dq_lanes(MaskConfig(deterministic=True)) == _cpp_constant("kDqLanes")
    assert primitives._dq_lanes(MaskConfig(deterministic=False)) == 1


def test_segment_chunk_follows_params_h():
    assert CHUNK == _cpp_constant("kSegmentChunk")
