"""How far bf16 parameters drift from an fp32 master: round to nearest, stochastic
rounding, and split master weights (``bf16+int8``, ``bf16+int16``), against float64.

SGD with small learning rates on bf16 parameters in [1, 2) (bf16's spacing there is
2**-7 = 0.0078): each run takes ``--steps`` steps of fresh random gradients, and the
table gives the parameters' (or, with split masters, the masters') error against the
same steps in float64, in units of bf16's spacing. Precision only, so it runs anywhere
(CPU through Triton's interpreter when there is no GPU).

    python benchmarks/probes/master_precision.py [--steps 200] [--n 4096] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fuser  # noqa: E402
from fuser.runtime import quant  # noqa: E402

RUNS = {
    "round to nearest": dict(),
    "stochastic rounding": dict(stochastic_rounding=True, seed=1),
    "bf16+int8": dict(master_weights="bf16+int8"),
    "bf16+int16": dict(master_weights="bf16+int16"),
}


def run(lr: float, mean: float, steps: int, n: int, device) -> dict:
    gen = torch.Generator().manual_seed(0)
    start = (1.0 + torch.rand(n, generator=gen, dtype=torch.float64)).to(torch.bfloat16).double()
    grads = [mean + torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(steps)]
    exact = start.clone()
    for g in grads:
        exact -= lr * g.to(torch.bfloat16).double()
    out = {}
    for name, options in RUNS.items():
        p = start.to(torch.bfloat16).to(device).requires_grad_()
        opt = fuser.optim.SGD([p], lr=lr, **options)
        for g in grads:
            p.grad = g.to(torch.bfloat16).to(device)
            opt.step()
        lo = opt.state[p].get("master_lo")
        value = (quant.master_join(p.detach(), lo) if lo is not None else p.detach().float()).double().cpu()
        spacing = quant.bf16_spacing(p.detach()).double().cpu()
        err = (value - exact).abs() / spacing
        out[name] = dict(mean=err.mean().item(), max=err.max().item())
    return out


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-3, 1e-4, 1e-5])
    ap.add_argument("--grad-mean", type=float, nargs="+", default=[0.0, 0.5],
                    help="means of the gradients (0: a random walk; > 0: a steady drift)")  # fmt: skip
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
    )
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = {(lr, mu): run(lr, mu, args.steps, args.n, device) for mu in args.grad_mean for lr in args.lr}
    where = f"CPU ({platform.machine()}), Triton's interpreter"
    if device.type == "cuda":
        where = torch.cuda.get_device_name(0)
    date = datetime.date.today().isoformat()
    command = "python " + " ".join([os.path.relpath(__file__), *(sys.argv[1:] if argv is None else argv)])
    lines = [
        f"# bf16 parameters against an fp32 master, {date}",
        "",
        f"{where}; torch {torch.__version__}. Command: `{command}`",
        "",
        f"SGD, {args.steps} steps of fresh N(mean, 1) gradients on {args.n} parameters in [1, 2) "
        "(bf16 spacing 2**-7); error of the parameter (or its split master) against float64, in bf16 "
        "spacings (mean / max over elements). One step moves a parameter by about lr, i.e. "
        "lr / 2**-7 spacings.",
        "",
        "| gradient mean | lr | " + " | ".join(RUNS) + " |",
        "|---|---|" + "---|" * len(RUNS),
    ]
    for (lr, mu), r in rows.items():
        cells = [f"{r[name]['mean']:.3g} / {r[name]['max']:.3g}" for name in RUNS]
        lines.append(f"| {mu:g} | {lr:g} | " + " | ".join(cells) + " |")
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"master_precision_{date}")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(stem + ".json", "w") as f:
        table = [dict(lr=lr, grad_mean=mu, **v) for (lr, mu), v in rows.items()]
        doc = dict(date=date, device=where, command=command, steps=args.steps, n=args.n, rows=table)
        json.dump(doc, f, indent=1)
    print("\n".join(lines))
    return stem + ".md"


if __name__ == "__main__":
    main()
