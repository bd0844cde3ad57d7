"""Matrix-preconditioned optimizers on TinyLlama-1.1B's shapes (fp32 parameters and
gradients): fuser's built-ins beside heavyball, pytorch-optimizer and kron-torch, in one
process.

Workloads:

- `soap_llama1b`: `fuser.optim.SOAP` and the zoo's SOAP rule (`examples/zoo.py`, matrix
  states in the rule language) beside heavyball 3.2.1's `SOAP` and pytorch-optimizer
  4.1.0's `SOAP`, all with the same betas, `precondition_frequency` and a dimension limit of
  10000 (the embedding's and head's 32000 rows take no factor in any of them);
- `psgdkron_llama1b`: `fuser.optim.PSGDKron` beside heavyball's `PSGDKron` and kron-torch
  0.3.3's `Kron`, and the zoo's Kron rule beside pytorch-optimizer's `Kron`, each at its
  defaults;
- `shampoo_llama1b`: `fuser.optim.Shampoo` (where it exists; roots by `eigh` and by coupled
  Newton) beside pytorch-optimizer's `ScalableShampoo`, both recomputing their roots every
  `--interval` steps.

Time per step is over one refresh interval (`--interval` steps between two refreshes),
from each step timed alone over `--rounds` intervals (at least two) after `--warmup`
intervals: a step over twice the fastest is a refresh step, and the row's time is
`((interval - 1) * median of the other steps + median refresh step) / interval`, so that
the decompositions count at their share (with no refresh step: the window's mean). A fixed
window of one interval is not enough: heavyball's refresh gate sums `1 / interval` in
floating point, and at 5 it refreshes at steps 5, 11, 15, 20, so steps 6-10 hold none. The
per-step times are in the JSON rows. `first step s` is the wall time of the first step of
each optimizer in this process (heavyball compiles its step then; fuser loads or compiles
its kernels); `again s` the first step of a second optimizer of the same kind made after it
on fresh parameters (what is left once compiles are done: the first factors'
decompositions). `held B/param` is `torch.cuda.memory_allocated` after the warm-up less
before the optimizer was made (the parameters and gradients already there). Every step
gets the same gradients (heavyball consumes `p.grad`).

The products' floor of a step: for SOAP the two statistics (`G Gᵀ`, `Gᵀ G`) and three
two-sided maps (the gradient and the first moment onto the eigenbases, the direction back),
for Shampoo the statistics and the two-sided preconditioning, for PSGD Kron the
preconditioning `Q_Lᵀ Q_L M Q_Rᵀ Q_R`; a side
without a factor (a dimension over the limit, a vector) costs nothing; at the fp32 GEMM rate
measured in this run (4096³, TF32 off). The decompositions (`eigh`, `qr`) and PSGD's fit are
not in it: their time is in the rows' difference from it.

    python benchmarks/precond_bench.py [--out DIR] [--tag _v1] [--interval 10] [--warmup 2]
        [--rounds 3] [--workloads soap_llama1b ...] [--smoke]

`--smoke` runs a few small tensors on the CPU (Triton's interpreter) to check the script:
no timing claims. Writes `precond_<date><tag>.json` and `.md` under --out (default
benchmarks/results).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
from optim_bench import llama1b_shapes  # noqa: E402

import fuser  # noqa: E402
import fuser.optim  # noqa: E402

WORKLOADS = ("soap_llama1b", "psgdkron_llama1b", "shampoo_llama1b")
MAX_DIM = 10000
SMOKE_SHAPES = [(40, 8), (8, 8), (12, 8), (8, 20), (8,), (40, 8)]


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


def _soap_rule(ps, interval: int):
    """The zoo's SOAP rule (matrix states in the rule language) with the built-in's settings:
    1-D parameters in a group whose sides above 1 have no factor (precondition_1d=False)."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
    from zoo import ZOO

    groups = [
        dict(params=[p for p in ps if p.dim() >= 2]),
        dict(params=[p for p in ps if p.dim() < 2], max_matrix_dim=1),
    ]
    hyper = dict(lr=3e-3, beta1=0.95, beta2=0.95, shampoo_beta=0.95, weight_decay=0.01)
    opt_cls = fuser.compile(ZOO["soap"].rule)
    groups = [g for g in groups if g["params"]]
    return opt_cls(groups, precondition_frequency=float(interval), max_matrix_dim=MAX_DIM, **hyper)


def _kron_rule(ps):
    """The zoo's Kron rule (pytorch-optimizer's ``Kron`` at its defaults, which it is checked
    against): 1-D parameters without factors; a side over 8192 (the embedding's and head's
    32000 rows) has no factor, where the reference keeps a diagonal one."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
    from zoo import ZOO

    groups = [
        dict(params=[p for p in ps if p.dim() >= 2]),
        dict(params=[p for p in ps if p.dim() < 2], max_matrix_dim=1),
    ]
    opt_cls = fuser.compile(ZOO["kron"].rule)
    return opt_cls([g for g in groups if g["params"]], max_matrix_dim=8192)


def _heavyball():
    import heavyball
    import heavyball.utils

    # (its default mode fails for SOAP on torch 2.11; on the CPU smoke run, eager)
    heavyball.utils.compile_mode = "default" if torch.cuda.is_available() else None
    return heavyball


def builds(workload: str, interval: int) -> dict:
    """Name -> (constructor over a parameter list, or the reason it cannot run)."""
    out: dict = {}
    if workload == "soap_llama1b":
        kw = dict(lr=3e-3, betas=(0.95, 0.95), weight_decay=0.01, precondition_frequency=interval)
        out["fuser.optim.SOAP"] = lambda ps: fuser.optim.SOAP(ps, max_precondition_dim=MAX_DIM, **kw)
        out["fuser SOAP rule (examples/zoo.py)"] = lambda ps: _soap_rule(ps, interval)
        out[f"heavyball {_version('heavyball')} SOAP"] = lambda ps: _heavyball().SOAP(
            ps, shampoo_beta=0.95, max_precond_dim=MAX_DIM, merge_dims=False, **kw
        )
        out[f"pytorch_optimizer {_version('pytorch_optimizer')} SOAP"] = lambda ps: _po().SOAP(
            ps, max_precondition_dim=MAX_DIM, **kw
        )
    elif workload == "psgdkron_llama1b":
        out["fuser.optim.PSGDKron"] = lambda ps: fuser.optim.PSGDKron(ps)
        out["fuser Kron rule (examples/zoo.py)"] = _kron_rule
        out[f"pytorch_optimizer {_version('pytorch_optimizer')} Kron"] = lambda ps: _po().Kron(ps)
        out[f"heavyball {_version('heavyball')} PSGDKron"] = lambda ps: _heavyball().PSGDKron(ps)

        def kron(ps):
            import kron_torch

            return kron_torch.Kron(ps)

        out[f"kron-torch {_version('kron-torch')} Kron"] = kron
    else:
        if hasattr(fuser.optim, "Shampoo"):
            out["fuser.optim.Shampoo"] = lambda ps: fuser.optim.Shampoo(ps, precondition_frequency=interval)
            # (coupled Newton, as ScalableShampoo takes its roots by default)
            out["fuser.optim.Shampoo, Newton roots"] = lambda ps: fuser.optim.Shampoo(
                ps, precondition_frequency=interval, root_method="newton"
            )
            # (ScalableShampoo's default blocks are 512 wide, fuser's 1024: the same blocks too)
            out["fuser.optim.Shampoo, blocks of 512"] = lambda ps: fuser.optim.Shampoo(
                ps, precondition_frequency=interval, max_preconditioner_dim=512
            )
            out["fuser.optim.Shampoo, Newton roots, blocks of 512"] = lambda ps: fuser.optim.Shampoo(
                ps, precondition_frequency=interval, max_preconditioner_dim=512, root_method="newton"
            )
        else:
            out["fuser.optim.Shampoo"] = "fuser.optim has no Shampoo in this tree"
        out[f"pytorch_optimizer {_version('pytorch_optimizer')} ScalableShampoo"] = lambda ps: (
            _po().ScalableShampoo(ps, preconditioning_compute_steps=interval, start_preconditioning_step=1)
        )
    return out


def _po():
    import pytorch_optimizer

    return pytorch_optimizer


def products_floor_flops(shapes, workload: str) -> float:
    """The floor's flops of one step (the module's docstring), per 2-D view ``[shape[0],
    prod(rest)]`` with a factor on each side of at most ``MAX_DIM`` (heavyball's and kron's
    own limits differ: the floor is the SOAP/Shampoo convention for all)."""
    # (products a factored side takes, each ``2 k² · other`` flops: SOAP its statistic and its
    # side of three two-sided maps (the gradient and the first moment onto the eigenbasis,
    # the direction back); Shampoo its statistic and its root's product; PSGD Kron ``Q`` and
    # ``Qᵀ`` of ``Qᵀ Q M``)
    per_side = {"soap_llama1b": 4, "shampoo_llama1b": 2, "psgdkron_llama1b": 2}[workload]
    total = 0.0
    for s in shapes:
        if len(s) < 2:
            continue
        m, n = s[0], int(torch.Size(s[1:]).numel())
        sides = [x for x in ((m, n), (n, m)) if x[0] <= MAX_DIM]  # (factor size, the other)
        for k, other in sides:
            total += per_side * 2 * k * k * other
    return total


def fp32_tflops(device) -> float:
    m = 4096 if device.type == "cuda" else 128
    x = torch.randn(m, m, device=device)
    y = torch.randn_like(x)
    ms = _interval_ms(lambda: x @ y, device, 10)
    return 2 * m**3 / (ms * 1e-3) / 1e12


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _interval_ms(fn, device, steps: int, rounds: int = 3) -> float:
    """Median over ``rounds`` of the time of ``steps`` back-to-back calls, per call."""
    times = []
    for _ in range(rounds):
        _sync(device)
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(steps):
                fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) / steps)
        else:
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / steps)
    return sorted(times)[len(times) // 2]


def _step_times_ms(fn, device, steps: int) -> list:
    """Each of ``steps`` calls timed alone (a refresh step stands out)."""
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def interval_ms(per: list, interval: int) -> tuple:
    """(Time per step over one refresh interval, the refresh steps among ``per``): the
    module's docstring."""
    fast = min(per)
    refresh = sorted(x for x in per if x > 2 * fast)
    other = sorted(x for x in per if x <= 2 * fast)
    if not refresh or interval < 2:
        return sum(per) / len(per), len(refresh)
    med = lambda xs: xs[len(xs) // 2]  # noqa: E731
    return ((interval - 1) * med(other) + med(refresh)) / interval, len(refresh)


def make(shapes, device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, device=device, generator=g) * 0.02) for s in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape, device=device, generator=g) * 1e-3
    return ps


def _allocated(device) -> int:
    return torch.cuda.memory_allocated() if device.type == "cuda" else 0


def _stepper(ps, grads, opt):
    """One step with the same gradients each time (heavyball consumes ``p.grad``)."""

    def step():
        for p, g in zip(ps, grads):
            p.grad = g
        opt.step()

    return step


def run(workload, shapes, device, interval, floor_ms, rows, smoke, warmup=2, rounds=3, impls=None):
    for name, build in builds(workload, interval).items():
        if impls and not any(name.startswith(i) for i in impls):
            continue
        if isinstance(build, str):
            rows.append(dict(workload=workload, impl=name, error=build))
            print(json.dumps(rows[-1]), flush=True)
            continue
        gc.collect()
        ps = make(shapes, device, 0)
        grads = [p.grad for p in ps]
        base = _allocated(device)
        try:
            opt = build(ps)
            step = _stepper(ps, grads, opt)
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            first = time.perf_counter() - t0
            for _ in range(warmup * interval - 1):  # (warm-up: whole intervals)
                step()
            _sync(device)
            held = _allocated(device) - base
            per = _step_times_ms(step, device, max(rounds, 2) * interval)
            ms, refreshes = interval_ms(per, interval)
            finite = all(bool(torch.isfinite(p).all()) for p in ps)
            again = _first_step_again(build, shapes, device)
        except Exception as e:  # one failing anchor must not hide the others
            rows.append(dict(workload=workload, impl=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
            print(json.dumps(rows[-1]), flush=True)
            # (its parameters and optimizer freed before the next is built: held over into the
            # next build they ran the next row out of memory and made its held bytes negative)
            ps = grads = opt = step = None
            _release(device)
            continue
        n = sum(p.numel() for p in ps)
        rows.append(
            dict(
                workload=workload,
                impl=name,
                ms=round(ms, 3),
                floor_ms=round(floor_ms, 3),
                pct_of_floor=round(100 * floor_ms / ms, 1),
                first_step_s=round(first, 2),
                again_s=round(again, 2),
                held_B_per_param=round(held / n, 2) if device.type == "cuda" else None,
                finite=finite,
                interval=interval,
                tensors=len(ps),
                refresh_steps_timed=refreshes,
                per_step_ms=[round(x, 1) for x in per],
            )
        )
        print(json.dumps(rows[-1]), flush=True)
        ps = grads = opt = step = None
        _release(device)


def _release(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _first_step_again(build, shapes, device) -> float:
    """The wall time of the first step of a second optimizer ``build`` makes, on fresh
    parameters (``run``'s ``again s``)."""
    ps = make(shapes, device, 1)
    step = _stepper(ps, [p.grad for p in ps], build(ps))
    _sync(device)
    t0 = time.perf_counter()
    step()
    _sync(device)
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--interval", type=int, default=10, help="steps between two refreshes of the factors")
    ap.add_argument("--warmup", type=int, default=2, help="whole intervals before the timed ones")
    ap.add_argument("--rounds", type=int, default=3, help="timed intervals (their median)")
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    ap.add_argument("--smoke", action="store_true", help="small tensors on the CPU, to check the script")
    ap.add_argument(
        "--impls", nargs="+", help="only implementations whose names start so (fuser, heavyball ...)"
    )
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = SMOKE_SHAPES if args.smoke else llama1b_shapes()
    interval = 2 if args.smoke else args.interval
    tf = fp32_tflops(device)
    rows: list = []
    for workload in args.workloads:
        floor_ms = products_floor_flops(shapes, workload) / (tf * 1e12) * 1e3
        run(
            workload,
            shapes,
            device,
            interval,
            floor_ms,
            rows,
            args.smoke,
            args.warmup,
            args.rounds,
            impls=args.impls,
        )
        write(args, rows, tf, argv, device)  # (after each workload: a run cut short keeps its rows)


def write(args, rows, tf, argv, device):
    date = datetime.date.today().isoformat()
    meta = dict(
        date=date,
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        triton=triton.__version__,
        fp32_gemm_TFLOPs=round(tf, 1),
        command="python "
        + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])),
    )
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"precond_{date}{args.tag}")
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [
        f"# Matrix-preconditioned optimizers, {meta['device']}, {date}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, fp32 GEMM {meta['fp32_gemm_TFLOPs']} TFLOP/s. "
        f"Command: `{meta['command']}`",
        "",
        "| workload | impl | ms/step (one interval) | products floor ms | % of floor | first step s "
        "| again s | held B/param | refresh steps timed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['workload']} | {r['impl']} | error: {r['error']} | | | | | | |")
            continue
        held = "" if r["held_B_per_param"] is None else r["held_B_per_param"]
        cells = [r["workload"], r["impl"], r["ms"], r["floor_ms"], r["pct_of_floor"], r["first_step_s"]]
        cells += [r.get("again_s", ""), held, r.get("refresh_steps_timed", "")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
