"""Draw ``scaling_<date>.json`` (from ``scaling.py``): AdamW step time against the number
of tensors and against the parameter count, fuser beside torch's fused AdamW. Needs
matplotlib (``pip install -e '.[bench]'``); runs on any machine.

    python benchmarks/plot.py benchmarks/results/scaling_<date>.json [--out PNG]
"""

from __future__ import annotations

import argparse
import json
import os


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
    out = args.out or os.path.splitext(args.json)[0] + ".png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
