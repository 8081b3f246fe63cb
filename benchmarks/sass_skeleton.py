"""A Hopper kernel's SASS as a skeleton: its wgmma groups, waits and barriers, and what lies
between them. Static (no GPU): the questions it answers are where a step's element work sits
against its GEMMs and how long each stretch is.

    cuobjdump -sass BINARY > k.sass          # or a cubin: cuobjdump -xelf NAME LIB, then -sass
    python benchmarks/sass_skeleton.py k.sass KERNEL_SUBSTRING [--min-gap 40] [--compare other.sass]

Each line is one landmark (a run of HGMMA is one line: the group and its count) with the number of
instructions since the previous landmark and, for stretches of at least --min-gap instructions, their
most frequent opcodes. The summary gives, for the first S/dP-style pair of waits
(`WARPGROUP.DEPBAR.LE gsb0, 0x1` then `0x0`), the instructions and MUFU between them and from the
second wait to the next `WARPGROUP.ARRIVE`, the loop bodies (backward branches that span a GEMM),
and the local-memory spills. A compiled peer kernel can be read the same way: FlashAttention-3's
from the flash_attn3_jax wheel's library (`cuobjdump -lelf` lists its cubins).
"""
from __future__ import annotations

import argparse
import collections
import re
import sys

from ncu_source_summary import opcode  # an instruction's opcode without its predicate and modifiers

INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
LANDMARK = re.compile(r"HGMMA|WARPGROUP\.(DEPBAR|ARRIVE)|BAR\.(SYNC|ARV)|SYNCS\.(PHASECHK|ARRIVE)|UBLKRED")
BRANCH = re.compile(r"\bBRA(?:\.\w+)* (?:!?U?P\d, )?(0x[0-9a-f]+)")


def kernels(lines):
    """{mangled name: [(address, instruction text)]} from cuobjdump -sass output."""
    found, name = {}, None
    for line in lines:
        if "Function :" in line:
            name = line.split("Function :", 1)[1].strip()
            found[name] = []
        elif name is not None:
            m = INSTRUCTION.match(line)
            if m:
                found[name].append((int(m.group(1), 16), m.group(2)))
    return found


def pick(found, substring):
    names = [n for n in found if substring in n]
    if len(names) != 1:
        listing = "\n  ".join(names or found)
        raise SystemExit(f"{len(names)} kernels match {substring!r}; the candidates:\n  {listing}")
    return names[0], [text for _, text in found[names[0]]]


def skeleton(code, min_gap=40):
    """Lines of (index, gap, label, top opcodes of the gap): a run of HGMMA (no other landmark and at
    most 12 instructions between two) is one line."""
    out, previous, i = [], 0, 0
    while i < len(code):
        text = code[i]
        if not LANDMARK.search(text):
            i += 1
            continue
        label, end = re.sub(r"^@!?U?P\w+\s+", "", text)[:60], i + 1
        if "HGMMA" in text:
            count, last, j = 1, i, i + 1
            while j < len(code) and j - last <= 12 and not (LANDMARK.search(code[j]) and "HGMMA" not in code[j]):
                if "HGMMA" in code[j]:
                    count, last = count + 1, j
                j += 1
            label, end = f"{label.split()[0]} x{count}", last + 1
        gap = code[previous:i]
        top = collections.Counter(opcode(t) for t in gap).most_common(6) if len(gap) >= min_gap else []
        out.append((i, len(gap), label, top))
        previous = i = end
    return out


def summary(code):
    count = lambda a, b, pattern: sum(1 for t in code[a:b] if re.search(pattern, t))
    lines = []
    waits1 = [i for i, t in enumerate(code) if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in t]
    for w1 in waits1:
        w0 = next((i for i in range(w1 + 1, len(code)) if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in code[i]), None)
        if w0 is None or count(w1, w0, "HGMMA|WARPGROUP.ARRIVE"):
            continue
        arrive = next((i for i in range(w0, len(code)) if "WARPGROUP.ARRIVE" in code[i]), len(code))
        lines.append(f"first wait pair at {w1}/{w0}: {w0 - w1} instructions between the waits "
                     f"({count(w1, w0, 'MUFU')} MUFU), {arrive - w0} from the second wait to the next "
                     f"WARPGROUP.ARRIVE ({count(w0, arrive, 'MUFU')} MUFU)")
        break
    gemms = [i for i, t in enumerate(code) if "HGMMA" in t]
    for i, t in enumerate(code):
        m = BRANCH.search(t)
        if m and gemms:
            target = int(m.group(1), 16) // 16
            if target < i and target <= gemms[0] <= i:
                lines.append(f"loop body {target}..{i}: {i - target} instructions")
    stores, loads = count(0, len(code), r"\bSTL\b"), count(0, len(code), r"\bLDL\b")
    lines.append(f"local memory: {stores} STL, {loads} LDL; {len(code)} instructions in all")
    return lines


def report(path, substring, min_gap):
    name, code = pick(kernels(open(path)), substring)
    print(f"== {path}: {name[:160]}")
    for index, gap, label, top in skeleton(code, min_gap):
        tail = "  " + " ".join(f"{op}:{n}" for op, n in top) if top else ""
        print(f"{index:6d} +{gap:5d}  {label}{tail}")
    for line in summary(code):
        print(line)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sass")
    ap.add_argument("kernel", help="a substring of exactly one kernel's mangled name")
    ap.add_argument("--min-gap", type=int, default=40, help="shortest stretch whose opcodes are listed")
    ap.add_argument("--compare", help="a second SASS listing, with a kernel of the same substring")
    ap.add_argument("--compare-kernel", help="the second listing's substring, if not the same")
    args = ap.parse_args(argv)
    report(args.sass, args.kernel, args.min_gap)
    if args.compare:
        report(args.compare, args.compare_kernel or args.kernel, args.min_gap)


if __name__ == "__main__":
    sys.exit(main())
