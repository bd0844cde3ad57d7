"""Factored optimizers on TinyLlama-1.1B's shapes: fuser's Adafactor and CAME beside their
anchors, in this process, on this GPU.

Rows: `adafactor_llama1b` (fuser.optim.Adafactor; torch.optim.Adafactor foreach=True and
foreach=False) and `came_llama1b` (fuser.optim.CAME; pytorch-optimizer's CAME when
installed), fp32 parameters and gradients. Each row gives the median step time (CUDA
events), the host wall time per step, the bandwidth floor of the step and the fraction of
it reached. The floor is the traffic no implementation avoids, over the copy bandwidth
measured in this run: read p and g and write p (12 bytes an element), plus CAME's
momentum exp_avg read and written (8 more); the row and column states are negligible.
The pass floor is the traffic of the fewest passes over the tensors that the rule's
data dependencies allow, on tensors larger than the GPU's caches: a value that every
element's update needs and that reads every element (a row or column mean, an RMS) is a
pass of its own, before the update's. Adafactor: the row and column sums of g**2 and the
parameter's RMS (read g and p), the RMS of the unclipped update (read g), then the update
(read g and p, write p): 8 + 4 + 12 = 24 bytes. CAME: the sums of g**2 (read g), the
update's RMS (read g), the momentum and the row and column sums of the residual (read g
and exp_avg, write exp_avg), then the update (read exp_avg and p, write p): 4 + 4 + 12 +
12 = 32 bytes.
Before timing, one step of fuser and of the anchor on the same inputs is compared
(relative error of the parameters).

    python benchmarks/shaped_bench.py [--out DIR] [--tag _v2] [--steps 20]
    python benchmarks/shaped_bench.py --smoke --out /tmp/x   # CPU, tiny shapes, interpreter

Writes `shaped_<date><tag>.json` and `.md` under --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from optim_bench import llama1b_shapes  # noqa: E402
from timing import copy_bandwidth, step_ms, sync, wall_ms  # noqa: E402

import fuser  # noqa: E402

SMOKE_SHAPES = [(24, 19), (19,), (16, 21), (24,)]
# Bytes an element that every implementation moves: p read and written, g read, and the
# element states read and written.
FLOOR_BYTES = {"adafactor": 12, "came": 20}
# Bytes an element of the fewest passes the rule's dependencies allow (see above).
PASS_BYTES = {"adafactor": 24, "came": 32}


def _came_reference():
    try:
        import pytorch_optimizer
    except ImportError as e:
        return None, f"pytorch_optimizer not installed ({e})"
    return pytorch_optimizer.CAME, None


def implementations(workload):
    """(name, builder or None, error) for each implementation of a workload."""
    if workload == "adafactor":
        return [
            ("fuser.optim.Adafactor", lambda ps: fuser.optim.Adafactor(ps, lr=1e-2), None),
            ("torch.Adafactor foreach", lambda ps: torch.optim.Adafactor(ps, lr=1e-2, foreach=True), None),
            ("torch.Adafactor for-loop", lambda ps: torch.optim.Adafactor(ps, lr=1e-2, foreach=False), None),
        ]
    came, error = _came_reference()
    return [
        ("fuser.optim.CAME", lambda ps: fuser.optim.CAME(ps, lr=1e-3), None),
        ("pytorch_optimizer.CAME", came and (lambda ps: came(ps, lr=1e-3)), error),
    ]


def make(shapes, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    ps = [torch.randn(s, device=device, generator=g) * 0.02 for s in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape, device=device, generator=g) * 1e-3
    return ps


def one_step_error(build, anchor, shapes, device):
    """Relative error between fuser's parameters and the anchor's after one step from the
    same parameters and gradients."""
    ours, theirs = make(shapes, device, 1), make(shapes, device, 1)
    build(ours).step()
    anchor(theirs).step()
    num = sum(((a - b).double().norm() ** 2).item() for a, b in zip(ours, theirs))
    den = sum((b.double().norm() ** 2).item() for b in theirs)
    return (num / den) ** 0.5


def run(workload, shapes, device, bw, steps, rows):
    n = sum(torch.Size(s).numel() for s in shapes)
    floor_ms = n * FLOOR_BYTES[workload] / (bw * 1e12) * 1e3
    pass_floor_ms = n * PASS_BYTES[workload] / (bw * 1e12) * 1e3
    impls = implementations(workload)
    fuser_build = impls[0][1]
    for name, build, error in impls:
        row = dict(workload=f"{workload}_{'smoke' if len(shapes) < 10 else 'llama1b'}", impl=name)
        if build is None:
            rows.append(dict(row, error=error))
            print(json.dumps(rows[-1]), flush=True)
            continue
        rel_err = None if build is fuser_build else one_step_error(fuser_build, build, shapes, device)
        ps = make(shapes, device, 0)
        opt = build(ps)
        t0 = time.perf_counter()
        opt.step()
        sync(device)
        first_s = time.perf_counter() - t0
        ms = step_ms(opt.step, device, steps)
        row.update(
            ms=round(ms, 4),
            wall_ms=round(wall_ms(opt.step, device, steps), 4),
            floor_ms=round(floor_ms, 4),
            # from the rounded figures the row shows, so that they agree to the last digit
            pct_of_floor=round(100 * round(floor_ms, 4) / round(ms, 4), 1),
            pass_floor_ms=round(pass_floor_ms, 4),
            pct_of_pass_floor=round(100 * round(pass_floor_ms, 4) / round(ms, 4), 1),
            first_step_s=round(first_s, 3),
            tensors=len(shapes),
            params=n,
            rel_err_vs_fuser=rel_err,
            device=device_name(device),
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
        del ps, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()


def device_name(device):
    return torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)"


def write(rows, meta, out, tag):
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"shaped_{meta['date']}{tag}")
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [
        f"# Factored optimizers (Adafactor, CAME), {meta['device']}, {meta['date']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, copy bandwidth {meta['copy_TBps']} TB/s. "
        f"Command: `{meta['command']}`",
        "",
        "| workload | impl | median ms | wall ms/step | floor ms | % of floor | pass floor ms "
        "| % of pass floor | vs fuser ms | rel err |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    fuser_ms = {r["workload"]: r["ms"] for r in rows if r["impl"].startswith("fuser") and "ms" in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['workload']} | {r['impl']} | {r['error']} | | | | | | | |")
            continue
        ratio = round(r["ms"] / fuser_ms[r["workload"]], 2) if r["workload"] in fuser_ms else ""
        err = "" if r["rel_err_vs_fuser"] is None else f"{r['rel_err_vs_fuser']:.1e}"
        lines.append(
            f"| {r['workload']} | {r['impl']} | {r['ms']} | {r['wall_ms']} | {r['floor_ms']} | "
            f"{r['pct_of_floor']} | {r['pass_floor_ms']} | {r['pct_of_pass_floor']} | {ratio} | {err} |"
        )
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--tag", default="", help="suffix of the output files' names")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per implementation")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU through the interpreter")
    args = ap.parse_args(argv)
    if not (args.smoke or torch.cuda.is_available()):
        ap.error("needs a GPU (or --smoke)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = SMOKE_SHAPES if args.smoke else llama1b_shapes()
    steps = 2 if args.smoke and device.type == "cpu" else args.steps
    bw = copy_bandwidth(device, 1 << 16 if args.smoke else 1 << 28)
    rows = []
    run("adafactor", shapes, device, bw, steps, rows)
    run("came", shapes, device, bw, steps, rows)
    meta = dict(
        date=datetime.date.today().isoformat(),
        device=device_name(device),
        torch=torch.__version__,
        triton=triton.__version__,
        copy_TBps=round(bw, 4),
        command=" ".join(["python", os.path.relpath(__file__), *(sys.argv[1:] if argv is None else argv)]),
    )
    write(rows, meta, args.out, args.tag)


if __name__ == "__main__":
    main()
