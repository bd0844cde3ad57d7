"""The scaled kernel and the lean gradient kernel alone, through tensor descriptors, with
one or two persistent programs per multiprocessor (H100, bf16, plain cross-entropy).

With [128, 256] tiles and 8 warps a program takes every register of a multiprocessor, so
its epilogue (the exponentials, the store) and the next tile's products run one after the
other. Smaller programs that fit twice on a multiprocessor can run one's epilogue beside
the other's products. Each row: a `Tiles` shape, the programs per multiprocessor, the
kernel's median time (CUDA events) and TFLOP/s of its 2*T*H*V product, and the largest
difference of its output from the first variant's (every 97th row).

    python benchmarks/loss_occupancy.py [gist llama8b]
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fuser  # noqa: E402
import fuser.losses  # noqa: E402
from fuser.cache import load_kernel  # noqa: E402
from fuser.codegen.loss import shard_layout  # noqa: E402
from fuser.codegen.loss_matmul import WIDE_GRAD_TMA, Tiles  # noqa: E402
from fuser.ir.loss import lower_loss  # noqa: E402
from fuser.runtime.loss.choice import SCALED_TILES_TMA  # noqa: E402
from fuser.runtime.loss.chunked import chunk_rows, logits_buffer  # noqa: E402
from fuser.runtime.loss.fused import slice_cols  # noqa: E402
from fuser.runtime.loss.staged import MAIN_GRAD_BUDGET  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loss_bench import CONFIGS, warm_up  # noqa: E402
from optim_bench import event_ms  # noqa: E402

# (name, tiles, programs per multiprocessor, register cap or 0); `None` tiles: the kernel's
# default. (Compiled for sm_90, the 4-warp shapes take 255 registers a thread, two programs
# a multiprocessor; [128, 128] with 8 warps 162-208, one unless capped at 128.)
W4 = dict(bk=64, num_warps=4)
W8 = dict(bm=128, bn=128, bk=64, num_warps=8)
VARIANTS = (
    ("default", None, 1, 0),
    ("128x128x64 s2 w4", Tiles(bm=128, bn=128, num_stages=2, **W4), 2, 0),
    ("128x128x64 s3 w4", Tiles(bm=128, bn=128, num_stages=3, **W4), 2, 0),
    ("64x256x64 s2 w4", Tiles(bm=64, bn=256, num_stages=2, **W4), 2, 0),
    ("128x128x64 s2 w4", Tiles(bm=128, bn=128, num_stages=2, **W4), 1, 0),
    ("default", None, 2, 0),
    ("128x128x64 s2 w8", Tiles(num_stages=2, **W8), 2, 0),
    ("128x128x64 s2 w8, 128 registers", Tiles(num_stages=2, **W8), 2, 128),
    ("128x128x64 s3 w8, 128 registers", Tiles(num_stages=3, **W8), 2, 128),
    ("default again", None, 1, 0),
)


def report(**row) -> None:
    print(json.dumps(row), flush=True)


def tiles_of(default: Tiles, tiles: Tiles | None, hid: int) -> Tiles:
    if tiles is None:
        return default.for_hidden(hid)
    return dataclasses.replace(tiles, group_m=default.group_m, tma=True).for_hidden(hid)


def capped(source, regs: int):
    return dataclasses.replace(source, max_registers=regs) if regs else source


def scaled(cfg, f, x, w, y, sms) -> None:
    t, h, v = CONFIGS[cfg]
    layout = shard_layout(lower_loss(fuser.losses.CROSS_ENTROPY, "bf16"))
    m = min(chunk_rows(t, h, v, 2), t)
    xc, yc = x[:m], y[:m]
    red = torch.zeros(m, layout.red_width, device="cuda")
    hyper = torch.zeros(1, device="cuda")
    ref = (xc[:, :64].float().sum(1) * 0.02).contiguous()
    flop = 2 * m * h * v
    first = None
    for name, tiles, per_sm, regs in VARIANTS:
        tiles = tiles_of(SCALED_TILES_TMA, tiles, h)
        try:
            kernel = load_kernel(capped(f.scaled_kernel_source("bf16", tiles), regs), x.device)
        except Exception as e:  # noqa: BLE001 - a shape that does not compile is a finding
            report(cfg=cfg, kernel="scaled", variant=name, per_sm=per_sm, error=str(e)[:200])
            continue
        tn = -(-v // tiles.bn)
        e_buf = logits_buffer(m, v, x)
        e_buf.fill_(float("nan"))
        part = torch.empty(tn, m, 2, device="cuda")
        grid = (min(-(-m // tiles.bm) * tn, per_sm * sms),)
        args = (grid, xc, w, w, yc, red, ref, part, e_buf, e_buf.stride(0), hyper, m, h, v, 0, v, -100)
        ms = event_ms(lambda: kernel(*args), warmup=3, rep=10)  # noqa: B023
        sample = e_buf[::97].float()
        first = sample if first is None else first
        diff = ((sample - first).abs().max() / first.abs().max()).item()
        report(
            cfg=cfg, kernel="scaled", variant=name, per_sm=per_sm, rows=m, ms=round(ms, 3),
            tflops=round(flop / ms / 1e9, 1), diff=diff,
        )  # fmt: skip
        del e_buf


def gradient(cfg, f, x, w, y, sms) -> None:
    t, h, v = CONFIGS[cfg]
    layout = shard_layout(lower_loss(fuser.losses.CROSS_ENTROPY, "bf16"))
    cols = min(slice_cols(t, h, 2, 256, MAIN_GRAD_BUDGET), v)
    ws = w[:cols]
    red = torch.zeros(t, layout.red_width, device="cuda")
    red[:, 1] = torch.log(torch.tensor(float(v))) + 1.0
    scale = torch.full((1,), 1.0 / t, device="cuda")
    hyper = torch.zeros(1, device="cuda")
    flop = 2 * t * h * cols
    first = None
    for name, tiles, per_sm, regs in VARIANTS:
        tiles = tiles_of(WIDE_GRAD_TMA, tiles, h)
        try:
            _, grad = f.matmul_kernel_sources("bf16", Tiles().for_hidden(h), grad_tiles=tiles)
            kernel = load_kernel(capped(grad, regs), x.device)
        except Exception as e:  # noqa: BLE001
            report(cfg=cfg, kernel="gradient", variant=name, per_sm=per_sm, error=str(e)[:200])
            continue
        dz = logits_buffer(t, cols, x)
        dz.fill_(float("nan"))
        grid = (min(-(-t // tiles.bm) * -(-cols // tiles.bn), per_sm * sms),)
        resid = torch.zeros(t, device="cuda")  # (the target column's residue, unread here)
        args = (grid, x, ws, ws, y, red, scale, 0, dz, dz.stride(0), resid, hyper, t, h, cols, 0, v, -100)
        ms = event_ms(lambda: kernel(*args), warmup=3, rep=10)  # noqa: B023
        sample = dz[::97].float()
        first = sample if first is None else first
        diff = ((sample - first).abs().max() / first.abs().max()).item()
        report(
            cfg=cfg, kernel="gradient", variant=name, per_sm=per_sm, rows=t, cols=cols,
            ms=round(ms, 3), tflops=round(flop / ms / 1e9, 1), diff=diff,
        )  # fmt: skip
        del dz


def cublas(cfg, x, w, name) -> None:
    logits = torch.empty(x.shape[0], w.shape[0], device="cuda", dtype=torch.bfloat16)
    ms = event_ms(lambda: torch.mm(x, w.t(), out=logits), warmup=3, rep=10)
    flop = 2 * x.shape[0] * x.shape[1] * w.shape[0]
    report(cfg=cfg, kernel=name, rows=x.shape[0], ms=round(ms, 3), tflops=round(flop / ms / 1e9, 1))


def main(configs) -> None:
    report(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    f = fuser.compile(fuser.losses.CROSS_ENTROPY)
    for cfg in configs:
        t, h, v = CONFIGS[cfg]
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(v, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        y = torch.randint(0, v, (t,), device="cuda", generator=g)
        warm_up()
        m = min(chunk_rows(t, h, v, 2), t)
        cublas(cfg, x[:m], w, "cuBLAS mm, scaled chunk, bf16 stored")
        scaled(cfg, f, x, w, y, sms)
        cols = min(slice_cols(t, h, 2, 256, MAIN_GRAD_BUDGET), v)
        cublas(cfg, x, w[:cols], "cuBLAS mm, gradient slice, bf16 stored")
        gradient(cfg, f, x, w, y, sms)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:] or ["gist", "llama8b"])
