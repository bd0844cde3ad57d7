"""Timing helpers the optimizer benchmarks share: device-event medians on a GPU (the host
clock on CPU, for smoke runs), back-to-back wall time, and the copy bandwidth that floors
are taken from."""

from __future__ import annotations

import statistics
import time

import torch


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_ms(fn, device, rep: int, warmup: int = 1) -> float:
    """Median time of one call after ``warmup`` calls: CUDA events on a GPU, the host
    clock on CPU."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(rep):
        if device.type == "cuda":
            times.append(_events(fn, spin=False))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _events(fn, spin: bool) -> float:
    """Milliseconds between CUDA events around one call of ``fn``; with ``spin``, recorded
    behind a ~1.5 ms spin of the GPU that the host queues its launches behind."""
    torch.cuda.synchronize()
    if spin:
        torch.cuda._sleep(3_000_000)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e)


def device_ms(fn, device, rep: int) -> float:
    """Median device time of one call whose launches the host queued behind a ~1.5 ms
    spin of the GPU, so the host's own work before them (checks, Python, the launch) is
    hidden: the GPU's time for the call alone. The host clock on CPU."""
    if device.type != "cuda":
        return step_ms(fn, device, rep, warmup=0)
    return statistics.median(_events(fn, spin=True) for _ in range(rep))


def wall_ms(fn, device, steps: int) -> float:
    """Host wall time per call over back-to-back calls, Python included."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / steps * 1e3


def copy_bandwidth(device, numel: int, rep: int = 10) -> float:
    """Bytes read and written per second by a large device-to-device copy (TB/s)."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    ms = step_ms(lambda: dst.copy_(src), device, rep, warmup=3)
    return 2 * numel * 4 / (ms * 1e-3) / 1e12
