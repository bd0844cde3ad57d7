"""The weight and hidden gradients' errors against float64 per schedule, with no token
ignored and with 1 in 7 ignored (H100, bf16, plain cross-entropy, gist; the lean, `vocab`
and `chunks` schedules also into an fp32 `main_grad`): the weight gradient's error split between the
sampled vocabulary rows that are some token's target and the others, and the largest
hidden gradient of an ignored token (0 expected).

With no token ignored the mean's scale is 1/32768 = 2**-15, and at a random initialisation
each target's `p - 1` is within ~1e-5 of -1: a target entry of a bf16 logit gradient is then
exact. With 1 in 7 ignored the scale is 1/28087: the target entries rounded to bf16 would
add up, row by row (`fuser.runtime.loss.residue` carries them in fp32).

    python benchmarks/probes/loss_target_error.py
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import fuser  # noqa: E402
import fuser.losses  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from loss_bench import CONFIGS, inputs, reference, rel_err  # noqa: E402


def main(cfg: str = "gist") -> None:
    t, h, v = CONFIGS[cfg]
    for ignore in (False, True):
        x, w, y, g = inputs(cfg)
        if ignore:
            y[torch.randperm(t, device="cuda", generator=g)[: t // 7]] = -100
        rows = torch.arange(0, v, max(1, v // 512), device="cuda")[:512]
        tokens = torch.arange(0, min(t, 1024), 4, device="cuda")
        ref = reference(x, w, y, rows, tokens)
        targets = torch.isin(rows, y[y != -100])
        runs = [(s, False) for s in ("fused", "scaled", "chunks", "vocab", "whole")] + [
            ("fused", True),
            ("vocab", True),
            ("chunks", True),
        ]
        for schedule, main_grad in runs:
            f = fuser.compile(fuser.losses.CROSS_ENTROPY, schedule=schedule)
            x.grad = w.grad = None
            w.main_grad = torch.zeros(v, h, device="cuda") if main_grad else None
            f(x, w, y, accumulate_into="main_grad" if main_grad else None).backward()
            wgrad = w.main_grad if main_grad else w.grad
            row = dict(
                cfg=cfg,
                ignore7=ignore,
                schedule=schedule,
                main_grad=main_grad,
                wgrad=rel_err(wgrad[rows], ref[1])[0],
                hgrad=rel_err(x.grad[tokens], ref[2])[0],
                wgrad_target_rows=rel_err(wgrad[rows[targets]], ref[1][targets])[0],
                wgrad_other_rows=rel_err(wgrad[rows[~targets]], ref[1][~targets])[0],
                n_target_rows=int(targets.sum()),
                ignored_grad_max=float(x.grad[y == -100].abs().max()) if ignore else 0.0,
            )
            print(json.dumps(row), flush=True)
        del x, w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(*sys.argv[1:])
