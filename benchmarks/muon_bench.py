"""Muon on TinyLlama-1.1B's shapes: fuser's built-in beside Keller Jordan's reference loop
(muon-optimizer 0.1.0) and torch.optim.Muon under torch.compile, in one process.

Workloads (bf16 parameters and gradients):

- `muon_llama1b`: Newton–Schulz (5 steps) on the 154 hidden matrices and AdamW on the
  other 47 tensors (embeddings, head, norms), one optimizer as muon-optimizer's
  `SingleDeviceMuonWithAuxAdam` runs it;
- `muon_hidden_llama1b`: the 154 hidden matrices alone, where torch.optim.Muon (2-D only)
  and `SingleDeviceMuon` run too;
- `muon_moe`: an MoE layout, 8 layers each of 8 experts' `[1408, 2048]` and `[2048, 1408]`
  matrices stored as `[8, 1408, 2048]` and `[8, 2048, 1408]` tensors and four `[2048, 2048]`
  attention matrices: fuser's Muon with `view="batched"` (each expert's matrix
  orthogonalised, the experts of every layer in one batched product) beside the references
  looping over the same matrices as 2-D parameters (torch.optim.Muon eager).

The floor is the Newton–Schulz products' flops, 5 x (4 m^2 n + 2 m^3) per m x n matrix
(m <= n), at the bf16 GEMM rate measured in this run (8192^3).

Memory (GPU runs), per parameter the optimizer updates: `held` is what it keeps between
steps, `torch.cuda.memory_allocated` after its first step less before it was made (the
parameters and gradients already there); `peak` the most allocated above that during a
later step (fuser: states plus its Newton–Schulz workspace, `FUSER_MATRIX_WORKSPACE`,
default 1 GiB a slice). fuser's row `one slice` runs with the budget `unlimited`: the time
slicing costs. `MiB allocated before the row` is what the earlier rows left allocated
(after a garbage collection), before this row's parameters are made: a held or peak figure
below zero means some of it was freed during the row. fuser's update is checked
against the reference's on identical inputs first (relative error of one step's update;
both use bf16 products, so they differ by bf16 rounding).

    python benchmarks/muon_bench.py [--out DIR] [--tag _v2] [--no-compile] [--smoke]

`--smoke` runs a few small matrices on the CPU (through Triton's interpreter) to check
the script. Writes `muon_<date><tag>.json` and `.md` under --out (default
benchmarks/results).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
from optim_bench import event_ms, llama1b_shapes, wall_ms  # noqa: E402

import fuser  # noqa: E402
import fuser.optim  # noqa: E402


def ns_flops(shapes) -> float:
    total = 0.0
    for s in shapes:
        m, n = sorted((s[0], int(torch.Size(s[1:]).numel())))
        total += 5 * (4 * m * m * n + 2 * m**3)
    return total


def gemm_tflops(device) -> float:
    m = 8192 if device.type == "cuda" else 256
    x = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    y = torch.randn_like(x)
    ms = event_ms(lambda: x @ y, rep=10) if device.type == "cuda" else _cpu_ms(lambda: x @ y)
    return 2 * m**3 / (ms * 1e-3) / 1e12


def _cpu_ms(fn, rep=3, warmup=True):
    import time

    if warmup:
        fn()
    t0 = time.perf_counter()
    for _ in range(rep):
        fn()
    return (time.perf_counter() - t0) / rep * 1e3


def moe_shapes(layers=8, experts=8, d=2048, ffn=1408, batched=True):
    """``muon_moe``'s shapes: per layer the experts' two stacks and four attention matrices
    (``batched=False``: each expert's matrix its own 2-D tensor, as a per-expert loop takes them)."""
    stacks = (
        [(experts, ffn, d), (experts, d, ffn)] if batched else [(ffn, d)] * experts + [(d, ffn)] * experts
    )
    return [s for _ in range(layers) for s in stacks + [(d, d)] * 4]


def make(shapes, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, device=device, generator=g).bfloat16() * 0.02) for s in shapes]
    for p in ps:
        p.grad = (torch.randn(p.shape, device=device, generator=g) * 1e-3).bfloat16()
    return ps


def split(ps):
    """Hidden matrices (Muon) and the rest (AdamW): 2-D tensors other than the first
    (embeddings) and the last (head)."""
    hidden = [p for i, p in enumerate(ps) if p.dim() == 2 and 0 < i < len(ps) - 1]
    ids = {id(p) for p in hidden}
    return hidden, [p for p in ps if id(p) not in ids]


def groups(ps):
    hidden, rest = split(ps)
    aux = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)
    return [dict(params=hidden, use_muon=True, lr=0.02, momentum=0.95, weight_decay=0.0),
            dict(params=rest, use_muon=False, **aux)]  # fmt: skip


ONE_SLICE = {"FUSER_MATRIX_WORKSPACE": "unlimited"}  # what a build with this in its name runs under


def impls(compile_torch: bool):
    full = {"fuser.optim.Muon (+AdamW groups)": lambda ps: fuser.optim.Muon(groups(ps))}
    full["fuser.optim.Muon (+AdamW groups) one slice"] = full["fuser.optim.Muon (+AdamW groups)"]
    full["fuser.optim.Muon static"] = lambda ps: fuser.optim.Muon(groups(ps), static=True)
    hidden = {"fuser.optim.Muon": lambda ps: fuser.optim.Muon(ps, lr=0.02)}
    hidden["fuser.optim.Muon one slice"] = hidden["fuser.optim.Muon"]
    try:
        import muon

        full["muon-optimizer SingleDeviceMuonWithAuxAdam"] = lambda ps: muon.SingleDeviceMuonWithAuxAdam(
            groups(ps)
        )
        hidden["muon-optimizer SingleDeviceMuon"] = lambda ps: muon.SingleDeviceMuon(
            ps, lr=0.02, momentum=0.95
        )
    except ImportError as e:
        print(f"muon-optimizer skipped: {e}", flush=True)
    if compile_torch and hasattr(torch.optim, "Muon"):

        def compiled(ps):
            opt = torch.optim.Muon(ps, lr=0.02, momentum=0.95, weight_decay=0.0)
            step = torch.compile(opt.step)
            return type("CompiledMuon", (), {"step": staticmethod(step)})()

        hidden["torch.compile(torch.optim.Muon.step)"] = compiled
    return full, hidden


def ns_alone(shapes, device) -> float:
    """Median ms of fuser's batched Newton–Schulz launches alone (no elementwise phase):
    what the products cost at cuBLAS's rate for these shapes."""
    from fuser.ir.optim import ReductionPlan
    from fuser.runtime.matrix import Workspace, build_matrices, extent, shape_groups

    plan = ReductionPlan(None, "orthogonalize", 0, -1, -1, args=(5, 3.4445, -4.7750, 2.0315, 1e-7))
    (work,), _ = build_matrices([plan], shapes, device)
    workspace = Workspace(device, extent([work]), shape_groups([work]))
    workspace.acquire()
    for sg in work.groups:
        sg.x.normal_()
    ms = event_ms(work) if device.type == "cuda" else _cpu_ms(work, rep=1)
    workspace.release()
    return ms


class Memory:
    """Bytes the device allocates above a baseline (``torch.cuda.memory_allocated``): what
    an optimizer made and stepped keeps (``held``), and the most a step allocates above
    the baseline (``peak``); None on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            gc.collect()  # (an earlier row's optimizer in a reference cycle is freed now, not later)
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()

    def held(self) -> int | None:
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - self.base

    def peak(self, step) -> int | None:
        """Run ``step`` once; the most allocated above the baseline meanwhile."""
        if not self.cuda:
            step()
            return None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - self.base


def per_param(nbytes: int | None, n: int) -> float | None:
    return None if nbytes is None else round(nbytes / n, 2)


class environ:
    """Set ``values`` in os.environ for a ``with`` block."""

    def __init__(self, values: dict):
        self.values, self.saved = values, {}

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.values}
        os.environ.update(self.values)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check(shapes, device) -> float | None:
    """One step of fuser's Muon and the reference's on the same inputs: relative error of
    the update (of the hidden matrices)."""
    try:
        import muon
    except ImportError:
        return None
    a, b = make(shapes, device, 1), make(shapes, device, 1)
    start = [p.detach().clone() for p in a]
    fuser.optim.Muon(a, lr=0.02).step()
    muon.SingleDeviceMuon(b, lr=0.02, momentum=0.95).step()
    num = sum(((x.double() - y.double()) ** 2).sum() for x, y in zip(a, b)).sqrt()
    den = sum(((y.double() - s.double()) ** 2).sum() for y, s in zip(b, start)).sqrt()
    return (num / den).item()


def run(workload, shapes, builds, device, floor_ms, err, rows):
    for name, build in builds.items():
        left = None
        if device.type == "cuda":  # (what earlier rows left allocated: a held figure below 0 comes from it)
            gc.collect()
            torch.cuda.synchronize()
            left = torch.cuda.memory_allocated()
        ps = make(shapes, device, 0)
        stepped = split(ps)[0] if workload.startswith("muon_hidden") else ps
        memory = Memory(device)
        opt = build(stepped)
        try:
            with environ(ONE_SLICE if name.endswith("one slice") else {}):
                opt.step()  # the first step builds tables (and slices) and compiles
            held = memory.held()
            before = fuser.stats()["launches"]
            if device.type == "cuda":
                ms = event_ms(opt.step, rep=10)
                wall = wall_ms(opt.step, steps=10)
            else:  # (the interpreter: one step after the first, timed and its launches counted)
                ms = wall = _cpu_ms(opt.step, rep=1, warmup=False)
        except Exception as e:  # an anchor that fails must not hide the others
            rows.append(dict(workload=workload, impl=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
            print(json.dumps(rows[-1]), flush=True)
            continue
        peak = None
        if device.type == "cuda":  # (one more step: its launches and the most it allocates)
            before = fuser.stats()["launches"]
            peak = memory.peak(opt.step)
        n = sum(p.numel() for p in stepped)
        row = dict(
            workload=workload,
            impl=name,
            ms=round(ms, 3),
            wall_ms=round(wall, 3),
            floor_ms=round(floor_ms, 3),
            pct_of_floor=round(100 * floor_ms / ms, 1),
            fuser_launches=fuser.stats()["launches"] - before if name.startswith("fuser") else None,
            held_B_per_param=per_param(held, n),
            peak_B_per_param=per_param(peak, n),
            peak_MiB=None if peak is None else round(peak / 2**20, 1),
            allocated_before_MiB=None if left is None else round(left / 2**20, 1),
            rel_err_vs_reference=err if name.startswith("fuser") else None,
            tensors=len(ps),
            device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
        del ps, opt, stepped
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--tag", default="")
    ap.add_argument(
        "--no-compile", action="store_true", help="leave out torch.compile(torch.optim.Muon.step)"
    )
    ap.add_argument("--smoke", action="store_true", help="small shapes on the CPU, to check the script")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    shapes = llama1b_shapes() if not args.smoke else [(64, 16), (16, 16), (8, 16), (16, 24), (16,), (64, 16)]
    hidden, _ = split([torch.empty(s, device="meta") for s in shapes])
    tf = gemm_tflops(device)
    floor_ms = ns_flops([tuple(p.shape) for p in hidden]) / (tf * 1e12) * 1e3
    err = check([tuple(p.shape) for p in hidden][:8], device)
    print(f"{len(hidden)} hidden matrices, NS floor {floor_ms:.2f} ms at {tf:.0f} TFLOP/s, "
          f"fuser vs reference update rel err {err}", flush=True)  # fmt: skip
    full, hidden_builds = impls(not args.no_compile and device.type == "cuda")
    rows = []
    run("muon_llama1b", shapes, full, device, floor_ms, err, rows)
    run("muon_hidden_llama1b", shapes, hidden_builds, device, floor_ms, err, rows)
    moe(args, device, tf, rows)
    ms = ns_alone([tuple(p.shape) for p in hidden], device)
    rows.append(dict(workload="muon_hidden_llama1b", impl="probe: fuser's Newton-Schulz launches alone",
                     ms=round(ms, 3), wall_ms=round(ms, 3), floor_ms=round(floor_ms, 3),
                     pct_of_floor=round(100 * floor_ms / ms, 1), fuser_launches=None))  # fmt: skip
    print(json.dumps(rows[-1]), flush=True)
    write(args, rows, tf, argv)


def moe(args, device, tf, rows):
    """``muon_moe``: fuser's batched view on the expert stacks beside the references' loop
    over the same matrices as 2-D parameters (the floor: the same products either way)."""
    small = dict(layers=2, experts=3, d=16, ffn=24) if args.smoke else {}
    flat = moe_shapes(batched=False, **small)
    floor_ms = ns_flops(flat) / (tf * 1e12) * 1e3
    builds = {"fuser.optim.Muon view=batched": lambda ps: fuser.optim.Muon(ps, lr=0.02, view="batched")}
    run("muon_moe", moe_shapes(**small), builds, device, floor_ms, None, rows)
    refs = {}
    try:
        import muon

        refs["muon-optimizer SingleDeviceMuon (per expert)"] = lambda ps: muon.SingleDeviceMuon(
            ps, lr=0.02, momentum=0.95
        )
    except ImportError as e:
        print(f"muon-optimizer skipped: {e}", flush=True)
    if hasattr(torch.optim, "Muon"):
        refs["torch.optim.Muon (per expert)"] = lambda ps: torch.optim.Muon(ps, lr=0.02, momentum=0.95)
    run("muon_moe", flat, refs, device, floor_ms, None, rows)


def write(args, rows, tf, argv):
    date = datetime.date.today().isoformat()
    meta = dict(
        date=date,
        device=torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu",
        torch=torch.__version__,
        triton=triton.__version__,
        bf16_gemm_TFLOPs=round(tf, 1),
        command="python "
        + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])),
    )
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"muon_{date}{args.tag}")
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [
        f"# Muon step, {meta['device']}, {date}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, bf16 GEMM {meta['bf16_gemm_TFLOPs']} TFLOP/s. "
        f"Command: `{meta['command']}`",
        "",
        "| workload | impl | median ms (events) | wall ms/step | % of NS floor | fuser launches "
        "| held B/param | peak B/param | peak MiB | MiB allocated before the row |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['workload']} | {r['impl']} | error: {r['error']} | | | | | | | |")
        else:
            cells = [
                r["workload"],
                r["impl"],
                r["ms"],
                r["wall_ms"],
                r["pct_of_floor"],
                r["fuser_launches"] or "",
                *(
                    "" if r.get(k) is None else r[k]
                    for k in ("held_B_per_param", "peak_B_per_param", "peak_MiB", "allocated_before_MiB")
                ),
            ]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
