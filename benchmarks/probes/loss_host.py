"""Host time of fuser's fused linear + cross-entropy step (bf16, forward + backward), and a
cProfile of it: where the host waits for the GPU (its reads of device values) and what its
Python costs.

For each config (`gist`, `llama8b` of `loss_bench.py`) and variant (`memory="auto"`, and
into `main_grad` with `"auto"`): the medians over 15 steps of the host's time in the
forward call, in `backward()` and for the whole step to the GPU's end, then ten steps
under cProfile, by own time and by cumulative time.

    python benchmarks/probes/loss_host.py [gist llama8b]
"""

import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import fuser.losses  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from loss_bench import inputs, warm_up  # noqa: E402

VARIANTS = {"auto": {}, "main_grad": dict(accumulate_into="main_grad")}


def step(x, w, y, kw) -> float:
    """One step; returns the host's time when the forward call returned."""
    loss = fuser.losses.cross_entropy(x, w, y, **kw)
    t1 = time.perf_counter()
    loss.backward()
    return t1


def host_times(x, w, y, kw) -> tuple[float, float, float]:
    fw, bw, tot = [], [], []
    for _ in range(15):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        t1 = step(x, w, y, kw)
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        fw.append(t1 - t0)
        bw.append(t2 - t1)
        tot.append(t3 - t0)
    return tuple(round(statistics.median(v) * 1e3, 3) for v in (fw, bw, tot))


def profiled(x, w, y, kw, title: str) -> None:
    pr = cProfile.Profile()
    for _ in range(10):
        torch.cuda.synchronize()
        pr.enable()
        step(x, w, y, kw)
        pr.disable()
    torch.cuda.synchronize()
    for key, n in (("tottime", 35), ("cumtime", 45)):
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats(key).print_stats(n)
        print(f"--- {title} by {key} (10 steps)\n" + s.getvalue().split("\n", 6)[-1], flush=True)


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    for cfg in sys.argv[1:] or ["gist", "llama8b"]:
        x, w, y, _ = inputs(cfg)
        x.grad, w.grad = torch.zeros_like(x), torch.zeros_like(w)
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device="cuda")
        for name, kw in VARIANTS.items():
            for _ in range(3):
                step(x, w, y, kw)
            warm_up(0.3)
            fw, bw, tot = host_times(x, w, y, kw)
            print(f"{cfg} {name}: host forward {fw} ms, host backward {bw} ms, step {tot} ms", flush=True)
            profiled(x, w, y, kw, f"{cfg} {name}")


if __name__ == "__main__":
    main()
