"""A few steps of fuser's AdamW on TinyLlama-1.1B's 201 tensors in one storage layout, for
a profiler to pick one launch of the step kernel:

    ncu --clock-control none -k regex:adamw_step --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section SchedulerStats \\
        python benchmarks/probes/profile_step.py q8 4

Layouts: those of `sweep_step.py` (`q8`, `m24`, `fp32s`, `bf16`, `fp32`), with its
inputs. Prints the median of 10 more steps by CUDA events (under a profiler, with its
overhead).
"""

import os
import sys

import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # probes/: sweep_step

from sweep_step import LAYOUTS, params  # noqa: E402

import fuser.optim  # noqa: E402


def main(layout: str, steps: int) -> None:
    ps = params(torch.float32 if layout == "fp32" else torch.bfloat16)
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
