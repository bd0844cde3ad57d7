"""Plans -> ``KernelSource`` through jinja2 templates and ``TritonPrinter``.

Jinja carries structure only; every expression comes from the printer. Rendering is a
pure function of the plan and options: the same inputs give byte-identical text.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jinja2
import sympy

from fuser.codegen.printer import TritonPrinter
from fuser.codegen.source import KernelSource
from fuser.ir.optim import STEP, OptimPlan
from fuser.rules.parse import symbol

TL_DTYPES = {"fp32": "tl.float32", "bf16": "tl.bfloat16", "fp16": "tl.float16"}


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
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(template_dir())),
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                              autoescape=False)


def helpers_source() -> str:
    return environment().get_template("helpers.py.jinja").render().strip("\n")


def optim_launch_config(plan: OptimPlan) -> tuple[int, int]:
    """(BLOCK, num_warps) for a step kernel."""
    return 2048, 8


def render_optim(plan: OptimPlan) -> KernelSource:
    """Render the one-launch step kernel of an optimizer plan."""
    hyper_syms = {symbol(h): f"h_{h}" for h in plan.hyper}
    scalar_state_syms = {symbol(s): f"c_{s}" for s in plan.scalar_states}
    temps64 = {s: s.name for s, _ in plan.prologue}
    scalar_names = {**hyper_syms, STEP: "step", **scalar_state_syms, **temps64}

    # fp64 scalars used by per-element code get an fp32 copy, `f_<name>`.
    body_free = set()
    for _, e in (*plan.body, *plan.stores):
        body_free |= e.free_symbols
    scalars_in_body = sorted((s for s in body_free if s in scalar_names), key=lambda s: scalar_names[s])
    element_names = {symbol(sl.name): f"x_{sl.name}" for sl in plan.slots}
    body_names = {**element_names, **{s: f"f_{scalar_names[s]}" for s in scalars_in_body},
                  **{s: s.name for s, _ in plan.body}}

    p64 = TritonPrinter(scalar_names, fp64=True)
    p32 = TritonPrinter(body_names)
    nh, ns = len(plan.hyper), 1 + len(plan.scalar_states)

    def scalar_loads(names: dict, row: str, group: str, mask: str = "") -> list[str]:
        m = f", mask={mask}, other=0.0" if mask else ""
        lines = [f"{names[symbol(h)]} = tl.load(hyper + {group} * {nh} + {j}{m})"
                 for j, h in enumerate(plan.hyper)]
        lines.append(f"{names[STEP]} = tl.load(scalars + {row} * {ns}{m}).to(tl.float64) + 1.0")
        lines += [f"{names[symbol(s)]} = tl.load(scalars + {row} * {ns} + {j + 1}{m}).to(tl.float64)"
                  for j, s in enumerate(plan.scalar_states)]
        return lines

    prologue = [f"{scalar_names[s]} = {p64.doprint_expr(e)}" for s, e in plan.prologue]
    casts = [f"f_{scalar_names[s]} = {scalar_names[s]}.to(tl.float32)" for s in scalars_in_body]
    loads = []
    for j, sl in enumerate(plan.slots):
        loads.append(f"{sl.name}_ptr = tl.load(ptrs + t * {len(plan.slots)} + {j})"
                     f".to(tl.pointer_type({TL_DTYPES[sl.dtype]}))")
    read = {s.name for s in body_free}
    for sl in plan.slots:
        if f"{sl.name}" in read:
            loads.append(f"x_{sl.name} = tl.load({sl.name}_ptr + offs, mask=mask).to(tl.float32)")
    body = [f"{s.name} = {p32.doprint_expr(e)}" for s, e in plan.body]
    stores = [f"tl.store({n}_ptr + offs, {store_cast(p32.doprint_expr(e), _slot(plan, n).dtype)}, mask=mask)"
              for n, e in plan.stores]

    # The last program advances step and scalar states for TBLOCK tensors at a time. Its
    # variables are vectors, so they get names of their own (`u_...`): Triton requires a
    # loop-carried name to keep one type.
    unames = {sym: f"u_{name}" for sym, name in scalar_names.items()}
    pu = TritonPrinter(unames, fp64=True)
    needed = _closure(plan, [e for _, e in plan.scalar_updates])
    update_prologue = [f"{unames[s]} = {pu.doprint_expr(e)}" for s, e in plan.prologue if s in needed]
    update_stores = [f"tl.store(scalars + u_t * {ns}, {unames[STEP]}.to(tl.float32), mask=u_mask)"]
    update_stores += [f"tl.store(scalars + u_t * {ns} + {j + 1}, ({pu.doprint_expr(e)}).to(tl.float32), "
                      f"mask=u_mask)" for j, (_, e) in enumerate(plan.scalar_updates)]
    used = set()
    for _, e in plan.scalar_updates:
        used |= e.free_symbols
    for s in needed:
        used |= dict(plan.prologue)[s].free_symbols
    update_loads = [ln for ln in scalar_loads(unames, "u_t", "u_grp", "u_mask")
                    if ln.startswith(unames[STEP] + " ") or any(ln.startswith(unames[s] + " ") for s in used
                                                                 if s in unames)]

    entry = f"{plan.name}_step"
    block, warps = optim_launch_config(plan)
    text = environment().get_template("optim_step.py.jinja").render(
        name=plan.name,
        dtype_key=plan.dtype_key,
        rule_lines=plan.rule_text.splitlines(),
        helpers=helpers_source(),
        entry=entry,
        slots=plan.slots,
        slot_names=", ".join(s.name for s in plan.slots),
        hyper=plan.hyper,
        hyper_names=", ".join(plan.hyper) or "(none)",
        scalar_states=plan.scalar_states,
        nscalar=ns,
        scalar_loads=scalar_loads(scalar_names, "t", "grp"),
        prologue=prologue,
        casts=casts,
        loads=loads,
        body=body,
        stores=stores,
        update_loads=update_loads,
        update_prologue=update_prologue,
        update_stores=update_stores,
    )
    signature = (("ptrs", "*i64"), ("numels", "*i64"), ("groups", "*i32"), ("block_tensor", "*i32"),
                 ("block_start", "*i64"), ("hyper", "*fp64"), ("scalars", "*fp32"), ("ticket", "*i32"),
                 ("n_tensors", "i32"), ("n_blocks", "i32"))
    return KernelSource(text=text, entry=entry, signature=signature,
                        constexprs=(("BLOCK", block), ("TBLOCK", 128)), num_warps=warps, num_stages=1,
                        meta=(("rule", plan.name), ("kind", "optim"), ("dtypes", plan.dtype_key)))


def store_cast(value: str, dtype: str) -> str:
    """An fp32 value converted for storage in ``dtype`` (bf16 through ``_to_bf16``)."""
    if dtype == "bf16":
        return f"_to_bf16({value})"
    return f"({value}).to({TL_DTYPES[dtype]})"


def _slot(plan: OptimPlan, name: str):
    return next(s for s in plan.slots if s.name == name)


def _closure(plan: OptimPlan, exprs) -> set[sympy.Symbol]:
    """Prologue symbols that ``exprs`` depend on, directly or through other prologue lines."""
    defs = dict(plan.prologue)
    need, todo = set(), [s for e in exprs for s in e.free_symbols]
    while todo:
        s = todo.pop()
        if s in defs and s not in need:
            need.add(s)
            todo.extend(defs[s].free_symbols)
    return need
