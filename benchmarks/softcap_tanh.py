"""The cost of a softcap's tanh in fuser's loss kernels, by formula of the `_tanh` helper.

    python benchmarks/softcap_tanh.py accuracy
    python benchmarks/softcap_tanh.py time VARIANT [gist llama8b]   # one variant per process
    python benchmarks/softcap_tanh.py options [llama8b gist]

`accuracy` runs each variant of the helper over fp32 inputs and prints its largest error
against float64 tanh. `time` patches one variant into every loss kernel of this process
(fresh `FUSER_CACHE_DIR` per process) and prints one JSON line per case: forward + backward
of `fuser.losses.cross_entropy`, bf16, plain and `softcap=30`, `memory="auto"` and
`"lean"` (CUDA events, median of 10), with the five costliest kernels of one profiled step.
`options` times the other options through `memory="auto"` in two orders in one process.

Variants: `template` (the helper as shipped), `series` (the helper's previous formula:
`-expm1(-2|x|) / (2 + expm1(-2|x|))` with a series inside expm1, the sign applied
after), `newton` (`(1 - e) / (1 + e)`, `e = exp(-2|x|)`, the division by two Newton steps
from a quadratic: no reciprocal on the special-function unit), `approx` (the GPU's
`tanh.approx.f32`, 1 special-function op, ~1e-5 relative error: the speed of light for a
one-op tanh, not exact) and `identity` (no tanh: the floor of the rest of the rule).
"""

from __future__ import annotations

import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loss_bench import inputs as loss_inputs  # noqa: E402
from loss_bench import warm_up  # noqa: E402
from optim_bench import event_ms  # noqa: E402

_SERIES_TAIL = """    x2 = x * x
    s = x + x * x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
        -0.05396825396825397 + x2 * 0.021869488536155203)))
    return tl.where(a < 0.3, s, tl.where(x < 0, -t, t))
"""

VARIANTS = {
    "template": None,
    "series": """@triton.jit
def _tanh(x):
    e = _expm1(-2.0 * tl.abs(x))
    return _sign(x) * (-e / (2.0 + e))
""",
    "newton": """@triton.jit
def _tanh(x):
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    d = 1.0 + e
    r = 0.9974100027513086 + e * (-0.912591452993308 + e * 0.5005386213817895)
    r = r + r * (1.0 - d * r)
    r = r + r * (1.0 - d * r)
    t = (1.0 - e) * r
"""
    + _SERIES_TAIL,
    "approx": """@triton.jit
def _tanh(x):
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)
""",
    "identity": """@triton.jit
def _tanh(x):
    return x
""",
}
_HELPER = re.compile(r"@triton\.jit\ndef _tanh\(x\):\n(    .*\n)+")


def helpers(variant: str) -> str:
    from fuser.codegen.render import helpers_source

    text = helpers_source() + "\n"
    if VARIANTS[variant] is None:
        return text
    new, n = _HELPER.subn(VARIANTS[variant], text)
    assert n == 1, "the helpers hold one _tanh"
    return new


def patch(variant: str) -> None:
    """Every loss kernel rendered from now on in this process uses ``variant``."""
    import fuser.codegen.loss as loss_codegen

    loss_codegen.helpers_source = lambda: helpers(variant)


def accuracy() -> None:
    import importlib.util
    import tempfile

    import triton

    x = torch.cat([torch.linspace(-12, 12, 1 << 21), torch.randn(1 << 20) * 0.4, torch.randn(1 << 20) * 1e-3])
    x = x.float().cuda()
    want = torch.tanh(x.double())
    eps = torch.finfo(torch.float32).eps
    for variant in VARIANTS:
        if variant == "identity":
            continue
        text = (
            "import triton\nimport triton.language as tl\n\n"
            + helpers(variant)
            + """

@triton.jit
def apply(x, out, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + i, _tanh(tl.load(x + i, mask=i < n)), mask=i < n)
"""
        )
        path = os.path.join(tempfile.mkdtemp(), f"tanh_{variant}.py")
        with open(path, "w") as f:
            f.write(text)
        spec = importlib.util.spec_from_file_location(f"tanh_{variant}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        out = torch.full_like(x, float("nan"))
        module.apply[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
        got = out.double()
        rel = ((got - want).abs() / want.abs().clamp_min(1e-30)).max().item()
        worst = (got - want).abs().max().item()
        row = dict(variant=variant, max_rel=rel, max_ulp=round(rel / eps, 1), max_abs=worst)
        print(json.dumps(row), flush=True)


def top_kernels(fn, n=5) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    total = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            total[e.name[:40]] = total.get(e.name[:40], 0.0) + e.device_time / 1000
    return {k: round(v, 2) for k, v in sorted(total.items(), key=lambda kv: -kv[1])[:n]}


def time_variant(variant: str, configs: list[str]) -> None:
    patch(variant)
    import fuser.losses

    for cfg in configs:
        x, w, y, _ = loss_inputs(cfg)
        warm_up()
        for memory in ("auto", "lean"):
            for case, kw in (("plain", {}), ("softcap", dict(softcap=30.0))):

                def step(x=x, w=w, y=y, kw=kw, memory=memory):
                    fuser.losses.cross_entropy(x, w, y, memory=memory, **kw).backward()

                step()
                ms = event_ms(step, warmup=2, rep=10)
                row = dict(variant=variant, cfg=cfg, case=case, memory=memory, ms=round(ms, 2))
                row["kernels"] = top_kernels(step)
                print(json.dumps(row), flush=True)
                x.grad = w.grad = None


def options(configs: list[str]) -> None:
    import fuser.losses

    kws = {"plain": {}, "label_smoothing=0.1": dict(label_smoothing=0.1), "z_loss=1e-4": dict(z_loss=1e-4),
           "temperature=0.7": dict(temperature=0.7)}  # fmt: skip
    order = list(kws) + list(kws)[::-1]
    for cfg in configs:
        x, w, y, _ = loss_inputs(cfg)
        warm_up()
        for name in order:

            def step(x=x, w=w, y=y, kw=kws[name]):
                fuser.losses.cross_entropy(x, w, y, **kw).backward()

            step()
            ms = event_ms(step, warmup=2, rep=10)
            print(json.dumps(dict(cfg=cfg, option=name, ms=round(ms, 2))), flush=True)
            x.grad = w.grad = None


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["accuracy"]:
        accuracy()
    elif argv[:1] == ["time"] and len(argv) >= 2 and argv[1] in VARIANTS:
        time_variant(argv[1], argv[2:] or ["gist", "llama8b"])
    elif argv[:1] == ["options"]:
        options(argv[1:] or ["llama8b", "gist"])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
