"""The lean schedule's matmul kernels alone, beside cuBLAS on the same shapes (H100, bf16).

For each config (`gist` T=32768 H=768 V=128256, `llama8b` T=8192 H=4096 V=128256) and each
block shape: the cross-entropy sweep kernel (logits tile + online logsumexp, nothing stored)
and the gradient kernel (logits tile recomputed, d loss / d logits stored as bf16, V in
one slice; with `Tiles.tma`, persistent programs through tensor descriptors) against
`torch.mm(x, w.T)` storing bf16 logits, in TFLOP/s of the 2*T*H*V product, and each
gradient kernel's output against the first's (every 97th row); then
`fuser.losses.cross_entropy` without gradients, `memory="auto"` and `"lean"`.
Prints one JSON line per measurement and writes `loss_kernels_<date>.json` and `.md` under
--out.

    python benchmarks/probes/loss_kernels.py [gist llama8b] [--tma] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import fuser  # noqa: E402
import fuser.losses  # noqa: E402
from fuser.cache import load_kernel  # noqa: E402
from fuser.codegen.loss import shard_layout  # noqa: E402
from fuser.codegen.loss_matmul import Tiles  # noqa: E402
from fuser.ir.loss import lower_loss  # noqa: E402
from fuser.runtime.loss.fused import shares  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from loss_bench import CONFIGS, warm_up  # noqa: E402
from optim_bench import event_ms  # noqa: E402

TILES = [
    Tiles(128, 128, 64, num_warps=8, num_stages=3),
    Tiles(128, 128, 64, num_warps=4, num_stages=4),
    Tiles(128, 256, 64, num_warps=8, num_stages=3),
    Tiles(128, 256, 64, num_warps=8, num_stages=4),
    Tiles(256, 128, 64, num_warps=8, num_stages=3),
    Tiles(64, 256, 64, num_warps=4, num_stages=4),
    # the gradient kernel alone: persistent programs, tiles through tensor descriptors (TMA)
    Tiles(256, 128, 64, num_warps=8, num_stages=3, tma=True),
    Tiles(256, 128, 64, group_m=16, num_warps=8, num_stages=3, tma=True),
    Tiles(128, 256, 64, num_warps=8, num_stages=3, tma=True),
    Tiles(128, 256, 64, group_m=16, num_warps=8, num_stages=3, tma=True),
    Tiles(128, 128, 64, num_warps=8, num_stages=4, tma=True),
]


def timed(fn, *args, **kwargs) -> float:
    """Median ms of ``fn(*args, **kwargs)``."""
    return event_ms(lambda: fn(*args, **kwargs), warmup=3, rep=10)


# `--tma`: the defaults (sweeps [128, 256], gradient [256, 128]) and the TMA shapes only
DEFAULTS = [TILES[2], TILES[4]]


def run(cfg: str, rows: list, shapes=TILES) -> None:
    t, h, v = CONFIGS[cfg]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(v, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    y = torch.randint(0, v, (t,), device="cuda", generator=g)
    flop = 2 * t * h * v
    logits = torch.empty(t, v, device="cuda", dtype=torch.bfloat16)
    warm_up()
    ms = timed(torch.mm, x, w.t(), out=logits)
    rows.append(
        dict(
            cfg=cfg,
            kernel="cuBLAS mm (bf16 logits stored)",
            ms=round(ms, 3),
            tflops=round(flop / ms / 1e9, 1),
        )
    )
    print(json.dumps(rows[-1]), flush=True)
    f = fuser.compile(fuser.losses.CROSS_ENTROPY)
    plan = lower_loss(fuser.losses.CROSS_ENTROPY, "bf16")
    layout = shard_layout(plan)
    red = torch.zeros(t, layout.red_width, device="cuda")
    hyper = torch.zeros(1, device="cuda")
    scale = torch.full((1,), 1.0 / t, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    first = None
    for tiles in shapes:
        name = f"{tiles.bm}x{tiles.bn}x{tiles.bk} w{tiles.num_warps} s{tiles.num_stages}"
        if tiles.tma:
            name += f" g{tiles.group_m} TMA"
        try:
            shape = tiles.for_hidden(h)
            (sweep,), grad = f.matmul_kernel_sources("bf16", shape, grad_tiles=shape)
            sweep, grad = load_kernel(sweep, x.device), load_kernel(grad, x.device)
            tm, tn = -(-t // tiles.bm), -(-v // tiles.bn)
            split = shares(tm, tn, sms)
            part = torch.empty(split, t, layout.part_widths[0], device="cuda")
            tail = (hyper, t, h, v, 0, v, -100)
            if not tiles.tma:  # (the sweeps take no descriptors)
                ms = timed(sweep, (tm, split), x, w, w, y, red, part, *tail)
                rows.append(
                    dict(
                        cfg=cfg,
                        kernel=f"sweep {name} (shares {split})",
                        ms=round(ms, 3),
                        tflops=round(flop / ms / 1e9, 1),
                    )
                )
                print(json.dumps(rows[-1]), flush=True)
            resid = torch.zeros(t, device="cuda")  # (the target column's residue, unread here)
            grad_args = (x, w, w, y, red, scale, 0, logits, logits.stride(0), resid, *tail)
            logits.fill_(float("nan"))
            ms = timed(grad, (min(tm * tn, sms) if tiles.tma else tm * tn,), *grad_args)
            # every 97th token's row of d loss / d logits against the first shape's
            sample = logits[::97].float()
            first = sample if first is None else first
            diff = ((sample - first).abs().max() / first.abs().max()).item()
            rows.append(
                dict(
                    cfg=cfg,
                    kernel=f"grad {name}" + (" persistent" if tiles.tma else ""),
                    ms=round(ms, 3),
                    tflops=round(flop / ms / 1e9, 1),
                    diff=diff,
                )
            )
            print(json.dumps(rows[-1]), flush=True)
        except Exception as e:  # one failing shape must not hide the others
            rows.append(dict(cfg=cfg, kernel=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
            print(json.dumps(rows[-1]), flush=True)
    del logits
    torch.cuda.empty_cache()
    # The loss without gradients (evaluation): the row kernel over chunks of stored logits
    # (auto) against the sweep alone (lean).
    for memory in ("auto", "lean"):
        with torch.no_grad():
            fuser.losses.cross_entropy(x, w, y, memory=memory)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            ms = timed(fuser.losses.cross_entropy, x, w, y, memory=memory)
            extra = (torch.cuda.max_memory_allocated() - base) / (1 << 30)
        name = f"loss without grad, memory={memory} (extra peak {extra:.3f} GiB)"
        rows.append(dict(cfg=cfg, kernel=name, ms=round(ms, 3), tflops=round(flop / ms / 1e9, 1)))
        print(json.dumps(rows[-1]), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="*", default=["gist", "llama8b"])
    ap.add_argument("--tma", action="store_true", help="only the default shapes and the TMA ones")
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
    )
    args = ap.parse_args(argv)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    print(json.dumps(meta), flush=True)
    rows: list = []
    for cfg in args.configs:
        run(cfg, rows, DEFAULTS + [t for t in TILES if t.tma] if args.tma else TILES)
    os.makedirs(args.out, exist_ok=True)
    stem = f"loss_kernels_{datetime.date.today().isoformat()}"
    with open(os.path.join(args.out, f"{stem}.json"), "w") as fh:
        json.dump(dict(meta=meta, rows=rows), fh, indent=1)
    lines = [
        f"# Lean-schedule matmul kernels beside cuBLAS ({meta['gpu']}, torch {meta['torch']}, "
        f"triton {meta['triton']})",
        "",
        "| config | kernel | ms | TFLOP/s (2·T·H·V) | gradient vs the first shape's (max rel) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        diff = f"{r['diff']:.1e}" if "diff" in r else ""
        lines.append(
            f"| {r['cfg']} | {r['kernel']} | {r.get('ms', r.get('error'))} | {r.get('tflops', '')} | {diff} |"
        )
    lines += ["", f"Command: `python {' '.join(['benchmarks/probes/loss_kernels.py', *sys.argv[1:]])}`"]
    with open(os.path.join(args.out, f"{stem}.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
