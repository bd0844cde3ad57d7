"""Fused linear + cross-entropy with skewed targets: fuser's default (`memory="auto"`) beside
`schedule="chunks"`, forward + backward, bf16, one process (H100).

The scaled schedule adds `grad_weight`'s target term over the tokens sorted by target,
each run of one target summed in token order; a frequent target makes a long run. Target
draws (T tokens, V classes): `uniform`; `zipf` (P(rank r) proportional to 1 / r**1.1, as
words in text; the most frequent ~1 in 10 tokens); `top5%`, `top30%`, `all` (that share of
the tokens on one target, the rest uniform).

    python benchmarks/loss_targets.py [gist h2048]

Prints one JSON line per (config, draw, schedule) with the median of CUDA events.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fuser  # noqa: E402
import fuser.losses  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loss_bench import CONFIGS, warm_up  # noqa: E402
from optim_bench import event_ms  # noqa: E402


def targets(draw: str, t: int, v: int, g: torch.Generator) -> torch.Tensor:
    y = torch.randint(0, v, (t,), device="cuda", generator=g)
    if draw == "zipf":
        p = 1.0 / torch.arange(1, v + 1, device="cuda", dtype=torch.float64) ** 1.1
        ranked = torch.multinomial(p / p.sum(), t, replacement=True, generator=g)
        y = torch.randperm(v, device="cuda", generator=g)[ranked]  # (ranks to random ids)
    elif draw != "uniform":
        share = {"top5%": 0.05, "top30%": 0.3, "all": 1.0}[draw]
        y[torch.randperm(t, device="cuda", generator=g)[: int(t * share)]] = 17
    return y


def run(cfg: str, chunks) -> None:
    t, h, v = CONFIGS[cfg]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02).requires_grad_()
    warm_up()
    for draw in ("uniform", "zipf", "top5%", "top30%", "all"):
        y = targets(draw, t, v, g)
        top = int(torch.bincount(y).max())
        for name, loss in (("auto", fuser.losses.cross_entropy), ("chunks", chunks)):

            def step(loss=loss, y=y):
                loss(x, w, y).backward()

            ms = event_ms(step, warmup=2, rep=10)
            x.grad = w.grad = None
            row = dict(cfg=cfg, draw=draw, most_frequent=top, schedule=name, fwd_bwd_ms=round(ms, 2))
            print(json.dumps(row), flush=True)


def main(configs) -> None:
    print(json.dumps(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__)), flush=True)
    chunks = fuser.compile(fuser.losses.CROSS_ENTROPY, schedule="chunks")
    for cfg in configs:
        run(cfg, chunks)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:] or ["gist"])
