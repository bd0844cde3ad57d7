"""Where one forward + backward of fuser's fused linear + cross-entropy spends its time.

For each config (loss_bench's) and each variant (`default`, `main_grad`), prints: the
median time by CUDA events, the host time of the forward and the backward calls (launches
only, no synchronisation), the device time of every kernel summed (the profiler's), the
number of launches, and the kernels that take the most device time. Events minus device
time is time the GPU sat idle inside the step, waiting for the host.

    python benchmarks/probes/profile_loss.py [gist llama8b]
                                       [--variants default main_grad chunks scaled z_loss]
                                       [--top 12]

(`chunks`, `scaled`: the built-in cross-entropy with that schedule forced; `z_loss`: the
built-in with `z_loss=1e-4`, the schedule `memory="auto"` picks.)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import fuser  # noqa: E402
import fuser.losses  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from loss_bench import CONFIGS  # noqa: E402
from optim_bench import event_ms  # noqa: E402


def step_fn(variant):
    if variant == "main_grad":
        return lambda x, w, y: fuser.losses.cross_entropy(x, w, y, accumulate_into="main_grad")
    if variant in ("chunks", "scaled"):
        return fuser.compile(fuser.losses.CROSS_ENTROPY, schedule=variant)
    if variant == "z_loss":
        return lambda x, w, y: fuser.losses.cross_entropy(x, w, y, z_loss=1e-4)
    return fuser.losses.cross_entropy


def profile_one(cfg, variant, top):
    """Prints one variant's profile; its tensors are freed on return."""
    t, h, v = CONFIGS[cfg]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02).requires_grad_()
    y = torch.randint(0, v, (t,), device="cuda", generator=g)
    x.grad, w.grad = torch.zeros_like(x), torch.zeros_like(w)
    if variant == "main_grad":
        w.main_grad = torch.zeros(v, h, device="cuda", dtype=torch.float32)
    fn = step_fn(variant)

    def step():
        fn(x, w, y).backward()

    ms = event_ms(step, warmup=2, rep=10)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss = fn(x, w, y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("step"):
            step()
            torch.cuda.synchronize()
    events = [
        e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA and e.key != "step"
    ]
    busy = sum(e.self_device_time_total for e in events) / 1e3
    launches = sum(e.count for e in events)
    print(
        f"\n## {cfg} {variant}: events {ms:.2f} ms; device busy {busy:.2f} ms in {launches} kernels "
        f"(idle {ms - busy:.2f} ms); host: forward {1e3 * (t1 - t0):.2f} ms, backward "
        f"{1e3 * (t2 - t1):.2f} ms, then waited {1e3 * (t3 - t2):.2f} ms"
    )
    events.sort(key=lambda e: -e.self_device_time_total)
    for e in events[:top]:
        print(f"  {e.self_device_time_total / 1e3:8.2f} ms  {e.count:5d}x  {e.key[:110]}")
    print_gaps(prof, top)
    torch.cuda.synchronize()
    calls = cProfile.Profile()
    calls.enable()
    loss = fn(x, w, y)
    calls.disable()
    loss.backward()
    torch.cuda.synchronize()
    print("  host calls of the forward (cProfile, by cumulative time):")
    text = io.StringIO()
    pstats.Stats(calls, stream=text).sort_stats("cumulative").print_stats(top)
    print("\n".join("    " + line for line in text.getvalue().splitlines() if line.strip()))


def print_gaps(prof, top):
    """When the first kernel started after the step began, and the longest stretches with
    no kernel running, with the kernels on either side (one stream: kernels do not overlap)."""
    evs = prof.events()
    start = min(e.time_range.start for e in evs if e.name == "step")
    kernels = sorted(
        (e for e in evs if e.device_type == torch.autograd.DeviceType.CUDA and e.name != "step"),
        key=lambda e: e.time_range.start,
    )
    if not kernels:
        return
    first = kernels[0].time_range.start
    print(f"  first kernel {(first - start) / 1e3:.2f} ms after the step began; host calls before it:")
    cpu = [e for e in evs if e.device_type == torch.autograd.DeviceType.CPU and e.time_range.start < first]

    def tree(parent, depth):
        for e in sorted((e for e in cpu if e.cpu_parent is parent), key=lambda e: e.time_range.start):
            took = (min(e.time_range.end, first) - e.time_range.start) / 1e3
            if took >= 0.05 and depth < 4:
                print(f"    {'  ' * depth}{took:6.3f} ms {e.name[:80]}")
                tree(e, depth + 1)

    tree(next(e for e in cpu if e.name == "step"), 0)
    gaps = [
        (b.time_range.start - a.time_range.end, a.name, b.name, (a.time_range.end - start) / 1e3)
        for a, b in zip(kernels, kernels[1:])
    ]
    idle = sum(g for g, *_ in gaps if g > 0) / 1e3
    print(f"  idle between kernels {idle:.2f} ms; longest gaps:")
    for gap, a, b, at in sorted(gaps, reverse=True)[:top]:
        print(f"    {gap / 1e3:6.3f} ms at {at:7.2f} ms, after {a[:50]} before {b[:50]}")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="*", default=["gist", "llama8b"])
    ap.add_argument(
        "--variants",
        nargs="*",
        default=["default", "main_grad"],
        choices=["default", "main_grad", "chunks", "scaled", "z_loss"],
    )
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args(argv)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for cfg in args.configs:
        for variant in args.variants:
            profile_one(cfg, variant, args.top)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
