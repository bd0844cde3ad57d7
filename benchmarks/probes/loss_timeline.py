"""Where the GPU waits for the host inside one step of fuser's fused linear + cross-entropy
(forward + backward, bf16).

CUDA events are recorded at points on the host's path: entering and leaving
`CompiledLoss._run_call` and the run it builds (`_scaled_run`, `_fused_run`), each chunk of
the scaled schedule, its weight-gradient terms, `LinearLoss.backward` and the scaled
schedule's range check (`resolve`, a host read). An event's time is when the GPU reached it:
a point that the GPU reached while idle reads the host's time, so the gap between a point's
GPU and host times shows how far the host ran ahead. For each config and variant, this
prints the median step time by events, the five probed steps' totals, and the last probed
step's points (chunks after the first three are left out).

    python benchmarks/probes/loss_timeline.py [gist llama8b]
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import fuser.losses  # noqa: E402
import fuser.losses.api as api  # noqa: E402
import fuser.runtime.loss.chunked as chunked  # noqa: E402
import fuser.runtime.loss.scaled as scaled  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from loss_bench import inputs, warm_up  # noqa: E402
from optim_bench import event_ms  # noqa: E402

VARIANTS = {
    "auto": {},
    "main_grad, memory=fast": dict(accumulate_into="main_grad", memory="fast"),
    "main_grad (auto)": dict(accumulate_into="main_grad"),
}
marks: list = []


def mark(name: str) -> None:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    marks.append((name, event, time.perf_counter()))


def probe(owner, attr: str, name: str, static: bool = False) -> None:
    """Marks on entering and leaving ``owner.attr``."""
    inner = getattr(owner, attr)

    def wrapped(*args, **kwargs):
        mark(name + " >")
        out = inner(*args, **kwargs)
        mark(name + " <")
        return out

    setattr(owner, attr, staticmethod(wrapped) if static else wrapped)


def install() -> None:
    probe(api.CompiledLoss, "_run_call", "_run_call")
    probe(api.CompiledLoss, "_scaled_run", "_scaled_run")
    probe(api.CompiledLoss, "_fused_run", "_fused_run")
    probe(scaled.ScaledExp, "run", "ScaledExp.run")
    probe(scaled.ScaledExp, "_forward", "chunk")
    probe(scaled.ScaledExp, "_weight_terms", "weight terms")
    probe(scaled.ScaledExp, "resolve", "resolve")
    probe(chunked.LinearLoss, "backward", "LinearLoss.backward", static=True)


def timeline(cfg: str) -> None:
    x, w, y, _ = inputs(cfg)
    x.grad, w.grad = torch.zeros_like(x), torch.zeros_like(w)
    w.main_grad = torch.zeros(w.shape, device="cuda")
    warm_up()
    for variant, kw in VARIANTS.items():

        def step(kw=kw):
            fuser.losses.cross_entropy(x, w, y, **kw).backward()

        median = event_ms(step, warmup=3, rep=10)
        totals = []
        for _ in range(5):
            marks.clear()
            torch.cuda.synchronize()
            mark("start")
            loss = fuser.losses.cross_entropy(x, w, y, **kw)
            mark("forward returned")
            loss.backward()
            mark("end")
            torch.cuda.synchronize()
            totals.append(round(marks[0][1].elapsed_time(marks[-1][1]), 3))
        print(json.dumps(dict(cfg=cfg, variant=variant, events_ms=round(median, 2), probed_ms=totals)))
        t0, h0 = marks[0][1], marks[0][2]
        chunk = 0
        for name, event, host in marks:
            chunk += name == "chunk >"
            if name.startswith("chunk") and chunk > 3:
                continue
            print(f"  {name:24s} gpu {t0.elapsed_time(event):8.3f} ms  host {1e3 * (host - h0):8.3f} ms")
        sys.stdout.flush()


def main(argv=None) -> None:
    configs = (argv if argv is not None else sys.argv[1:]) or ["gist", "llama8b"]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}")
    install()
    for cfg in configs:
        timeline(cfg)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
