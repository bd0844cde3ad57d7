"""Draw a ``fsdp_train.py`` result: both runs' loss curves, their difference per step, and
each run's median step time split into forward + backward and optimizer.

    python benchmarks/plot_fsdp.py RESULT.json [PNG]

Writes the PNG next to the JSON unless a path is given. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"baseline": "tab:blue", "fuser": "tab:orange"}
WIDTHS = {"baseline": 3.0, "fuser": 1.0}  # the curves overlap: the baseline drawn wide underneath


def plot(result: dict, png: str) -> None:
    runs = result["runs"]
    cfg = result["config"]
    fig, (ax_loss, ax_diff, ax_time) = plt.subplots(
        1, 3, figsize=(16, 4.8), gridspec_kw=dict(width_ratios=[2, 2, 1.2])
    )
    for kind, run in runs.items():
        ax_loss.plot(
            run["losses"],
            label=f"{kind}: {run['optimizer']}",
            color=COLORS.get(kind),
            lw=WIDTHS.get(kind, 1.0),
        )
    ax_loss.axhline(result["ln_vocab"], color="grey", ls=":", lw=1, label="ln V")
    ax_loss.axhline(result["loss_floor"], color="black", ls="--", lw=1, label="entropy of the data")
    ax_loss.set(xlabel="step", ylabel="loss (mean over the global batch)", title="Training loss")
    ax_loss.legend(fontsize=8)

    base, fus = runs["baseline"]["losses"], runs["fuser"]["losses"]
    ax_diff.plot([f - b for b, f in zip(base, fus)], color="tab:red", lw=1)
    ax_diff.axhline(0, color="grey", lw=0.8)
    ax_diff.set(
        xlabel="step",
        ylabel="fuser - baseline",
        title=f"Loss difference (max |d| {result['max_loss_diff']:.2e})",
    )

    names = list(runs)
    fb = [runs[k]["summary"]["fwd_bwd_ms"] for k in names]
    op = [runs[k]["summary"]["opt_ms"] for k in names]
    ax_time.bar(names, fb, color="lightgrey", label="forward + backward")
    ax_time.bar(names, op, bottom=fb, color=[COLORS.get(k) for k in names], label="optimizer.step()")
    for i, k in enumerate(names):
        share = runs[k]["summary"]["opt_share"]
        ax_time.text(i, fb[i] + op[i], f"{100 * share:.1f}%", ha="center", va="bottom", fontsize=9)
    ax_time.set(ylabel="median ms per step", title="Optimizer share of the step")
    ax_time.legend(fontsize=8, loc="lower right")

    fig.suptitle(
        f"FSDP2, {result['world']} x {result['device']}: {cfg['layers']} layers, dim {cfg['dim']}, "
        f"vocab {cfg['vocab']}, seq {cfg['seq']}, batch {cfg['batch']}/rank, {cfg['dtype']} "
        f"(torch {result['torch']}, triton {result['triton']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json")
    ap.add_argument("png", nargs="?")
    args = ap.parse_args(argv)
    with open(args.json) as f:
        result = json.load(f)
    png = args.png or os.path.splitext(args.json)[0] + ".png"
    plot(result, png)
    print(f"wrote {png}")
    return png


if __name__ == "__main__":
    main()
