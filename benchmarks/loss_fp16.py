"""fp16 beside bf16: fuser's fused linear + cross-entropy, forward + backward, under a loss
scale of 65536 (as `torch.amp.GradScaler` starts), `memory="auto"` and `"lean"`, beside the
full-logits loss in eager torch (logits in the inputs' dtype, cross-entropy in fp32). One
JSON line per (config, dtype, variant): two medians of CUDA events over 8 steps each; the
first line says what ran.

    python benchmarks/loss_fp16.py [gist llama8b]
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fuser.losses  # noqa: E402
from fuser.losses import api  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loss_bench import CONFIGS, warm_up  # noqa: E402
from optim_bench import event_ms  # noqa: E402

SCALE = 65536.0


PICKED: list = []  # the schedules of the plans `choice.choose` returned, for the rows


def _recording(choose):
    def spy(*args, **kwargs):
        plan = choose(*args, **kwargs)
        PICKED.append(plan.schedule)
        return plan

    return spy


def variants(x, w, y):
    return {
        "fuser memory=auto": lambda: fuser.losses.cross_entropy(x, w, y),
        "fuser memory=lean": lambda: fuser.losses.cross_entropy(x, w, y, memory="lean"),
        "torch eager, full logits": lambda: F.cross_entropy((x @ w.t()).float(), y),
    }


def step_ms(loss) -> list[float]:
    def step():
        (loss() * SCALE).backward()

    return [round(event_ms(step, warmup=2, rep=8), 2) for _ in range(2)]


def main(argv=None) -> None:
    configs = (argv if argv is not None else sys.argv[1:]) or ["gist", "llama8b"]
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                loss_scale=SCALE)  # fmt: skip
    print(json.dumps(dict(meta=meta)), flush=True)
    api.choose = _recording(api.choose)
    for cfg in configs:
        t, h, v = CONFIGS[cfg]
        g = torch.Generator(device="cuda").manual_seed(0)
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.randn(t, h, device="cuda", dtype=dtype, generator=g).requires_grad_()
            w = (torch.randn(v, h, device="cuda", dtype=dtype, generator=g) * 0.02).requires_grad_()
            y = torch.randint(0, v, (t,), device="cuda", generator=g)
            warm_up()
            for name, loss in variants(x, w, y).items():
                PICKED.clear()
                row = dict(cfg=cfg, dtype=str(dtype).split(".")[-1], impl=name, ms=step_ms(loss))
                if PICKED:
                    row["schedule"] = PICKED[-1]
                print(json.dumps(row), flush=True)
                x.grad = w.grad = None
            del x, w
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
