"""Draw TFLOP/s against sequence length from a benchmarks/results CSV (a bench_decode.py CSV: K/V
bytes per second, grouped bars per row; a bench_masks.py CSV: milliseconds, grouped bars per mask).

    python benchmarks/plot_results.py benchmarks/results/2026-11-21-nvidia-h100-80gb-hbm3.csv
    python benchmarks/plot_results.py RESULTS.csv --anchors /work/shared/anchors/2026-11-21-h200.csv

One subplot per (pass, head dim): rows are the passes present (fwd, bwd, fwdbwd, attn_dist), columns
the head dims of the standard sweep plus one column for the GQA rows (kv_heads < heads) when there
are any.
One line per impl, solid non-causal and dashed causal, x axis log2(seqlen). --anchors overlays rows
of another CSV with the same columns (e.g. peer timings on another device) as thin grey lines.
The PNG goes next to the CSV with the same stem unless --out says otherwise.
"""
from __future__ import annotations

import argparse
import csv
from pathlib import Path

PASS_ORDER = ("fwd", "bwd", "fwdbwd", "attn_dist")
IMPL_COLORS = {"jax_flashattn": "tab:red", "jax_flashattn_sm80": "tab:orange", "cudnn": "tab:blue",
               "xla": "tab:gray", "fa3": "tab:green", "tokamax": "tab:olive", "torch_cudnn": "tab:purple",
               "torch_fa2": "tab:brown"}
ANCHOR_MARKERS = ("x", "+", "1", "2", "3", "4")


def read_rows(path) -> list[dict]:
    """The CSV's rows with numeric columns converted."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for name in ("hdim", "seqlen", "batch", "heads", "kv_heads"):
            row[name] = int(row[name])
        row["causal"] = row["causal"] in ("1", "True")  # (bench_sparse.py writes True/False)
        row["ms"], row["tflops"] = float(row["ms"]), float(row["tflops"])
    return rows


def panel_column(row) -> str:
    """Column label of the subplot a row belongs to: 'H=64' for MHA rows, 'GQA 16/2, H=128' otherwise."""
    if row["kv_heads"] != row["heads"]:
        return f"GQA {row['heads']}/{row['kv_heads']}, H={row['hdim']}"
    return f"H={row['hdim']}"


def _column_order(label: str):
    return (label.startswith("GQA"), int(label.rsplit("H=", 1)[1]), label)


def _draw_lines(ax, rows, style_of):
    """One line per (impl, causal) in `rows`, points sorted by seqlen; style_of(impl, causal) -> kwargs."""
    for impl, causal in sorted({(r["impl"], r["causal"]) for r in rows}):
        points = sorted((r["seqlen"], r["tflops"]) for r in rows if r["impl"] == impl and r["causal"] == causal)
        xs, ys = zip(*points)
        ax.plot(xs, ys, **style_of(impl, causal))


def plot_csv(csv_path, png_path=None, anchors_path=None) -> Path:
    """Write the PNG for `csv_path` (default: same stem, .png) and return its path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path, newline="") as f:
        header = next(csv.reader(f), [])
    if "kv_gb_per_s" in header:
        return plot_decode_csv(csv_path, png_path)
    if "mask" in header and "speed_vs_reference" in header:
        return plot_masks_csv(csv_path, png_path)
    rows = read_rows(csv_path)
    if not rows:
        raise ValueError(f"{csv_path} has no rows")
    png_path = Path(png_path) if png_path else Path(csv_path).with_suffix(".png")
    passes = [p for p in PASS_ORDER if any(r["pass"] == p for r in rows)]
    columns = sorted({panel_column(r) for r in rows}, key=_column_order)
    anchors = read_rows(anchors_path) if anchors_path else []
    anchor_markers = {impl: ANCHOR_MARKERS[i % len(ANCHOR_MARKERS)]
                      for i, impl in enumerate(sorted({r["impl"] for r in anchors}))}

    fig, axes = plt.subplots(len(passes), len(columns), squeeze=False, sharex=True,
                             figsize=(max(4.2 * len(columns), 6.5), 3.4 * len(passes)))
    for i, pass_name in enumerate(passes):
        for j, column in enumerate(columns):
            ax = axes[i][j]
            in_panel = lambda r: r["pass"] == pass_name and panel_column(r) == column  # noqa: E731
            _draw_lines(ax, [r for r in anchors if in_panel(r) and r["dtype"] == rows[0]["dtype"]],
                        lambda impl, causal: dict(
                            color="0.6", lw=0.8, marker=anchor_markers[impl], ms=4,
                            ls="--" if causal else "-",
                            label=f"{impl} ({anchors[0]['device']}, anchor)"))
            _draw_lines(ax, [r for r in rows if in_panel(r)],
                        lambda impl, causal: dict(
                            color=IMPL_COLORS.get(impl), lw=1.8, marker="o", ms=3,
                            ls="--" if causal else "-", label=impl))
            ax.set_xscale("log", base=2)
            ax.set_ylim(bottom=0)
            ax.grid(True, which="both", alpha=0.3)
            ax.set_title(f"{pass_name} · {column}", fontsize=10)
            if i == len(passes) - 1:
                ax.set_xlabel("keys S (the dense sweeps: T = S)")
            if j == 0:
                ax.set_ylabel("TFLOP/s")

    legend = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=min(len(legend), 4), fontsize=9,
               bbox_to_anchor=(0.5, 0.0))
    fig.suptitle(f"{rows[0]['device']}, {rows[0]['dtype']} — solid: non-causal, dashed: causal")
    rows_of_legend = (len(legend) + 3) // 4
    fig.tight_layout(rect=(0, 0.03 + 0.035 * rows_of_legend, 1, 1))
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def plot_decode_csv(csv_path, png_path=None) -> Path:
    """A bench_decode.py CSV: K/V bytes read per second, one group of bars per (B, T, S) row and one
    bar per impl, in the CSV's order."""
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


def plot_masks_csv(csv_path, png_path=None) -> Path:
    """A bench_masks.py CSV: milliseconds, one subplot per (head dim, pass), one group of bars per
    mask and one bar per impl, in the CSV's order."""
    import matplotlib.pyplot as plt

    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    panels = list(dict.fromkeys((r["H"], r["passes"]) for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    width = 0.8 / len(impls)
    fig, axes = plt.subplots(1, len(panels), squeeze=False, figsize=(5.2 * len(panels), 4.0))
    for ax, (hdim, passes) in zip(axes[0], panels):
        in_panel = [r for r in rows if (r["H"], r["passes"]) == (hdim, passes)]
        masks = list(dict.fromkeys(r["mask"] for r in in_panel))
        ms = {(r["mask"], r["impl"]): float(r["ms"]) for r in in_panel}
        for i, impl in enumerate(impls):
            xs = [m + (i - (len(impls) - 1) / 2) * width for m in range(len(masks))]
            ax.bar(xs, [ms.get((mask, impl), 0.0) for mask in masks], width, label=impl,
                   color=IMPL_COLORS.get(impl))
        ax.set_xticks(range(len(masks)))
        ax.set_xticklabels(masks, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("ms")
        ax.set_title(f"{passes}, H {hdim}, T = S = {in_panel[0]['T']}", fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(f"{rows[0]['device']}: masks given as tensors (bench_masks.py), bf16")
    fig.tight_layout()
    png_path = Path(png_path) if png_path else Path(csv_path).with_suffix(".png")
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", help="a benchmarks/results CSV")
    parser.add_argument("--anchors", help="another CSV with the same columns, drawn thin and grey")
    parser.add_argument("--out", help="PNG path (default: the CSV's path with .png)")
    args = parser.parse_args()
    print(f"wrote {plot_csv(args.csv, args.out, args.anchors)}")


if __name__ == "__main__":
    main()
