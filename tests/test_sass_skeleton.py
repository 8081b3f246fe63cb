"""benchmarks/sass_skeleton.py on a small listing in cuobjdump's format: its landmarks, the wait
pair's counts, the loop body and the spills, and the kernel pick's refusal of an ambiguous name."""
from __future__ import annotations

import importlib.util
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "sass_skeleton.py"

BODY = [
    "MOV R1, c[0x0][0x28]",
    "WARPGROUP.ARRIVE",
    "HGMMA.64x80x16.F32.BF16 R192, gdesc[UR4], RZ, !UPT",
    "UIADD3 UR4, UR4, 0x2, URZ",
    "HGMMA.64x80x16.F32.BF16 R192, gdesc[UR4], R192, gsb0",
    "WARPGROUP.ARRIVE",
    "HGMMA.64x80x16.F32.BF16 R152, gdesc[UR4], RZ, !UPT, gsb0",
    "WARPGROUP.DEPBAR.LE gsb0, 0x1",
    "MUFU.EX2 R3, R3",
    "FFMA.FTZ R4, R192, UR10, -R10",
    "WARPGROUP.DEPBAR.LE gsb0, 0x0",
    "MUFU.EX2 R5, R5",
    "MUFU.EX2 R6, R6",
    "FMUL.FTZ R7, R5, R6",
    "WARPGROUP.ARRIVE",
    "HGMMA.64x128x16.F32.BF16 R24, R212, gdesc[UR16].tnspB, R24, gsb0",
    "STL [R1], R2",
    "@!P0 BRA 0x10",
    "EXIT",
]


def listing(names):
    lines = ["\tcode for sm_90a"]
    for name in names:
        lines.append(f"\t\tFunction : {name}")
        lines.append("\t.headerflags\t@\"EF_CUDA_SM90\"")
        for k, text in enumerate(BODY):
            lines.append(f"        /*{16 * k:04x}*/                   {text} ;        /* 0x000000000000 */")
    return "\n".join(lines) + "\n"


@pytest.fixture
def tool(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # its sibling ncu_source_summary, as when run as a script
    spec = importlib.util.spec_from_file_location("sass_skeleton", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_skeleton_and_summary(tool):
    found = tool.kernels(listing(["_Z6kernelv"]).splitlines())
    name, code = tool.pick(found, "kernel")
    assert name == "_Z6kernelv" and len(code) == len(BODY)
    marks = [(index, gap, label) for index, gap, label, _ in tool.skeleton(code, min_gap=40)]
    assert marks == [
        (1, 1, "WARPGROUP.ARRIVE"),
        (2, 0, "HGMMA.64x80x16.F32.BF16 x2"),
        (5, 0, "WARPGROUP.ARRIVE"),
        (6, 0, "HGMMA.64x80x16.F32.BF16 x1"),
        (7, 0, "WARPGROUP.DEPBAR.LE gsb0, 0x1"),
        (10, 2, "WARPGROUP.DEPBAR.LE gsb0, 0x0"),
        (14, 3, "WARPGROUP.ARRIVE"),
        (15, 0, "HGMMA.64x128x16.F32.BF16 x1"),
    ]
    assert tool.summary(code) == [
        "first wait pair at 7/10: 3 instructions between the waits (1 MUFU), "
        "4 from the second wait to the next WARPGROUP.ARRIVE (2 MUFU)",
        "loop body 1..17: 16 instructions",
        "local memory: 1 STL, 0 LDL; 19 instructions in all",
    ]


def test_ambiguous_kernel_name_lists_candidates(tool):
    found = tool.kernels(listing(["_Z7kernelAv", "_Z7kernelBv"]).splitlines())
    with pytest.raises(SystemExit, match="2 kernels match 'kernel'"):
        tool.pick(found, "kernel")
    assert tool.pick(found, "kernelB")[0] == "_Z7kernelBv"
