"""``distill(kind="jsd")`` at the `distill_jsd` workload's shape, in one process: the
built-in rule beside the JSD written with ``log m`` about the larger log-probability and the
hard loss always in the rule (the form before 2026-12-08: two more exps a logit in the
second sweep, three more in the gradient's), and the goal's reference (fuser's
cross-entropy plus one teacher logits product); then the kernels each spends its time in,
and those of the DPO example with ``memory="fast"``.

    python benchmarks/probes/distill_ab.py [--rounds 2] [--smoke]

``--smoke``: tiny shapes on the CPU through Triton's interpreter, the two rules' losses
compared, no timing.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from optim_bench import event_ms  # noqa: E402
from post_training import dpo_loss  # noqa: E402
from post_training_bench import distill_inputs  # noqa: E402

import fuser  # noqa: E402
import fuser.losses  # noqa: E402
from fuser.losses.builtins import _DISTILL, _HARD  # noqa: E402

PREVIOUS = fuser.loss(
    _DISTILL
    + """\
    ls = s - lse_s
    lt = u - lse_t
    d = lt - ls
    lm = (ls + lt + abs(d)) / 2 + log((1 - beta) * exp(-(d + abs(d)) / 2) + beta * exp((d - abs(d)) / 2))
    soft = beta * sum(exp(lt) * (lt - lm)) + (1 - beta) * sum(exp(ls) * (ls - lm))
"""
    + _HARD,
    name="distill_jsd_about_the_larger",
    hyper=dict(beta=0.5, temperature=1.0, hard_weight=0.0),
)


def ms(fn, rep=10) -> float:
    return event_ms(fn, warmup=3, rep=rep)


def kernels(name: str, fn, top: int = 10) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    print(f"==== {name} (3 calls)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    t, h, v = (9, 16, 61) if args.smoke else (8192, 4096, 128256)
    x, w, xt, wt, y = distill_inputs(t, h, h, v, device)
    previous = fuser.compile(PREVIOUS)
    steps = {
        "built-in": lambda: fuser.losses.distill(x, w, xt, wt, y, kind="jsd", beta=0.5),
        "about the larger": lambda: previous(x, w, y, teacher_hidden=xt, teacher_weight=wt, beta=0.5),
    }
    with torch.no_grad():
        a, b = (float(f()) for f in steps.values())
    print(f"loss built-in {a:.8f}, about the larger {b:.8f}: relative {abs(a - b) / abs(b):.2e}")
    if args.smoke:
        return
    x.grad, w.grad = torch.zeros_like(x), torch.zeros_like(w)
    timed = {name: (lambda f=f: f().backward()) for name, f in steps.items()}
    timed["cross_entropy"] = lambda: fuser.losses.cross_entropy(x, w, y).backward()
    timed["teacher logits"] = lambda: torch.matmul(xt, wt.T)
    for r in range(args.rounds):
        got = {name: ms(f) for name, f in timed.items()}
        ref = got["cross_entropy"] + got["teacher logits"]
        ratios = ", ".join(f"{k} {got[k] / ref:.3f}" for k in steps)
        times = ", ".join(f"{k} {m:.2f} ms" for k, m in got.items())
        print(f"round {r}: {times}; x reference: {ratios}")
    for name in steps:
        kernels(name, timed[name])
    xd = x.detach().reshape(8, t // 8, h).clone().requires_grad_()
    wr = (w.detach() + 0.002 * torch.randn_like(w)).contiguous()
    yd = y.reshape(8, t // 8).clone()
    yd[:, :128] = -100
    xd.grad = torch.zeros_like(xd)

    def dpo_fast():
        dpo_loss(xd, w, xt.reshape(xd.shape), wr, yd, beta=0.1, memory="fast").backward()

    print(f"dpo memory=fast {ms(dpo_fast):.2f} ms")
    kernels("dpo memory=fast", dpo_fast, top=12)


if __name__ == "__main__":
    main()
