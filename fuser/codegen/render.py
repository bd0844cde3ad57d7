"""Plans -> ``KernelSource`` through jinja2 templates and ``TritonPrinter``.

Jinja carries structure only; every expression comes from the printer. Rendering is a
pure function of the plan: the same inputs give byte-identical text. ``template_dir()``
names the templates folder.

Launch shapes: ``optim_launch_config`` picks a step kernel's BLOCK elements per program,
walked SUB at a time, and its warps (the defaults from ``default_launch``, by the bytes of
the step's element tensors, and a GPU's ``LAUNCH_PROFILES``); ``optim_max_registers`` its
register cap. A tiled phase's
program walks ``optim_strip()`` tiles of ``optim_tile()`` down the rows; phases of column
sums, and of per-tensor sums before the last, walk the same strips in one-warp tiles
(``SLIM_ROWS``); the rows that no whole aligned tile covers go one at a time, masked
(``MASKED_ROWS``). ``_zero_guards`` finds where a phase before the last may skip loading
the parameter.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import sympy

from fuser.codegen.printer import TritonPrinter
from fuser.codegen.source import KernelSource
from fuser.ir.optim import (
    ACCUMULATE,
    COL,
    COLS,
    MASTER_SLOT,
    NDIM,
    NUMEL,
    QFORMATS,
    ROW,
    ROWS,
    STEP,
    OptimPlan,
    Phase,
    Tail,
    matrix_slot,
    scale_slot,
)
from fuser.ir.stores import DTYPE_BYTES
from fuser.rules.functions import RandomValue
from fuser.rules.parse import symbol

TL_DTYPES = {"fp32": "tl.float32", "bf16": "tl.bfloat16", "fp16": "tl.float16"}
# Storage of the 8-bit formats' codes and of split masters' low parts.
TL_INT_DTYPES = {
    "int8": "tl.int8",
    "uint8": "tl.uint8",
    "int8_linear": "tl.int8",
    "uint8_linear": "tl.uint8",
    "fp8e4m3": "tl.float8e4nv",
    "fp8e5m2": "tl.float8e5",
}
# The kernel helpers' number for each 8-bit format (``_q8_encode``, ``_q8_decode``).
QFORMAT_CODE = {f: i + 1 for i, f in enumerate(QFORMATS)}
# Elements per scale of an 8-bit state: FlashOptim's group of 32 (FUSER_OPTIM_QBLOCK
# overrides it for tuning runs; the value is part of the kernel's cache key).
QBLOCK = 32

# Every phase kernel of an optimizer takes these runtime arguments, in this order.
OPTIM_SIGNATURE = (
    ("ptrs", "*i64"),
    ("numels", "*i64"),
    ("groups", "*i32"),
    ("block_tensor", "*i32"),
    ("block_start", "*i64"),
    ("tensor_first_block", "*i32"),
    ("tensor_blocks", "*i32"),
    ("hyper", "*fp64"),
    ("scalars", "*fp32"),
    ("red", "*fp32"),
    ("partials", "*fp32"),
    ("counters", "*i32"),
    ("glob", "*fp32"),
    ("grad_scale", "*fp32"),
    ("found_inf", "*fp32"),
    ("n_tensors", "i32"),
    ("n_blocks", "i32"),
    ("part", "i32"),
    ("n_parts", "i32"),
    ("seed", "i64"),
)
# Shape-aware (tiled) phase kernels also take each tensor's 2-D view and the axis buffer.
TILED_SIGNATURE = (
    ("axis_starts", "*i64"),
    ("axis", "*fp32"),
    ("total_rows", "i64"),
    ("total_cols", "i64"),
)
REDUCE_BLOCK = 128
# A tiled phase's tile (rows x cols of one tensor's 2-D view) over TILE_WARPS warps, TILE_STRIP
# tiles a program: the fastest of 28 shapes (benchmarks/results/sweep_tiles_2026-11-26_strip*.json).
TILE_ROWS, TILE_COLS, TILE_WARPS, TILE_STRIP = 8, 128, 2, 32
# Phases of column sums, and of per-tensor sums before the last, walk one-warp tiles (1 KiB where
# one tensor moves) so no sum crosses warps (benchmarks/NOTES.md, "Rules of rows and columns").
SLIM_ROWS, SLIM_WARPS = 4, 1
# Rows a tiled phase's masked path takes at a time: masked loads hold an address per value, and one
# row keeps the kernel's registers near the unmasked path's (benchmarks/NOTES.md, tiled phases).
MASKED_ROWS = 1
# Registers a thread of a flat step kernel with 8-bit states or split masters may hold: 48 fits
# without spilling and doubles the programs a multiprocessor (benchmarks/results/state_2026-11-26_cap*.md).
COMPRESSED_MAX_REGISTERS = 48


def optim_tile() -> tuple[int, int]:
    """(rows, cols) of a tiled phase's tile. ``FUSER_OPTIM_TILE=16x256`` overrides it (for
    tuning runs; the values are part of the kernel's cache key)."""
    text = os.environ.get("FUSER_OPTIM_TILE")
    if not text:
        return TILE_ROWS, TILE_COLS
    try:
        rows, cols = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"FUSER_OPTIM_TILE must read ROWSxCOLS, e.g. 16x256, not {text!r}") from None
    if min(rows, cols) < 1 or rows & (rows - 1) or cols & (cols - 1) or cols < 16:
        raise ValueError(f"FUSER_OPTIM_TILE needs powers of two (cols at least 16), not {text!r}")
    return rows, cols


# Reductions call tl.reduce with Triton's own combine functions rather than tl.sum/tl.max:
# those are jitted library functions, which only run in the interpreter when it was on
# at import, while the interpreter recognises these combiners and sums with numpy. The
# same kernel module then serves the interpreter (CPU tensors) and the compiler.
SUM, SUM_COMBINE, MAX_COMBINE = "tl.reduce", "tl.standard._sum_combine", "tl.standard._elementwise_max"


def optim_strip() -> int:
    """Tiles each program of a tiled phase walks, down the rows. ``FUSER_OPTIM_STRIP``
    overrides it (for tuning runs; the value is part of the kernel's cache key)."""
    text = os.environ.get("FUSER_OPTIM_STRIP")
    if not text:
        return TILE_STRIP
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"FUSER_OPTIM_STRIP must be a whole number of tiles (1 or more), not {text!r}")
    return int(text)


def template_dir() -> Path:
    """Templates ship inside the wheel as ``fuser/templates``; a source tree keeps them at
    the top level."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "templates", here.parent / "templates"):
        if (candidate / "optim_step.py.jinja").is_file():
            return candidate
    raise FileNotFoundError("fuser's kernel templates are missing from the installation")


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def helpers_source() -> str:
    return environment().get_template("helpers.py.jinja").render().strip("\n")


def quant_block() -> int:
    """Elements per scale of an 8-bit state."""
    qb = int(os.environ.get("FUSER_OPTIM_QBLOCK") or QBLOCK)
    if qb < 8 or qb & (qb - 1):
        raise ValueError(f"FUSER_OPTIM_QBLOCK must be a power of two >= 8, not {qb}")
    return qb


# Launch shapes that differ from ``default_launch``'s on a GPU, by the ``device_profile``
# naming it and the layout of the step's bytes. On an H200 every-tensor-fp32 steps walk 8192
# elements 1024 at a time: AdamW 7.83 against 8.12 ms, LAMB 10.70 against 13.24 (its floor
# 10.48), where an H100 read AdamW 10.45 at 2048 over 8 against 10.94
# (sweep_step_2026-12-03_h200_lamb.md, sweep_step_2026-11-25_fp32.md).
LAUNCH_PROFILES = {"h200": {"fp32": (8192, 1024, 8)}}


def device_profile(device) -> str:
    """The ``LAUNCH_PROFILES`` key of ``device`` (a torch device), ``""`` for the defaults."""
    if getattr(device, "type", None) != "cuda":
        return ""
    import torch

    name = torch.cuda.get_device_name(device)
    return next((key for key in LAUNCH_PROFILES if key in name.lower()), "")


def optim_launch_config(plan: OptimPlan, profile: str = "") -> tuple[int, int, int]:
    """(BLOCK, SUB, num_warps) for a step kernel: each program updates BLOCK elements of
    one tensor, SUB at a time. ``FUSER_OPTIM_BLOCK`` / ``FUSER_OPTIM_SUB`` /
    ``FUSER_OPTIM_WARPS`` override them (for tuning runs; the values are part of the
    kernel's cache key); the defaults are ``default_launch``'s, or ``profile``'s."""
    block, sub, warps = default_launch(plan, profile)
    block = int(os.environ.get("FUSER_OPTIM_BLOCK") or block)
    sub = int(os.environ.get("FUSER_OPTIM_SUB") or min(sub, block))
    warps = int(os.environ.get("FUSER_OPTIM_WARPS") or warps)
    if block < 128 or block & (block - 1):
        raise ValueError(f"FUSER_OPTIM_BLOCK must be a power of two >= 128, not {block}")
    if sub < 128 or sub & (sub - 1) or sub > block:
        raise ValueError(f"FUSER_OPTIM_SUB must be a power of two from 128 to BLOCK ({block}), not {sub}")
    return block, sub, warps


def default_launch(plan: OptimPlan, profile: str = "") -> tuple[int, int, int]:
    """(BLOCK, SUB, num_warps) by the bytes of a step's element tensors (and a GPU's
    ``LAUNCH_PROFILES`` entry, ``profile``).

    A few values per thread per pass keep a thread's registers few (about 50 for AdamW
    with 8-bit states, 255 at 16 values), so many programs share a multiprocessor, and
    the loop spreads each program's fixed costs (its tensor's addresses and scalars, the
    counter it bumps at the end) over 8192 elements. On TinyLlama-1.1B's tensors on an
    H100 this took AdamW with 8-bit states from 9.2 to 5.0 ms, with bf16 parameters and
    fp32 states from 10.7 to 9.0 ms (benchmarks/results/sweep_step_2026-11-25.md). Kernel
    times of AdamW per layout, two rounds in one H100 call, against 512 a pass over 4
    warps (benchmarks/results/step_shapes_2026-11-26*.jsonl, NOTES):

    - all fp32: one pass of 2048 over 8 warps (512 a pass was 5% slower);
    - 16-bit parameters and states: 1024 over 8 warps, 5.229 against 5.306 ms;
    - 16-bit parameters, fp32 states: 1024 over 4 warps, 8.28 against 8.40 ms;
    - 8-bit states: 512 over 2 warps, 4.18 against 4.26 ms (256 over 2); Lion 3.27
      against 3.30 ms;
    - 8-bit states and an int8 split master: 512 over 2 warps. On the H100 256 over 2
      read 5.07 ms, 512 over 2 5.11; on an H200, with the kernels of fewer instructions,
      512 over 2 reads 4.03 ms against 4.49 (sweep_step_2026-12-03_h200_q8_v2.md);
    - other split masters (int16, or beside fp32 states): 512 over 4 warps, 1% ahead of
      256 over 2.

    Tiled phases (shape-aware rules) take TILE_WARPS.
    """
    if plan.tiled:
        return 8192, 512, TILE_WARPS
    if all(sl.dtype == "fp32" for sl in plan.slots if sl.role not in ("row", "col")):
        return LAUNCH_PROFILES.get(profile, {}).get("fp32", (2048, 2048, 8))
    elements = [sl for sl in plan.slots if sl.role in ("param", "grad", "state", "master")]
    if _is_compressed(plan):
        if not all(_one_byte(sl) for sl in elements if sl.role in ("state", "master")):
            return 8192, 512, 4
        return 8192, 512, 2
    if any(sl.role == "matrix" for sl in plan.slots):
        return 8192, 512, 4  # (phases of a matrix function's rule: not measured otherwise)
    if all(DTYPE_BYTES[sl.dtype] == 2 for sl in elements):
        return 8192, 1024, 8
    return 8192, 1024, 4


def optim_max_registers(plan: OptimPlan) -> int:
    """Registers a thread of the step's kernels may hold (0: the compiler's choice):
    COMPRESSED_MAX_REGISTERS for flat kernels with 8-bit states or split masters.
    ``FUSER_OPTIM_MAXNREG`` overrides it (for tuning runs; 0 lifts the cap; the value is part
    of the kernel's cache key)."""
    text = os.environ.get("FUSER_OPTIM_MAXNREG")
    if text:
        if not text.isdigit() or 0 < int(text) < 24 or int(text) > 255:
            raise ValueError(f"FUSER_OPTIM_MAXNREG must be 0 or a count from 24 to 255, not {text!r}")
        return int(text)
    return COMPRESSED_MAX_REGISTERS if _is_compressed(plan) and not plan.tiled else 0


def store_cast(value: str, dtype: str, random: str | None = None) -> str:
    """An fp32 value converted for storage in ``dtype``: round to nearest even, or
    stochastically from the uint32 ``random`` bits when given."""
    if dtype == "fp32":
        return f"({value}).to(tl.float32)"
    if random is not None:
        return f"_to_{dtype}_sr({value}, {random})"
    if dtype == "bf16":
        return f"_to_bf16({value}, INTERPRETED)"
    return f"({value}).to(tl.float16)"


def _finalize(op: str, raw: str, size: str = "numel") -> str:
    """A reduction's result from its accumulated ``raw`` value; ``size`` counts what it
    ran over (for ``mean``)."""
    if op == "mean":
        return f"{raw} / {size}"
    if op in ("norm", "global_norm"):
        return f"tl.sqrt({raw})"
    return raw


def render_optim(plan: OptimPlan, profile: str = "") -> list[KernelSource]:
    """Render the step's kernels, one per phase, in launch order (``profile``: the GPU's
    ``LAUNCH_PROFILES`` key)."""
    return [render_phase(plan, ph, profile) for ph in plan.phases]


def _launch_constexprs(ctx: _PhaseContext) -> tuple[tuple, int]:
    """A step kernel's launch shape as its constexprs (BLOCK and SUB, or a tile's BR x BC;
    QB with 8-bit states), and its warps."""
    plan, phase = ctx.plan, ctx.phase
    block, sub, warps = optim_launch_config(plan, ctx.profile)
    tile, strip = optim_tile(), optim_strip()
    tuned = any(os.environ.get(f"FUSER_OPTIM_{k}") for k in ("TILE", "STRIP", "WARPS"))
    columns = any(plan.reductions[i].axis == COL for i, _ in phase.axis_reduce)
    if plan.tiled and (columns and not phase.reduce or phase.reduce and not ctx.last) and not tuned:
        # (the same strips, so the same block table: SLIM_ROWS * TK rows a program)
        elements = [sl for _, sl in ctx.used_slots if _SLOT_KIND.get(sl.role) == "element"]
        moved = [sl for sl in elements if sl.name in ctx.read and sl.name not in ctx.guards]
        moved += [sl for sl in elements if sl.name in {n for n, _ in phase.stores}]
        rows = SLIM_ROWS
        if len(moved) == 1:
            rows = min(SLIM_ROWS, max(1, 1024 // (tile[1] * DTYPE_BYTES.get(moved[0].dtype, 1))))
        tile, strip, warps = (rows, tile[1]), strip * tile[0] // rows, SLIM_WARPS
    tiled = (("BR", tile[0]), ("BC", tile[1]), ("TK", strip), ("MR", MASKED_ROWS))
    tiles = tiled if plan.tiled else (("SUB", sub),)
    block = tile[0] * tile[1] if plan.tiled else block
    quant = (("QB", quant_block()),) if _is_compressed(plan) else ()
    if quant and plan.tiled and quant[0][1] > tile[1]:
        raise ValueError(
            f"8-bit states' blocks of {quant[0][1]} elements (FUSER_OPTIM_QBLOCK) must fit in a tile's "
            f"{tile[1]} columns (FUSER_OPTIM_TILE) for rule {plan.name!r}, which reads rows and columns"
        )
    if quant and not plan.tiled and quant[0][1] > sub:
        raise ValueError(
            f"8-bit states' blocks of {quant[0][1]} elements (FUSER_OPTIM_QBLOCK) must fit in a pass of "
            f"{sub} (FUSER_OPTIM_SUB) for rule {plan.name!r}"
        )
    return (("BLOCK", block), ("RBLOCK", REDUCE_BLOCK), ("INTERPRETED", False), *tiles, *quant), warps


def render_phase(plan: OptimPlan, phase: Phase, profile: str = "") -> KernelSource:
    """One phase's kernel: per-tensor scalars, the element work (an aligned unmasked path
    and a masked one), then the last phase's stores and scalar updates, or an earlier
    phase's reduction partials and their totals."""
    ctx = _phase_context(plan, phase, profile)
    loads = _scalar_loads(ctx, ctx.scalar_names, "t", "grp") + _global_reduction_loads(ctx)
    prologue = [f"{ctx.scalar_names[s]} = {ctx.p64.doprint_expr(e)}" for s, e in phase.prologue]
    casts = [f"f_{ctx.scalar_names[s]} = {ctx.scalar_names[s]}.to(tl.float32)" for s in ctx.scalars_in_body]
    pointers = _pointer_lines(ctx)
    if _draws(phase):  # rand() / randn(): the stream of (seed, step, tensor)
        pointers.append("rng_key = _rand_key(seed, step, t)")
    aligned = " | ".join(f"{sl.name}_raw" for _, sl in ctx.used_slots) or "0"
    fast_lines, masked_lines = _element_lines(ctx, True), _element_lines(ctx, False)
    sections = {name: [] for name in (*_UPDATE_SECTIONS, *_COMBINE_SECTIONS, "strip_lines")}
    if ctx.last:
        _add_stores(ctx, fast_lines, masked_lines, pointers)
        sections.update(_scalar_update_lines(ctx))
    else:
        sections.update(_reduction_lines(ctx, fast_lines, masked_lines))
        if phase.stores:  # states stored before the last phase (fuser.ir.stores)
            _add_stores(ctx, fast_lines, masked_lines, pointers)
        tile, before, after = _axis_partial_lines(ctx)
        fast_lines += tile
        masked_lines += tile
        sections["partial_init"] += before
        sections["strip_lines"] = after
        for i, e in phase.matrix_stores:  # a matrix function's argument, in bf16
            value = store_cast(ctx.p32.doprint_expr(e), "bf16")
            fast_lines.append(f"tl.store({matrix_slot(i, 'in')}_ptr + offs, {value})")
            masked_lines.append(f"tl.store({matrix_slot(i, 'in')}_ptr + offs, {value}, mask=mask)")
    sections["tail_lines"] = _tail_lines(ctx)
    sections["column_lines"] = _column_lines(ctx) if plan.tiled else []
    # (a phase of tails alone, as DTensor shards lower some rules, has no element work)
    fast_lines, masked_lines = fast_lines or ["pass"], masked_lines or ["pass"]

    entry = f"{plan.name}_step" if len(plan.phases) == 1 else f"{plan.name}_phase{phase.index}"
    constexprs, warps = _launch_constexprs(ctx)
    text = _kernel_text(
        ctx,
        entry,
        scalar_loads=loads,
        prologue=prologue,
        casts=casts,
        pointers=pointers,
        aligned=aligned,
        fast_lines=fast_lines,
        masked_lines=masked_lines,
        **sections,
    )
    return KernelSource(
        text=text,
        entry=entry,
        signature=OPTIM_SIGNATURE + (TILED_SIGNATURE if plan.tiled else ()),
        constexprs=constexprs,
        num_warps=warps,
        num_stages=1,
        max_registers=optim_max_registers(plan),
        meta=_meta(plan, phase),
    )


def _draws(phase: Phase) -> bool:
    """Whether the phase's element work reads ``rand()`` or ``randn()``."""
    values = (*phase.body, *phase.stores, *phase.reduce, *phase.axis_reduce, *phase.matrix_stores)
    return any(e.has(RandomValue) for _, e in values)


def _meta(plan: OptimPlan, phase: Phase) -> tuple:
    """What ``fuser cache ls`` shows of a phase's kernel."""
    phases = f"{phase.index + 1}/{len(plan.phases)}"
    return (("rule", plan.name), ("kind", "optim"), ("dtypes", plan.dtype_key), ("phase", phases))


# The template's line lists that only the last phase fills, and those only the others fill.
_UPDATE_SECTIONS = ("update_loads", "update_prologue", "update_stores")
_COMBINE_SECTIONS = (
    "partial_init",
    "partial_store",
    "combine_init",
    "combine_step",
    "combine_store",
    "global_init",
    "global_step",
    "global_store",
)


@dataclass(frozen=True, eq=False)
class _PhaseContext:
    """What every step of rendering one phase reads: the plan's row sizes, the reductions
    finished before it, the names each printer gives symbols, and the slots it touches."""

    plan: OptimPlan
    phase: Phase
    last: bool
    nh: int
    ns: int
    nred: int
    nglob: int
    known: list
    scalar_names: dict
    scalars_in_body: list
    read: set
    used_slots: list
    p64: TritonPrinter
    p32: TritonPrinter
    guards: dict = field(default_factory=dict)  # slot name -> fp32 scalar (_zero_guards)
    profile: str = ""  # the GPU's LAUNCH_PROFILES key


def _phase_context(plan: OptimPlan, phase: Phase, profile: str = "") -> _PhaseContext:
    last = phase.index == len(plan.phases) - 1
    known = [r for r in plan.reductions if r.phase < phase.index]

    scalar_names = {symbol(h): f"h_{h}" for h in plan.hyper}
    scalar_names.update({STEP: "step", NUMEL: "numel"})
    scalar_names.update({ROWS: "rows", COLS: "cols"})
    if plan.reads_ndim:
        scalar_names[NDIM] = "ndim"
    scalar_names.update({symbol(s): f"c_{s}" for s in plan.scalar_states})
    scalar_names.update({r.symbol: r.symbol.name for r in known if not r.axis and not r.matrix})
    scalar_names.update({s: s.name for s, _ in phase.prologue})

    results = (*phase.stores, *phase.reduce)
    body_free = set()
    for _, e in (*phase.body, *results, *phase.axis_reduce, *phase.matrix_stores):
        body_free |= e.free_symbols
    tail_free = set()
    for tail in phase.tails:
        for _, e in (*tail.body, *tail.reduce, *tail.stores):
            tail_free |= e.free_symbols
    scalars_in_body = sorted(
        (s for s in body_free | tail_free if s in scalar_names), key=lambda s: scalar_names[s]
    )
    body_names = {symbol(sl.name): f"x_{sl.name}" for sl in plan.slots}
    body_names.update({s: f"f_{scalar_names[s]}" for s in scalars_in_body})
    body_names.update({r.symbol: f"a_{r.symbol.name}" for r in known if r.axis})
    matrix_out = {r.symbol: matrix_slot(i, "out") for i, r in enumerate(plan.reductions) if r.matrix}
    body_names.update({sym: f"x_{name}" for sym, name in matrix_out.items() if sym in body_free})
    body_names.update({s: s.name for s, _ in phase.body})

    read = {s.name for s in body_free} | {matrix_out[s] for s in body_free if s in matrix_out}
    written = {n for n, _ in phase.stores} | {n for t in phase.tails for n, _ in t.stores}
    written |= {matrix_slot(i, "in") for i, _ in phase.matrix_stores}
    touched = read | written | {s.name for s in tail_free}
    touched |= {scale_slot(sl.name) for sl in plan.slots if sl.dtype in QFORMATS and sl.name in touched}
    if "p" in touched and any(sl.role == "master" for sl in plan.slots):
        touched.add(MASTER_SLOT)
    return _PhaseContext(
        plan=plan,
        phase=phase,
        last=last,
        nh=len(plan.hyper),
        ns=1 + len(plan.scalar_states),
        nred=max(1, len(plan.reductions)),
        nglob=max(1, plan.n_global),
        known=known,
        scalar_names=scalar_names,
        scalars_in_body=scalars_in_body,
        read=read,
        used_slots=[(j, sl) for j, sl in enumerate(plan.slots) if sl.name in touched],
        p64=TritonPrinter(scalar_names, fp64=True),
        # With 8-bit states a step's values carry 2**-8 of their block's scale: sqrt_rn's
        # last ulp shows in none of them, and it took 13 more instructions an element than
        # the approximate root in q8 AdamW on sm_90 (benchmarks/NOTES.md, 8-bit states).
        p32=TritonPrinter(body_names, fast_sqrt=any(sl.dtype in QFORMATS for sl in plan.slots)),
        guards={n: body_names[c] for n, c in _zero_guards(plan, phase, scalars_in_body, read).items()},
        profile=profile,
    )


def _zero_guards(plan: OptimPlan, phase: Phase, scalars: list, read: set) -> dict[str, sympy.Symbol]:
    """The parameter, where a phase before the last reads it only through terms that one
    per-step scalar zeroes (CAME's ``(1 - weight_decouple) * weight_decay * p``): the
    kernel loads it only where that scalar is not zero, as the references skip the term
    (a NaN there is not read either). Slot name -> the scalar. The last phase, which
    stores, keeps its loads."""
    if phase.index == len(plan.phases) - 1:
        return {}
    values = {}
    for sym, e in phase.body:
        values[sym] = e.xreplace(values)
    results = [
        e.xreplace(values)
        for _, e in (*phase.stores, *phase.reduce, *phase.axis_reduce, *phase.matrix_stores)
    ]
    guards = {}
    for sl in plan.slots:
        x = symbol(sl.name)
        # (parameters only: a guard costs a branch per tile, and the terms that zero in
        # practice are decays of p; on CAME's gradient it slowed its third phase by 20%)
        if sl.name not in read or sl.role != "param":
            continue
        for c in scalars:
            zeroed = [e.xreplace({c: sympy.Integer(0)}) for e in results]
            if all(
                not z.has(x) and z.is_finite is not False and not z.has(sympy.nan, sympy.zoo) for z in zeroed
            ):
                guards[sl.name] = c
                break
    return guards


def _scalar_loads(ctx: _PhaseContext, names: dict, row: str, group: str, mask: str = "") -> list[str]:
    """Hyperparameters, step, numel, scalar states and earlier per-tensor reductions of
    tensor ``row`` (fp64), named by ``names``."""
    plan, nh, ns = ctx.plan, ctx.nh, ctx.ns
    m = f", mask={mask}, other=0.0" if mask else ""
    lines = [
        f"{names[symbol(h)]} = tl.load(hyper + {group} * {nh} + {j}{m})" for j, h in enumerate(plan.hyper)
    ]
    lines.append(f"{names[STEP]} = tl.load(scalars + {row} * {ns}{m}).to(tl.float64) + 1.0")
    lines.append(f"{names[NUMEL]} = tl.load(numels + n_tensors + {row}{m}).to(tl.float64)")
    lines.append(f"{names[ROWS]} = tl.load(numels + 2 * n_tensors + {row}{m}).to(tl.float64)")
    lines.append(f"{names[COLS]} = tl.load(numels + 3 * n_tensors + {row}{m}).to(tl.float64)")
    if NDIM in names:
        lines.append(f"{names[NDIM]} = tl.load(numels + 6 * n_tensors + {row}{m}).to(tl.float64)")
    lines += [
        f"{names[symbol(s)]} = tl.load(scalars + {row} * {ns} + {j + 1}{m}).to(tl.float64)"
        for j, s in enumerate(plan.scalar_states)
    ]
    sizes = {"element": names[NUMEL], "row": names.get(ROWS), "col": names.get(COLS)}
    for r in ctx.known:
        if r.global_column >= 0 or r.axis or r.matrix:
            continue
        raw = f"tl.load(red + {row} * {ctx.nred} + {r.column}{m}).to(tl.float64)"
        lines.append(f"{names[r.symbol]} = {_finalize(r.op, raw, sizes[r.over])}")
    return lines


def _global_reduction_loads(ctx: _PhaseContext) -> list[str]:
    """Each earlier global reduction: the sum of every part's total (then its square root,
    for a norm)."""
    lines = []
    for r in ctx.known:
        if r.global_column >= 0:
            lines += [
                f"{r.symbol.name} = tl.full((), 0.0, tl.float64)",
                "q = 0",
                "while q < n_parts:",
                f"    {r.symbol.name} += tl.load(glob + q * {ctx.nglob} + {r.global_column}).to(tl.float64)",
                "    q += 1",
            ]
            if r.op == "global_norm":
                lines.append(f"{r.symbol.name} = tl.sqrt({r.symbol.name})")
    return lines


def _pointer_lines(ctx: _PhaseContext) -> list[str]:
    pointers = []
    for j, sl in ctx.used_slots:
        dtype = TL_DTYPES.get(sl.dtype) or TL_INT_DTYPES.get(sl.dtype, "tl.int16")
        pointers.append(f"{sl.name}_raw = tl.load(ptrs + t * {len(ctx.plan.slots)} + {j})")
        pointers.append(f"{sl.name}_ptr = {sl.name}_raw.to(tl.pointer_type({dtype}))")
    return pointers


def _is_compressed(plan: OptimPlan) -> bool:
    return any(sl.role == "master" or sl.dtype in QFORMATS for sl in plan.slots)


def _one_byte(slot) -> bool:
    """An element state in an 8-bit format, or an int8 split master."""
    return slot.dtype in QFORMATS or (slot.role == "master" and slot.dtype == "int8")


def _master_bits(plan: OptimPlan) -> int:
    """Bits of the split master's low part (0: none)."""
    return next((8 if sl.dtype == "int8" else 16 for sl in plan.slots if sl.role == "master"), 0)


def _element_lines(ctx: _PhaseContext, fast: bool) -> list[str]:
    if ctx.plan.tiled:
        return _tile_lines(ctx, fast)
    lines = []
    for _, sl in ctx.used_slots:
        if fast:
            lines.append(f"{sl.name}_ptr = tl.multiple_of({sl.name}_ptr, 16)")
    for _, sl in ctx.used_slots:
        if sl.name in ctx.read:
            lines += _guarded(ctx, sl.name, _element_load(ctx, sl, fast), "[SUB]")
    lines += [f"{s.name} = {ctx.p32.doprint_expr(e)}" for s, e in ctx.phase.body]
    return lines


def _guarded(ctx: _PhaseContext, name: str, load: str, shape: str) -> list[str]:
    """``x_<name> = load``, or zeros without a load where the slot's guard is zero."""
    if name not in ctx.guards:
        return [f"x_{name} = {load}"]
    return [
        f"if {ctx.guards[name]} != 0.0:  # (else every term that reads it is zero)",
        f"    x_{name} = {load}",
        "else:",
        f"    x_{name} = tl.full({shape}, 0.0, tl.float32)",
    ]


def _element_load(ctx: _PhaseContext, sl, fast: bool) -> str:
    """A flat block's fp32 values of slot ``sl``: decoded from 8 bits and their block's
    scale, joined with the split master's low part, or cast."""
    ints = "" if fast else ", mask=mask, other=0"
    floats = "" if fast else ", mask=mask, other=0.0"
    if sl.dtype in QFORMATS:
        fp8 = sl.dtype.startswith("fp8")  # (no `other`: an int would not convert)
        codes = f"tl.load({sl.name}_ptr + offs{'' if fast else ', mask=mask' if fp8 else ints})"
        scales = f"tl.load({scale_slot(sl.name)}_ptr + offs // QB{floats})"
        return f"_q8_decode({codes}, {scales}, {QFORMAT_CODE[sl.dtype]}, INTERPRETED)"
    value = f"tl.load({sl.name}_ptr + offs{floats}).to(tl.float32)"
    if sl.role == "grad":
        return f"{value} * inv_scale"
    bits = _master_bits(ctx.plan)
    if sl.role == "param" and bits:
        return f"_master_join({value}, tl.load({MASTER_SLOT}_ptr + offs{ints}), {bits})"
    return value


_SLOT_KIND = {
    "param": "element",
    "grad": "element",
    "state": "element",
    "matrix": "element",
    "row": ROW,
    "col": COL,
}


def _tile_lines(ctx: _PhaseContext, fast: bool) -> list[str]:
    """A tiled phase's loads (elements, row states, finished row reductions) and its
    temporaries; ``fast``: of a whole tile of aligned rows, unmasked, else of MR rows,
    masked. (Column values are loaded once per strip: ``_column_lines``.)"""
    lines = []
    if fast:
        lines += [f"{sl.name}_ptr = tl.multiple_of({sl.name}_ptr, 16)" for _, sl in ctx.used_slots]
    rows = "BR" if fast else "MR"
    for _, sl in ctx.used_slots:
        if sl.name not in ctx.read:
            continue
        kind = _SLOT_KIND[sl.role]
        if kind == "element":  # (decoded from 8 bits, joined with a split master's low part)
            lines += _guarded(ctx, sl.name, _element_load(ctx, sl, fast), f"[{rows}, BC]")
        elif kind == ROW:
            how = "" if fast else ", mask=rm, other=0.0"
            lines.append(f"x_{sl.name} = tl.load({sl.name}_ptr + ri{how}).to(tl.float32)[:, None]")
    for r in _known_axis_results(ctx, ROW):
        lines.append(f"a_{r.symbol.name} = ({_axis_result(ctx, r, 'ri', 'rm')})[:, None]")
    lines += [f"{s.name} = {ctx.p32.doprint_expr(e)}" for s, e in ctx.phase.body]
    return lines


def _column_lines(ctx: _PhaseContext) -> list[str]:
    """A tiled phase's column states and finished column reductions at the strip's
    columns ``ci``, loaded once before its loop over the rows."""
    lines = [
        f"x_{sl.name} = tl.load({sl.name}_ptr + ci, mask=cm, other=0.0).to(tl.float32)[None, :]"
        for _, sl in ctx.used_slots
        if sl.name in ctx.read and _SLOT_KIND[sl.role] == COL
    ]
    for r in _known_axis_results(ctx, COL):
        lines.append(f"a_{r.symbol.name} = ({_axis_result(ctx, r, 'ci', 'cm')})[None, :]")
    return lines


def _known_axis_results(ctx: _PhaseContext, axis) -> list:
    """The finished axis reductions along ``axis`` that the phase's expressions read."""
    used = {
        s
        for _, e in (
            *ctx.phase.body,
            *ctx.phase.stores,
            *ctx.phase.reduce,
            *ctx.phase.axis_reduce,
            *ctx.phase.matrix_stores,
        )
        for s in e.free_symbols
    }
    return [r for r in ctx.known if r.axis == axis and r.symbol in used]


def _axis_base(ctx: _PhaseContext, r) -> str:
    """Where tensor ``t``'s results of axis reduction ``r`` start in the axis buffer."""
    if r.axis == ROW:
        return f"{r.axis_column} * total_rows + roff"
    return f"{ctx.plan.n_axis[0]} * total_rows + {r.axis_column} * total_cols + coff"


def _axis_result(ctx: _PhaseContext, r, idx: str, mask: str) -> str:
    """Axis reduction ``r``'s finished results at rows (columns) ``idx``, fp32."""
    raw = f"tl.load(axis + {_axis_base(ctx, r)} + {idx}, mask={mask}, other=0.0)"
    other = "all_cols_t" if r.axis == ROW else "all_rows_t"
    return _finalize(r.op, raw, f"{other}.to(tl.float32)").replace("tl.sqrt(", "tl.sqrt_rn(")


def _axis_partial_lines(ctx: _PhaseContext) -> tuple[list[str], list[str], list[str]]:
    """Each tile's partial of the phase's axis reductions, added into the axis buffer: a
    row's at once (each tile of the strip holds other rows), a column's summed over the
    strip's tiles in registers and added after the last. Returns the lines of each tile,
    those before the strip's loop and those after it."""
    tile, before, after = [], [], []
    for j, (index, e) in enumerate(ctx.phase.axis_reduce):
        r = ctx.plan.reductions[index]
        value = ctx.p32.doprint_expr(e)
        if ACCUMULATE[r.op][1] == "sum":
            neutral, comb, op = "0.0", SUM_COMBINE, "tl.atomic_add"
        else:
            neutral, comb, op = "float('-inf')", MAX_COMBINE, "tl.atomic_max"
        dim = 1 if r.axis == ROW else 0
        part = f"{SUM}(tl.where(mask, {value}, {neutral}), {dim}, {comb})"
        if r.axis == ROW:
            tile.append(f'{op}(axis + {_axis_base(ctx, r)} + ri, {part}, mask=rm, sem="relaxed")')
            continue
        acc, where = f"cpart{j}", f"axis + {_axis_base(ctx, r)} + ctile * BC + tl.arange(0, BC)"
        before.append(f"{acc} = tl.full([BC], {neutral}, tl.float32)")
        summed = op == "tl.atomic_add"
        tile.append(f"{acc} = {acc} + {part}" if summed else f"{acc} = tl.maximum({acc}, {part})")
        after.append(f'{op}({where}, {acc}, mask=cm, sem="relaxed")')
    return tile, before, after


def _tail_lines(ctx: _PhaseContext) -> list[str]:
    """The program that finishes tensor ``t``'s tiles of the phase: each tail's loop over
    the tensor's rows or columns (reductions of their values, or the new row and column
    states)."""
    lines = []
    for j, tail in enumerate(ctx.phase.tails):
        lines += _one_tail(ctx, j, tail)
    return lines


def _one_tail(ctx: _PhaseContext, j: int, tail: Tail) -> list[str]:
    plan, phase = ctx.plan, ctx.phase
    size = "rows_t" if tail.axis == ROW else "cols_t"
    names = {s: n for s, n in ctx.p32.names.items() if not n.startswith(("x_", "a_"))}
    free = {s for _, e in (*tail.body, *tail.reduce, *tail.stores) for s in e.free_symbols}
    lines, loop = [], []
    sizes = {"element": "numel", ROW: "rows", COL: "cols"}
    for r in plan.reductions:
        if r.symbol not in free:
            continue
        if r.axis:
            names[r.symbol] = f"b_{r.symbol.name}"
            loop.append(f"b_{r.symbol.name} = {_axis_result(ctx, r, 'tix', 'tim')}")
        elif r.phase == phase.index:  # finished by this program, before this tail
            names[r.symbol] = f"f_{r.symbol.name}"
            raw = f"tl.load(red + t * {ctx.nred} + {r.column})"
            lines.append(f"f_{r.symbol.name} = ({_finalize(r.op, raw, sizes[r.over])}).to(tl.float32)")
    for sl in plan.slots:
        if symbol(sl.name) in free:
            names[symbol(sl.name)] = f"y_{sl.name}"
            loop.append(f"y_{sl.name} = tl.load({sl.name}_ptr + tix, mask=tim, other=0.0).to(tl.float32)")
    names.update({s: s.name for s, _ in tail.body})
    pr = TritonPrinter(names)
    loop += [f"{s.name} = {pr.doprint_expr(e)}" for s, e in tail.body]
    after = []
    for col, e in tail.reduce:
        r = _per_tensor(plan, col)
        acc = f"tacc{j}_{col}"
        if ACCUMULATE[r.op][1] == "sum":
            lines.append(f"{acc} = tl.full([RBLOCK], 0.0, tl.float32)")
            loop.append(f"{acc} += tl.where(tim, {pr.doprint_expr(e)}, 0.0)")
            after.append(f"tl.store(red + t * {ctx.nred} + {col}, {SUM}({acc}, 0, {SUM_COMBINE}))")
        else:
            lines.append(f"{acc} = tl.full([RBLOCK], float('-inf'), tl.float32)")
            loop.append(f"{acc} = tl.maximum({acc}, tl.where(tim, {pr.doprint_expr(e)}, float('-inf')))")
            after.append(f"tl.store(red + t * {ctx.nred} + {col}, {SUM}({acc}, 0, {MAX_COMBINE}))")
    for name, e in tail.stores:
        dtype = _slot(plan, name).dtype
        value = store_cast(pr.doprint_expr(e), dtype)
        loop.append(f"tl.store({name}_ptr + tix, {value}, mask=tix < tl.where(keep, {size}, 0))")
    lines += [
        "ti = 0",
        f"while ti < {size}:",
        "    tix = ti + tl.arange(0, RBLOCK)",
        f"    tim = tix < {size}",
    ]
    lines += [f"    {ln}" for ln in loop] + ["    ti += RBLOCK"]
    return lines + after


def _add_stores(
    ctx: _PhaseContext, fast_lines: list[str], masked_lines: list[str], pointers: list[str]
) -> None:
    """Append the phase's stores to both element paths, each value cast for its slot."""
    plan, phase = ctx.plan, ctx.phase
    sr_lines = []
    sr = plan.stochastic_rounding and any(_slot(plan, n).dtype != "fp32" for n, _ in phase.stores)
    if sr:
        # Counter-based random bits: one stream per (seed, step, tensor, slot), indexed
        # by the element, so a run is reproducible and no state is kept.
        pointers.append("sr_key = _stream_key(seed, step, t)")
    fast_stores, masked_stores = [], []
    for k, (n, e) in enumerate(phase.stores):
        dtype = _slot(plan, n).dtype
        value = ctx.p32.doprint_expr(e)
        if dtype in QFORMATS or (n == "p" and _master_bits(plan)):
            fast_stores += _compressed_store(plan, n, value, True)
            masked_stores += _compressed_store(plan, n, value, False)
            continue
        rnd = None
        if sr and dtype != "fp32":
            sr_lines.append(f"rnd_{n} = _hash32(offs.to(tl.uint32) ^ _hash32(sr_key + {k}))")
            rnd = f"rnd_{n}"
        value = store_cast(value, dtype, rnd)
        fast_stores.append(f"tl.store({n}_ptr + offs, {value})")
        masked_stores.append(f"tl.store({n}_ptr + offs, {value}, mask=smask)")
    fast_lines += sr_lines + fast_stores
    masked_lines += sr_lines + masked_stores


def _compressed_store(plan: OptimPlan, name: str, value: str, fast: bool) -> list[str]:
    """Store a new value of an 8-bit state (its codes, then each block's fresh scale) or of
    a parameter with a split master (the bf16 parameter, then the low part)."""
    mask = "" if fast else ", mask=smask"
    if name == "p":
        return [
            f"y_p = {value}",
            "b_p = _to_bf16(y_p, INTERPRETED)",
            f"tl.store(p_ptr + offs, b_p{mask})",
            f"tl.store({MASTER_SLOT}_ptr + offs, _master_low(y_p, b_p, {_master_bits(plan)}){mask})",
        ]
    lines = [f"v_{name} = {value}" if fast else f"v_{name} = tl.where(mask, {value}, 0.0)"]
    fmt = QFORMAT_CODE[_slot(plan, name).dtype]
    if plan.tiled:
        return lines + _tile_q8_store(name, fmt, mask)
    lines.append(f"q_{name}, s_{name} = _q8_encode(v_{name}, {fmt}, SUB, QB, INTERPRETED)")
    lines.append(f"tl.store({name}_ptr + offs, q_{name}{mask})")
    where = f"{scale_slot(name)}_ptr + base // QB + tl.arange(0, SUB // QB)"
    if fast:
        lines.append(f"tl.store({where}, s_{name})")
    else:
        qmask = "base + tl.arange(0, SUB // QB) * QB < tl.where(keep, n, 0)"
        lines.append(f"tl.store({where}, s_{name}, mask={qmask})")
    return lines


def _tile_q8_store(name: str, fmt: int, mask: str) -> list[str]:
    """A tile's new 8-bit codes of state ``name`` and the scale of each QB of them, which
    lie within one row of the tile (QB divides BC and every 8-bit tensor's row length)."""
    qmask = "" if not mask else ", mask=rm[:, None] & (qc < tl.where(keep, cols_t, 0))[None, :]"
    rows = "MR" if mask else "BR"
    return [
        f"q_{name}, s_{name} = _q8_encode(tl.reshape(v_{name}, ({rows} * BC,)), {fmt}, {rows} * BC, QB, "
        "INTERPRETED)",
        f"tl.store({name}_ptr + offs, tl.reshape(q_{name}, ({rows}, BC)){mask})",
        "qc = ctile * BC + tl.arange(0, BC // QB) * QB",
        f"tl.store({scale_slot(name)}_ptr + (ri[:, None] * cols_t + qc[None, :]) // QB, "
        f"tl.reshape(s_{name}, ({rows}, BC // QB)){qmask})",
    ]


def _scalar_update_lines(ctx: _PhaseContext) -> dict[str, list[str]]:
    """The template's ``update_*`` lines: the last phase advancing step and scalar states."""
    plan, phase, ns = ctx.plan, ctx.phase, ctx.ns
    # The last program advances step and scalar states for RBLOCK tensors at a time.
    # Its variables are vectors, so they get names of their own (`u_...`): Triton
    # requires a loop-carried name to keep one type.
    unames = {sym: f"u_{name}" for sym, name in ctx.scalar_names.items()}
    pu = TritonPrinter(unames, fp64=True)
    defs = dict(phase.prologue)
    needed = _closure(defs, [e for _, e in phase.scalar_updates])
    update_prologue = [f"{unames[s]} = {pu.doprint_expr(e)}" for s, e in phase.prologue if s in needed]
    update_stores = [f"tl.store(scalars + u_t * {ns}, (u_step - 1.0 + advance).to(tl.float32), mask=u_mask)"]
    for j, (name, e) in enumerate(phase.scalar_updates):
        old = f"u_c_{name}"
        update_stores.append(
            f"tl.store(scalars + u_t * {ns} + {j + 1}, tl.where(advance > 0, "
            f"{pu.doprint_expr(e)}, {old}).to(tl.float32), mask=u_mask)"
        )
    used = {STEP} | {symbol(s) for s in plan.scalar_states}
    for _, e in phase.scalar_updates:
        used |= e.free_symbols
    for s in needed:
        used |= defs[s].free_symbols
    used |= {NUMEL, ROWS, COLS}  # a mean's result divides by one of them
    used |= {NDIM} if ctx.plan.reads_ndim else set()
    update_loads = [
        ln
        for ln in _scalar_loads(ctx, unames, "u_t", "u_grp", "u_mask")
        if any(ln.startswith(unames[s] + " ") for s in used if s in unames)
    ]
    # Global reductions are one number for every tensor, loaded once per program.
    update_loads += [
        f"{unames[r.symbol]} = {r.symbol.name}"
        for r in ctx.known
        if r.global_column >= 0 and r.symbol in used
    ]
    return dict(update_loads=update_loads, update_prologue=update_prologue, update_stores=update_stores)


def _reduction_lines(
    ctx: _PhaseContext, fast_lines: list[str], masked_lines: list[str]
) -> dict[str, list[str]]:
    """Append each block's partial of the phase's reductions to both element paths; return
    the template's ``combine_*`` and ``global_*`` lines that total them per tensor and
    over every tensor."""
    plan, nred, nglob = ctx.plan, ctx.nred, ctx.nglob
    lines = {name: [] for name in _COMBINE_SECTIONS}
    for col, e in ctx.phase.reduce:
        r = _per_tensor(plan, col)
        op = r.op
        combine = ACCUMULATE[op][1]
        value = ctx.p32.doprint_expr(e)
        comb, neutral = (SUM_COMBINE, "0.0") if combine == "sum" else (MAX_COMBINE, "float('-inf')")
        masked = f"tl.where(mask, {value}, {neutral})"
        # The block's partial accumulates over the program's passes (or tiles); stored
        # after the last. A scalar-only value, sum(1) say, still counts once per element.
        # A flat block keeps one partial per element of a pass, reduced across threads
        # once, after the last pass (a reduction per pass synchronises the program's
        # warps each time: 4% of LAMB's step). A tiled phase reduces each tile (keeping
        # its per-tensor and column partials as tiles slowed Adafactor's and CAME's first
        # phases by 15-35% and their norms' phases by 5%, on an H100).
        acc = f"part{col}"
        if plan.tiled:  # a tile: across its columns, then its rows
            fast = masked = f"{SUM}({SUM}({masked}, 1, {comb}), 0, {comb})"
            shape, total = "[]", acc
        else:
            fast, shape, total = value, "[SUB]", f"{SUM}({acc}, 0, {comb})"
        for out, part in ((fast_lines, fast), (masked_lines, masked)):
            out.append(
                f"{acc} = {acc} + {part}" if combine == "sum" else f"{acc} = tl.maximum({acc}, {part})"
            )
        lines["partial_init"].append(f"part{col} = tl.full({shape}, {neutral}, tl.float32)")
        lines["partial_store"].append(f"tl.store(partials + pid * {nred} + {col}, {total})")
        if combine == "sum":
            lines["combine_init"].append(f"acc{col} = tl.full([RBLOCK], 0.0, tl.float32)")
            lines["combine_step"].append(
                f"acc{col} += tl.load(partials + idx * {nred} + {col}, mask=m, other=0.0)"
            )
        else:
            lines["combine_init"].append(f"acc{col} = tl.full([RBLOCK], float('-inf'), tl.float32)")
            lines["combine_step"].append(
                f"acc{col} = tl.maximum(acc{col}, tl.load(partials + idx * {nred} + "
                f"{col}, mask=m, other=float('-inf')))"
            )
        lines["combine_store"].append(f"tl.store(red + t * {nred} + {col}, {SUM}(acc{col}, 0, {comb}))")
        if r.global_column >= 0:
            g = r.global_column
            lines["global_init"].append(f"gacc{g} = tl.full([RBLOCK], 0.0, tl.float32)")
            lines["global_step"].append(
                f"gacc{g} += tl.load(red + tidx * {nred} + {col}, mask=tm, other=0.0)"
            )
            lines["global_store"].append(
                f"tl.store(glob + part * {nglob} + {g}, {SUM}(gacc{g}, 0, {SUM_COMBINE}))"
            )
    return lines


def _kernel_text(ctx: _PhaseContext, entry: str, **lines) -> str:
    """The phase's kernel from the template: the plan's description and ``lines``."""
    plan, phase = ctx.plan, ctx.phase
    return (
        environment()
        .get_template("optim_step.py.jinja")
        .render(
            name=plan.name,
            phase=phase.index + 1,
            n_phases=len(plan.phases),
            last=ctx.last,
            stores=ctx.last or bool(phase.stores),
            tiled=plan.tiled,
            quantized=_is_compressed(plan),
            dtype_key=plan.dtype_key + (" (stochastic rounding)" if plan.stochastic_rounding else ""),
            rule_lines=plan.rule_text.splitlines(),
            helpers=helpers_source(),
            entry=entry,
            slots=plan.slots,
            slot_names=", ".join(s.name for s in plan.slots),
            hyper=plan.hyper,
            hyper_names=", ".join(plan.hyper) or "(none)",
            scalar_states=plan.scalar_states,
            nscalar=ctx.ns,
            nred=ctx.nred,
            nglob=ctx.nglob,
            global_columns=[
                r.global_column for r in plan.reductions if r.global_column >= 0 and r.phase == phase.index
            ],
            **lines,
        )
    )


def _per_tensor(plan: OptimPlan, column: int):
    """The per-tensor reduction in ``column`` of the result table (axis reductions and
    matrix functions have none, so a plan's index is not its column)."""
    return next(r for r in plan.reductions if r.column == column)


def _slot(plan: OptimPlan, name: str):
    return next(s for s in plan.slots if s.name == name)


def _closure(defs: dict, exprs) -> set[sympy.Symbol]:
    """Prologue symbols that ``exprs`` depend on, directly or through other prologue lines."""
    need, todo = set(), [s for e in exprs for s in e.free_symbols]
    while todo:
        s = todo.pop()
        if s in defs and s not in need:
            need.add(s)
            todo.extend(defs[s].free_symbols)
    return need
