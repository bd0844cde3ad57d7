"""Compressed optimizer state on TinyLlama-1.1B's shapes: fuser's 8-bit states and bf16
master-weight correction beside FlashOptim, bitsandbytes, torchao and torch, in this
process, on this GPU.

Workloads (TinyLlama-1.1B's 201 tensors, bf16 parameters and gradients); the floor is
the bytes a step must move over the copy bandwidth measured in this run, per parameter:

- `adamw_q8_llama1b`: AdamW, 8-bit m (int8) and v (uint8): p read + written 2 + 2,
  g 2, m 1 + 1, v 1 + 1, one fp32 scale per 32 elements of each state read and written
  (0.5): 10.5 B;
- `adamw_q8_master24_llama1b`: the same with ``master_weights="bf16+int8"`` (the int8
  correction read and written, 1 + 1): 12.5 B;
- `adamw_bf16p_fp32s_llama1b`: fp32 m and v (4 + 4 each way): 22 B;
- `adamw_bf16_llama1b`: bf16 m and v (``state_dtype="param"``): 14 B;
- `lion_q8_llama1b`: Lion written as a ``fuser.rule``, 8-bit m: 2 + 2 + 2 + 1 + 1 + 0.25
  = 8.25 B.

Each fuser configuration runs as built and with ``static=True`` (no parameter, gradient or
state tensor replaced between steps; the gradients here are written once and never
replaced). Anchors, each guarded (one that fails to import or run is an error row):
torch's fused AdamW (bf16 states) and ``torch.compile(AdamW.step)`` under
`adamw_bf16_llama1b`; FlashOptim 0.1.4's FlashAdamW with ``master_weight_bits=None``
(8-bit m and v, no correction), bitsandbytes 0.50.2's AdamW8bit and torchao 0.18's
AdamW8bit (torch.compile inside; ~20 s first step) under `adamw_q8_llama1b`; FlashAdamW
with its default 24-bit master weights under `adamw_q8_master24_llama1b`; FlashAdamW with
``quantize=False, master_weight_bits=None`` (fp32 states) under
`adamw_bf16p_fp32s_llama1b`; FlashLion (``master_weight_bits=None`` and the default 24)
and bitsandbytes' Lion8bit under `lion_q8_llama1b`.

Per row: median step time by CUDA events (``ms``: from the host's call to the GPU's end,
so the host's checks before the launch count), host wall time per step back to back
(``wall_ms``), the GPU's time alone (``device_ms``: the step's launches queued behind a
spin of the GPU, so the host's work is hidden), the floor and its fraction reached by
``ms`` (``pct_of_floor``) and by ``device_ms``, bytes per parameter the optimizer holds
after its first step (CUDA allocator difference), seconds from construction to the end of
the first step, and the relative error of the parameter update after 10 steps on one
decoder layer's 9 tensors against float64 AdamW (Lion) from the same bf16 start and
gradients (``update_rel_err``: what bf16 storage, 8-bit states and the master correction
cost in precision; not run for compiled anchors). fuser rows carry the ratio anchor ms /
fuser ms against every anchor of the same optimizer (``vs``, > 1: fuser faster).

    PYTHONPATH=.:.bench/anch python benchmarks/state_bench.py [--out DIR] [--tag _v2]
        [--rows adamw_q8_llama1b lion_q8_llama1b ...] [--quick] [--no-anchors]
    python benchmarks/state_bench.py --cpu-smoke --out /tmp/x   # CPU, 3 tensors, interpreter

``--quick`` leaves out the two anchors that compile (torch.compile, torchao; ~90 s of the
~3 min) and times 10 steps instead of 20. Writes ``state_<date><tag>.json`` and ``.md``
under --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import importlib.metadata
import json
import math
import os
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if "--cpu-smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import triton  # noqa: E402
from optim_bench import CompiledAdamW, llama1b_shapes  # noqa: E402
from timing import copy_bandwidth, device_ms, step_ms, sync, wall_ms  # noqa: E402

import fuser  # noqa: E402
import fuser.optim  # noqa: E402

ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
LION = dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.01)
LION_RULE = fuser.rule(
    """
    p = p * (1 - lr * weight_decay)
    update = sign(beta1 * exp_avg + (1 - beta1) * g)
    exp_avg = beta2 * exp_avg + (1 - beta2) * g
    p = p - lr * update
    """,
    name="lion",
    hyper=dict(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.0),
    state=dict(exp_avg=0.0),
)
CPU_SHAPES = [(64, 48), (48,), (33, 7)]
QBLOCK = 32
SCALES = 2 * 4 / QBLOCK  # one fp32 scale per 32 elements, read and written, per 8-bit state

# Bytes per parameter that every implementation of a workload moves (module docstring).
FLOOR_BYTES = {
    "adamw_q8_llama1b": dict(p=4, g=2, m=2, v=2, scales=2 * SCALES),
    "adamw_q8_master24_llama1b": dict(p=4, g=2, m=2, v=2, scales=2 * SCALES, master_lo=2),
    "adamw_bf16p_fp32s_llama1b": dict(p=4, g=2, m=8, v=8),
    "adamw_bf16_llama1b": dict(p=4, g=2, m=4, v=4),
    "lion_q8_llama1b": dict(p=4, g=2, m=2, scales=SCALES),
}
FAMILY = {w: w.split("_")[0] for w in FLOOR_BYTES}


# --- implementations ------------------------------------------------------------------------


def fuser_adamw(ps, **options):
    return fuser.optim.AdamW(ps, **options, **ADAMW)


def fuser_lion(ps, static):
    b1, b2 = LION["betas"]
    Lion = fuser.compile(LION_RULE, state_dtype="q8", static=static)
    return Lion(ps, lr=LION["lr"], beta1=b1, beta2=b2, weight_decay=LION["weight_decay"])


def fuser_impls():
    """(workload, impl, build): each fuser configuration, as built and static."""
    configs = {
        "adamw_q8_llama1b": dict(state_dtype="q8"),
        "adamw_q8_master24_llama1b": dict(state_dtype="q8", master_weights="bf16+int8"),
        "adamw_bf16p_fp32s_llama1b": dict(),
        "adamw_bf16_llama1b": dict(state_dtype="param"),
    }
    out = []
    for static in (False, True):
        suffix = " static" if static else ""
        for workload, opts in configs.items():
            out.append(
                (
                    workload,
                    "fuser.optim.AdamW" + suffix,
                    functools.partial(fuser_adamw, static=static, **opts),
                )
            )
        out.append(
            ("lion_q8_llama1b", "fuser.rule lion" + suffix, functools.partial(fuser_lion, static=static))
        )
    return out


def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        module = __import__(dist)
        return getattr(module, "__version__", "?")


def anchor_impls(quick):
    """(workload, impl, build or None, error, compiled) for every anchor. An anchor whose
    package fails to import is one row with the error."""
    out = [
        ("adamw_bf16_llama1b", "torch.AdamW fused (bf16 states)",
         lambda ps: torch.optim.AdamW(ps, fused=True, **ADAMW), None, False),
    ]  # fmt: skip
    if not quick:
        out.append(
            ("adamw_bf16_llama1b", "torch.compile(AdamW.step) (bf16 states)", CompiledAdamW, None, True)
        )
    try:
        import flashoptim

        v = f"FlashOptim {_version('flashoptim')}"
        out += [
            ("adamw_q8_llama1b", f"{v} FlashAdamW master_weight_bits=None",
             lambda ps: flashoptim.FlashAdamW(ps, master_weight_bits=None, **ADAMW), None, False),
            ("adamw_q8_master24_llama1b", f"{v} FlashAdamW (24-bit master)",
             lambda ps: flashoptim.FlashAdamW(ps, **ADAMW), None, False),
            ("adamw_bf16p_fp32s_llama1b", f"{v} FlashAdamW quantize=False master_weight_bits=None",
             lambda ps: flashoptim.FlashAdamW(ps, quantize=False, master_weight_bits=None, **ADAMW),
             None, False),
            ("lion_q8_llama1b", f"{v} FlashLion master_weight_bits=None",
             lambda ps: flashoptim.FlashLion(ps, master_weight_bits=None, **LION), None, False),
            ("lion_q8_llama1b", f"{v} FlashLion (24-bit master)",
             lambda ps: flashoptim.FlashLion(ps, **LION), None, False),
        ]  # fmt: skip
    except Exception as e:
        out.append(("adamw_q8_llama1b", "FlashOptim", None, f"import: {type(e).__name__}: {e}"[:400], False))
    try:
        import bitsandbytes as bnb

        v = f"bitsandbytes {_version('bitsandbytes')}"
        out += [
            ("adamw_q8_llama1b", f"{v} AdamW8bit", lambda ps: bnb.optim.AdamW8bit(ps, **ADAMW), None, False),
            ("lion_q8_llama1b", f"{v} Lion8bit", lambda ps: bnb.optim.Lion8bit(ps, **LION), None, False),
        ]
    except Exception as e:
        out.append(
            ("adamw_q8_llama1b", "bitsandbytes", None, f"import: {type(e).__name__}: {e}"[:400], False)
        )
    if not quick:
        try:
            from torchao.optim import AdamW8bit

            v = f"torchao {_version('torchao')}"
            out.append(("adamw_q8_llama1b", f"{v} AdamW8bit", lambda ps: AdamW8bit(ps, **ADAMW), None, True))
        except Exception as e:
            out.append(("adamw_q8_llama1b", "torchao", None, f"import: {type(e).__name__}: {e}"[:400], False))
    return out


# --- timing and memory ----------------------------------------------------------------------


def free(device):
    if device.type == "cuda":  # (what the next row's memory figures read; the CPU smoke reads none)
        gc.collect()
        torch.cuda.empty_cache()


def allocated(device):
    return torch.cuda.memory_allocated() if device.type == "cuda" else 0


def state_tensor_bytes(opt):
    """Bytes of the plain tensors in ``opt.state`` (the CPU stand-in for the allocator)."""
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and type(v) is torch.Tensor:
                total += v.numel() * v.element_size()
    return total


def state_layout(opt, p):
    """The dtype of each state entry of parameter ``p`` (the type for tensor subclasses)."""
    st = getattr(opt, "state", {}).get(p, {}) if hasattr(opt, "state") else {}
    out = {}
    for k, v in st.items():
        if isinstance(v, torch.Tensor):
            out[k] = str(v.dtype).replace("torch.", "") if type(v) is torch.Tensor else type(v).__name__
    return out


def make(shapes, device, seed):
    """bf16 parameters ~ N(0, 0.02) and gradients ~ N(0, 1e-3), as optim_bench's."""
    g = torch.Generator(device=device).manual_seed(seed)
    ps = [(torch.randn(s, device=device, generator=g) * 0.02).bfloat16().requires_grad_() for s in shapes]
    for p in ps:
        p.grad = (torch.randn(p.shape, device=device, generator=g) * 1e-3).bfloat16()
    return ps


# --- precision ------------------------------------------------------------------------------


def reference_updates(start, grads, family):
    """Float64 AdamW (Lion) from the same start over the same gradients: the final
    parameters."""
    ps = [p.double() for p in start]
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    for step, gs in enumerate(grads, start=1):
        for i, (p, g) in enumerate(zip(ps, gs)):
            g = g.double()
            if family == "adamw":
                b1, b2 = ADAMW["betas"]
                m[i] = b1 * m[i] + (1 - b1) * g
                v[i] = b2 * v[i] + (1 - b2) * g * g
                u = (m[i] / (1 - b1**step)) / ((v[i] / (1 - b2**step)).sqrt() + ADAMW["eps"])
                ps[i] = p * (1 - ADAMW["lr"] * ADAMW["weight_decay"]) - ADAMW["lr"] * u
            else:
                b1, b2 = LION["betas"]
                u = torch.sign(b1 * m[i] + (1 - b1) * g)
                m[i] = b2 * m[i] + (1 - b2) * g
                ps[i] = p * (1 - LION["lr"] * LION["weight_decay"]) - LION["lr"] * u
    return ps


def update_rel_err(build, shapes, device, family, steps=10):
    """||update - float64 update|| / ||float64 update|| after ``steps`` steps from the same
    bf16 start with the same fresh gradients each step."""
    ps = make(shapes, device, 1)
    start = [p.detach().clone() for p in ps]
    g = torch.Generator(device=device).manual_seed(2)
    grads = [
        [(torch.randn(p.shape, device=device, generator=g) * 1e-3).bfloat16() for p in ps]
        for _ in range(steps)
    ]
    opt = build(ps)
    for gs in grads:
        for p, gr in zip(ps, gs):
            p.grad.copy_(gr)  # in place: static optimizers read the same tensors
        opt.step()
    want = reference_updates(start, grads, family)
    num = sum(((p.double() - w) ** 2).sum() for p, w in zip(ps, want)).sqrt()
    den = sum(((w - s.double()) ** 2).sum() for w, s in zip(want, start)).sqrt()
    del opt, ps
    return (num / den).item()


# --- one row --------------------------------------------------------------------------------


def run_one(workload, impl, build, compiled, shapes, device, bw, cfg, rows):
    n = sum(math.prod(s) for s in shapes)
    per_param = sum(FLOOR_BYTES[workload].values())
    floor_ms = n * per_param / (bw * 1e12) * 1e3
    row = dict(workload=workload, impl=impl)
    try:
        err = None
        if not compiled:
            err = update_rel_err(build, cfg["check_shapes"], device, FAMILY[workload])
            free(device)
        ps = make(shapes, device, 0)
        base = allocated(device)
        t0 = time.perf_counter()
        opt = build(ps)
        opt.step()
        sync(device)
        first_s = time.perf_counter() - t0
        held = allocated(device) - base if device.type == "cuda" else state_tensor_bytes(opt)
        layout = state_layout(getattr(opt, "opt", opt), ps[1])
        before = fuser.stats()["launches"]
        opt.step()
        launches = fuser.stats()["launches"] - before if impl.startswith("fuser") else None
        ms = step_ms(opt.step, device, cfg["rep"], warmup=cfg["warmup"])
        wall = wall_ms(opt.step, device, cfg["rep"])
        alone = device_ms(opt.step, device, cfg["rep"])
        row.update(
            ms=round(ms, 4),
            wall_ms=round(wall, 4),
            device_ms=round(alone, 4),
            pct_of_floor_device=round(100 * round(floor_ms, 4) / round(alone, 4), 1),
            floor_ms=round(floor_ms, 4),
            # from the rounded figures the row shows, so that they agree to the last digit
            pct_of_floor=round(100 * round(floor_ms, 4) / round(ms, 4), 1),
            floor_bytes_per_param=per_param,
            state_bytes_per_param=round(held / n, 3),
            first_step_s=round(first_s, 3),
            update_rel_err=err,
            fuser_launches=launches,
            state_layout=layout,
            tensors=len(shapes),
            params=n,
            device=device_name(device),
        )
    except Exception as e:  # one failing configuration or anchor must not hide the others
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        traceback.print_exc(limit=4)
    rows.append(row)
    print(json.dumps(row), flush=True)
    opt = ps = None
    if compiled:
        torch._dynamo.reset()
    free(device)


def ratios(rows):
    """On each fuser row: anchor ms / fuser ms for every anchor of the same optimizer."""
    anchors = [r for r in rows if not r["impl"].startswith("fuser") and "ms" in r]
    for r in rows:
        if r["impl"].startswith("fuser") and "ms" in r:
            fam = FAMILY[r["workload"]]
            r["vs"] = {
                f"{a['workload']}: {a['impl']}": round(a["ms"] / r["ms"], 3)
                for a in anchors
                if FAMILY[a["workload"]] == fam
            }


def device_name(device):
    return torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)"


# --- output ---------------------------------------------------------------------------------


def write(rows, meta, out, tag):
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"state_{meta['date']}{tag}")
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
    lines = [
        f"# Compressed optimizer state, {meta['device']}, {meta['date']}",
        "",
        f"{versions}; copy bandwidth {meta['copy_TBps']} TB/s. Command: `{meta['command']}`",
        "",
        "bf16 parameters and gradients; B/param held: bytes the optimizer holds after its first step "
        f"({meta['held_bytes']}); update err: relative error of 10 steps' update against float64.",
        "",
        "| workload | impl | median ms (events) | wall ms/step | device ms | floor ms | % of floor "
        "| % of floor (device) | B/param held | first step s | update err |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['workload']} | {r['impl']} | error: {r['error']} | | | | | | | | |")
            continue
        err = "" if r["update_rel_err"] is None else f"{r['update_rel_err']:.2e}"
        cells = [r["workload"], r["impl"], r["ms"], r["wall_ms"], r["device_ms"], r["floor_ms"],
                 r["pct_of_floor"], r["pct_of_floor_device"], r["state_bytes_per_param"], r["first_step_s"],
                 err]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    for fam in dict.fromkeys(FAMILY.values()):
        fused = [r for r in rows if "vs" in r and FAMILY[r["workload"]] == fam]
        cols = list(dict.fromkeys(k for r in fused for k in r["vs"]))
        if not fused or not cols:
            continue
        lines += [
            "",
            f"{fam}: anchor ms / fuser ms (> 1: fuser faster)",
            "",
            "| fuser row | " + " | ".join(cols) + " |",
            "|---|" + "---|" * len(cols),
        ]
        for r in fused:
            lines.append(
                f"| {r['workload']}: {r['impl']} | "
                + " | ".join(str(r["vs"].get(c, "")) for c in cols)
                + " |"
            )
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return stem


def versions(names):
    out = dict(torch=torch.__version__, triton=triton.__version__)
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except Exception:
            try:
                out[name] = getattr(__import__(name), "__version__", "?")
            except Exception:
                out[name] = "absent"
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--tag", default="", help="suffix of the output files' names")
    ap.add_argument("--rows", nargs="+", choices=sorted(FLOOR_BYTES), help="only these workloads")
    ap.add_argument(
        "--quick", action="store_true", help="no compiled anchors (torch.compile, torchao); 10 steps"
    )
    ap.add_argument("--no-anchors", action="store_true", help="fuser rows only")
    ap.add_argument("--no-static", action="store_true", help="leave out the static=True fuser rows")
    ap.add_argument(
        "--cpu-smoke", action="store_true", help="3 small tensors on the CPU, interpreter, no anchors"
    )
    args = ap.parse_args(argv)
    if not (args.cpu_smoke or torch.cuda.is_available()):
        ap.error("needs a CUDA GPU (or --cpu-smoke)")
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    shapes = CPU_SHAPES if args.cpu_smoke else llama1b_shapes()
    cfg = dict(
        warmup=0 if args.cpu_smoke else 3,
        rep=1 if args.cpu_smoke else (10 if args.quick else 20),
        check_shapes=CPU_SHAPES if args.cpu_smoke else shapes[1:10],  # one decoder layer
    )
    wanted = set(args.rows or FLOOR_BYTES)
    impls = [
        (w, i, b, None, False) for w, i, b in fuser_impls() if not (args.no_static and i.endswith("static"))
    ]
    if not (args.cpu_smoke or args.no_anchors):
        torch._dynamo.config.cache_size_limit = 64
        impls += anchor_impls(args.quick)
    impls = [x for x in impls if x[0] in wanted]
    bw = copy_bandwidth(device, 1 << 16 if args.cpu_smoke else 1 << 28, rep=20)
    n = sum(math.prod(s) for s in shapes)
    print(f"copy bandwidth {bw:.3f} TB/s; {len(shapes)} tensors, {n / 1e6:.1f} M params", flush=True)
    rows = []
    for workload, impl, build, error, compiled in impls:
        if build is None:
            rows.append(dict(workload=workload, impl=impl, error=error))
            print(json.dumps(rows[-1]), flush=True)
            continue
        run_one(workload, impl, build, compiled, shapes, device, bw, cfg, rows)
    ratios(rows)
    meta = dict(
        date=datetime.date.today().isoformat(),
        device=device_name(device),
        versions=versions(["flashoptim", "bitsandbytes", "torchao"] if not args.cpu_smoke else []),
        copy_TBps=round(bw, 4),
        held_bytes="CUDA allocator difference"
        if device.type == "cuda"
        else "plain tensors in optimizer.state",
        command=" ".join(["python", os.path.relpath(__file__), *(sys.argv[1:] if argv is None else argv)]),
    )
    meta.update(torch=torch.__version__, triton=triton.__version__)
    write(rows, meta, args.out, args.tag)


if __name__ == "__main__":
    main()
