"""One optimizer step's time on TinyLlama-1.1B's 201 tensors (bf16 parameters and
gradients, ``static=True``) for a few state layouts, under whatever launch shape
``FUSER_OPTIM_BLOCK`` / ``FUSER_OPTIM_SUB`` / ``FUSER_OPTIM_WARPS`` set: the tuning runs
behind ``render.default_launch``. Needs a CUDA GPU.

Per layout, one JSON line: CUDA events around ``opt.step()`` (``events``), the same with
the step's launch queued behind a spin of the GPU so the host's work is hidden
(``queued``) and the host's time in ``opt.step()`` then (``host_us``), the kernels' own
time from torch.profiler (``kernel_ms``), and the floor: the layout's bytes per parameter
over the copy bandwidth measured in the process. Fresh processes alternate the shapes:

    for r in 1 2; do
      for shape in "X=1" "FUSER_OPTIM_SUB=256 FUSER_OPTIM_WARPS=2" \\
                   "FUSER_OPTIM_BLOCK=16384 FUSER_OPTIM_SUB=256 FUSER_OPTIM_WARPS=2"; do
        env $shape FUSER_CACHE_DIR=$(mktemp -d) TAG=... LAYOUTS="m24 m32 f32m24 lionm24" \\
          PYTHONPATH=. python3 benchmarks/probes/step_shapes.py
      done
    done
"""

import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from optim_bench import llama1b_shapes  # noqa: E402
from state_bench import LION_RULE  # noqa: E402
from timing import copy_bandwidth, step_ms  # noqa: E402

import fuser  # noqa: E402
import fuser.optim  # noqa: E402

ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
LION = dict(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.01)
LION_Q8 = fuser.compile(LION_RULE, state_dtype="q8", static=True)
LION_Q8_M24 = fuser.compile(LION_RULE, state_dtype="q8", master_weights="bf16+int8", static=True)
# layout -> (bytes a step moves per parameter, optimizer)
LAYOUTS = {
    "bf16": (14.0, lambda ps: fuser.optim.AdamW(ps, state_dtype="param", static=True, **ADAMW)),
    "f32s": (22.0, lambda ps: fuser.optim.AdamW(ps, static=True, **ADAMW)),
    "lion": (8.25, lambda ps: LION_Q8(ps, **LION)),
    "q8": (10.5, lambda ps: fuser.optim.AdamW(ps, state_dtype="q8", static=True, **ADAMW)),
    "m24": (
        12.5,
        lambda ps: fuser.optim.AdamW(ps, state_dtype="q8", master_weights="bf16+int8", static=True, **ADAMW),
    ),
    "m32": (
        14.5,
        lambda ps: fuser.optim.AdamW(ps, state_dtype="q8", master_weights="bf16+int16", static=True, **ADAMW),
    ),
    "f32m24": (24.0, lambda ps: fuser.optim.AdamW(ps, master_weights="bf16+int8", static=True, **ADAMW)),
    "lionm24": (10.25, lambda ps: LION_Q8_M24(ps, **LION)),
}


def make(dev, shapes):
    g = torch.Generator(device=dev).manual_seed(0)
    ps = [(torch.randn(s, device=dev, generator=g) * 0.02).bfloat16().requires_grad_() for s in shapes]
    for p in ps:
        p.grad = (torch.randn(p.shape, device=dev, generator=g) * 1e-3).bfloat16()
    return ps


def queued(fn, rep=20):
    """Median device time of ``fn`` queued behind a spin, and the host's time in it (us)."""
    dev_t, host_t = [], []
    for _ in range(rep):
        torch.cuda.synchronize()
        torch.cuda._sleep(3_000_000)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        t0 = time.perf_counter()
        fn()
        host_t.append((time.perf_counter() - t0) * 1e6)
        e.record()
        torch.cuda.synchronize()
        dev_t.append(s.elapsed_time(e))
    return statistics.median(dev_t), statistics.median(host_t)


def kernel_ms(fn):
    """The kernels' time per call by torch.profiler, over 10 calls."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as pr:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time for e in pr.events() if e.device_type.name == "CUDA") / 10 / 1e3


def main():
    dev = torch.device("cuda")
    shapes = llama1b_shapes()
    n = sum(math.prod(s) for s in shapes)
    bw = copy_bandwidth(dev, 256 * 2**20)
    tag = os.environ.get("TAG", "")
    for w in os.environ["LAYOUTS"].split():
        per_param, build = LAYOUTS[w]
        ps = make(dev, shapes)
        opt = build(ps)
        opt.step()
        opt.step()
        floor = n * per_param / (bw * 1e12) * 1e3
        ev = step_ms(opt.step, dev, 20, warmup=4)
        qd, host = queued(opt.step)
        kt = kernel_ms(opt.step)
        row = dict(tag=tag, w=w, floor=round(floor, 4), events=round(ev, 4), queued=round(qd, 4),
                   host_us=round(host, 1), kernel_ms=round(kt, 4), pct_events=round(100 * floor / ev, 1),
                   pct_kernel=round(100 * floor / kt, 1))  # fmt: skip
        print(json.dumps(row), flush=True)
        del opt, ps
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
