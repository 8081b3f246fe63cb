"""Draw a bench_decode.py CSV: K/V bytes read per second, one group of bars per (B, T, S) row and
one bar per impl, in the CSV's order.

    python benchmarks/plot_decode.py benchmarks/results/2026-11-27-nvidia-h200-decode-paged.csv

The PNG goes next to the CSV with the same stem unless --out says otherwise.
"""
from __future__ import annotations

import argparse
import csv
from pathlib import Path


def plot_csv(csv_path, png_path=None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    problems = list(dict.fromkeys((r["batch"], r["queries"], r["keys"]) for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    rate = {(r["batch"], r["queries"], r["keys"], r["impl"]): float(r["kv_gb_per_s"]) for r in rows}
    width = 0.8 / len(impls)
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(problems), 4.2))
    for i, impl in enumerate(impls):
        xs = [p + (i - (len(impls) - 1) / 2) * width for p in range(len(problems))]
        ax.bar(xs, [rate.get(problem + (impl,), 0.0) for problem in problems], width, label=impl)
    ax.set_xticks(range(len(problems)))
    ax.set_xticklabels([f"B {b}, T {t}\nS {int(s) // 1024}k" for b, t, s in problems])
    ax.set_ylabel("K/V read, GB/s")
    first = rows[0]
    ax.set_title(f"{first['device']}: decoding, N {first['heads']}, K {first['kv_heads']}, H {first['hdim']}, bf16")
    ax.set_ylim(0, 1.3 * max(rate.values()))  # room for the legend above the bars
    ax.legend(fontsize=8, ncol=3, loc="upper left")
    fig.tight_layout()
    png_path = Path(png_path) if png_path else Path(csv_path).with_suffix(".png")
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", help="a bench_decode.py CSV")
    parser.add_argument("--out", help="PNG path (default: the CSV's path with .png)")
    args = parser.parse_args()
    print(f"wrote {plot_csv(args.csv, args.out)}")


if __name__ == "__main__":
    main()
