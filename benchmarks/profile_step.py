"""A few steps of fuser's AdamW on TinyLlama-1.1B's 201 tensors (bf16 parameters and
gradients) in one storage layout, for a profiler to pick one launch of the step kernel:

    ncu --clock-control none -k regex:adamw_step --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section SchedulerStats \\
        python benchmarks/profile_step.py q8 4

Layouts: `q8` (8-bit m and v), `m24` (q8 with `master_weights="bf16+int8"`), `fp32s`
(fp32 states), `bf16` (`state_dtype="param"`). Prints the median of 10 more steps by CUDA
events (under a profiler, with its overhead).
"""

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from optim_bench import llama1b_shapes  # noqa: E402

import fuser.optim  # noqa: E402

LAYOUTS = {
    "q8": dict(state_dtype="q8"),
    "m24": dict(state_dtype="q8", master_weights="bf16+int8"),
    "fp32s": dict(),
    "bf16": dict(state_dtype="param"),
}


def main(layout: str, steps: int) -> None:
    torch.manual_seed(0)
    ps = [(torch.randn(s, device="cuda") * 0.02).bfloat16().requires_grad_() for s in llama1b_shapes()]
    for p in ps:
        p.grad = (torch.randn(p.shape, device="cuda") * 1e-3).bfloat16()
    opt = fuser.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, **LAYOUTS[layout])
    for _ in range(steps):
        opt.step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        opt.step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    print(layout, "median ms", sorted(times)[5])


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4)
