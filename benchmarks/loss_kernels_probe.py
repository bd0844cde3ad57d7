"""Two matmul kernels of the loss schedules alone, beside cuBLAS (H100, bf16):

- the lean schedule's cross-entropy sweep (default tiles) against the same kernel with its
  tile loop flattened into the hidden-dimension loop (`tl.range(..., flatten=True)`: the
  rendered text changed here, not a fuser option), their partials compared;
- the scaled schedule's kernel on one chunk of tokens (the size the schedule takes), with
  pointer loads and through tensor descriptors (persistent programs, GROUP_M 16 and 8),
  against `torch.mm` storing bf16 logits of the same chunk; `E` compared on every 97th row.

Prints one JSON line per measurement (TFLOP/s of the 2*T*H*V product).

    python benchmarks/loss_kernels_probe.py [gist llama8b]
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
from fuser.codegen.loss_matmul import Tiles  # noqa: E402
from fuser.ir.loss import lower_loss  # noqa: E402
from fuser.runtime.loss.choice import SCALED_TILES, SCALED_TILES_TMA  # noqa: E402
from fuser.runtime.loss.chunked import chunk_rows, logits_buffer  # noqa: E402
from fuser.runtime.loss.fused import shares  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loss_bench import CONFIGS, warm_up  # noqa: E402
from optim_bench import event_ms  # noqa: E402


def flattened(source):
    """The sweep's source with its tile loop a flattened `tl.range`."""
    text = source.text
    loop = "    while t < t_end:\n"
    assert loop in text and "        t += 1\n" in text
    text = text.replace(loop, "    t_first = t\n    for t in tl.range(t_first, t_end, flatten=True):\n")
    return dataclasses.replace(source, text=text.replace("        t += 1\n", ""))


def report(**row) -> None:
    print(json.dumps(row), flush=True)


def timed(fn) -> float:
    return event_ms(fn, warmup=3, rep=10)


def sweeps(cfg, x, w, y, flop) -> None:
    t, h, v = CONFIGS[cfg]
    f = fuser.compile(fuser.losses.CROSS_ENTROPY)
    layout = shard_layout(lower_loss(fuser.losses.CROSS_ENTROPY, "bf16"))
    red = torch.zeros(t, layout.red_width, device="cuda")
    hyper = torch.zeros(1, device="cuda")
    tiles = Tiles().for_hidden(h)
    (sweep,), _ = f.matmul_kernel_sources("bf16", tiles)
    tm, tn = -(-t // tiles.bm), -(-v // tiles.bn)
    split = shares(tm, tn, torch.cuda.get_device_properties(0).multi_processor_count)
    first = None
    variants = (("sweep", sweep), ("sweep, flattened loop", flattened(sweep)), ("sweep again", sweep))
    for name, source in variants:
        kernel = load_kernel(source, x.device)
        part = torch.full((split, t, layout.part_widths[0]), float("nan"), device="cuda")
        args = ((tm, split), x, w, w, y, red, part, hyper, t, h, v, 0, v, -100)
        ms = timed(lambda: kernel(*args))  # noqa: B023 (called before the loop moves on)
        lse = part[:, :, 0].clone()
        first = lse if first is None else first
        diff = ((lse - first).abs().max() / first.abs().max()).item()
        report(cfg=cfg, kernel=name, ms=round(ms, 3), tflops=round(flop / ms / 1e9, 1), partials_diff=diff)


def scaled(cfg, x, w, y) -> None:
    t, h, v = CONFIGS[cfg]
    f = fuser.compile(fuser.losses.CROSS_ENTROPY)
    layout = shard_layout(lower_loss(fuser.losses.CROSS_ENTROPY, "bf16"))
    m = min(chunk_rows(t, h, v, 2), t)
    xc, yc = x[:m], y[:m]
    red = torch.zeros(m, layout.red_width, device="cuda")
    hyper = torch.zeros(1, device="cuda")
    ref = torch.randn(m, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    flop = 2 * m * h * v
    first = None
    variants = (
        ("scaled, pointer loads, GROUP_M 16", SCALED_TILES),
        ("scaled, TMA persistent, GROUP_M 16", SCALED_TILES_TMA),
        ("scaled, TMA persistent, GROUP_M 8", dataclasses.replace(SCALED_TILES_TMA, group_m=8)),
    )
    for name, tiles in variants:
        tiles = tiles.for_hidden(h)
        kernel = load_kernel(f.scaled_kernel_source("bf16", tiles), x.device)
        tn = -(-v // tiles.bn)
        e_buf = logits_buffer(-(-m // tiles.bm) * tiles.bm, tn * tiles.bn, x)
        e_buf.fill_(float("nan"))
        part = torch.empty(tn, m, 2, device="cuda")
        programs = -(-m // tiles.bm) * tn
        grid = (min(programs, sms),) if tiles.tma else (programs,)
        args = (grid, xc, w, w, yc, red, ref, part, e_buf, e_buf.stride(0), hyper, m, h, v, 0, v, -100)
        ms = timed(lambda: kernel(*args))  # noqa: B023 (called before the loop moves on)
        sample = e_buf[:m:97, :v].float()
        first = sample if first is None else first
        diff = ((sample - first).abs().max() / first.abs().max()).item()
        report(cfg=cfg, kernel=name, rows=m, ms=round(ms, 3), tflops=round(flop / ms / 1e9, 1), e_diff=diff)
        del e_buf
    cublas(cfg, xc, w, "cuBLAS mm, chunk, bf16 stored")


def cublas(cfg, x, w, name) -> None:
    logits = torch.empty(x.shape[0], w.shape[0], device="cuda", dtype=torch.bfloat16)
    ms = timed(lambda: torch.mm(x, w.t(), out=logits))
    flop = 2 * x.shape[0] * x.shape[1] * w.shape[0]
    report(cfg=cfg, kernel=name, rows=x.shape[0], ms=round(ms, 3), tflops=round(flop / ms / 1e9, 1))


def main(configs) -> None:
    report(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    for cfg in configs:
        t, h, v = CONFIGS[cfg]
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(v, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        y = torch.randint(0, v, (t,), device="cuda", generator=g)
        warm_up()
        cublas(cfg, x, w, "cuBLAS mm, bf16 stored")
        sweeps(cfg, x, w, y, 2 * t * h * v)
        scaled(cfg, x, w, y)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:] or ["gist", "llama8b"])
