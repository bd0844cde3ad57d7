"""What the memory system gives the 8-bit AdamW steps' mix of streams, without their
arithmetic: a Triton kernel that reads and writes, in place, the same streams as fuser's
step over one flat range of TinyLlama-1.1B's parameter count (bf16 parameters, bf16
gradients read, uint8 codes of m and v, an fp32 scale per 32 codes of each, and for
`m24` the int8 low bits of the master weights), each stored value a trivial function of
the loaded ones. Beside it, in the same process: fuser's AdamW with the same layout on the
201 tensors, and the copy bandwidth that state_bench.py's floors are taken from.

    PYTHONPATH=. python benchmarks/probes/stream_floor.py [--out DIR] [--tag _x]

Rows: per layout and launch shape, the probe's median ms (CUDA events around one launch
queued behind a spin, 20 of them) and its percentage of the copy-rate floor; fuser's step
(`timing.device_ms`, the same measure as state_bench.py's `device ms`) against the copy
floor and against the best probe. Writes `stream_floor_<date><tag>.json` and `.md`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from optim_bench import llama1b_shapes  # noqa: E402
from state_bench import ADAMW, FLOOR_BYTES, make  # noqa: E402
from timing import copy_bandwidth, device_ms  # noqa: E402

import fuser  # noqa: E402
import fuser.optim  # noqa: E402

LAYOUTS = {
    "q8": ("adamw_q8_llama1b", dict(state_dtype="q8")),
    "m24": ("adamw_q8_master24_llama1b", dict(state_dtype="q8", master_weights="bf16+int8")),
}
SHAPES = [(8192, 512, 2), (8192, 1024, 4), (4096, 1024, 4), (16384, 2048, 8), (2048, 2048, 8)]


@triton.jit
def _streams(p_ptr, g_ptr, m_ptr, v_ptr, ms_ptr, vs_ptr, r_ptr, n, HAS_R: tl.constexpr,
             BLOCK: tl.constexpr, SUB: tl.constexpr):  # fmt: skip
    base = tl.program_id(0).to(tl.int64) * BLOCK
    for s in tl.static_range(0, BLOCK, SUB):
        offs = base + s + tl.arange(0, SUB)
        mask = offs < n
        p = tl.load(p_ptr + offs, mask=mask)
        g = tl.load(g_ptr + offs, mask=mask)
        m = tl.load(m_ptr + offs, mask=mask)
        v = tl.load(v_ptr + offs, mask=mask)
        tl.store(p_ptr + offs, p + g, mask=mask)
        tl.store(m_ptr + offs, m ^ 1, mask=mask)
        tl.store(v_ptr + offs, v ^ 2, mask=mask)
        if HAS_R:
            r = tl.load(r_ptr + offs, mask=mask)
            tl.store(r_ptr + offs, r ^ 3, mask=mask)
        so = (base + s) // 32 + tl.arange(0, SUB // 32)
        smask = so < n // 32
        a = tl.load(ms_ptr + so, mask=smask)
        b = tl.load(vs_ptr + so, mask=smask)
        tl.store(ms_ptr + so, a * 0.5, mask=smask)
        tl.store(vs_ptr + so, b * 0.5, mask=smask)


def probe_ms(n: int, has_r: bool, shape, device) -> float:
    block, sub, warps = shape
    g = torch.Generator(device=device).manual_seed(0)
    p = torch.randn(n, device=device, generator=g).bfloat16()
    gr = torch.randn(n, device=device, generator=g).bfloat16()
    m = torch.randint(0, 255, (n,), device=device, dtype=torch.uint8, generator=g)
    v = torch.randint(0, 255, (n,), device=device, dtype=torch.uint8, generator=g)
    r = torch.randint(-128, 127, (n,), device=device, dtype=torch.int8, generator=g) if has_r else m
    ms, vs = torch.rand(n // 32, device=device, generator=g), torch.rand(n // 32, device=device, generator=g)
    grid = (triton.cdiv(n, block),)

    def launch():
        _streams[grid](p, gr, m, v, ms, vs, r, n, HAS_R=has_r, BLOCK=block, SUB=sub, num_warps=warps)

    launch()
    return device_ms(launch, device, rep=20)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    shapes = llama1b_shapes()
    n = sum(torch.Size(s).numel() for s in shapes) // 32 * 32
    bw = copy_bandwidth(device, 1 << 28, rep=20)
    rows = []
    for layout, (workload, opts) in LAYOUTS.items():
        floor = n * sum(FLOOR_BYTES[workload].values()) / (bw * 1e12) * 1e3
        best = None
        for shape in SHAPES:
            ms = probe_ms(n, layout == "m24", shape, device)
            best = ms if best is None else min(best, ms)
            rows.append(
                dict(
                    layout=layout,
                    impl="probe: streams alone",
                    shape=":".join(map(str, shape)),
                    ms=round(ms, 4),
                    floor_ms=round(floor, 4),
                    pct_of_floor=round(100 * floor / ms, 1),
                )
            )
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
        ps = make(shapes, device, 0)
        opt = fuser.optim.AdamW(ps, **opts, **ADAMW)
        opt.step()
        ms = device_ms(opt.step, device, rep=20)
        rows.append(
            dict(
                layout=layout,
                impl="fuser.optim.AdamW",
                shape="default",
                ms=round(ms, 4),
                floor_ms=round(floor, 4),
                pct_of_floor=round(100 * floor / ms, 1),
                pct_of_best_probe=round(100 * best / ms, 1),
            )
        )
        print(json.dumps(rows[-1]), flush=True)
        del ps, opt
        torch.cuda.empty_cache()
    date = datetime.date.today().isoformat()
    meta = dict(
        date=date,
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        copy_TBps=round(bw, 4),
        elements=n,
        command="python benchmarks/probes/stream_floor.py " + " ".join(argv or sys.argv[1:]),
    )
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"stream_floor_{date}{args.tag}")
    with open(base + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"# 8-bit AdamW's streams alone, {meta['device']}, {date}", "",
             f"torch {meta['torch']}, triton {meta['triton']}; copy bandwidth {meta['copy_TBps']} TB/s; "
             f"{n} elements. Command: `{meta['command']}`", "",
             "| layout | impl | BLOCK:SUB:warps | device ms | copy floor ms | % of floor | % of best probe |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['layout']} | {r['impl']} | {r['shape']} | {r['ms']} | {r['floor_ms']} | "
                     f"{r['pct_of_floor']} | {r.get('pct_of_best_probe', '')} |")  # fmt: skip
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
