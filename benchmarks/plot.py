"""Plots of benchmark results; needs matplotlib (``pip install -e '.[bench]'``), runs on
any machine.

    python benchmarks/plot.py benchmarks/results/latest.json [--out PNG]
    python benchmarks/plot.py benchmarks/results/scaling_<date>.json [--out PNG]

From ``latest.json`` (``make bench``): for each workload with an anchor, the fastest
anchor's time over fuser's, on a log axis (right of 1: fuser is faster), the two times
beside each bar; the rows are ``results_md.py``'s. From ``scaling_<date>.json``
(``scaling.py``): AdamW step time against the number of tensors and against the
parameter count, fuser beside torch's fused AdamW.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from results_md import ms, summary  # noqa: E402


def plot_latest(plt, rows: list[dict], folder: str):
    entries = [e for e in summary(rows, folder) if e["anchor"] and "_option_" not in e["workload"]]
    fig, ax = plt.subplots(figsize=(11, 0.42 * len(entries) + 1.6))
    names = [e["workload"] for e in entries][::-1]
    ratios = [e["ratio"] for e in entries][::-1]
    colors = ["tab:green" if r >= 1 else "tab:red" for r in ratios]
    ax.barh(names, [r - 1 for r in ratios], left=1, color=colors)  # from 1 to the ratio
    ax.axvline(1, color="black", linewidth=0.8)
    ax.set_xscale("log")
    for y, e in enumerate(entries[::-1]):
        label = f" fuser {ms(e['fuser']['ms'])}, {e['anchor']['impl']} {ms(e['anchor']['ms'])}"
        ax.text(max(e["ratio"], 1), y, label, va="center", fontsize=7)
    ax.set_xlim(0.5, max(ratios) * 8)
    ax.set_xlabel("fastest anchor's time / fuser's time (log; right of 1: fuser is faster)")
    devices = ", ".join(sorted({e["device"] for e in entries}))
    dates = sorted({e["date"] for e in entries})
    ax.set_title(
        f"fuser beside its fastest anchor (benchmarks/RESULTS.md)\n{devices}; {dates[0]} to {dates[-1]}"
    )
    ax.grid(True, axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    return fig


def plot_scaling(plt, doc: dict):
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, sweep, xlabel in zip(
        axes, ("tensors", "params"), ("tensors (4096 elements each)", "parameters (200 tensors)")
    ):
        rows = [r for r in doc["rows"] if r["sweep"] == sweep]
        for impl in dict.fromkeys(r["impl"] for r in rows):
            pts = sorted((r["x"], r["wall_ms"]) for r in rows if r["impl"] == impl)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("ms per step (wall, back-to-back, Python included)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    meta = doc["meta"]
    fig.suptitle(
        f"AdamW fp32 step: {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}"
    )
    fig.tight_layout()
    return fig


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.json) as f:
        doc = json.load(f)
    if isinstance(doc, list):  # latest.json: one list of rows
        fig = plot_latest(plt, doc, os.path.dirname(os.path.abspath(args.json)))
    else:
        fig = plot_scaling(plt, doc)
    out = args.out or os.path.splitext(args.json)[0] + ".png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
