"""The backward pass's scaling of gradients taken in forward by `grad_output` (bf16 inputs,
the `chunks` and `scaled` schedules): fuser's `grad_scale` kernel against the torch ops it
replaced, in one process, on a gist-sized `grad_weight` (fp32 [128256, 768] into bf16) and
`grad_hidden` (bf16 [32768, 768], in place). Each output is compared with the torch op's.

    python benchmarks/loss_grad_scale.py
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fuser.runtime.loss.chunked import _scaled  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from optim_bench import event_ms  # noqa: E402


def report(name, ms, nbytes, **extra) -> None:
    row = dict(op=name, ms=round(ms, 4), gb_per_s=round(nbytes / ms / 1e6, 1), **extra)
    print(json.dumps(row), flush=True)


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    go = torch.rand((), device="cuda") + 0.5
    gw = torch.randn(128256, 768, device="cuda")
    out = torch.empty(gw.shape, dtype=torch.bfloat16, device="cuda")
    nbytes = gw.numel() * 6
    for _ in range(2):
        report("grad_weight: torch.mul(out=bf16)", event_ms(lambda: torch.mul(gw, go, out=out)), nbytes)
        got = _scaled(gw, go, torch.bfloat16)
        report("grad_weight: grad_scale", event_ms(lambda: _scaled(gw, go, torch.bfloat16)), nbytes,
               same=bool(torch.equal(got, torch.mul(gw, go, out=out))))  # fmt: skip
    gx = torch.randn(32768, 768, device="cuda", dtype=torch.bfloat16)
    nbytes = gx.numel() * 4
    for _ in range(2):
        report("grad_hidden: mul_ in place", event_ms(lambda: gx.mul_(go)), nbytes)
        report("grad_hidden: grad_scale in place", event_ms(lambda: _scaled(gx, go, torch.bfloat16)), nbytes)
    a, b = gx.clone(), gx.clone()
    _scaled(a, go, torch.bfloat16)
    print(json.dumps(dict(op="grad_hidden in place: same as mul_", same=bool(torch.equal(a, b.mul_(go))))))


if __name__ == "__main__":
    main()
