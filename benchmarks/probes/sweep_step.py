"""Launch shape of the flat step kernels: fuser's AdamW on TinyLlama-1.1B's 201 tensors
in five storage layouts, for each (BLOCK, SUB, warps[, register cap]), in this process on
this GPU.

Layouts, as `state_bench.py` names their workloads (bf16 parameters and gradients):
`q8` (8-bit m and v, `adamw_q8_llama1b`), `m24` (the same with
`master_weights="bf16+int8"`, `adamw_q8_master24_llama1b`), `fp32s` (fp32 states,
`adamw_bf16p_fp32s_llama1b`), `bf16` (`state_dtype="param"`, `adamw_bf16_llama1b`); and
`fp32`: fp32 parameters, gradients and states (`optim_bench.py`'s `adamw_fp32_llama1b`);
`lamb`: `fuser.optim.LAMB` in fp32 (`lamb_fp32_llama1b`, two phases).
The launch shape is rendered into the kernel from `FUSER_OPTIM_BLOCK`, `FUSER_OPTIM_SUB`
and `FUSER_OPTIM_WARPS`, a setting's optional fourth field is `FUSER_OPTIM_MAXNREG` (0: no
cap; left out: the default), all part of the kernel's key, so each setting compiles its own
kernels. Per setting: median and minimum of CUDA events around one
step (20 steps after 3).

    PYTHONPATH=. python benchmarks/probes/sweep_step.py [--out DIR] [--tag _x]
        [--layouts q8,m24,fp32s,bf16,fp32] [--settings 2048:2048:4,8192:512:2:0,...]

Writes `sweep_step_<date><tag>.json` and `.md` under --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys

import torch
import triton

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from optim_bench import llama1b_shapes  # noqa: E402

import fuser  # noqa: E402
import fuser.optim  # noqa: E402

LAYOUTS = {
    "q8": dict(state_dtype="q8"),
    "m24": dict(state_dtype="q8", master_weights="bf16+int8"),
    "fp32s": dict(),
    "bf16": dict(state_dtype="param"),
    "fp32": dict(),  # fp32 parameters, gradients and states (`adamw_fp32_llama1b`)
    "lamb": dict(),  # fuser.optim.LAMB, fp32 (`lamb_fp32_llama1b`)
}
FP32_LAYOUTS = ("fp32", "lamb")
# BLOCK:SUB:WARPS. The first two are the launch shapes before the loop over passes
# (8-bit layouts took 4 warps, the others 8); 8192:512:4 is the default since.
SETTINGS = "2048:2048:4,2048:2048:8,512:512:4,4096:512:4,8192:512:4,16384:512:4,8192:1024:8,4096:256:2"
ENV = ("FUSER_OPTIM_BLOCK", "FUSER_OPTIM_SUB", "FUSER_OPTIM_WARPS", "FUSER_OPTIM_MAXNREG")


def time_step(opt, steps: int = 20, warmup: int = 3) -> tuple[float, float]:
    for _ in range(warmup):
        opt.step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(steps):
        start.record()
        opt.step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2], times[0]


def params(dtype: torch.dtype) -> list[torch.Tensor]:
    torch.manual_seed(0)
    ps = [(torch.randn(s, device="cuda") * 0.02).to(dtype).requires_grad_() for s in llama1b_shapes()]
    for p in ps:
        p.grad = (torch.randn(p.shape, device="cuda") * 1e-3).to(dtype)
    return ps


def run(layouts: list[str], settings: list[tuple[str, ...]]) -> list[dict]:
    saved = {k: os.environ.get(k) for k in ENV}
    rows = []
    try:
        for layout in layouts:
            ps = params(torch.float32 if layout in FP32_LAYOUTS else torch.bfloat16)
            make = fuser.optim.LAMB if layout == "lamb" else fuser.optim.AdamW
            for block, sub, warps, *cap in settings:
                os.environ.update(dict(zip(ENV, (block, sub, warps))))
                os.environ.pop("FUSER_OPTIM_MAXNREG", None)
                if cap:
                    os.environ["FUSER_OPTIM_MAXNREG"] = cap[0]
                row = dict(layout=layout, BLOCK=int(block), SUB=int(sub), warps=int(warps))
                row["maxnreg"] = cap[0] if cap else "default"
                opt = make(ps, lr=1e-3, weight_decay=0.01, **LAYOUTS[layout])
                row["ms"], row["min_ms"] = (round(t, 4) for t in time_step(opt))
                print(row, flush=True)
                rows.append(row)
                del opt
                gc.collect()
                torch.cuda.empty_cache()
            del ps
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return rows


def write(rows: list[dict], meta: dict, out: str, tag: str) -> None:
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"sweep_step_{meta['date']}{tag}")
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [
        f"# Launch shape of the flat step kernels, {meta['device']}, {meta['date']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}. Command: `{meta['command']}`",
        "",
        "AdamW (LAMB for `lamb`) on TinyLlama-1.1B's 201 tensors; ms per step (CUDA events, median and "
        "minimum of 20).",
        "",
        "| layout | BLOCK | SUB | warps | register cap | median ms | min ms |",
        "|---|---|---|---|---|---|---|",
    ]
    cols = ("layout", "BLOCK", "SUB", "warps", "maxnreg", "ms", "min_ms")
    lines += ["| " + " | ".join(str(r.get(c, "default")) for c in cols) + " |" for r in rows]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--settings", default=SETTINGS)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("sweep_step.py times GPU kernels: run it on a CUDA machine")
    settings = [tuple(s.split(":")) for s in args.settings.split(",")]
    rows = run(args.layouts.split(","), settings)
    meta = dict(
        date=datetime.date.today().isoformat(),
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        command="python benchmarks/probes/sweep_step.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    write(rows, meta, args.out, args.tag)


if __name__ == "__main__":
    main()
