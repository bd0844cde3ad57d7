"""The floor under the linear + cross-entropy goals, measured: cuBLAS's time for each of the
three products of a linear + loss (bf16, fp32 accumulation) at the shapes a schedule gives
them, beside fuser's whole step in the same process.

For a config (T tokens, hidden H, vocabulary V) the products are ``Z = X @ W.T`` (the
logits), ``dX = dZ @ W`` and ``dW = dZ.T @ X``, each ``2·T·H·V`` floating-point operations:

* whole: each product once over all tokens (the logits stored in bf16, ``T × V``: 8 GiB at
  gist, so only a schedule allowed that memory can take them whole), ``dX`` and ``dW``
  written in bf16 and, as a schedule that adds chunks needs them, in fp32;
* chunked: over chunks of ``chunk_rows`` tokens (the length fuser's ``chunks`` and
  ``scaled`` schedules take), as they call them: the logits stored in bf16, ``dX`` into an
  fp32 block, ``dW`` added into the fp32 ``[V, H]`` accumulator (``addmm(out_dtype=fp32)``).

The three (and four, the logits twice) are also timed together as a step issues them,
whole and back to back, or each chunk's in turn (the GPU then runs them in one stretch, at
the clock it holds under that load: an H200 at its 700 W cap averaged 1680-1700 MHz of 1980).
Each product's time is the median of CUDA events around all its calls of one step, queued
behind a ~1.5 ms spin of the GPU so that the host's launches are hidden (``device_ms``).
The floors: the three products timed apart, each at its faster form, and timed together
(a schedule that keeps no logits between forward and backward computes them twice: four). fuser's step is
timed both ways: by events around a step the host starts on an idle GPU (how
``loss_bench.py`` times every implementation), and queued behind the spin (the step's GPU
time, what a training step pays when the host runs ahead, less what the host's one read of
the ignored targets' count exposes).

    python benchmarks/loss_floor.py [gist] [llama8b] [--out results.md]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fuser.losses  # noqa: E402
from fuser.runtime.loss.chunked import accumulate_mm, chunk_rows  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loss_bench import CONFIGS, TARGETS, inputs, warm_up  # noqa: E402
from timing import device_ms, step_ms  # noqa: E402

REP = 10
STEPS = {
    "lce_{cfg}": {},
    "lce_{cfg}_lean": dict(memory="lean"),
    "lce_{cfg}_main_grad": dict(accumulate_into="main_grad"),
}


def products(cfg: str) -> list[dict]:
    """Each product's time in each form, one row per (product, form)."""
    t, h, v = CONFIGS[cfg]
    dev = torch.device("cuda")
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    w = torch.randn(v, h, device=dev, dtype=torch.bfloat16) * 0.02
    dz = torch.rand(t, v, device=dev, dtype=torch.bfloat16)  # (E / dZ: positive, like exp)
    flop = 2 * t * h * v
    c = chunk_rows(t, h, v, 2)
    zc = torch.empty(c, v, device=dev, dtype=torch.bfloat16)
    dxc = torch.empty(c, h, device=dev, dtype=torch.float32)
    gw = torch.zeros(v, h, device=dev, dtype=torch.float32)
    spans = [(s, min(s + c, t)) for s in range(0, t, c)]

    def logits_at(s, e):
        torch.mm(x[s:e], w.t(), out=zc[: e - s])

    def dx_at(s, e):
        dxc[: e - s].zero_()
        accumulate_mm(dxc[: e - s], dz[s:e], w)

    def dw_at(s, e):
        accumulate_mm(gw, dz[s:e].t(), x[s:e])

    def chunks(*parts):  # (each chunk's parts in turn, as the schedule orders them)
        def run():
            for s, e in spans:
                for part in parts:
                    part(s, e)

        return run

    def whole_logits():
        torch.mm(x, w.t())

    def whole_three():
        whole_logits()
        torch.mm(dz, w)
        torch.mm(dz.t(), x)

    def whole_four():
        whole_logits()
        whole_three()

    def chunked_four():  # (the logits of every chunk again before the gradients, as a lean schedule)
        chunks(logits_at)()
        chunks(logits_at, dx_at, dw_at)()

    forms = {
        ("logits", "whole, bf16 out"): whole_logits,
        ("logits", f"chunks of {c}, bf16 out"): chunks(logits_at),
        ("dX", "whole, bf16 out"): lambda: torch.mm(dz, w),
        ("dX", "whole, fp32 out"): lambda: torch.mm(dz, w, out_dtype=torch.float32),
        ("dX", f"chunks of {c}, fp32 out"): chunks(dx_at),
        ("dW", "whole, bf16 out"): lambda: torch.mm(dz.t(), x),
        ("dW", "whole, fp32 out"): lambda: torch.mm(dz.t(), x, out_dtype=torch.float32),
        ("dW", f"chunks of {c}, added to fp32"): chunks(dw_at),
        ("all three", "whole, bf16 out, back to back"): whole_three,
        ("all three", f"chunks of {c}, each chunk's three in turn"): chunks(logits_at, dx_at, dw_at),
        ("all four", "whole, bf16 out, back to back"): whole_four,
        ("all four", f"chunks of {c}, the logits of every chunk, then each chunk's three"): chunked_four,
    }
    rows = []
    for (prod, form), fn in forms.items():
        for _ in range(2):
            fn()
        ms = device_ms(fn, dev, REP)
        rate = {"all three": 3, "all four": 4}.get(prod, 1) * flop / ms / 1e9
        rows.append(dict(cfg=cfg, product=prod, form=form, ms=round(ms, 3), tflops=round(rate, 1)))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def steps(cfg: str) -> list[dict]:
    """fuser's step (forward + backward) by events from an idle GPU and behind the spin."""
    x, w, y, _ = inputs(cfg)
    x.grad, w.grad = torch.zeros_like(x), torch.zeros_like(w)
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    dev = x.device
    rows = []
    for name, kw in STEPS.items():

        def step(kw=kw):
            fuser.losses.cross_entropy(x, w, y, **kw).backward()

        for _ in range(2):
            step()
        idle = step_ms(step, dev, REP)
        busy = device_ms(step, dev, REP)
        workload = name.format(cfg=cfg)
        rows.append(dict(cfg=cfg, workload=workload, events_ms=round(idle, 2), gpu_ms=round(busy, 2)))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def floors(cfg: str, prods: list[dict], stepped: list[dict]) -> list[str]:
    """The table of floors against the goals and fuser's step."""
    best = {p: min(r["ms"] for r in prods if r["product"] == p) for p in ("logits", "dX", "dW")}  # (apart)
    three = best["logits"] + best["dX"] + best["dW"]
    four = three + best["logits"]
    c3 = sum(r["ms"] for r in prods if r["form"].startswith("chunks") and r["product"] in best)

    def together(n: str, form: str) -> float:
        return next(r["ms"] for r in prods if r["product"] == n and r["form"].startswith(form))

    whole3, chunk3 = together("all three", "whole"), together("all three", "chunks")
    lines = [
        f"| `lce_{cfg}` | three, each at its best form: {three:.2f} (in chunks: {c3:.2f}); "
        f"timed together: whole {whole3:.2f}, in chunks {chunk3:.2f} |",
        f"| `lce_{cfg}_lean`, `_main_grad` | four (the logits twice): {four:.2f}; timed together: "
        f"whole {together('all four', 'whole'):.2f}, in chunks {together('all four', 'chunks'):.2f} |",
    ]
    lines = [f"| {cfg} goal | products at cuBLAS's measured rates (ms) |", "|---|---|", *lines]
    lines += ["", "| workload | goal (ms) | fuser, events from an idle GPU | fuser, GPU time behind a spin |"]
    lines += ["|---|---|---|---|"]
    for r in stepped:
        goal = TARGETS.get(r["workload"], (None,))[0]
        lines.append(f"| `{r['workload']}` | {goal} | {r['events_ms']} | {r['gpu_ms']} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="*", help=f"any of {list(CONFIGS)} (default: gist llama8b)")
    ap.add_argument("--out", help="also write the tables as markdown here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("loss_floor.py times cuBLAS on a GPU; none is visible", file=sys.stderr)
        return 1
    name = torch.cuda.get_device_name()
    head = f"{name}, torch {torch.__version__}, Triton {triton.__version__}"
    print(head, flush=True)
    warm_up()
    md = [f"# Products of a linear + cross-entropy at cuBLAS's rates ({head})", ""]
    for cfg in args.configs or ["gist", "llama8b"]:
        prods = products(cfg)
        torch.cuda.empty_cache()
        stepped = steps(cfg)
        torch.cuda.empty_cache()
        md += [f"## {cfg} {CONFIGS[cfg]}", "", "| product | form | ms | TFLOP/s |", "|---|---|---|---|"]
        md += [f"| {r['product']} | {r['form']} | {r['ms']} | {r['tflops']} |" for r in prods]
        md += ["", *floors(cfg, prods, stepped), ""]
    text = "\n".join(md)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
