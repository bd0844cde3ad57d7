"""One process's share of an A/B of fuser's fused linear + cross-entropy (bf16, forward +
backward) between two source trees: run it from each tree in turn, alternating processes.

For each config (`gist`, `llama8b`, `h2048` of `loss_bench.py`) and variant (`memory="auto"`,
`"lean"`, each with and without `accumulate_into="main_grad"`): two medians of ten steps
(CUDA events) and the extra peak memory of a step, as one JSON line tagged with TAG.

    cd TREE && PYTHONPATH=TREE python PATH/TO/benchmarks/probes/loss_ab.py TAG [gist llama8b h2048]
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())  # (the tree under test)
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from loss_bench import inputs, warm_up  # noqa: E402
from optim_bench import event_ms  # noqa: E402

import fuser  # noqa: E402
import fuser.losses  # noqa: E402

VARIANTS = {
    "auto": {},
    "lean": dict(memory="lean"),
    "main_grad auto": dict(accumulate_into="main_grad"),
    "main_grad lean": dict(accumulate_into="main_grad", memory="lean"),
}


def config(tag: str, cfg: str) -> None:
    x, w, y, _ = inputs(cfg)
    x.grad = torch.zeros_like(x)
    w.grad = torch.zeros_like(w)
    w.main_grad = torch.zeros(w.shape, device="cuda")
    warm_up()
    for name, kw in VARIANTS.items():

        def step(kw=kw):
            fuser.losses.cross_entropy(x, w, y, **kw).backward()

        step()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        ms = [event_ms(step, warmup=1, rep=10) for _ in range(2)]
        row = dict(tree=tag, cfg=cfg, variant=name, ms=[round(m, 2) for m in ms], peak_gib=round(peak, 3))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    for c in sys.argv[2:] or ["gist", "llama8b", "h2048"]:
        config(sys.argv[1], c)
        torch.cuda.empty_cache()
