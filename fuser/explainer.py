"""``fuser.explain(rule)``: print what each stage of the pipeline made of a rule.

Stages, in the order data flows: the parsed statements (as written, then each output as
a function of the values before the step), the per-step scalars hoisted out of the
per-element work, the per-element plan after CSE, phases and reductions, the dtype plan,
and the kernel's identity (launch options and the digest that keys the cache).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import TextIO

from fuser.rules.rule import Rule


def _s(expr) -> str:
    from fuser.display import expr_text

    return expr_text(expr)


def _resolve(obj) -> tuple[Rule, dict]:
    """A rule and its compile options from a rule or a compiled optimizer (class or instance)."""
    if isinstance(obj, Rule):
        return obj, {}
    rule = getattr(obj, "rule", None)
    if isinstance(rule, Rule):
        options = getattr(obj, "options", None)
        if options is not None and rule.kind == "optim":
            opts = dataclasses.asdict(options)
            opts["state_keys"] = dict(options.state_keys)
            return rule, opts
        return rule, {}
    raise TypeError(f"fuser.explain takes a fuser.Rule or a compiled optimizer, not {type(obj).__name__}")


def explain(obj, dtype: str | None = None, *, file: TextIO | None = None, **options) -> None:
    """Print each stage of compiling ``obj``: a rule, a class or instance from
    ``fuser.compile(optimizer_rule)``, or a compiled loss. ``dtype`` ("fp32", "bf16" or
    "fp16") is the storage dtype of the parameters and gradients (default fp32) or of the
    loss's hidden states and weight (default bf16; the row kernel shown takes fp32 logits,
    as every call's does and ``.source`` shows); ``options`` are
    ``fuser.compile``'s, e.g. ``state_dtype=torch.bfloat16``."""
    rule, compiled_with = _resolve(obj)
    if rule.kind == "loss":
        text = _explain_loss(rule, dtype or "bf16", obj if hasattr(obj, "kernel_source") else None)
    else:
        text = _explain_optim(rule, dtype or "fp32", **{**compiled_with, **options})
    print(text, file=file if file is not None else sys.stdout)


def explanation(rule: Rule, dtype: str | None = None, **options) -> str:
    """The text ``explain`` prints for a rule."""
    if rule.kind == "loss":
        return _explain_loss(rule, dtype or "bf16", None)
    return _explain_optim(rule, dtype or "fp32", **options)


def _statements(rule: Rule) -> list[str]:
    from fuser.display import is_text, written_statements

    lines = []
    if is_text(rule):
        lines.append(f"{len(rule.statements)} statement(s), in order, as written:")
        lines += [f"  line {s.line}: {s.target} = {_s(s.expr)}" for s in written_statements(rule)]
    else:
        lines.append("traced from a Python function:")
        lines += ["  " + ln for ln in rule.text.splitlines()]
    if rule.kind == "loss" and len(rule.outputs) > 1:
        lines.append("the per-token outputs, in the order a call returns them, from the raw logits:")
    elif rule.kind == "loss":
        lines.append(f"the per-token {rule.outputs[0][0]}, from the raw logits:")
    else:
        lines.append("outputs, each from the values before the step:")
    lines += [f"  {name} <- {_s(expr)}" for name, expr in rule.outputs]
    return lines


_ACCUMULATE = {
    "sum": "sum",
    "mean": "sum, then / numel",
    "norm": "sum of squares, then sqrt",
    "global_norm": "sum of squares over every tensor, then sqrt",
    "global_sum": "sum over every tensor",
    "amax": "max",
}
_OVER = {"row": "over each row's columns", "col": "over each column's rows"}


def _explain_matrix(rule: Rule, dtype: str, **options) -> str:
    """A matrix rule: its torch phase (what it computes per stack of one shape), then the
    update kernel's explanation."""
    from fuser.optim.matrix_rules import MatrixProgram

    program = MatrixProgram(rule)
    lines = [
        f"fuser.explain: matrix rule {rule.name!r}, {dtype} parameters and gradients",
        f"hyperparameters (defaults): {', '.join(f'{k}={v}' for k, v in rule.hyper) or 'none'}",
        f"state (initial values): {', '.join(f'{k}={v!r}' for k, v in rule.state)}",
        "",
        "1. parsed statements",
        *["   " + ln for ln in _statements(rule)],
        "",
        "2. the matrix phase (torch, fp32, batched over the matrices of one "
        + ("shape, each dimension's factors apart," if program.per_dims else "2-D shape")
        + " and param group)",
        "   values the update reads, written to fp32 buffers:",
        *[f"     {name} = {_s(e)}" for e, name in program.boundaries.items()],
        "   new matrix states (written last):",
        *[f"     {name} <- {_s(e)}" for name, e in program.matrix_outputs],
        "   decompositions (retried in fp64; where both fail, the state keeps its value):",
        *([f"     {d.spelling}: kept by {s}" for d, s in program.owners.items()] or ["     none"]),
        "",
        "3. the update kernel (one fused launch over every tensor; the step as matrix_step):",
    ]
    inner = _explain_optim(program.update_rule, dtype, buffers=set(program.boundaries.values()), **options)
    lines += ["   " + ln for ln in inner.splitlines()]
    return "\n".join(lines)


def _explain_optim(rule: Rule, dtype: str, buffers: set = frozenset(), **options) -> str:
    """``buffers``: the update kernel's slots that a matrix phase fills (not states)."""
    from fuser.ir.optim import DTYPES, lower_optim
    from fuser.rules.matrices import is_matrix_rule
    from fuser.runtime.plans import dtype_plan, parse_options, plan_and_sources

    if is_matrix_rule(rule):
        return _explain_matrix(rule, dtype, **options)

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    opts = parse_options(**options)
    dplan = dtype_plan(rule, opts, dtype, dtype)
    plan = lower_optim(rule, dict(dplan), stochastic_rounding=opts.stochastic_rounding)
    sources = plan_and_sources(rule, dplan, opts.stochastic_rounding)[1]
    sections = [
        ("parsed statements", ["   " + ln for ln in _statements(rule)]),
        ("per-step scalars, hoisted out of the per-element work (fp64, once per program)", _hoisted(plan)),
        (
            "per-element plan after CSE (fp32; hyperparameters and s<i> used here are fp32 copies)",
            _elementwise(plan),
        ),
        ("phases and reductions", _phases(plan)),
        (
            "dtype plan (loads upcast to fp32, stores cast to each slot's dtype)",
            _dtypes(plan, opts.seed, buffers),
        ),
        ("kernels and cache keys", [ln for src in sources for ln in _kernel(src)]),
    ]
    hyper = ", ".join(f"{k}={v}" for k, v in rule.hyper) or "none"
    state = ", ".join(f"{k}={v!r}" for k, v in rule.state if k not in buffers) or "none"
    out = [
        f"fuser.explain: optimizer rule {rule.name!r}, {dtype} parameters and gradients",
        f"hyperparameters (defaults): {hyper}",
        f"state (initial values): {state}",
        *([f"buffers from the matrix phase (fp32, read): {', '.join(sorted(buffers))}"] if buffers else []),
        "",
    ]
    for number, (title, lines) in enumerate(sections, 1):
        out += [f"{number}. {title}", *lines, ""]
    return "\n".join(out[:-1])


def _per_phase(plan, lines_of, empty: str | None = None) -> list[str]:
    """Each phase's lines, under a ``phase i:`` head where the plan has several phases."""
    many = len(plan.phases) > 1
    pad = "     " if many else "   "
    out = []
    for ph in plan.phases:
        out += [f"   phase {ph.index}:"] if many else []
        out += [pad + ln for ln in lines_of(ph) or ([empty] if empty else [])]
    return out


def _hoisted(plan) -> list[str]:
    out = _per_phase(plan, lambda ph: [f"{sym} = {_s(e)}" for sym, e in ph.prologue], empty="none")
    if plan.scalar_states:
        out.append("   per-tensor scalar states (one number per tensor, advanced by the last program):")
        out += [f"   {name} <- {_s(e)}" for name, e in plan.phases[-1].scalar_updates]
    return out


def _elementwise(plan) -> list[str]:
    by_column = {r.column: r for r in plan.reductions if r.column >= 0}

    def lines(ph) -> list[str]:
        out = [
            *(f"{sym} = {_s(e)}" for sym, e in ph.body),
            *(f"accumulate {by_column[col].symbol} += {_s(e)}" for col, e in ph.reduce),
            *(
                f"accumulate {plan.reductions[i].symbol}[{plan.reductions[i].axis}] += {_s(e)}"
                for i, e in ph.axis_reduce
            ),
            *(
                f"store the matrix of {plan.reductions[i].symbol} = {_s(e)} (bf16)"
                for i, e in ph.matrix_stores
            ),
            *(f"store {name} = {_s(e)}" for name, e in ph.stores),
        ]
        for tail in ph.tails:
            out.append(f"then, per tensor, for each {tail.axis}:")
            out += [f"  {sym} = {_s(e)}" for sym, e in tail.body]
            out += [f"  accumulate {by_column[col].symbol} += {_s(e)}" for col, e in tail.reduce]
            out += [f"  store {name}[{tail.axis}] = {_s(e)}" for name, e in tail.stores]
        return out

    return _per_phase(plan, lines)


def _phases(plan) -> list[str]:
    out = []
    for r in plan.reductions:
        scope = "over every tensor" if r.global_column >= 0 else "per tensor"
        where = f"accumulated in phase {r.phase}"
        if r.axis:
            scope = f"per {r.axis}, {_OVER[r.axis]}"
        elif r.over != "element":
            scope, where = f"per tensor, of {r.over} values", f"reduced by the tail of phase {r.phase}"
        if r.matrix:
            steps, a, b, c, eps = r.args
            out.append(
                f"   {r.symbol} = {r.op}(...) per element: each tensor's matrix written in phase "
                f"{r.phase}, then {steps} Newton-Schulz steps (a={a}, b={b}, c={c}, eps={eps}) batched "
                f"by shape, read from phase {r.phase + 1}"
            )
            continue
        how = _ACCUMULATE.get(r.op, r.op)
        if r.op == "mean" and (r.axis or r.over != "element"):
            how = "sum, then / the count"
        out.append(
            f"   {r.symbol} = {r.axis}{r.op}(...) {scope}: {where} ({how}), read from phase {r.phase + 1}"
        )
    many = len(plan.phases) > 1
    early = [f"{name} in phase {ph.index}" for ph in plan.phases[:-1] for name, _ in ph.stores]
    return (out or ["   reductions: none"]) + [
        f"   phases: {len(plan.phases)} launch{'es' * many} per step over every tensor; the last "
        "phase stores"
        + (
            f" (states known earlier are stored by the phase that computes them: {', '.join(early)})"
            if early
            else ""
        )
        + ", and its last program advances step"
        + (" and the scalar states" if plan.scalar_states else "")
    ]


def _dtypes(plan, seed: int, buffers: set = frozenset()) -> list[str]:
    width = max(14, *(len(sl.name) + 1 for sl in plan.slots))
    out = [f"   {'slot':<{width}}{'role':<7}{'dtype':<13}access"]
    for sl in plan.slots:
        role = "buffer" if sl.name in buffers else sl.role
        out.append(f"   {sl.name:<{width}}{role:<7}{sl.dtype:<13}{'read/write' if sl.written else 'read'}")
    rounding = f"stochastic (seed {seed})" if plan.stochastic_rounding else "to nearest even"
    notes = []
    if any(sl.role == "scale" for sl in plan.slots):
        notes.append(
            "   8-bit states: decoded in registers with their block's scale (<state>__absmax), "
            "re-encoded with each block's fresh absmax"
        )
    if any(sl.role == "master" for sl in plan.slots):
        notes.append("   p__lo: the low part of each bf16 parameter's fp32 master (split master weights)")
    return (
        out
        + notes
        + [
            f"   bf16/fp16 stores round {rounding}",
            f"   hyper table: fp64 [param groups, {len(plan.hyper)}]: {', '.join(plan.hyper) or '(none)'}",
            f"   scalar table: fp32 [tensors, {1 + len(plan.scalar_states)}]: "
            + ", ".join(("step", *plan.scalar_states)),
        ]
    )


def _kernel(src) -> list[str]:
    constexprs = ", ".join(f"{k}={v}" for k, v in src.constexprs)
    return [
        f"   {src.entry}({', '.join(n for n, _ in src.signature)})",
        f"     {constexprs}, num_warps={src.num_warps}, num_stages={src.num_stages}, "
        f"{f'max_registers={src.max_registers}, ' if src.max_registers else ''}"
        f"{len(src.text.splitlines())} lines of Triton",
        *_cache_key(src),
    ]


def _cache_key(src) -> list[str]:
    """The kernel's cache entry key and the hash of each field it is made of."""
    from fuser.cache import entry_key

    key = entry_key(src)
    lines = [f"     cache key {key.digest}  (once stored: fuser cache explain {key.digest[:12]})"]
    lines += [f"       {ln}" for ln in key.explain()]
    return lines


def _explain_loss(rule: Rule, dtype: str, compiled) -> str:
    from fuser.codegen.loss import render_loss
    from fuser.ir.loss import DTYPES, lower_loss

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    # (calls of every dtype launch the row kernel on fp32 logits: CompiledLoss.row_source)
    plan = lower_loss(rule, "fp32")
    source = compiled.row_source() if compiled is not None else render_loss(plan)
    sections = [
        ("parsed statements", ["   " + ln for ln in _statements(rule)]),
        ("reductions over the vocabulary, by pass (one sweep over a row of logits each)", _loss_passes(plan)),
        (
            "derived gradient (symbolic, before CSE; adj(x) is d loss / d x)",
            [f"   {label}: {_s(e)}" for label, e in plan.derivation if " = " not in label],
        ),
        ("plan after the reductions, after CSE", _loss_plan(plan)),
        ("dtype plan", _loss_dtypes(plan, dtype)),
        ("kernel and cache key", _kernel(source)),
    ]
    hyper = ", ".join(f"{k}={v}" for k, v in rule.hyper) or "none"
    out = [
        f"fuser.explain: loss rule {rule.name!r}, {dtype} hidden states and weight, fp32 logits",
        f"hyperparameters (defaults): {hyper}",
        *([f"per-token inputs: {', '.join(rule.inputs)}"] if rule.inputs else []),
        "z is one logit of a token's row, z[y] the logit at its target, is_y 1 at the target's "
        "column; r<i> are reductions over the row, vocab its length",
        "",
    ]
    for number, (title, lines) in enumerate(sections, 1):
        out += [f"{number}. {title}", *lines, ""]
    return "\n".join(out[:-1])


def _loss_passes(plan) -> list[str]:
    out = []
    for i, ps in enumerate(plan.passes):
        out.append(f"   pass {i}:")
        out += [f"     {_s(sym)} = {_s(e)}   (per token, hoisted)" for sym, e in ps.prologue]
        out += [f"     {_s(sym)} = {_s(e)}" for sym, e in ps.body]
        out += [f"     r{a.index} = {a.op}({_s(a.arg)})" for a in ps.accumulators]
    return out or ["   none"]


def _loss_plan(plan) -> list[str]:
    return [
        "   per token (fp32):",
        *(f"     {_s(sym)} = {_s(e)}" for sym, e in plan.epilogue),
        *(
            (f"     {n} = {_s(e)}" for n, e in zip(plan.outputs, plan.values))
            if plan.token
            else [f"     loss = {_s(plan.loss)}"]
        ),
        "   gradient sweep, per logit (fp32), written over the logits:",
        *(f"     {_s(sym)} = {_s(e)}" for sym, e in plan.grad.body),
        f"     dloss/dz = {_s(plan.grad_value)}",
    ]


def _loss_dtypes(plan, dtype: str) -> list[str]:
    if plan.token:
        return [
            f"   hidden, weight and bias: {dtype}; each chunk's logits: fp32 (products accumulated in "
            "fp32, never rounded); row math: fp32",
            f"   logit gradient: fp32, rounded once to {dtype} for the products; weight gradient "
            "accumulated in fp32",
            f"   per-token inputs and upstream gradients (dout<i>): fp32 rows "
            f"({', '.join([*plan.inputs, *(f'd {n}' for n in plan.outputs)])})",
            f"   hyperparameters: fp32 row ({', '.join(plan.hyper) or 'none'})",
        ]
    rounded = f", rounded once to {dtype} for the products (the target column's residue added back in fp32)"
    rounded = "" if dtype == "fp32" else rounded
    return [
        f"   hidden, weight and bias: {dtype}; each chunk's logits: fp32 (products accumulated in "
        "fp32, never rounded); row math: fp32",
        f"   logit gradient: fp32{rounded}; weight gradient accumulated in fp32",
        f"   hyperparameters: fp32 row ({', '.join(plan.hyper) or 'none'})",
    ]
