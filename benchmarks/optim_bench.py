"""One AdamW step: fuser's built-in AdamW beside torch's foreach and fused AdamW.

Workloads (ANCHORS.md): `llama1b` = TinyLlama-1.1B's 201 parameter tensors, fp32 and
all-bf16 (params, grads and states in bf16, as torch keeps them); `small1000` = 1000
tensors of 4096 fp32 elements (launch-bound); `lamb` = LAMB on llama1b fp32, fuser's
built-in beside pytorch-optimizer's `Lamb` when installed. Every implementation runs in
this process on this GPU; AdamW is first checked against torch's fused AdamW on the same
inputs, LAMB against a float64 reference of the paper's rule.

    python benchmarks/optim_bench.py [--out DIR] [--tag _v2] [--compile] [llama1b small1000 lamb]

`--compile` adds `torch.compile(AdamW.step)` to the llama1b workloads (ANCHORS.md's fastest
torch anchor there; its compile takes about a minute per dtype). Writes
`optim_<date><tag>.json` and `.md` under --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fuser  # noqa: E402


def llama1b_shapes():
    vocab, hidden, inter, layers, kv = 32000, 2048, 5632, 22, 256
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [
            (hidden, hidden),
            (kv, hidden),
            (kv, hidden),
            (hidden, hidden),
            (inter, hidden),
            (inter, hidden),
            (hidden, inter),
            (hidden,),
            (hidden,),
        ]
    return shapes + [(hidden,), (vocab, hidden)]


def event_ms(fn, warmup=3, rep=20):
    """Median device time of fn (CUDA events), after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rep):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[len(times) // 2]


def wall_ms(fn, steps=50):
    """Host wall time per call over back-to-back calls, Python included."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3


def copy_bandwidth():
    src = torch.empty(1 << 28, device="cuda")
    src.normal_()
    dst = torch.empty_like(src)
    ms = event_ms(lambda: dst.copy_(src))
    src = dst = None
    torch.cuda.empty_cache()
    return 2 * (1 << 28) * 4 / (ms * 1e-3) / 1e12


def make(shapes, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ps = [torch.randn(s, device="cuda", dtype=dtype, generator=g) * 0.02 for s in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape, device="cuda", dtype=dtype, generator=g) * 1e-3
    return ps


IMPLS = {
    "fuser.optim.AdamW": lambda ps, bf16: fuser.optim.AdamW(
        ps, lr=1e-3, weight_decay=0.01, state_dtype="param" if bf16 else None
    ),
    "fuser.optim.AdamW static": lambda ps, bf16: fuser.optim.AdamW(
        ps, lr=1e-3, weight_decay=0.01, state_dtype="param" if bf16 else None, static=True
    ),
    "torch.AdamW foreach": lambda ps, bf16: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=True),
    "torch.AdamW fused": lambda ps, bf16: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True),
}


class CompiledAdamW:
    """``torch.compile(torch.optim.AdamW.step)`` with a tensor learning rate, as ANCHORS.md
    times it (so a scheduler would not recompile). Its first step is the compile."""

    def __init__(self, ps):
        self.opt = torch.optim.AdamW(ps, lr=torch.tensor(1e-3, device="cuda"), weight_decay=0.01)
        self.step = torch.compile(self.opt.step)


COMPILED = {"torch.compile(AdamW.step)": lambda ps, bf16: CompiledAdamW(ps)}


def check(shapes, dtype, bf16):
    """fuser vs torch fused after 3 steps on identical inputs: relative error of params."""
    small = shapes[:12]
    a, b = make(small, dtype, 1), make(small, dtype, 1)
    oa, ob = IMPLS["fuser.optim.AdamW"](a, bf16), IMPLS["torch.AdamW fused"](b, bf16)
    for _ in range(3):
        oa.step()
        ob.step()
    num = sum(((x.double() - y.double()) ** 2).sum() for x, y in zip(a, b)).sqrt()
    den = sum((y.double() ** 2).sum() for y in b).sqrt()
    return (num / den).item()


def lamb_check(shapes):
    """fuser's LAMB after 3 steps against the paper's rule in float64: relative error."""
    small = shapes[:12]
    ps = make(small, torch.float32, 2)
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    opt = fuser.optim.LAMB(ps, **hyper)
    ref = [p.detach().double().clone() for p in ps]
    m = [torch.zeros_like(r) for r in ref]
    v = [torch.zeros_like(r) for r in ref]
    b1, b2 = hyper["betas"]
    for step in range(1, 4):
        opt.step()
        for i, p in enumerate(ps):
            g = p.grad.double()
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            u = (m[i] / (1 - b1**step)) / ((v[i] / (1 - b2**step)).sqrt() + hyper["eps"])
            u = u + hyper["weight_decay"] * ref[i]
            pn, un = ref[i].norm(), u.norm()
            trust = pn / un if pn > 0 and un > 0 else 1.0
            ref[i] = ref[i] - hyper["lr"] * trust * u
    num = sum(((p.double() - r) ** 2).sum() for p, r in zip(ps, ref)).sqrt()
    return (num / sum((r**2).sum() for r in ref).sqrt()).item()


def run_lamb(shapes, bw, rows):
    """LAMB's floor: the trust ratio needs norm(p) and the norm of the update, so a first
    pass reads p, g, m and v (and may write the new m and v), the second reads what the
    update needs and writes p. Fewest bytes: the first pass writes m and v, the second
    reads p, m and v (16 + 8 + 12 + 4 = 40 B per fp32 parameter), as fuser's generated
    kernels do (`python -m fuser show`); recomputing m and v in the second pass instead
    moves 44 B."""
    n = sum(torch.Size(s).numel() for s in shapes)
    floor_ms = n * 40 / (bw * 1e12) * 1e3
    err = lamb_check(shapes)
    print(f"lamb_fp32_llama1b: floor {floor_ms:.3f} ms (40 B/param), fuser vs float64 rel err {err:.2e}")
    impls = {
        "fuser.optim.LAMB": lambda ps: fuser.optim.LAMB(ps, lr=1e-3, weight_decay=0.01),
        "fuser.optim.LAMB static": lambda ps: fuser.optim.LAMB(ps, lr=1e-3, weight_decay=0.01, static=True),
    }
    try:
        import pytorch_optimizer

        impls["pytorch_optimizer.Lamb foreach"] = lambda ps: pytorch_optimizer.Lamb(
            ps, lr=1e-3, weight_decay=0.01, foreach=True
        )
    except ImportError as e:
        print(f"pytorch_optimizer.Lamb skipped: {e}", flush=True)
    for name, build in impls.items():
        ps = make(shapes, torch.float32, 0)
        opt = build(ps)
        ms = event_ms(opt.step, rep=10)
        wall = wall_ms(opt.step, steps=20)
        row = dict(
            workload="lamb_fp32_llama1b",
            impl=name,
            ms=round(ms, 4),
            wall_ms=round(wall, 4),
            floor_ms=round(floor_ms, 4),
            pct_of_floor=round(100 * floor_ms / ms, 1),
            tensors=len(shapes),
            params=n,
            rel_err_vs_float64=err if name.startswith("fuser") else None,
            device=torch.cuda.get_device_name(),
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
        del ps, opt
        torch.cuda.empty_cache()


def run(workload, shapes, dtype, bw, rows, impls=IMPLS):
    bf16 = dtype == torch.bfloat16
    n = sum(torch.Size(s).numel() for s in shapes)
    floor_ms = n * (14 if bf16 else 28) / (bw * 1e12) * 1e3
    err = check(shapes, dtype, bf16)
    print(
        f"{workload}: {len(shapes)} tensors, {n / 1e6:.1f} M params, floor {floor_ms:.3f} ms, "
        f"fuser vs torch fused rel err {err:.2e}",
        flush=True,
    )
    for name, build in impls.items():
        ps = make(shapes, dtype, 0)
        opt = build(ps, bf16)
        t0 = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        ms = event_ms(opt.step)
        wall = wall_ms(opt.step)
        row = dict(
            workload=workload,
            impl=name,
            ms=round(ms, 4),
            wall_ms=round(wall, 4),
            floor_ms=round(floor_ms, 4),
            pct_of_floor=round(100 * floor_ms / ms, 1),
            first_step_s=round(first_s, 3),
            tensors=len(shapes),
            params=n,
            rel_err_vs_torch_fused=err if name.startswith("fuser") else None,
            device=torch.cuda.get_device_name(),
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
        del ps, opt
        torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("workloads", nargs="*", default=["llama1b", "small1000"])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--tag", default="", help="suffix of the output files' names")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile(AdamW.step) on llama1b")
    args = ap.parse_args(argv)
    bw = copy_bandwidth()
    rows = []
    if "llama1b" in args.workloads:
        impls = {**IMPLS, **COMPILED} if args.compile else IMPLS
        if args.compile:
            torch._dynamo.config.cache_size_limit = 64
        run("adamw_fp32_llama1b", llama1b_shapes(), torch.float32, bw, rows, impls)
        run("adamw_bf16_llama1b", llama1b_shapes(), torch.bfloat16, bw, rows, impls)
    if "small1000" in args.workloads:
        run("adamw_fp32_small1000", [(4096,)] * 1000, torch.float32, bw, rows)
    if "lamb" in args.workloads:
        run_lamb(llama1b_shapes(), bw, rows)
    date = datetime.date.today().isoformat()
    meta = dict(
        date=date,
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        copy_TBps=round(bw, 3),
        command="python " + " ".join([os.path.relpath(__file__)] + (argv or sys.argv[1:])),
    )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"optim_{date}{args.tag}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [
        f"# AdamW step, {meta['device']}, {date}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, copy bandwidth {meta['copy_TBps']} TB/s. "
        f"Command: `{meta['command']}`",
        "",
        "| workload | impl | median ms (events) | wall ms/step | % of floor | first step s |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['workload']} | {r['impl']} | {r['ms']} | {r['wall_ms']} | {r['pct_of_floor']} | "
        f"{r.get('first_step_s', '')} |"
        for r in rows
    ]
    with open(os.path.join(args.out, f"optim_{date}{args.tag}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
