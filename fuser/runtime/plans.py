"""What an optimizer step launches, before any tensor is seen: compile options, the dtype
plan of a launch group, and the lowered layout and rendered kernels of a rule.

``plan_and_sources`` is the one place that turns a rule into kernels for the step; it
remembers its results in memory and on disk (``cache.rendered``), because lowering and
rendering cost ~0.1-0.2 s of sympy per rule.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import sympy
import torch

from fuser.cache import rendered
from fuser.codegen.matrix import matrix_kernel_sources
from fuser.codegen.render import LAUNCH_PROFILES, optim_strip, optim_tile, render_optim, template_dir
from fuser.codegen.source import KernelSource
from fuser.ir.optim import (
    DTYPES,
    ELEMENT,
    MASTER_SLOT,
    QFORMATS,
    ReductionPlan,
    Slot,
    check_compressed,
    lower_optim,
    state_kinds,
)
from fuser.rules.rule import Rule
from fuser.rules.signs import nonneg_states
from fuser.runtime.tables import check_view

TORCH_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
FROM_NAME = {v: k for k, v in TORCH_DTYPES.items()}


@dataclass(frozen=True)
class Options:
    """Compile options of an optimizer class."""

    # None: fp32; "param": each parameter's dtype; a dtype name; an 8-bit format (QFORMATS,
    # or "q8": unsigned where the rule keeps the state non-negative); or per state, as
    # sorted (state, one of those) pairs, "default" naming the rest's.
    state_dtype: str | tuple[tuple[str, str], ...] | None = None
    state_keys: tuple[tuple[str, str], ...] = ()  # rule state name -> key in optimizer.state[p]
    grad_attr: str = "grad"  # read each gradient from this attribute ("main_grad": Megatron's fp32)
    stochastic_rounding: bool = False  # bf16/fp16 stores round stochastically
    seed: int = 0  # of stochastic rounding and rand()/randn() (with the step, tensor and element)
    static: bool = False  # storage of params, grads and states never replaced: no per-tensor check
    master_weights: str | None = None  # "bf16+int8" / "bf16+int16": split fp32 masters of bf16 params
    # The 2-D view of tensors of 3 or more dimensions (runtime.tables.VIEWS); a param
    # group's "view" key overrides it.
    view: str = "flatten"


# state_dtype's names: a dtype, each parameter's ("param"), an 8-bit format, or "q8".
STATE_FORMATS = (*DTYPES, "param", *QFORMATS, "q8")
MASTER_WEIGHTS = {"bf16+int8": "int8", "bf16+int16": "int16"}


def _state_format(value, what: str = "state_dtype") -> str:
    if isinstance(value, torch.dtype):
        if value not in TORCH_DTYPES:
            raise ValueError(f"{what} must be float32, bfloat16 or float16, not {value}")
        return TORCH_DTYPES[value]
    if value not in STATE_FORMATS:
        raise ValueError(
            f"{what} must be a torch dtype or one of {', '.join(map(repr, STATE_FORMATS))}, not {value!r}"
        )
    return value


def parse_options(
    state_dtype=None,
    state_keys=None,
    grad_attr="grad",
    stochastic_rounding=False,
    seed=0,
    static=False,
    master_weights=None,
    view="flatten",
) -> Options:
    """``Options`` from ``fuser.compile``'s keywords, checked."""
    check_view(view, "fuser.compile")
    if isinstance(state_dtype, dict):
        if not all(isinstance(k, str) for k in state_dtype):
            raise ValueError("state_dtype's keys must be the rule's state names (or 'default')")
        state_dtype = tuple(
            sorted((k, _state_format(v, f"state_dtype[{k!r}]")) for k, v in state_dtype.items())
        )
    elif state_dtype is not None:
        state_dtype = _state_format(state_dtype)
    if master_weights not in (None, *MASTER_WEIGHTS):
        raise ValueError(f"master_weights must be None, 'bf16+int8' or 'bf16+int16', not {master_weights!r}")
    if master_weights and stochastic_rounding:
        raise ValueError(
            "master_weights keeps the bits that bf16 rounding drops; stochastic_rounding would "
            "discard them: choose one"
        )
    if not isinstance(grad_attr, str) or not grad_attr.isidentifier():
        raise ValueError("grad_attr must be an attribute name such as 'grad' or 'main_grad'")
    if not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be a non-negative integer below 2**63, not {seed!r}")
    if not isinstance(static, bool):
        raise ValueError(f"static must be True or False, not {static!r}")
    return Options(
        state_dtype,
        tuple(sorted((state_keys or {}).items())),
        grad_attr,
        bool(stochastic_rounding),
        seed,
        static,
        master_weights,
        view,
    )


def check_state_formats(rules, options: Options) -> None:
    """Raise where a per-state ``state_dtype`` names a state none of ``rules`` has, or
    where a rule cannot store its states as asked (8 bits for a state of one number per
    row; any 8-bit state of a rule that reads rows, columns or matrices)."""
    rules = [rules] if isinstance(rules, Rule) else list(rules)
    sd = options.state_dtype
    if isinstance(sd, tuple):
        names = {s for r in rules for s, _ in r.state}
        unknown = sorted({k for k, _ in sd} - names - {"default"})
        if unknown:
            raise ValueError(
                f"state_dtype names {unknown}, which rule {rules[0].name!r} does not have; its states "
                f"are {sorted(names)} (and 'default' names the rest)"
            )
    for r in rules:
        check_compressed(r, dict(dtype_plan(r, options, "bf16", "bf16")))


def state_format(options: Options, rule: Rule | None, state: str, param_dtype: str) -> str:
    """The storage of ``state`` of a parameter stored in ``param_dtype``: a dtype name
    (DTYPES) or an 8-bit format (QFORMATS)."""
    sd = options.state_dtype
    if isinstance(sd, tuple):
        sd = dict(sd).get(state) or dict(sd).get("default")
        named = state in dict(options.state_dtype)
    else:
        named = False
    if sd is None:
        return "fp32"
    if sd in (*QFORMATS, "q8") and not named and rule is not None and state_kinds(rule).get(state) != ELEMENT:
        return "fp32"  # one number per row, column or tensor: 8 bits would save nothing
    if sd == "param":
        return param_dtype
    if sd == "q8":
        return "uint8" if rule is not None and state in nonneg_states(rule) else "int8"
    return sd


def state_dtype(
    options: Options, param_dtype: torch.dtype, rule: Rule | None = None, state: str = ""
) -> torch.dtype:
    """The torch dtype of a new element state ``state`` of ``rule`` for a parameter
    stored in ``param_dtype``: fp32 for those stored in 8 bits (quantized from it)."""
    fmt = state_format(options, rule, state, TORCH_DTYPES.get(param_dtype, "fp32"))
    return FROM_NAME.get(fmt, torch.float32)


def dtype_plan(rule: Rule, options: Options, param_dtype: str, grad_dtype: str) -> tuple:
    """The storage dtype of each slot ((name, dtype) pairs) of one launch group: a split
    master's low part beside bf16 parameters when ``master_weights`` asks for it."""
    master = ()
    if options.master_weights and param_dtype == "bf16":
        master = ((MASTER_SLOT, MASTER_WEIGHTS[options.master_weights]),)
    states = tuple((s, state_format(options, rule, s, param_dtype)) for s, _ in rule.state)
    return (("p", param_dtype), ("g", grad_dtype), *master, *states)


@dataclass(frozen=True)
class StepLayout:
    """What the runtime needs of a lowered plan: the pointer table's columns, the sizes
    of the reduction tables, and how each reduction combines (for DTensor shards)."""

    slots: tuple[Slot, ...]
    n_reductions: int
    n_global: int
    reductions: tuple[ReductionPlan, ...]  # symbols left out
    tiled: bool = False  # phases walk tiles of each tensor's 2-D view
    tile: tuple[int, int] = (0, 0)  # (rows, cols) of a program's strip of tiles, when tiled


# The tuning variables the renderer reads: part of a rendering's key, in memory and on disk.
LAUNCH_VARIABLES = (
    "FUSER_OPTIM_BLOCK",
    "FUSER_OPTIM_SUB",
    "FUSER_OPTIM_WARPS",
    "FUSER_OPTIM_TILE",
    "FUSER_OPTIM_STRIP",
    "FUSER_OPTIM_QBLOCK",
    "FUSER_OPTIM_MAXNREG",
)


def plan_and_sources(
    rule: Rule,
    dtypes: tuple[tuple[str, str], ...],
    stochastic_rounding: bool = False,
    sharded: bool = False,
    profile: str = "",
) -> tuple[StepLayout, list[KernelSource]]:
    """The step's layout and kernels, from this process's cache or the on-disk memo when
    this rule was rendered before with the same code and tuning variables (sympy costs
    ~0.1-0.2 s per rule), else lowered and rendered. ``sharded``: a rule of rows and
    columns over DTensor shards (``lower_optim``); ``profile``: the GPU's launch shapes
    (``render.LAUNCH_PROFILES``, ``render.device_profile``; ``""`` the defaults)."""
    launch = tuple(os.environ.get(v) for v in LAUNCH_VARIABLES)
    return _plan_and_sources(rule, dtypes, stochastic_rounding, launch, sharded, profile)


def forget_plans() -> None:
    """Drop every rendering this process holds (the on-disk memo stays)."""
    _plan_and_sources.cache_clear()


@functools.lru_cache(maxsize=256)
def _plan_and_sources(
    rule: Rule, dtypes: tuple[tuple[str, str], ...], stochastic_rounding: bool, launch: tuple, sharded: bool,
    profile: str = "",
) -> tuple[StepLayout, list[KernelSource]]:  # fmt: skip
    key = rendered.fingerprint(
        "optim",
        rule.name,
        rule.text,
        rule.hyper,
        rule.state,
        [(n, sympy.srepr(e)) for n, e in rule.outputs],
        dtypes,
        stochastic_rounding,
        list(launch),
        sharded,
        *([profile] if profile else []),  # (the defaults' keys as before)
        templates=template_dir(),
    )
    memo = rendered.load(key)
    if memo is not None:
        try:
            return _from_memo(memo)
        except (KeyError, TypeError, ValueError):
            pass  # an entry of another shape: render again
    plan = lower_optim(rule, dict(dtypes), stochastic_rounding=stochastic_rounding, sharded=sharded)
    layout = StepLayout(
        plan.slots,
        len(plan.reductions),
        plan.n_global,
        tuple(dataclasses.replace(r, symbol=None) for r in plan.reductions),
        plan.tiled,
        _strip_shape() if plan.tiled else (0, 0),
    )
    sources = render_optim(plan, profile)
    rendered.store(key, _to_memo(layout, sources))
    return layout, sources


def _strip_shape() -> tuple[int, int]:
    """(rows, cols) of what one program of a tiled phase walks: its strip of tiles."""
    rows, cols = optim_tile()
    return rows * optim_strip(), cols


_SOURCE_FIELDS = (
    "text",
    "entry",
    "signature",
    "constexprs",
    "num_warps",
    "num_stages",
    "max_registers",
    "meta",
)


def _to_memo(layout: StepLayout, sources: list[KernelSource]) -> dict:
    return {
        "slots": [dataclasses.asdict(s) for s in layout.slots],
        "n_reductions": layout.n_reductions,
        "n_global": layout.n_global,
        "reductions": [
            (r.op, r.phase, r.column, r.global_column, r.axis, r.axis_column, r.over, list(r.args))
            for r in layout.reductions
        ],
        "tiled": layout.tiled,
        "tile": list(layout.tile),
        "sources": [{f: getattr(k, f) for f in _SOURCE_FIELDS} for k in sources],
    }


def _from_memo(memo: dict) -> tuple[StepLayout, list[KernelSource]]:
    layout = StepLayout(
        tuple(Slot(**s) for s in memo["slots"]),
        memo["n_reductions"],
        memo["n_global"],
        tuple(ReductionPlan(None, *r[:-1], tuple(r[-1])) for r in memo["reductions"]),
        memo["tiled"],
        tuple(memo["tile"]),
    )
    sources = [
        KernelSource(
            text=k["text"],
            entry=k["entry"],
            signature=tuple(tuple(x) for x in k["signature"]),
            constexprs=tuple(tuple(x) for x in k["constexprs"]),
            num_warps=k["num_warps"],
            num_stages=k["num_stages"],
            max_registers=k["max_registers"],
            meta=tuple(tuple(x) for x in k["meta"]),
        )
        for k in memo["sources"]
    ]
    return layout, sources


def kernel_sources(
    rule: Rule, dtype: str = "fp32", *, grad_dtype: str | None = None, profile: str = "", **options
) -> list[KernelSource]:
    """Every kernel an optimizer compiled from ``rule`` with ``options`` (``fuser.compile``'s
    keywords) launches when parameters are stored in ``dtype`` and gradients in
    ``grad_dtype`` (default ``dtype``; ``"fp32"`` for Megatron's ``main_grad`` beside bf16
    parameters). Of the options, ``state_dtype`` and ``stochastic_rounding`` change the
    kernels; ``grad_attr``, ``state_keys`` and ``seed`` do not. A rule with a matrix
    function adds every variant of the matrix kernels (``fuser.codegen.matrix``) with the
    GPU's tiles. ``profile``: a GPU's launch shapes (``render.LAUNCH_PROFILES``), as a step
    on that GPU renders them."""
    grad_dtype = dtype if grad_dtype is None else grad_dtype
    for what, value in (("dtype", dtype), ("grad_dtype", grad_dtype)):
        if value not in DTYPES:
            raise ValueError(f"{what} must be one of {DTYPES}, not {value!r}")
    opts = parse_options(**options)
    plan = dtype_plan(rule, opts, dtype, grad_dtype)
    if profile and profile not in LAUNCH_PROFILES:
        raise ValueError(f"profile must be one of {sorted(LAUNCH_PROFILES)} or '', not {profile!r}")
    layout, sources = plan_and_sources(rule, plan, opts.stochastic_rounding, profile=profile)
    matrices = matrix_kernel_sources() if any(r.matrix for r in layout.reductions) else []
    return [*sources, *matrices]
