"""AdamW step time against the number of tensors and against the parameter count: fuser
(default and ``static=True``) beside torch's fused AdamW, fp32, in this process on this GPU.

- tensors: N tensors of 4096 elements, N = 1, 10, 100, 1000, 10000, 100000;
- params: 200 equal tensors holding 1e5 ... 1e9 parameters in all.

Each point: median of device events around one ``step()`` and wall time per step over
back-to-back steps (Python included).

    python benchmarks/scaling.py [--out DIR]

Writes ``scaling_<date>.json``; ``benchmarks/plot.py`` draws it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fuser  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from optim_bench import event_ms, wall_ms  # noqa: E402

IMPLS = {
    "fuser.optim.AdamW": lambda ps: fuser.optim.AdamW(ps, lr=1e-3, weight_decay=0.01),
    "fuser.optim.AdamW static": lambda ps: fuser.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, static=True),
    "torch.AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True),
}


def point(sweep, x, shapes, rows):
    for name, build in IMPLS.items():
        flat = torch.randn(sum(torch.Size(s).numel() for s in shapes), device="cuda")
        ps, at = [], 0
        for s in shapes:
            k = torch.Size(s).numel()
            ps.append(flat[at : at + k].view(s).clone())
            at += k
        del flat
        for p in ps:
            p.grad = torch.randn_like(p) * 1e-3
        opt = build(ps)
        reps = 5 if len(shapes) >= 10000 else 20
        ms = event_ms(opt.step, warmup=2, rep=reps)
        wall = wall_ms(opt.step, steps=reps)
        row = dict(sweep=sweep, x=x, impl=name, ms=round(ms, 4), wall_ms=round(wall, 4),
                   tensors=len(shapes), params=sum(p.numel() for p in ps))  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
        del ps, opt
        torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    rows = []
    for n in (1, 10, 100, 1000, 10000, 100000):
        point("tensors", n, [(4096,)] * n, rows)
    for total in (1e5, 1e6, 1e7, 1e8, 1e9):
        per = max(1, int(total) // 200)
        point("params", 200 * per, [(per,)] * 200, rows)
    date = datetime.date.today().isoformat()
    command = "python " + " ".join([os.path.relpath(__file__)] + (argv or sys.argv[1:]))
    meta = dict(
        date=date,
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        command=command,
    )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"scaling_{date}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
