"""Warp-specialised loss matmul kernels against the others (H100, bf16).

On sm_90 Triton 3.6 splits a persistent program whose tile loop is
``tl.range(..., warp_specialize=True)`` into a producer warp group (the TMA loads) and two
consumer groups, each taking half of a tile's rows (``Tiles(warp_specialize=True)``, 4
warps asked, 12 run; ``fuser.codegen.loss_matmul.warp_specialized``).

- ``kernels CFG...``: the scaled kernel on one chunk of tokens and the lean schedule's
  gradient kernel over every token (V in one slice), with the default tiles and
  warp-specialised with GROUP_M 16 and 8, in alternating rounds (median of 10 launches
  each); TFLOP/s of the 2*T*H*V product.
- ``steps on|off``: forward + backward at gist through ``fuser.losses.cross_entropy``,
  ``memory="auto"``, ``"lean"`` and into ``main_grad``, three readings each; ``off`` sets
  the hidden sizes up to which the API takes warp-specialised kernels to 0. Run ``off`` and
  ``on`` in alternating processes, each with a fresh ``FUSER_CACHE_DIR``.
- ``softcap on|off``: the same through ``memory="auto"`` (the scaled schedule) for plain
  cross-entropy and ``softcap=30`` with the exact ``tanh`` and with ``approx_tanh`` (the
  scaled kernel in [128, 256] and [128, 128] tiles).

Prints one JSON line per measurement.

    python benchmarks/loss_warp_specialized.py kernels gist h2048 llama8b
    python benchmarks/loss_warp_specialized.py steps off
    python benchmarks/loss_warp_specialized.py softcap off
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
from fuser.codegen.loss_matmul import WIDE_GRAD_TMA  # noqa: E402
from fuser.ir.loss import lower_loss  # noqa: E402
from fuser.runtime.loss import choice  # noqa: E402
from fuser.runtime.loss.chunked import chunk_rows, logits_buffer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loss_bench import CONFIGS, inputs, warm_up  # noqa: E402
from optim_bench import event_ms  # noqa: E402

RULE = fuser.losses.CROSS_ENTROPY


def report(**row) -> None:
    print(json.dumps(row), flush=True)


def specialised(tiles, group_m=16):
    return dataclasses.replace(tiles, warp_specialize=True, num_warps=4, group_m=group_m)


def scaled_launches(f, x, w, y, cfg) -> dict:
    """The scaled kernel on the schedule's first chunk, per variant."""
    t, h, v = CONFIGS[cfg]
    m = min(chunk_rows(t, h, v, 2), t)
    layout = shard_layout(lower_loss(RULE, "bf16"))
    red, ref = torch.zeros(m, layout.red_width, device="cuda"), torch.randn(m, device="cuda")
    hyper = torch.zeros(1, device="cuda")
    tn = -(-v // 256)
    e = logits_buffer(-(-m // 128) * 128, tn * 256, x)
    part = torch.empty(tn, m, 2, device="cuda")
    grid = (min(-(-m // 128) * tn, torch.cuda.get_device_properties(0).multi_processor_count),)
    base = choice.SCALED_TILES_TMA
    out = {}
    for name, tiles in (("default", base), ("ws g16", specialised(base)), ("ws g8", specialised(base, 8))):
        k = load_kernel(f.scaled_kernel_source("bf16", tiles.for_hidden(h)), x.device)
        args = (grid, x[:m], w, w, y[:m], red, ref, part, e, e.stride(0), hyper, m, h, v, 0, v, -100)
        out[f"scaled {name}"] = (lambda k=k, args=args: k(*args), 2 * m * h * v)
    return out


def gradient_launches(f, x, w, y, cfg) -> dict:
    """The lean schedule's gradient kernel over every token, V in one slice, per variant."""
    t, h, v = CONFIGS[cfg]
    layout = shard_layout(lower_loss(RULE, "bf16"))
    tm, tn = -(-t // 128), -(-v // 256)
    dz = torch.empty(t, tn * 256, device="cuda", dtype=torch.bfloat16)
    red = torch.randn(t, layout.red_width, device="cuda").abs() + 10
    scale, resid = torch.full((1,), 1.0 / t, device="cuda"), torch.zeros(t, device="cuda")
    hyper = torch.zeros(1, device="cuda")
    grid = (min(tm * tn, torch.cuda.get_device_properties(0).multi_processor_count),)
    out = {}
    for name, tiles in (("default", WIDE_GRAD_TMA), ("ws g8", specialised(WIDE_GRAD_TMA, 8)),
                        ("ws g16", specialised(WIDE_GRAD_TMA))):  # fmt: skip
        tiles = tiles.for_hidden(h)
        k = load_kernel(f.matmul_kernel_sources("bf16", tiles, grad_tiles=tiles)[1], x.device)
        args = (grid, x, w, w, y, red, scale, 0, dz, dz.stride(0), resid, hyper, t, h, v, 0, v, -100)
        out[f"grad {name}"] = (lambda k=k, args=args: k(*args), 2 * t * h * v)
    return out


def kernels(cfg: str, rounds: int = 3) -> None:
    t, h, v = CONFIGS[cfg]
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(v, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    y = torch.randint(0, v, (t,), device="cuda", generator=g)
    f = fuser.compile(RULE)
    calls = {**scaled_launches(f, x, w, y, cfg), **gradient_launches(f, x, w, y, cfg)}
    warm_up()
    names, times = list(calls), {n: [] for n in calls}
    for r in range(rounds):
        for n in names[r:] + names[:r]:
            times[n].append(event_ms(calls[n][0], warmup=2, rep=10))
    for n in names:
        median = sorted(times[n])[len(times[n]) // 2]
        report(cfg=cfg, kernel=n, ms=[round(a, 3) for a in times[n]], median=round(median, 3),
               tflops=round(calls[n][1] / median / 1e9, 1))  # fmt: skip
    torch.cuda.empty_cache()


def gist_steps(on: bool, calls: dict, key: str) -> None:
    """Three readings of forward + backward at gist per ``calls`` entry (its keyword
    arguments to ``cross_entropy``), warp-specialised kernels taken (``on``) or not."""
    if not on:
        choice.SCALED_WARP_SPECIALIZED_MAX_HIDDEN = choice.GRAD_WARP_SPECIALIZED_MAX_HIDDEN = 0
    x, w, y, _ = inputs("gist")
    if any("accumulate_into" in kw for kw in calls.values()):
        w.main_grad = torch.zeros(w.shape, device="cuda")
    warm_up()
    for name, kw in calls.items():

        def step():
            fuser.losses.cross_entropy(x, w, y, **kw).backward()  # noqa: B023 (run in this pass)

        step()
        ms = [event_ms(step, warmup=2, rep=10) for _ in range(3)]
        x.grad = w.grad = None
        report(cfg="gist", **{key: name}, warp_specialized=on, ms=[round(a, 2) for a in ms])


STEPS = {
    "auto": dict(memory="auto"),
    "lean": dict(memory="lean"),
    "main_grad": dict(accumulate_into="main_grad"),
}
SOFTCAPS = {
    "plain": {},
    "softcap": dict(softcap=30.0),
    "softcap approx": dict(softcap=30.0, approx_tanh=True),
}


if __name__ == "__main__":
    report(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    if sys.argv[1] == "kernels":
        for c in sys.argv[2:] or ["gist", "h2048", "llama8b"]:
            kernels(c)
    elif sys.argv[1] == "softcap":
        gist_steps(sys.argv[2] == "on", SOFTCAPS, "loss")
    else:
        gist_steps(sys.argv[2] == "on", STEPS, "memory")
