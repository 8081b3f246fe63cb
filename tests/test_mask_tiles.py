"""Host checks of the mask policies' C++ (cuda/include/jfa/mask.h) that need a C++ compiler and no
GPU: the kernels' tile classifications must agree with each other on every tile."""
from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


@pytest.mark.skipif(CXX is None, reason="no C++ compiler on the PATH")
def test_full_query_rows_agrees_with_position_tile_kind(tmp_path):
    exe = tmp_path / "full_query_rows_check"
    subprocess.run([CXX, "-std=c++17", "-O1", f"-I{ROOT / 'cuda' / 'include'}",
                    str(ROOT / "tests" / "cpp" / "full_query_rows_check.cc"), "-o", str(exe)],
                   check=True, capture_output=True, text=True, timeout=300)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "compared" in run.stdout
