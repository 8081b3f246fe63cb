"""Draw context parallelism's scaling efficiency from benchmarks/bench_multigpu.py CSVs.

    python benchmarks/plot_multigpu.py benchmarks/results/2026-11-27-nvidia-h200-x2-multigpu-cp128k.csv ... \
        --out benchmarks/results/2026-11-27-nvidia-h200-multigpu.png

One subplot per (pass, GPU count); x axis log2 of the total sequence length, y the efficiency
(single-GPU time / (GPUs x time) at the same total problem); one line per strategy, solid
non-causal and dashed causal. Rows of later files replace rows of earlier ones with the same
(GPUs, strategy, T, K/V heads, causal, pass), so a re-measured configuration is drawn once. Rows
without a single-GPU baseline (no efficiency) and GQA rows (K/V heads < heads) are left out.
"""
from __future__ import annotations

import argparse
import csv
from pathlib import Path

COLORS = {"ring": "tab:red", "all_gather": "tab:blue"}


def read_cp_rows(paths) -> dict:
    rows = {}
    for path in paths:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                if row["section"] != "cp" or row["impl"] == "single" or not row["efficiency"]:
                    continue
                if row["kv_heads"] and int(row["kv_heads"]) < int(row["heads"]):
                    continue
                key = (int(row["gpus"]), row["impl"], int(row["seqlen"]), int(row["causal"]), row["pass"])
                rows[key] = float(row["efficiency"])
    return rows


def plot(rows: dict, out: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    passes = [p for p in ("fwd", "fwdbwd") if any(k[4] == p for k in rows)]
    gpu_counts = sorted({k[0] for k in rows})
    fig, axes = plt.subplots(len(passes), len(gpu_counts), figsize=(4.5 * len(gpu_counts), 3.4 * len(passes)),
                             squeeze=False, sharey=True)
    for i, pass_ in enumerate(passes):
        for j, gpus in enumerate(gpu_counts):
            ax = axes[i][j]
            for impl in COLORS:
                for causal in (0, 1):
                    points = sorted((k[2], e) for k, e in rows.items()
                                    if k[0] == gpus and k[1] == impl and k[3] == causal and k[4] == pass_)
                    if points:
                        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=COLORS[impl],
                                linestyle="--" if causal else "-",
                                label=f"{impl}{' causal' if causal else ''}")
            ax.axhline(1.0, color="gray", linewidth=0.8)
            ax.axhline(0.9, color="gray", linewidth=0.8, linestyle=":")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{gpus} GPUs, {pass_}")
            ax.set_xlabel("total sequence length")
            if j == 0:
                ax.set_ylabel("scaling efficiency")
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("csv", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--title", default="context_parallel_attention: one-GPU time / (GPUs x time), bf16, H 128, N = K = 8")
    args = p.parse_args(argv)
    plot(read_cp_rows(args.csv), Path(args.out), args.title)


if __name__ == "__main__":
    main()
