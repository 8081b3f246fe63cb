"""Summarise ncu's source page (SASS, CSV) of one kernel: where the instructions and stalls are.

    ncu --section SourceCounters ... -o rep <program>          # on the GPU machine
    ncu -i rep.ncu-rep --page source --csv --print-source sass > rep.csv
    python benchmarks/ncu_source_summary.py rep.csv [--min-share 0.005]

Consecutive instructions that ran equally often are one straight-line run (a loop body, a
feature's per-element loop, the epilogue); each run that holds at least --min-share of the
executed instructions is printed with its share of instructions and of stall samples and its most
frequent opcodes. Then the stall reasons over the whole kernel. Comparing two variants' runs shows
what a change costs per key block (executions per run = blocks x warps) and, with the stall
reasons, whether time follows the instruction count (no_inst: instruction-cache misses).
"""

import argparse
import collections
import csv


def read(path):
    rows = list(csv.reader(open(path, newline="")))
    header = next(i for i, r in enumerate(rows) if "Source" in r and "Instructions Executed" in r)
    names = rows[header]
    return names, rows[header + 1:]


def opcode(source):
    words = source.split()
    if not words:
        return ""
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--min-share", type=float, default=0.005, help="smallest share of instructions printed")
    args = ap.parse_args()
    names, data = read(args.csv)
    col = {n: i for i, n in enumerate(names)}
    executed = [int(r[col["Instructions Executed"]] or 0) for r in data]
    samples = [int(r[col["Warp Stall Sampling (All Samples)"]] or 0) for r in data]
    total, total_samples = sum(executed) or 1, sum(samples) or 1
    print(f"{sum(executed)} instructions executed (warp level), {sum(samples)} stall samples")

    runs = []  # [first row, executions, length, samples, opcodes]
    for i, r in enumerate(data):
        if runs and runs[-1][1] == executed[i]:
            runs[-1][2] += 1
            runs[-1][3] += samples[i]
            runs[-1][4][opcode(r[col["Source"]])] += 1
        else:
            runs.append([i, executed[i], 1, samples[i], collections.Counter([opcode(r[col["Source"]])])])
    print(f"{'row':>6} {'executions':>11} {'length':>6} {'inst %':>7} {'stall %':>7}  opcodes")
    for first, n, length, s, ops in runs:
        if n * length >= args.min_share * total:
            top = ", ".join(f"{k} {v}" for k, v in ops.most_common(6))
            print(f"{first:6d} {n:11d} {length:6d} {100 * n * length / total:7.1f} {100 * s / total_samples:7.1f}  {top}")

    reasons = collections.Counter()
    for name, i in col.items():
        if name.startswith("stall_") and "Not Issued" not in name:
            reasons[name[len("stall_"):]] += sum(int(r[i] or 0) for r in data)
    all_reasons = sum(reasons.values()) or 1
    print("stall reasons: " + ", ".join(f"{k} {100 * v / all_reasons:.1f} %" for k, v in reasons.most_common(10)))


if __name__ == "__main__":
    main()
