"""A few all-bf16 AdamW steps on TinyLlama's shapes, for an external profiler (or, with
``--profile``, torch's), fuser's built-in or ``torch.compile(torch.optim.AdamW.step)``.

    ncu --clock-control none --kernel-name regex:adamw_step --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python benchmarks/adamw_steps.py fuser
    python benchmarks/adamw_steps.py compile --profile   # the compiled step's kernels and their device time
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fuser  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from optim_bench import CompiledAdamW, llama1b_shapes, make  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("impl", choices=["fuser", "compile"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--profile", action="store_true", help="then one more step under torch's profiler")
    args = ap.parse_args(argv)
    ps = make(llama1b_shapes(), torch.bfloat16, 0)
    if args.impl == "fuser":
        step = fuser.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, state_dtype="param", static=True).step
    else:
        step = CompiledAdamW(ps).step
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    if args.profile:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernels.sort(key=lambda e: -e.self_device_time_total)
        total = sum(e.self_device_time_total for e in kernels) / 1e3
        print(f"{args.impl}: {sum(e.count for e in kernels)} kernels, {total:.3f} ms of device time")
        for e in kernels[:12]:
            print(f"  {e.self_device_time_total / 1e3:7.3f} ms {e.count:4d}x {e.key[:100]}")


if __name__ == "__main__":
    main()
