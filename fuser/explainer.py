"""``fuser.explain(rule)``: print what each stage of the pipeline made of a rule.

Stages, in the order data flows: the parsed statements (as written, then each output as
a function of the values before the step), the per-step scalars hoisted out of the
per-element work, the per-element plan after CSE, phases and reductions, the dtype plan,
and the kernel's identity (launch options and the digest that keys the cache).
"""

from __future__ import annotations

import sys
from typing import TextIO

import sympy

from fuser.rules.rule import Rule


def _s(expr) -> str:
    return sympy.sstr(expr, order="none")


def _resolve(obj) -> tuple[Rule, dict]:
    """A rule and its compile options from a rule or a compiled optimizer (class or instance)."""
    if isinstance(obj, Rule):
        return obj, {}
    rule = getattr(obj, "rule", None)
    if isinstance(rule, Rule):
        options = getattr(obj, "options", None)
        if options is not None and rule.kind == "optim":
            return rule, {"state_dtype": options.state_dtype, "grad_attr": options.grad_attr}
        return rule, {}
    raise TypeError(f"fuser.explain takes a fuser.Rule or a compiled optimizer, not {type(obj).__name__}")


def explain(obj, dtype: str = "fp32", *, file: TextIO | None = None, **options) -> None:
    """Print each stage of compiling ``obj`` (a rule, or a class or instance from
    ``fuser.compile``) for parameters and gradients stored in ``dtype`` ("fp32", "bf16" or
    "fp16"); ``options`` are ``fuser.compile``'s, e.g. ``state_dtype=torch.bfloat16``."""
    rule, compiled_with = _resolve(obj)
    text = explanation(rule, dtype, **{**compiled_with, **options})
    print(text, file=file if file is not None else sys.stdout)


def explanation(rule: Rule, dtype: str = "fp32", **options) -> str:
    """The text ``explain`` prints."""
    if rule.kind == "optim":
        return _explain_optim(rule, dtype, **options)
    raise TypeError(f"fuser.explain does not know {rule.kind} rules yet")


def _statements(rule: Rule) -> list[str]:
    from fuser.display import _is_text, written_statements

    lines = []
    if _is_text(rule):
        lines.append(f"{len(rule.statements)} statement(s), in order, as written:")
        lines += [f"  line {s.line}: {s.target} = {_s(s.expr)}" for s in written_statements(rule)]
    else:
        lines.append("traced from a Python function:")
        lines += ["  " + ln for ln in rule.text.splitlines()]
    lines.append("outputs, each from the values before the step:")
    lines += [f"  {name} <- {_s(expr)}" for name, expr in rule.outputs]
    return lines


def _explain_optim(rule: Rule, dtype: str, **options) -> str:
    from fuser.codegen.render import render_optim
    from fuser.ir.optim import DTYPES, lower_optim
    from fuser.optim.factory import _dtype_plan, _options

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    opts = _options(**options)
    plan = lower_optim(rule, dict(_dtype_plan(rule, opts, dtype, dtype)))
    source = render_optim(plan)
    hyper = ", ".join(f"{k}={v}" for k, v in rule.hyper) or "none"
    state = ", ".join(f"{k}={v!r}" for k, v in rule.state) or "none"
    out = [f"fuser.explain: optimizer rule {rule.name!r}, {dtype} parameters and gradients",
           f"hyperparameters (defaults): {hyper}", f"state (initial values): {state}", ""]

    out.append("1. parsed statements")
    out += ["   " + ln for ln in _statements(rule)]
    out.append("")

    out.append("2. per-step scalars, hoisted out of the per-element work (fp64, once per program)")
    if plan.prologue:
        out += [f"   {sym} = {_s(e)}" for sym, e in plan.prologue]
    else:
        out.append("   none")
    if plan.scalar_states:
        out.append("   per-tensor scalar states (one number per tensor, advanced by the last program):")
        out += [f"   {name} <- {_s(e)}" for name, e in plan.scalar_updates]
    out.append("")

    out.append("3. per-element plan after CSE (fp32; hyperparameters and s<i> used here are fp32 copies)")
    out += [f"   {sym} = {_s(e)}" for sym, e in plan.body]
    out += [f"   store {name} = {_s(e)}" for name, e in plan.stores]
    out.append("")

    out.append("4. phases and reductions")
    out.append("   reductions: none")
    out.append("   phases: 1 (load, compute, store in one launch over every tensor; the last program")
    out.append("   advances step" + (" and the scalar states)" if plan.scalar_states else ")"))
    out.append("")

    out.append("5. dtype plan (loads upcast to fp32, stores cast to each slot's dtype)")
    out.append(f"   {'slot':<14}{'role':<7}{'dtype':<7}access")
    for sl in plan.slots:
        out.append(f"   {sl.name:<14}{sl.role:<7}{sl.dtype:<7}{'read/write' if sl.written else 'read'}")
    out.append(f"   hyper table: fp64 [param groups, {len(plan.hyper)}]: {', '.join(plan.hyper) or '(none)'}")
    out.append(f"   scalar table: fp32 [tensors, {1 + len(plan.scalar_states)}]: "
               + ", ".join(("step", *plan.scalar_states)))
    out.append("")

    constexprs = ", ".join(f"{k}={v}" for k, v in source.constexprs)
    out.append("6. kernel and cache key")
    out.append(f"   entry {source.entry}({', '.join(n for n, _ in source.signature)})")
    out.append(f"   {constexprs}, num_warps={source.num_warps}, num_stages={source.num_stages}, "
               f"{len(source.text.splitlines())} lines of Triton")
    out.append(f"   source digest (cache key): {source.digest}")
    return "\n".join(out)
