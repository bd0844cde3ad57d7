"""The README's performance table and its plot, from the benchmark results.

    python docs/perf_plot.py            # prints the table, writes docs/img/perf.png

Every figure comes from ``benchmarks/results/latest.json`` (the optimizer rows) and the
loss run named in ``LOSS_RUN`` (whose anchors ``latest.json`` keeps only for another GPU),
all on one GPU, ``DEVICE``. For each workload the anchor is the fastest other
implementation timed in the same file as fuser's row, so each ratio is taken within one
run. ``tests/test_readme.py`` checks that the README holds this table as printed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DEVICE = "NVIDIA H100 80GB HBM3"
LOSS_RUN = "loss_2026-11-28_v22.json"
IMAGE = ROOT / "docs" / "img" / "perf.png"

# (workload in the results, fuser's implementation, label in the table)
ROWS = [
    ("adamw_fp32_llama1b", "fuser.optim.AdamW", "AdamW, fp32"),
    ("adamw_bf16_llama1b", "fuser.optim.AdamW", "AdamW, bf16"),
    ("adamw_fp32_small1000", "fuser.optim.AdamW", "AdamW, 1000 tensors of 4096 (wall)"),
    ("lamb_fp32_llama1b", "fuser.optim.LAMB", "LAMB, fp32"),
    ("muon_llama1b", "fuser.optim.Muon (+AdamW groups)", "Muon + AdamW, bf16"),
    ("adafactor_llama1b", "fuser.optim.Adafactor", "Adafactor, fp32"),
    ("came_llama1b", "fuser.optim.CAME", "CAME, fp32"),
    ("adamw_q8_llama1b", "fuser.optim.AdamW", "AdamW, 8-bit states"),
    ("adamw_q8_master24_llama1b", "fuser.optim.AdamW", "AdamW, 8-bit states + split masters"),
    ("lion_q8_llama1b", "fuser.rule lion", "Lion rule, 8-bit states"),
    ("lce_gist", "fuser cross_entropy", "linear + CE, T=32768 H=768 V=128256"),
    ("lce_llama8b", "fuser cross_entropy", "linear + CE, T=8192 H=4096 V=128256"),
]


def _loss_rows() -> list[dict]:
    doc = json.loads((RESULTS / LOSS_RUN).read_text())
    assert doc["meta"]["gpu"] == DEVICE, f"{LOSS_RUN} ran on {doc['meta']['gpu']}, not {DEVICE}"
    return [
        dict(
            workload=r["workload"],
            impl=r["name"],
            ms=r["fwd_bwd_ms"],
            pct_of_floor=round(100 * r["gemm_floor_ms"] / r["fwd_bwd_ms"], 1),
            device=DEVICE,
            source=LOSS_RUN,
        )
        for r in doc["rows"]
        if "error" not in r and "option" not in r
    ]


def rows() -> list[dict]:
    """One dict per table row: label, fuser's ms, the anchor's name and ms, the ratio of
    their times, fuser's % of its floor, and the source file."""
    latest = json.loads((RESULTS / "latest.json").read_text())
    pool = [r for r in latest if r["device"] == DEVICE and not r["workload"].startswith("lce_")]
    pool += _loss_rows()
    out = []
    for workload, impl, label in ROWS:
        mine = [r for r in pool if r["workload"] == workload and r["impl"] == impl]
        assert len(mine) == 1, f"{len(mine)} rows of {impl!r} for {workload} on {DEVICE}"
        fuser = mine[0]
        others = [
            r
            for r in pool
            if r["workload"] == workload
            and r["source"] == fuser["source"]
            and not r["impl"].startswith(("fuser", "probe"))
        ]
        anchor = min(others, key=lambda r: r["ms"])
        # Shaped rules cannot run in one pass: their floor counts the passes they need.
        pct = fuser.get("pct_of_pass_floor", fuser["pct_of_floor"])
        out.append(
            dict(
                label=label,
                ms=fuser["ms"],
                anchor=anchor["impl"],
                anchor_ms=anchor["ms"],
                ratio=anchor["ms"] / fuser["ms"],
                pct_of_floor=pct,
                source=fuser["source"],
            )
        )
    return out


def _ms(v: float) -> str:
    return f"{v:.3f}" if v < 1 else f"{v:.2f}"


def table() -> str:
    """The README's table, as markdown."""
    lines = [
        "| workload | fuser ms | best anchor | anchor ms | anchor / fuser | % of floor |",
        "| --- | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in rows():
        lines.append(
            f"| {r['label']} | {_ms(r['ms'])} | {r['anchor']} | {_ms(r['anchor_ms'])} | "
            f"{r['ratio']:.2f}x | {r['pct_of_floor']:.1f}% |"
        )
    return "\n".join(lines)


def plot(path: Path = IMAGE) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = rows()[::-1]
    fig, ax = plt.subplots(figsize=(8, 4.6), dpi=110)
    ratios = [r["ratio"] for r in data]
    colors = ["#2e7d32" if x >= 1 else "#c62828" for x in ratios]
    ax.barh(range(len(data)), ratios, color=colors)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xticks([0.5, 1, 2, 4, 8])
    ax.set_xticklabels(["0.5x", "1x", "2x", "4x", "8x"])
    ax.set_xlim(0.5, 12)
    ax.set_yticks(range(len(data)))
    ax.set_yticklabels([r["label"] for r in data], fontsize=8)
    for i, r in enumerate(data):
        ax.text(r["ratio"] * 1.04, i, f"{_ms(r['ms'])} ms vs {_ms(r['anchor_ms'])}", va="center", fontsize=7)
    ax.set_xlabel("best anchor's time / fuser's time (higher: fuser faster)")
    ax.set_title("fuser beside the fastest anchor of each run, H100 (benchmarks/results)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    print(table())
    if "--no-plot" not in sys.argv:
        plot()
        print(f"wrote {IMAGE.relative_to(ROOT)}")
