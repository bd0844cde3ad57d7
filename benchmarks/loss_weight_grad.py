"""A 16-bit ``grad_weight`` with the target column's residue, alone (bf16, GPU).

``grad_weight = dz.T @ hidden`` plus ``resid[t] * hidden[t]`` in row ``y_t``, rounded once,
for the shapes the schedules write it in: ``llama8b_whole`` (T=8192, H=4096, the whole
vocabulary of 128256 rows: the ``whole`` schedule), ``llama8b_lean`` and ``gist_lean`` (one
slice of the lean schedule's backward, at T=8192 H=4096 and T=32768 H=768). Timed in one
process, each the median of 10 after 3 warm-ups:

- ``cublas``: ``torch.mm(dz.T, hidden)`` rounded to bf16, no residue (what the schedules did
  before the residue, and the speed to meet);
- ``blocks``: fuser's fp32 blocks (``SliceTerms.weight_slice`` without the kernel): cuBLAS's
  product into fp32 blocks of 64 MiB, the residue rows, a copy to bf16;
- ``kernel BMxBN...``: fuser's ``render_weight_grad`` kernels (the residue rows written into
  ``grad_weight``, then ``weight_grad_tma``, which adds them to its product) in each block
  shape, ``flat``: its tile loop flattened with the token loop; ``, no residue``: with no
  token's target in the slice.

Every output is compared with the float64 value rounded once to bf16 (the share of elements
that differ from it) and with the float64 value (relative norm error). ``dz`` holds normal
values of 1e-5 rounded to bf16, ``resid`` uniform values below half a bf16 spacing of them,
1 token in 7 has no target. Prints one JSON line per measurement and writes
``loss_weight_grad_<date>.json`` and ``.md`` under --out.

    python benchmarks/loss_weight_grad.py [llama8b_whole llama8b_lean gist_lean] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from functools import partial

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fuser  # noqa: E402
import fuser.losses  # noqa: E402
from fuser.codegen.loss_matmul import WEIGHT_GRAD_FLATTEN, WEIGHT_GRAD_TILES, Tiles, render_weight_grad  # noqa: E402
from fuser.runtime.loss.chunked import logits_buffer  # noqa: E402
from fuser.runtime.loss.fused import slice_cols  # noqa: E402
from fuser.runtime.loss.residue import Residue, SliceTerms, WeightGrad  # noqa: E402
from fuser.runtime.loss.staged import MAIN_GRAD_BUDGET  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from optim_bench import event_ms  # noqa: E402

V = 128256
CONFIGS = {  # name: (T, H, the slice's rows, or None for the whole vocabulary)
    "llama8b_whole": (8192, 4096, None),
    "llama8b_lean": (8192, 4096, "lean"),
    "gist_lean": (32768, 768, "lean"),
}
TILES = [  # (block shape, the tile loop flattened with the token loop)
    (WEIGHT_GRAD_TILES, WEIGHT_GRAD_FLATTEN),
    (Tiles(256, 128, 64, group_m=8, num_warps=8, num_stages=3, tma=True), False),
    (Tiles(128, 256, 64, group_m=16, num_warps=8, num_stages=3, tma=True), False),
    (Tiles(128, 256, 64, group_m=8, num_warps=8, num_stages=2, tma=True), True),
    (Tiles(256, 128, 64, group_m=8, num_warps=8, num_stages=2, tma=True), True),
    (Tiles(128, 128, 64, group_m=8, num_warps=8, num_stages=3, tma=True), True),
]


def label(t: Tiles, flatten: bool) -> str:
    return f"kernel {t.bm}x{t.bn}x{t.bk} g{t.group_m} w{t.num_warps} s{t.num_stages}" + (
        " flat" if flatten else ""
    )


def run(cfg: str, rows: list) -> None:
    n, h, cols = CONFIGS[cfg]
    dev = torch.device("cuda")
    cols = V if cols is None else slice_cols(n, h, 2, 256, MAIN_GRAD_BUDGET)
    v0 = 0 if cols == V else (V // 2) // cols * cols  # a slice from the middle
    torch.manual_seed(0)
    x = torch.randn(n, h, device=dev).bfloat16()
    dz = logits_buffer(n, cols, x)
    dz.copy_(torch.randn(n, cols, device=dev) * 1e-5)
    target = torch.randint(0, V, (n,), device=dev)
    target[::7] = -100
    spacing = dz.float().abs().mean() * 2**-8
    resid = (torch.rand(n, device=dev) - 0.5) * spacing
    resid[target == -100] = 0.0
    f = fuser.compile(fuser.losses.CROSS_ENTROPY)
    residue = Residue(f.residue_sources("bf16"), dev, -100)
    terms = SliceTerms(residue, x, target, 0, V, cols)
    terms.resid.copy_(resid)
    gw = torch.empty(V, h, dtype=torch.bfloat16, device=dev)
    out = gw[v0 : v0 + cols]

    # float64: the product and the rows of the slice's targets
    ref = dz.double().t() @ x.double()
    local = target - v0
    hit = (target != -100) & (local >= 0) & (local < cols)
    ref.index_add_(0, local[hit], resid[hit].double()[:, None] * x[hit].double())
    ref16 = ref.bfloat16()
    flops = 2 * n * h * cols

    def record(kernel: str, fn) -> None:
        out.fill_(float("nan"))
        torch.cuda.synchronize()
        try:
            ms = event_ms(fn, warmup=3, rep=10)
        except Exception as e:  # (a shape that does not compile: recorded, not fatal)
            rows.append(dict(cfg=cfg, kernel=kernel, error=f"{type(e).__name__}: {str(e)[:200]}"))
            print(json.dumps(rows[-1]), flush=True)
            return
        differ = (out != ref16).double().mean().item()
        err = ((out.double() - ref).norm() / ref.norm()).item()
        rows.append(dict(cfg=cfg, kernel=kernel, T=n, H=h, rows=cols, ms=round(ms, 3),
                         tflops=round(flops / ms / 1e9, 1), differ=differ, err=err))  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)

    record("cublas (no residue)", lambda: torch.mm(dz.t(), x, out=out))
    record("blocks", lambda: terms.weight_slice(gw, v0, v0 + cols, dz, x))  # (no kernel: fp32 blocks)
    none = residue.runs(torch.full_like(target, -100), 0, V)  # (no token's target here)
    for t, flatten in TILES:
        kernel = WeightGrad(render_weight_grad("bf16", t, flatten), dev)
        lo, hi = terms.runs.positions([v0, v0 + cols])
        args = (terms.resid, terms.runs, kernel.flags(terms.runs), v0, lo, hi)
        record(label(t, flatten), partial(kernel, out, dz, x, *args))
        if (t, flatten) == TILES[0]:
            args = (terms.resid, none, kernel.flags(none), v0, 0, 0)
            record(label(t, flatten) + ", no residue", partial(kernel, out, dz, x, *args))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="*", default=list(CONFIGS))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    print(json.dumps(meta), flush=True)
    rows: list = []
    for cfg in args.configs:
        run(cfg, rows)
    os.makedirs(args.out, exist_ok=True)
    stem = f"loss_weight_grad_{datetime.date.today().isoformat()}"
    with open(os.path.join(args.out, f"{stem}.json"), "w") as fh:
        json.dump(dict(meta=meta, rows=rows), fh, indent=1)
    lines = [
        f"# A bf16 grad_weight with the target column's residue ({meta['gpu']}, torch {meta['torch']}, "
        f"triton {meta['triton']})",
        "",
        "| config | kernel | rows | ms | TFLOP/s | differs from float64 rounded once | rel. error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['cfg']} | {r['kernel']} | | {r['error']} | | | |")
            continue
        lines.append(
            f"| {r['cfg']} | {r['kernel']} | {r['rows']} | {r['ms']} | {r['tflops']} | "
            f"{r['differ']:.2e} | {r['err']:.3e} |"
        )
    lines += ["", f"Command: `python {' '.join(['benchmarks/loss_weight_grad.py', *sys.argv[1:]])}`"]
    with open(os.path.join(args.out, f"{stem}.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
