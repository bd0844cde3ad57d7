"""Device time of each kind of launch in fuser's Newton–Schulz (5 iterations) over
TinyLlama-1.1B's 154 hidden matrices, by torch.profiler, with each kind's rate in TFLOP/s
of the flops it computes (the symmetric products: the tiles on and above the diagonal).

    python benchmarks/probes/profile_ns.py [--out DIR] [--tag _v2]

Writes `profile_ns_<date><tag>.json` and `.md` under --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import triton  # noqa: E402
from muon_bench import llama1b_shapes, split  # noqa: E402

from fuser.codegen.matrix import GPU_MATRIX_TILES  # noqa: E402
from fuser.ir.optim import ReductionPlan  # noqa: E402
from fuser.runtime.matrix import Workspace, build_matrices, extent, shape_groups  # noqa: E402

STEPS, CALLS = 5, 5


def computed_tflop(shapes) -> dict[str, float]:
    """TFLOP one call computes in each kind of launch."""
    bm = GPU_MATRIX_TILES.bm
    out = collections.Counter()
    for s in shapes:
        m, n = sorted((s[0], int(torch.Size(s[1:]).numel())))
        t = -(-m // bm)
        share = t * (t + 1) / 2 / t**2  # tiles on and above the diagonal
        out["ns_gram"] += STEPS * 2 * m * m * n * share / 1e12
        out["ns_poly"] += STEPS * 2 * m**3 * share / 1e12
        out["bmm (B X)"] += STEPS * 2 * m * m * n / 1e12
    return out


def kind(name: str) -> str:
    for k in ("ns_gram", "ns_poly"):
        if k in name:
            return k
    return "bmm (B X)" if ("gemm" in name or "nvjet" in name or "cutlass" in name) else name[:50]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    shapes = [tuple(p.shape) for p in split([torch.empty(s, device="meta") for s in llama1b_shapes()])[0]]
    plan = ReductionPlan(None, "orthogonalize", 0, -1, -1, args=(STEPS, 3.4445, -4.7750, 2.0315, 1e-7))
    (work,), _ = build_matrices([plan], shapes, torch.device("cuda"))
    Workspace("cuda", extent([work]), shape_groups([work])).acquire()  # held to the end
    for sg in work.groups:
        sg.x.normal_()
    for _ in range(3):
        work()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            work()
        torch.cuda.synchronize()
    ms = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            ms[kind(e.name)] += e.device_time_total / CALLS / 1000
    tflop = computed_tflop(shapes)
    rows = [dict(kind=k, ms=round(v, 3), tflops=round(tflop[k] / v * 1e3, 1) if k in tflop else None)
            for k, v in ms.most_common()]  # fmt: skip
    write(args, rows, argv)


def write(args, rows, argv):
    date = datetime.date.today().isoformat()
    meta = dict(
        date=date,
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        command="python "
        + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])),
    )
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"profile_ns_{date}{args.tag}")
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    total = sum(r["ms"] for r in rows)
    lines = [f"# Newton–Schulz launches by kind, {meta['device']}, {date}", "",
             f"torch {meta['torch']}, triton {meta['triton']}. Command: `{meta['command']}`", "",
             "| launch | ms per call | TFLOP/s of the flops it computes |", "|---|---|---|"]  # fmt: skip
    lines += [f"| {r['kind']} | {r['ms']} | {r['tflops'] or ''} |" for r in rows]
    lines.append(f"| total | {round(total, 3)} | |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
