"""Fused linear + cross-entropy, forward + backward, bf16: fuser's built-in beside torch.

Configs (ANCHORS.md): `gist` = T=32768, H=768, V=128256; `llama8b` = T=8192, H=4096,
V=128256; `h2048` (T=16384, H=2048, V=128256: between them, where `memory="auto"` changes
schedule on a GPU) when named. Targets on an H100 (ms, extra peak): `lce_gist` <= 31 ms / 1 GiB, `lce_llama8b`
<= 35 ms / 3 GiB; `memory="lean"` (`lce_*_lean`) and the weight gradient accumulated into
an fp32 `main_grad` (`lce_*_main_grad`) <= 256 MiB, in 38 ms (gist) and 48 ms (llama8b);
1 token in 7 ignored (`lce_gist_ignore7`) 10% faster than `lce_gist`. Extra peak is
measured as the anchors do: above the inputs, the weight and their existing `.grad` (and
`main_grad`). Every variant runs in this process on this GPU; each is checked against a
float64 reference (the loss; `grad_weight` on a slice of vocabulary rows and `grad_hidden`
on a slice of tokens, from the whole batch).

    python benchmarks/loss_bench.py [gist llama8b] [--out DIR] [--sweep] [--tag _v3] [--no-compile]
                                    [--schedules chunks whole vocab fused scaled] [--lean] [--ignore7]
                                    [--options]

Anchors: torch's `F.linear_cross_entropy` where torch has it, Liger and CCE where they
import (a row says why where they do not), and `torch.compile` of the full-logits loss
(ANCHORS.md's; `--no-compile` leaves it out).

`--sweep` also times a few (chunk, block, warps) settings of fuser's kernel, to pick the
defaults; `--schedules` times fuser with each schedule forced (`auto` picks one by memory);
`main_grad` runs with `memory="auto"` and `"fast"` (which takes the gradients in forward into
an fp32 buffer); `--lean` adds `memory="lean"` with and without `main_grad`; `--ignore7` runs each config
again with 1 token in 7 ignored (fuser, lean, CCE); `--options` times softcap (its tanh exact,
and `approx_tanh=True`), z-loss, label smoothing and temperature against plain
cross-entropy, `memory="auto"` and `"lean"`,
in 3 rounds with the order rotated (time only: their values are checked against float64
in tests/losses).
Writes `loss_<date><tag>.json` and `.md` under --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fuser  # noqa: E402
import fuser.losses  # noqa: E402
from fuser.runtime.loss.choice import SCHEDULES  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from optim_bench import event_ms  # noqa: E402

CONFIGS = {"gist": (32768, 768, 128256), "llama8b": (8192, 4096, 128256), "h2048": (16384, 2048, 128256)}
TARGETS = {  # ms, GiB of extra peak on an H100, per workload
    "lce_gist": (31.0, 1.0),
    "lce_gist_lean": (38.0, 0.25),
    "lce_gist_main_grad": (38.0, 0.25),
    "lce_llama8b": (35.0, 3.0),
    "lce_llama8b_lean": (48.0, 0.25),
    "lce_llama8b_main_grad": (48.0, 0.25),
}
OPTIONS = {
    "plain": {},
    "softcap=30": dict(softcap=30.0),
    "softcap=30,approx_tanh": dict(softcap=30.0, approx_tanh=True),
    "z_loss=1e-4": dict(z_loss=1e-4),
    "label_smoothing=0.1": dict(label_smoothing=0.1),
    "temperature=0.7": dict(temperature=0.7),
}
GIB = 1 << 30
ROUNDS = 3  # of each option in --options


def gemm_tflops():
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    ms = event_ms(lambda: a @ b, warmup=2, rep=10)
    return 2 * m**3 / (ms * 1e-3) / 1e12


def warm_up(seconds=1.0):
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def reference(x, w, y, rows, tokens, chunk=1024):
    """Float64 mean cross-entropy of the whole batch, with grad_weight[rows] and
    grad_hidden[tokens]."""
    live = y != -100
    n = live.sum()
    w64 = w.detach().double()
    loss = torch.zeros((), dtype=torch.float64, device=x.device)
    gw = torch.zeros(len(rows), w.shape[1], dtype=torch.float64, device=x.device)
    gx = torch.zeros(len(tokens), w.shape[1], dtype=torch.float64, device=x.device)
    for s in range(0, x.shape[0], chunk):
        xc = x.detach()[s : s + chunk].double()
        z = xc @ w64.T
        lse = torch.logsumexp(z, 1)
        yc, lc = y[s : s + chunk, None].clamp(min=0), live[s : s + chunk, None]
        loss += ((lse - z.gather(1, yc)[:, 0]) * lc[:, 0]).sum()
        dz = torch.exp(z - lse[:, None])
        dz.scatter_add_(1, yc, -torch.ones_like(dz[:, :1]))
        dz *= lc
        dz /= n
        gw += dz[:, rows].T @ xc
        here = (tokens >= s) & (tokens < s + chunk)
        gx[here] = dz[tokens[here] - s] @ w64
        del z, dz
    return loss / n, gw, gx


def _anchor(module: str, name: str, cfg: str, rows: list):
    """``module.name``, or None with a row saying why it could not be imported."""
    try:
        return getattr(__import__(module, fromlist=[name]), name)
    except Exception as e:  # a missing anchor is reported, not silently left out
        rows.append(dict(cfg=cfg, name=f"{module} (anchor)", error=f"{type(e).__name__}: {str(e)[:300]}"))
        print(json.dumps(rows[-1]), flush=True)
        return None


def rel_err(a, ref):
    a = a.double()
    return float((a - ref).norm() / ref.norm().clamp(min=1e-30)), float((a - ref).abs().max())


def measure(name, fn, x, w, y, ref, cfg, main_grad=False, workload=None):
    """One variant: errors against the float64 reference, extra peak memory, median time.
    With ``main_grad`` the weight gradient is read from ``w.main_grad`` (fp32), which the
    variant accumulates into, and that buffer counts as existing memory, like ``.grad``."""

    def step():
        loss = fn(x, w, y)
        loss.backward()
        return loss

    x.grad.zero_()
    w.grad.zero_()
    if main_grad:
        w.main_grad.zero_()
    loss = step()
    torch.cuda.synchronize()
    err_loss = abs(float(loss.detach()) - float(ref[0]))
    err_w = rel_err((w.main_grad if main_grad else w.grad)[ref[3]], ref[1])
    err_x = rel_err(x.grad[ref[4]], ref[2])
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / GIB
    ms = event_ms(step, warmup=2, rep=10)
    t, h, v = CONFIGS[cfg]
    row = dict(
        workload=workload or f"lce_{cfg}" + ("_main_grad" if main_grad else ""),
        cfg=cfg,
        name=name,
        fwd_bwd_ms=round(ms, 2),
        extra_peak_GiB=round(peak, 3),
        loss_abs_err=err_loss,
        loss_rel_err=err_loss / abs(float(ref[0])),
        grad_weight_rel_err=err_w[0],
        grad_weight_max_err=err_w[1],
        grad_hidden_rel_err=err_x[0],
        grad_hidden_max_err=err_x[1],
        gemm_floor_ms=round(6 * t * h * v / (783e12) * 1e3, 2),
    )
    print(json.dumps(row), flush=True)
    torch.cuda.empty_cache()
    return row


def inputs(cfg: str):
    """``(hidden, weight, target, generator)`` of a config, bf16, the same on every call: the
    hidden states and weight require gradients; the generator goes on where they stopped."""
    t, h, v = CONFIGS[cfg]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02).requires_grad_()
    y = torch.randint(0, v, (t,), device="cuda", generator=g)
    return x, w, y, g


def run(cfg, sweep, rows_out, schedules=(), compile_anchor=True, lean=False, ignore7=False):
    t, h, v = CONFIGS[cfg]
    x, w, y, g = inputs(cfg)
    suffix = ""
    if ignore7:  # 1 token in 7 ignored, at random places
        y[torch.randperm(t, device="cuda", generator=g)[: t // 7]] = -100
        suffix = "_ignore7"
    x.grad = torch.zeros_like(x)
    w.grad = torch.zeros_like(w)
    rows = torch.arange(0, v, max(1, v // 512), device="cuda")[:512]
    tokens = torch.arange(0, min(t, 1024), 4, device="cuda")
    r = reference(x, w, y, rows, tokens)
    ref = (*r, rows, tokens)
    # The first variant timed right after the float64 reference ran ~2 ms slower than the
    # same schedule timed later in the run (llama8b, H100, 2026-11-24): a second of bf16
    # matmuls first, so that every variant starts from the same state of the GPU.
    warm_up()

    def guarded(name, fn, workload=f"lce_{cfg}{suffix}", main_grad=False):
        try:
            rows_out.append(measure(name, fn, x, w, y, ref, cfg, main_grad, workload))
        except Exception as e:  # one failing variant must not hide the others
            rows_out.append(dict(cfg=cfg, name=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
            print(json.dumps(rows_out[-1]), flush=True)
            torch.cuda.empty_cache()

    guarded("fuser cross_entropy", fuser.losses.cross_entropy)
    if lean or ignore7:
        guarded("fuser memory=lean", lambda x, w, y: fuser.losses.cross_entropy(x, w, y, memory="lean"),
                f"lce_{cfg}_lean{suffix}")  # fmt: skip
    if lean:
        w.main_grad = torch.zeros(v, h, device="cuda", dtype=torch.float32)
        guarded(
            "fuser memory=lean",
            lambda x, w, y: fuser.losses.cross_entropy(x, w, y, accumulate_into="main_grad", memory="lean"),
            f"lce_{cfg}_main_grad",
            main_grad=True,
        )
        del w.main_grad
    if ignore7:
        cce = _anchor("cut_cross_entropy", "linear_cross_entropy", cfg, rows_out)
        if cce is not None:
            guarded("CCE (cce)", lambda x, w, y: cce(x, w, y, impl="cce"))
        return
    w.main_grad = torch.zeros(v, h, device="cuda", dtype=torch.float32)
    try:
        rows_out.append(
            measure(
                "fuser cross_entropy",
                lambda x, w, y: fuser.losses.cross_entropy(x, w, y, accumulate_into="main_grad"),
                x,
                w,
                y,
                ref,
                cfg,
                main_grad=True,
            )
        )
    except Exception as e:
        rows_out.append(dict(cfg=cfg, name="fuser main_grad", error=f"{type(e).__name__}: {str(e)[:300]}"))
        print(json.dumps(rows_out[-1]), flush=True)
    guarded(
        "fuser memory=fast",
        lambda x, w, y: fuser.losses.cross_entropy(x, w, y, accumulate_into="main_grad", memory="fast"),
        f"lce_{cfg}_main_grad",
        main_grad=True,
    )
    del w.main_grad
    torch.cuda.empty_cache()
    if hasattr(F, "linear_cross_entropy"):
        guarded("torch linear_cross_entropy", lambda x, w, y: F.linear_cross_entropy(x, w, y))
    # Anchors of ANCHORS.md, when their (pure-Python) packages are installed.
    liger = _anchor("liger_kernel.transformers.functional", "liger_fused_linear_cross_entropy", cfg, rows_out)
    if liger is not None:
        guarded("Liger FLCE", lambda x, w, y: liger(x, w, y))
    cce = _anchor("cut_cross_entropy", "linear_cross_entropy", cfg, rows_out)
    if cce is not None:
        guarded("CCE (cce)", lambda x, w, y: cce(x, w, y, impl="cce"))
    if compile_anchor:
        # ANCHORS.md's torch.compile row: full bf16 logits, cross-entropy in fp32.
        compiled = torch.compile(lambda x, w, y: F.cross_entropy((x @ w.t()).float(), y))
        guarded("torch.compile (full logits)", compiled)
    for schedule in schedules:
        f = fuser.compile(fuser.losses.CROSS_ENTROPY, schedule=schedule)
        guarded(f"fuser schedule={schedule}", f)
    if sweep:
        for chunk in (1024, 2048, 4096):
            for block, warps in ((4096, 8), (4096, 16), (8192, 16), (16384, 32)):
                f = fuser.compile(
                    fuser.losses.CROSS_ENTROPY, chunk_size=min(chunk, t), block=block, num_warps=warps
                )
                guarded(f"fuser chunk={chunk} block={block} warps={warps}", f)


def options(cfg: str, rows: list) -> None:
    """Forward + backward of the built-in with each option, beside plain cross-entropy, for
    ``memory="auto"`` and ``"lean"``: time only. Each option is timed in ``ROUNDS`` rounds,
    the order rotated from round to round, so that a slow stretch of the GPU falls on
    different options; the row keeps every round's median and the median of its ratios to
    plain's time in the same round."""
    x, w, y, _ = inputs(cfg)
    warm_up()
    names = list(OPTIONS)
    for memory in ("auto", "lean"):
        times = {name: [] for name in names}
        for r in range(ROUNDS):
            for name in names[r:] + names[:r]:

                def step(kw=OPTIONS[name], memory=memory):
                    fuser.losses.cross_entropy(x, w, y, memory=memory, **kw).backward()

                step()
                times[name].append(event_ms(step, warmup=2, rep=10))
                x.grad = w.grad = None
        for name in names:
            ratios = sorted(a / b for a, b in zip(times[name], times["plain"]))
            ms = sorted(times[name])[ROUNDS // 2]
            row = dict(cfg=cfg, option=name, memory=memory, fwd_bwd_ms=round(ms, 2))
            row.update(rounds_ms=[round(m, 2) for m in times[name]])
            row.update(over_plain=round(ratios[ROUNDS // 2] - 1, 4))
            rows.append(row)
            print(json.dumps(rows[-1]), flush=True)


def _ignored_lines(rows: list) -> list[str]:
    """fuser with 1 token in 7 ignored against fuser on the same config with none."""
    ms = {r["workload"]: r["fwd_bwd_ms"] for r in rows if r.get("name") == "fuser cross_entropy"}
    lines = []
    for cfg in CONFIGS:
        if f"lce_{cfg}" in ms and f"lce_{cfg}_ignore7" in ms:
            gain = 1 - ms[f"lce_{cfg}_ignore7"] / ms[f"lce_{cfg}"]
            lines.append(f"1 token in 7 ignored, {cfg}: fuser {gain:.1%} faster than with none (target 10%).")
    return [""] + lines if lines else []


def _option_lines(rows: list) -> list[str]:
    opts = [r for r in rows if "option" in r]
    if not opts:
        return []
    lines = [
        "",
        f"Options: median of {ROUNDS} rounds (order rotated); over plain: the median of the rounds' ratios.",
        "",
        "| config | memory | option | fwd+bwd ms | rounds ms | over plain |",
        "|---|---|---|---|---|---|",
    ]
    for r in opts:
        rounds = ", ".join(str(ms) for ms in r["rounds_ms"])
        cells = (r["cfg"], r["memory"], r["option"], r["fwd_bwd_ms"], rounds, f"{r['over_plain']:+.1%}")
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="*", default=["gist", "llama8b"])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--schedules", nargs="*", default=[], choices=list(SCHEDULES[1:]),
                    help="also time fuser with each of these schedules forced")  # fmt: skip
    ap.add_argument("--tag", default="", help="suffix of the output files' names")
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile anchor")
    ap.add_argument("--lean", action="store_true", help="also time memory='lean' (and with main_grad)")
    ap.add_argument("--options", action="store_true", help="time each option against plain cross-entropy")
    ap.add_argument("--ignore7", action="store_true",
                    help="each config again, 1 in 7 tokens ignored: fuser, lean, CCE")  # fmt: skip
    args = ap.parse_args(argv)
    if not args.no_compile:
        torch._dynamo.config.cache_size_limit = 64
    meta = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        fuser=fuser.__version__,
        bf16_gemm_TFLOPs=round(gemm_tflops(), 1),
        command="python " + " ".join([os.path.relpath(__file__)] + (argv or sys.argv[1:])),
    )
    print(json.dumps(meta), flush=True)
    rows = []
    for cfg in args.configs:
        run(cfg, args.sweep, rows, args.schedules, not args.no_compile, args.lean)
    if args.ignore7:
        for cfg in args.configs:
            run(cfg, False, rows, (), False, ignore7=True)
    if args.options:
        for cfg in args.configs:
            options(cfg, rows)
    os.makedirs(args.out, exist_ok=True)
    date = datetime.date.today().isoformat()
    stem = f"loss_{date}{args.tag}"
    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [
        f"# Linear + cross-entropy, forward + backward, bf16 ({meta['gpu']})",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, bf16 GEMM {meta['bf16_gemm_TFLOPs']} TFLOP/s. "
        "Targets (H100, ms / GiB of extra peak): "
        + ", ".join(f"{k} {ms:g} / {gib:g}" for k, (ms, gib) in TARGETS.items())
        + ".",
        "",
        "| workload | variant | fwd+bwd ms | GEMM floor ms | extra peak GiB | loss err | "
        "grad_weight rel err | grad_hidden rel err |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['cfg']} | {r['name']} | error: {r['error']} | | | | | |")
            continue
        if "option" in r:
            continue
        ms_t, gib_t = TARGETS.get(r["workload"], (float("inf"), float("inf")))
        ok = "" if r["fwd_bwd_ms"] <= ms_t and r["extra_peak_GiB"] <= gib_t else " (misses target)"
        lines.append(
            f"| {r['workload']} | {r['name']}{ok} | {r['fwd_bwd_ms']} | {r['gemm_floor_ms']} | "
            f"{r['extra_peak_GiB']} | {r['loss_abs_err']:.2e} | {r['grad_weight_rel_err']:.2e} | "
            f"{r['grad_hidden_rel_err']:.2e} |"
        )
    lines += _ignored_lines(rows) + _option_lines(rows)
    lines += ["", "`loss err` is absolute: fuser, Liger and CCE return an fp32 loss; torch's "
              "`linear_cross_entropy` returns the input dtype.", "",
              f"Command: `python {' '.join(['benchmarks/loss_bench.py', *sys.argv[1:]])}`"]  # fmt: skip
    with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
