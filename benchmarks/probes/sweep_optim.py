"""Block size and warps of the optimizer step kernel: fuser's AdamW on the llama1b
workloads for each (BLOCK, num_warps), each in a fresh process (the values are rendered
into the kernel): median of device events around one step, and wall time per step over
back-to-back steps.

    python benchmarks/probes/sweep_optim.py [--out DIR]
"""

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, torch
sys.path.insert(0, {root!r})
sys.path.insert(0, {bench!r})
import fuser
from optim_bench import event_ms, llama1b_shapes, make, wall_ms
rows = []
for dtype in (torch.float32, torch.bfloat16):
    bf16 = dtype == torch.bfloat16
    ps = make(llama1b_shapes(), dtype, 0)
    opt = fuser.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, state_dtype="param" if bf16 else None)
    ms = event_ms(opt.step)
    wall = wall_ms(opt.step)
    del ps, opt
    torch.cuda.empty_cache()
    rows.append(dict(dtype=str(dtype), ms=round(ms, 4), wall_ms=round(wall, 4)))
print(json.dumps(rows))
"""


def sweep(child: str, configs: list[tuple[dict, dict]]) -> list[dict]:
    """Run ``child`` (Python source printing a JSON list of rows on its last line) once per
    (environment, fields) config, in a fresh process each; its rows get the fields."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    results = []
    for env, fields in configs:
        out = subprocess.run(
            [sys.executable, "-c", child.format(root=os.path.dirname(here), bench=here)],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
        )
        if out.returncode:
            print(fields, "failed:", out.stderr[-2000:], flush=True)
            continue
        for row in json.loads(out.stdout.strip().splitlines()[-1]):
            row.update(fields)
            results.append(row)
            print(json.dumps(row), flush=True)
    return results


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
    )
    ap.add_argument("--configs", default="2048:8,4096:8,8192:8,4096:4,8192:16")
    args = ap.parse_args(argv)
    configs = []
    for cfg in args.configs.split(","):
        block, warps = cfg.split(":")
        env = {"FUSER_OPTIM_BLOCK": block, "FUSER_OPTIM_WARPS": warps}
        configs.append((env, dict(block=int(block), warps=int(warps))))
    results = sweep(CHILD, configs)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sweep_optim.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
