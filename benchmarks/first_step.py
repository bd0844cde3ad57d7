"""Time from process start to the first completed AdamW step (GPU).

Each sample is a fresh Python process; the parent notes the wall clock just before it
starts the child, the child reports the wall clock after its imports, after building the
parameters, and after its first ``step()`` has finished on the device. Modes:

- ``fuser-cold``: empty fuser cache and empty Triton cache (compiles the kernel; before
  ``fuser.cache.launcher``, also built Triton's C launcher).
- ``fuser-warm``: both caches as a previous process on this host left them.
- ``fuser-precompiled``: a fuser cache made by ``fuser precompile`` with no GPU visible
  (as on a CPU CI runner), on a host whose Triton cache is empty (before
  ``fuser.cache.launcher``, Triton's launcher was built then).
- ``fuser-precompiled-launcher``: the same cache, Triton's launcher already built here
  (the same as ``fuser-precompiled`` now that nothing is built).
- ``torch-compile-cold`` / ``-warm``: ``torch.compile`` of ``opt.step`` (torch.optim.AdamW,
  foreach) with empty / warm Inductor and Triton caches.
- ``torch-fused``: eager ``torch.optim.AdamW(fused=True)``, no compiler (the floor).

    python benchmarks/first_step.py [--workload llama1b|small1000] [--dtype fp32|bf16]
                                    [--repeats 3] [--out benchmarks/results]

Writes ``first_step_<date>.json`` and ``.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("fuser-cold", "fuser-warm", "fuser-precompiled", "fuser-precompiled-launcher",
         "torch-compile-cold", "torch-compile-warm", "torch-fused")  # fmt: skip


# ---------------------------------------------------------------------------- child --
def shapes(workload: str) -> list[tuple[int, ...]]:
    if workload == "small1000":
        return [(4096,)] * 1000
    vocab, hidden, inter, layers, kv = 32000, 2048, 5632, 22, 256  # TinyLlama-1.1B
    out = [(vocab, hidden)]
    for _ in range(layers):
        out += [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden),
                (inter, hidden), (hidden, inter), (hidden,), (hidden,)]  # fmt: skip
    return out + [(hidden,), (vocab, hidden)]


def child(mode: str, workload: str, dtype_name: str) -> dict:
    t_start = time.time()
    import torch

    if mode.startswith("fuser"):
        import fuser
        import fuser.optim

    t_import = time.time()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(s, device="cuda", dtype=dtype, generator=gen) for s in shapes(workload)]
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", dtype=dtype, generator=gen)
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    if mode.startswith("fuser"):
        opt = fuser.optim.AdamW(params, **kw)
        step = opt.step
    elif mode.startswith("torch-compile"):
        opt = torch.optim.AdamW(params, foreach=True, **kw)

        @torch.compile(fullgraph=False)
        def step():
            opt.step()
    else:
        opt = torch.optim.AdamW(params, fused=True, **kw)
        step = opt.step
    torch.cuda.synchronize()
    t_setup = time.time()
    step()
    torch.cuda.synchronize()
    t_step = time.time()
    stats = fuser.stats() if mode.startswith("fuser") else {}
    return dict(t_start=t_start, t_import=t_import, t_setup=t_setup, t_step=t_step, fuser_stats=stats)


# --------------------------------------------------------------------------- parent --
def run_child(mode, args, env) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--workload", args.workload,
           "--dtype", args.dtype]  # fmt: skip
    t0 = time.time()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{res.stderr[-4000:]}")
    r = json.loads(res.stdout.strip().splitlines()[-1])
    return {
        "total_s": r["t_step"] - t0,
        "python_start_s": r["t_start"] - t0,
        "imports_s": r["t_import"] - r["t_start"],
        "setup_s": r["t_setup"] - r["t_import"],
        "first_step_s": r["t_step"] - r["t_setup"],
        "fuser_compiles": r["fuser_stats"].get("compiles"),
        "fuser_cache_hits": r["fuser_stats"].get("cache_hits"),
    }


def fresh_env(root: str, name: str) -> tuple[dict, dict]:
    """An environment with its own fuser, Triton and Inductor cache folders."""
    dirs = {k: tempfile.mkdtemp(prefix=f"{name}-{k}-", dir=root) for k in ("fuser", "triton", "inductor")}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
               FUSER_CACHE_DIR=dirs["fuser"], TRITON_CACHE_DIR=dirs["triton"],
               TORCHINDUCTOR_CACHE_DIR=dirs["inductor"])  # fmt: skip
    env.pop("TRITON_INTERPRET", None)
    return env, dirs


def precompile_on_cpu(env: dict, target: str, dtype: str) -> float:
    """``fuser precompile`` with no GPU visible, as a CPU CI runner would run it."""
    cpu_env = dict(env, CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "fuser", "precompile", "--builtins", "--target", target, "--dtype", dtype]
    t0 = time.time()
    res = subprocess.run(cmd, env=cpu_env, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"precompile failed:\n{res.stdout}\n{res.stderr}")
    return time.time() - t0


def samples(mode, args, root, target) -> tuple[list[dict], dict]:
    out, extra = [], {}
    for i in range(args.repeats):
        env, dirs = fresh_env(root, f"{mode}{i}")
        if mode.endswith("-warm"):
            run_child(mode.replace("warm", "cold"), args, env)  # fills this sample's caches
        if mode.startswith("fuser-precompiled"):
            extra.setdefault("precompile_on_cpu_s", []).append(precompile_on_cpu(env, target, args.dtype))
            if mode == "fuser-precompiled-launcher":
                # Build Triton's launcher on this host with a throwaway fuser cache.
                warm_env = dict(env, FUSER_CACHE_DIR=tempfile.mkdtemp(dir=root))
                run_child("fuser-cold", args, warm_env)
        out.append(run_child(mode, args, env))
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)
    return out, extra


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# Time to first AdamW step ({report['workload']}, {report['dtype']})", "",
             f"{env['gpu']}; torch {env['torch']}, triton {env['triton']}, fuser {env['fuser']}; "
             f"{report['repeats']} fresh processes per mode, median seconds.", "",
             "| mode | total | python start | imports | setup | first step | fuser compiles |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for mode, data in report["modes"].items():
        m = data["median"]
        compiles = ",".join(str(s["fuser_compiles"]) for s in data["samples"])
        compiles = compiles if mode.startswith("fuser") else "-"
        lines.append(f"| {mode} | {m['total_s']:.2f} | {m['python_start_s']:.2f} | {m['imports_s']:.2f} | "
                     f"{m['setup_s']:.2f} | {m['first_step_s']:.3f} | {compiles} |")  # fmt: skip
    pre = report["modes"].get("fuser-precompiled", {}).get("precompile_on_cpu_s")
    if pre:
        took = statistics.median(pre)
        cmd = f"fuser precompile --builtins --dtype {report['dtype']}"
        lines += ["", f"`{cmd}` with no GPU visible: {took:.1f} s."]
    if report.get("command"):
        lines += ["", f"Command: `{report['command']}`"]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--workload", default="llama1b", choices=("llama1b", "small1000"))
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.workload, args.dtype)))
        return

    import torch
    import triton

    import fuser

    major, minor = torch.cuda.get_device_capability()
    target = f"cuda:{major}{minor}"
    report = {
        "benchmark": "first_step", "command": " ".join(["python", *sys.argv]),
        "workload": args.workload, "dtype": args.dtype, "repeats": args.repeats,
        "environment": {"gpu": torch.cuda.get_device_name(), "target": target, "torch": torch.__version__,
                        "triton": triton.__version__, "fuser": fuser.__version__,
                        "python": sys.version.split()[0],
                        "date": datetime.datetime.now().isoformat(timespec="seconds")},
        "modes": {},
    }  # fmt: skip
    root = tempfile.mkdtemp(prefix="fuser-first-step-")
    try:
        for mode in args.modes:
            got, extra = samples(mode, args, root, target)
            # Numbers only: torch's modes have no fuser counters (None).
            median = {k: statistics.median(s[k] for s in got) for k, v in got[0].items() if v is not None}
            report["modes"][mode] = {"median": median, "samples": got, **extra}
            print(f"{mode:<28} {median['total_s']:7.2f} s  (first step {median['first_step_s']:.3f} s, "
                  f"compiles {[s['fuser_compiles'] for s in got]})", flush=True)  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    name = f"first_step_{datetime.date.today().isoformat()}_{args.workload}_{args.dtype}"
    stem = os.path.join(args.out, name)
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(report))
    print(f"wrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    main()
