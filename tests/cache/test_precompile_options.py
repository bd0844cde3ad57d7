"""``fuser precompile``'s kernel options cover what a job with the same keywords loads.

After one precompile (real compiles, one target, one dtype plan a run: the two in 2 runs),
an optimizer built with each combination of options, stepped on CPU with ``load_kernel``
recording instead of loading, asks only for kernels whose binaries are in the store under
the loader's own keys; so does a compiled loss, plain and vocabulary-parallel. Options left
out are misses, and a second run is all hits. What both plans together render (each
kernel once) is checked every run, without compiling.
"""

import re

import pytest
import torch
from cache_helpers import files_state

import fuser
import fuser.optim
from fuser import cli, clitools
from fuser.cache import stored_binary
from fuser.codegen.loss_matmul import warp_specialized
from fuser.codegen.matrix import matrix_kernel_sources
from fuser.losses import api
from fuser.optim import builtins
from fuser.runtime import engine, plans
from fuser.runtime.loss import choice

TARGET = "cuda:90"

RULES = '''
import fuser

heavy_ball = fuser.rule("""
    m = mu * m + g
    p = p - lr * m
""", name="heavy_ball", hyper=dict(lr=0.1, mu=0.9), state=dict(m=0.0))

plain_ce = fuser.loss("loss = logsumexp(z) - z[y]", name="plain_ce")
'''

# (parameters, gradients) of each dtype plan of the precompile: one plan's real compiles a
# run, both in 2 runs (tests/README.md, sweeps); what both plans together render, every run
PLANS = {"bf16": ("bf16:fp32", torch.bfloat16, torch.float32), "fp16": ("fp16", torch.float16, torch.float16)}
STATE_DTYPES = ["fp32", "param"]
OPTIONS = ["--state-dtype", "fp32", "--state-dtype", "param", "--stochastic-rounding", "--vocab-parallel"]
# For both dtypes, the row kernel and 2 staged loss kernels of fp32 logits (3; every dtype's
# calls launch them); per dtype, the last staged kernel of its own (``fused`` and ``scaled``
# run it), the lean schedule's 6 matmul kernels (one sweep, the gradient without and with
# tensor descriptors, and warp-specialised, the forward's tile sums through descriptors,
# and warp-specialised), the scaled schedule's kernel (three ways: its tiles, through
# descriptors, warp-specialised) and its 5 kernels around it (per token, per chunk, the
# gradient's terms), the target column's residue's 2 more (its row sums' second phase is
# the scaled schedule's), the 3 that write a 16-bit grad_weight with the residue's rows in
# it and the 2 that scale a forward's gradients by grad_output: 22 for bf16 besides those
# 3; 15 for fp16, which the scaled schedule refuses (its 3 + 3 gradient-term kernels, less
# the residue's second phase, then its own; the lean forward's tile sums take the
# per-token kernels) and whose gradients are all taken in backward
OWN_LOSS_KERNELS = {"bf16": 22, "fp16": 15}


def _rows(out: str) -> list[list[str]]:
    lines = out.strip().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("rule "))
    return [re.split(r"\s{2,}", ln.strip()) for ln in lines[start + 1 : -1]]


def _step_loads(monkeypatch, rule, param_dtype, grad_dtype, **options) -> list:
    """The kernels one step of ``fuser.compile(rule, **options)`` loads on CPU tensors of
    these dtypes, through the optimizer's own rebuild; nothing is loaded or launched."""
    loaded = []

    def record(source, device):
        loaded.append(source)
        return lambda grid, *args: None

    monkeypatch.setattr(engine, "load_kernel", record)
    attr = "grad" if grad_dtype == param_dtype else "main_grad"
    params = [torch.randn(37, 5, dtype=param_dtype), torch.randn(11, dtype=param_dtype)]
    for p in params:
        setattr(p, attr, torch.randn(p.shape, dtype=grad_dtype))
    opt = fuser.compile(rule, grad_attr=attr, **options)(params)
    opt.step()
    assert loaded
    return loaded


def _missing(sources) -> list[str]:
    return [s.entry for s in sources if stored_binary(s, TARGET) is None]


def _rendered(module, plans: list[str]) -> dict:
    """The distinct kernels (by digest: what precompile compiles once) that ``fuser
    precompile`` with these ``--dtype`` plans and ``OPTIONS`` renders, by rule name."""
    parsed = [clitools.parse_plan(p) for p in plans]
    kernels = {}
    for rule in (module.heavy_ball, module.plain_ce):
        for variant in clitools.variants(rule, parsed, STATE_DTYPES, True, True):
            kernels.update({s.digest: rule.name for s in clitools.kernel_sources(rule, variant)})
    return kernels


def _loss_sources(loss, dtype: str) -> tuple[list, list]:
    """A compiled loss's kernels of ``dtype`` that every schedule but the scaled one
    launches, and the scaled schedule's."""
    sweeps, grad = loss.matmul_kernel_sources(dtype)
    _, grad_tma = loss.matmul_kernel_sources(dtype, grad_tiles=loss._gradient_tiles(dtype, True))
    ws_tiles = warp_specialized(loss._gradient_tiles(dtype, True))
    _, grad_ws = loss.matmul_kernel_sources(dtype, grad_tiles=ws_tiles)
    sum_tiles = choice.scaled_tiles(dtype, True)
    sources = [
        *loss.tile_sums_sources(dtype, sum_tiles),
        loss.tile_sums_sources(dtype, warp_specialized(sum_tiles))[0],
        loss.row_source(),  # (fp32 logits for every dtype)
        *loss.sharded_kernel_sources("fp32")[0],
        loss.sharded_kernel_sources(dtype)[0][-1],  # (fused and scaled, on the reductions)
        *sweeps,
        grad,
        grad_tma,
        grad_ws,
        *loss.residue_sources(dtype),
        *loss.weight_grad_sources(dtype),
        *api.grad_scale_sources(dtype),
    ]
    scaled = [
        loss.scaled_kernel_source(dtype),
        loss.scaled_kernel_source(dtype, choice.SCALED_TILES_TMA),
        loss.scaled_kernel_source(dtype, warp_specialized(choice.SCALED_TILES_TMA)),
        *loss.scaled_token_sources(dtype),
    ]
    assert loss.residue_sources(dtype)  # (16-bit logits: the target column's residue)
    return sources, scaled


@pytest.mark.sweep(runs=2)
@pytest.mark.parametrize("dtype", sorted(PLANS))
def test_options_cover_the_kernels_a_job_loads(dtype, cache_root, tmp_path, capsys, monkeypatch):
    path = tmp_path / "job_rules.py"
    path.write_text(RULES)
    module = clitools.load_module(str(path))
    # Both plans in one precompile: each kernel of each, the 3 on fp32 logits once; 2 plans
    # x 2 state dtypes for the optimizer.
    both = _rendered(module, [plan for plan, _, _ in PLANS.values()])
    assert sorted(both.values()).count("heavy_ball") == 4
    assert len(both) == 4 + 3 + sum(OWN_LOSS_KERNELS.values())
    mine = _rendered(module, [PLANS[dtype][0]])
    assert set(mine) < set(both)

    plan, param_dtype, grad_dtype = PLANS[dtype]
    args = ["precompile", str(path), "--target", TARGET, "--dtype", plan, *OPTIONS]
    assert cli.main(args) == 0, capsys.readouterr().err
    rows = _rows(capsys.readouterr().out)
    assert len(rows) == len(mine) == 2 + 3 + OWN_LOSS_KERNELS[dtype] and {r[5] for r in rows} == {"compiled"}
    assert {r[4] for r in rows if r[0] == "heavy_ball"} == {"stochastic rounding"}
    assert [r[4] for r in rows if r[0] == "plain_ce"] == ["-"] * (3 + OWN_LOSS_KERNELS[dtype])
    short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    p, g = short[param_dtype], short[grad_dtype]
    assert {r[3] for r in rows if r[0] == "heavy_ball"} == {f"p:{p}-g:{g}-m:fp32", f"p:{p}-g:{g}-m:{p}"}

    for state_dtype in STATE_DTYPES:
        loads = _step_loads(monkeypatch, module.heavy_ball, param_dtype, grad_dtype,
                            state_dtype=state_dtype, stochastic_rounding=True, seed=7)  # fmt: skip
        assert _missing(loads) == [], (param_dtype, grad_dtype, state_dtype)
    # Not precompiled: without stochastic rounding, the other plan, or gradients like the
    # parameters.
    assert _missing(_step_loads(monkeypatch, module.heavy_ball, param_dtype, grad_dtype))
    (other,) = set(PLANS) - {dtype}
    _, other_p, other_g = PLANS[other]
    assert _missing(_step_loads(monkeypatch, module.heavy_ball, other_p, other_g, stochastic_rounding=True))
    assert _missing(_step_loads(monkeypatch, module.heavy_ball, torch.bfloat16, torch.bfloat16,
                                stochastic_rounding=True))  # fmt: skip

    loss = fuser.compile(module.plain_ce)
    sources, scaled = _loss_sources(loss, dtype)
    assert _missing(sources) == []
    if dtype == "bf16":
        assert _missing(scaled) == []
    else:  # (the scaled schedule refuses fp16: of its 8 kernels, the residue shares one
        # and the lean forward takes the two per-token ones)
        assert len(_missing(scaled)) == 5
    # the other dtype's kernels but the 3 on fp32 logits, and fp32 inputs', were not asked for
    others = {s.digest: s for s in _loss_sources(loss, other)[0]}
    assert set(_missing(others.values())) == {s.entry for d, s in others.items() if d not in mine}
    assert len(set(others) - set(mine)) == len(others) - 3
    assert _missing([loss.matmul_kernel_sources("fp32")[1]])

    before = files_state(cache_root)
    assert cli.main(args) == 0
    again = _rows(capsys.readouterr().out)
    assert len(again) == len(rows) and {r[5] for r in again} == {"hit"}
    assert files_state(cache_root) == before


# Constructor keywords that pick each rule variant of a built-in (the rest have one rule).
VARIANT_KEYWORDS = {
    "SGD": [{}, {"momentum": 0.9}, {"momentum": 0.9, "nesterov": True}],
    "Adam": [{}, {"amsgrad": True}, {"decoupled_weight_decay": True, "amsgrad": True}],
    "AdamW": [{}, {"amsgrad": True}],
    "RMSprop": [{}, {"centered": True}, {"momentum": 0.9}, {"centered": True, "momentum": 0.9}],
    "Adan": [{}, {"max_grad_norm": 1.0}],
    "Muon": [{}, {"nesterov": False}],
    "NorMuon": [{}, {"nesterov": False}, {"update_scale": "match_rms"}],
    "SOAP": [{}, {"normalize_gradient": True}],
}


@pytest.mark.parametrize("name", [n for n in fuser.optim.__all__ if n[0].isupper() and n != "FuserOptimizer"])
def test_builtins_cover_every_variant_with_its_defaults(cache_root, name):
    """``--builtins`` collects every rule a built-in's keywords select, and the class's own
    options (state keys, say) render the kernels that precompile renders for that rule."""
    collected = {id(f.rule) for f in clitools.collect([], True, print)[0]}
    cls = getattr(fuser.optim, name)
    assert issubclass(cls, builtins._Builtin)
    for keywords in VARIANT_KEYWORDS.get(name, [{}]):
        opt = cls([torch.zeros(3, 2, requires_grad=True)], lr=0.1, **keywords)
        assert id(opt.rule) in collected, (name, keywords, opt.rule.name)
        plan = plans.dtype_plan(opt.rule, opt.options, "bf16", "bf16")
        launched = plans.plan_and_sources(opt.rule, plan, opt.options.stochastic_rounding)[1]
        compiled = clitools.kernel_sources(opt.rule, clitools.Variant("bf16"))
        # the step's phases, then (a matrix function) every variant of the matrix kernels
        steps = [s for s in compiled if dict(s.meta)["kind"] != "matrix"]
        assert [s.digest for s in launched] == [s.digest for s in steps]
        matrices = [s.digest for s in compiled if dict(s.meta)["kind"] == "matrix"]
        assert matrices == (
            [s.digest for s in matrix_kernel_sources()] if "orthogonalize(" in opt.rule.text else []
        )
