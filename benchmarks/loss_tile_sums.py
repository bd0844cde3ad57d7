"""The lean schedule's forward: its sweep kernel against the tile-sums kernel that takes its
place for rules of the scaled schedule's form (bf16, cross-entropy, every token).

For each config (`gist` T=32768 H=768, `llama8b` T=8192 H=4096, `h2048` T=16384 H=2048;
V=128256): the cross-entropy sweep kernel alone as `Fused.forward` launches it; the
tile-sums kernel alone over blocks of `TILE_SUMS_ROWS` tokens; the whole lean forward
(without gradients) with each (`Fused.tile_sums` taken away for the sweeps); and cuBLAS's
`x @ w.T` in blocks of 4096 tokens storing bf16 logits. Three rounds with the order
rotated, medians, TFLOP/s of the 2*T*H*V product; the two forwards' per-token losses are
compared. Needs a CUDA GPU. Writes `loss_tile_sums_<date>.jsonl` under --out.

    python benchmarks/loss_tile_sums.py [gist llama8b h2048] [--out DIR]
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
import fuser.losses  # noqa: E402
from fuser.losses import api  # noqa: E402
from fuser.runtime.loss.choice import choose  # noqa: E402
from fuser.runtime.loss.fused import TILE_SUMS_ROWS, shares  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loss_bench import CONFIGS, warm_up  # noqa: E402
from optim_bench import event_ms  # noqa: E402

RULE = fuser.losses.CROSS_ENTROPY


def launches(cfg: str) -> dict:
    t, h, v = CONFIGS[cfg]
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(v, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    y = torch.randint(0, v, (t,), device="cuda", generator=g)
    f = fuser.compile(RULE)
    hyper = f._hyper_row({}, x.device)
    call = api._Call("bf16", x.device, hyper, -100, t, h, v, 2)
    plan = choose(f._loss_call(call, x, w, memory="lean"))
    new = f._fused_run(call, plan, x, w, None)
    old = f._fused_run(call, plan, x, w, None)
    old.tile_sums = None
    assert new.tile_sums is not None
    ts, p = new.tile_sums, new.processors
    red = torch.zeros(t, old.layout.red_width, device="cuda")
    split = shares(-(-t // old.tiles.bm), -(-v // old.tiles.bn), p)
    part = torch.empty(split, t, old.layout.part_widths[0], device="cuda")
    tm = -(-t // old.tiles.bm)
    sweep = old.sweeps[0]
    tn, rows = -(-v // ts.tiles.bn), min(TILE_SUMS_ROWS, t)
    buf = torch.empty(tn * rows * ts.values.part_width, device="cuda")

    def tile_sums():
        for s in range(0, t, rows):
            m = min(rows, t - s)
            grid = (min(-(-m // ts.tiles.bm) * tn, p),) if ts.tiles.tma else (-(-m // ts.tiles.bm) * tn,)
            pt = buf[: tn * m * ts.values.part_width].view(tn, m, ts.values.part_width)
            ts.kernel(grid, x[s : s + m], w, w, y[s : s + m], red[s : s + m], pt, hyper, m, h, v, 0, v, -100)

    out = torch.empty(min(t, 4096), v, device="cuda", dtype=torch.bfloat16)

    def cublas():
        for s in range(0, t, 4096):
            torch.mm(x[s : s + 4096], w.t(), out=out[: min(4096, t - s)])

    loss_old, loss_new = torch.empty(t, device="cuda"), torch.empty(t, device="cuda")
    old.forward(x, w, None, y, loss_old)
    new.forward(x, w, None, y, loss_new)
    diff = float(((loss_new - loss_old).abs() / loss_old.abs()).max())
    calls = {
        "sweep kernel": lambda: sweep((tm, split), x, w, w, y, red, part, hyper, t, h, v, 0, v, -100),
        "tile-sums kernel": tile_sums,
        "lean forward, sweeps": lambda: old.forward(x, w, None, y, loss_old),
        "lean forward, tile sums": lambda: new.forward(x, w, None, y, loss_new),
        "cuBLAS x @ w.T (bf16 out)": cublas,
    }
    return calls, 2 * t * h * v, diff, str(ts.tiles)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="*", default=["gist", "llama8b", "h2048"])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"loss_tile_sums_{datetime.date.today()}.jsonl")
    head = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__)
    lines = [head]
    print(json.dumps(head), flush=True)
    for cfg in args.configs:
        calls, flops, diff, tiles = launches(cfg)
        warm_up()
        names, times = list(calls), {n: [] for n in calls}
        for r in range(3):
            for n in names[r:] + names[:r]:
                times[n].append(event_ms(calls[n], warmup=2, rep=10))
        for n in names:
            med = sorted(times[n])[1]
            row = dict(cfg=cfg, kernel=n, ms=[round(a, 3) for a in times[n]], median=round(med, 3),
                       tflops=round(flops / med / 1e9, 1))  # fmt: skip
            lines.append(row)
            print(json.dumps(row), flush=True)
        row = dict(cfg=cfg, tile_sums_tiles=tiles, loss_max_rel_diff=diff)
        lines.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    with open(path, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in lines)


if __name__ == "__main__":
    main()
