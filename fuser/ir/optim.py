"""Optimizer rule -> ``OptimPlan``: the kernels of one step and what each computes.

A step is one or more *phases*, each one launch over every tensor. Rules without
reductions have one phase. A reduction (``norm``, ``sum``, ``mean``, ``amax``,
``global_norm``) splits the rule: the phase before it accumulates per-tensor partials in
fp32 (re-reading what it needs, writing nothing but the partials), the next phase reads
the results as per-tensor scalars. Within a phase the work is separated by how often it
must run:

- *per-step scalars* (``prologue``): every maximal subexpression that depends only on
  hyperparameters, ``step``, ``numel``, reduction results and per-tensor scalar states
  (bias corrections, ``1 - lr*wd``, trust ratios) is hoisted out of the per-element work
  and computed once per program in fp64;
- *per-element work* (``body``): the rest, after ``sympy.cse``, in fp32;
- *per-tensor scalar states* (``scalar_updates``): states whose update reads no
  per-element value (NAdam's ``mu_product``) are one number per tensor, not a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from fuser.errors import RuleError
from fuser.rules.functions import Reduction
from fuser.rules.parse import symbol
from fuser.rules.rule import Rule

# Storage dtypes a tensor may have, by the short name used in plans and cache entries.
DTYPES = ("fp32", "bf16", "fp16")

STEP = symbol("step")
NUMEL = symbol("numel")

# How a reduction accumulates over elements and how its result is read back.
# op -> (value accumulated per element, combine: "sum" or "max")
ACCUMULATE = {
    "sum": (lambda e: e, "sum"),
    "mean": (lambda e: e, "sum"),
    "norm": (lambda e: e * e, "sum"),
    "global_norm": (lambda e: e * e, "sum"),
    "amax": (lambda e: e, "max"),
}


@dataclass(frozen=True)
class Slot:
    """One per-element tensor of the step: its rule name, role, storage dtype, and
    whether the kernel writes it."""

    name: str
    role: str  # "param", "grad" or "state"
    dtype: str
    written: bool


@dataclass(frozen=True)
class ReductionPlan:
    """One reduction of the rule: ``symbol`` stands for its result in later phases."""

    symbol: sympy.Symbol
    op: str
    phase: int  # the phase that accumulates it; its result is usable from phase + 1
    column: int  # column in the per-tensor result table
    global_column: int  # column in the per-device table (global reductions), else -1


@dataclass(frozen=True)
class Phase:
    """One launch: scalars, per-element temporaries, then either reductions or stores."""

    index: int
    prologue: tuple[tuple[sympy.Symbol, sympy.Expr], ...]  # fp64 per-step scalars, in order
    body: tuple[tuple[sympy.Symbol, sympy.Expr], ...]  # fp32 per-element temporaries
    reduce: tuple[tuple[int, sympy.Expr], ...]  # (reduction column, per-element value accumulated)
    stores: tuple[tuple[str, sympy.Expr], ...]  # slot name -> value stored (last phase only)
    scalar_updates: tuple[tuple[str, sympy.Expr], ...]  # new scalar-state values (last phase only)


@dataclass(frozen=True)
class OptimPlan:
    name: str
    rule_text: str
    hyper: tuple[str, ...]  # columns of a param group's row in the hyper table
    slots: tuple[Slot, ...]  # columns of the pointer table, in order
    scalar_states: tuple[str, ...]  # columns 1.. of the per-tensor scalar table (0 is step)
    reductions: tuple[ReductionPlan, ...]
    phases: tuple[Phase, ...]
    stochastic_rounding: bool = False

    @property
    def dtype_key(self) -> str:
        return "-".join(f"{s.name}:{s.dtype}" for s in self.slots)

    @property
    def n_global(self) -> int:
        return sum(1 for r in self.reductions if r.global_column >= 0)


def scalar_state_names(rule: Rule) -> tuple[str, ...]:
    """States whose every update reads only hyperparameters, ``step``, ``numel``, reduction
    results and other such states: one number per tensor."""
    outputs = {n: _replace_reductions(e) for n, e in rule.outputs}
    candidates = {s for s, init in rule.state if s in outputs and init != "p"}
    base = {symbol(h) for h, _ in rule.hyper} | {STEP, NUMEL}
    changed = True
    while changed:
        changed = False
        allowed = base | {symbol(s) for s in candidates}
        for s in sorted(candidates):
            free = {x for x in outputs[s].free_symbols if not x.name.startswith("__red")}
            if not free <= allowed:
                candidates.discard(s)
                changed = True
    return tuple(s for s, _ in rule.state if s in candidates)


def _replace_reductions(e: sympy.Expr) -> sympy.Expr:
    """``e`` with each reduction call replaced by a placeholder symbol (for dependency checks)."""
    reds = sorted(e.atoms(Reduction), key=sympy.default_sort_key)
    return e.xreplace({r: sympy.Symbol(f"__red{i}", real=True) for i, r in enumerate(reds)})


class _Hoister:
    """Replace maximal scalar-only subexpressions by fresh symbols."""

    def __init__(self, scalar: set[sympy.Symbol], prefix: str):
        self.scalar = scalar
        self.prefix = prefix
        self.found: dict[sympy.Expr, sympy.Symbol] = {}

    def is_scalar(self, e) -> bool:
        return isinstance(e, sympy.Expr) and e.free_symbols <= self.scalar

    def name(self, e: sympy.Expr) -> sympy.Expr:
        if e.is_Atom:
            return e
        if e not in self.found:
            self.found[e] = sympy.Symbol(f"{self.prefix}{len(self.found)}", real=True)
        return self.found[e]

    def __call__(self, e):
        if self.is_scalar(e):
            return self.name(e)
        if e.is_Atom:
            return e
        if isinstance(e, (sympy.Add, sympy.Mul)):
            scalar_args = [a for a in e.args if self.is_scalar(a)]
            rest = [self(a) for a in e.args if not self.is_scalar(a)]
            if scalar_args:
                rest.insert(0, self.name(e.func(*scalar_args)))
            return e.func(*rest, evaluate=False)
        return e.func(*[self(a) for a in e.args])


def _extract_reductions(outputs: dict[str, sympy.Expr]):
    """Replace every reduction call by a symbol ``r<i>``, innermost first.

    Returns (outputs over the symbols, [(symbol, op, argument over earlier symbols, phase)]).
    """
    found: dict[sympy.Expr, tuple] = {}

    def visit(e):
        if not e.args:
            return e
        new = e.func(*[visit(a) for a in e.args]) if not isinstance(e, Reduction) else None
        if isinstance(e, Reduction):
            arg = visit(e.args[0])
            key = (e.op, arg)
            if key not in found:
                inner = [found[k] for k in found if found[k][0] in arg.free_symbols]
                phase = 1 + max((i[3] for i in inner), default=-1)
                found[key] = (sympy.Symbol(f"r{len(found)}", real=True), e.op, arg, phase)
            return found[key][0]
        return new

    replaced = {n: visit(e) for n, e in outputs.items()}
    return replaced, list(found.values())


def lower_optim(
    rule: Rule, dtypes: dict[str, str] | None = None, *, stochastic_rounding: bool = False
) -> OptimPlan:
    """Lower an optimizer rule for one dtype plan.

    ``dtypes`` gives the storage dtype of ``p``, ``g`` and each state by name (missing
    ones are fp32). Raises ``RuleError`` when the rule cannot run as a step.
    """
    if rule.kind != "optim":
        raise TypeError(f"lower_optim takes an optimizer rule, not a {rule.kind} rule")
    dtypes = dict(dtypes or {})
    for k, v in dtypes.items():
        if v not in DTYPES:
            raise ValueError(f"dtype {v!r} of {k!r} is not one of {DTYPES}")
    outputs, reds = _extract_reductions(dict(rule.outputs))
    scalar_states = scalar_state_names(rule)
    element_states = [s for s, _ in rule.state if s not in scalar_states]
    reductions = _reduction_plans(reds)
    phases = _lower_phases(rule, outputs, reds, scalar_states, element_states)
    return OptimPlan(
        name=rule.name,
        rule_text=rule.text,
        hyper=tuple(h for h, _ in rule.hyper),
        slots=_slots(phases, element_states, dtypes),
        scalar_states=scalar_states,
        reductions=reductions,
        phases=tuple(phases),
        stochastic_rounding=stochastic_rounding,
    )


def _reduction_plans(reds: list[tuple]) -> tuple[ReductionPlan, ...]:
    """One plan per reduction, in order; global norms also get their column of ``glob``."""
    reductions, gcol = [], 0
    for i, (sym, op, _, phase) in enumerate(reds):
        reductions.append(ReductionPlan(sym, op, phase, i, gcol if op == "global_norm" else -1))
        gcol += op == "global_norm"
    return tuple(reductions)


def _lower_phases(rule: Rule, outputs: dict, reds: list[tuple], scalar_states, element_states) -> list[Phase]:
    """A phase per level of reductions (each computes those whose arguments read only the
    earlier ones' results), then the last: the stores and the scalar states' updates."""
    red_syms = {r[0] for r in reds}
    scalar = (
        {symbol(h) for h, _ in rule.hyper} | {STEP, NUMEL} | {symbol(s) for s in scalar_states} | red_syms
    )
    element = {symbol(n) for n in ("p", "g", *element_states)}
    n_phases = 1 + max((r[3] for r in reds), default=-1) + 1

    phases = []
    for k in range(n_phases):
        last = k == n_phases - 1
        # Results of reductions of phase k and later are not known yet in phase k.
        unknown = {r[0] for r in reds if r[3] >= k}
        if last:
            targets = []
            for name in ("p", *element_states):
                if name in outputs:
                    expr = sympy.collect(outputs[name], sorted(element, key=str), evaluate=True)
                    targets.append((name, expr))
            updates = [(s, outputs[s]) for s in scalar_states]
        else:
            targets = [
                (i, ACCUMULATE[op][0](arg)) for i, (_, op, arg, phase) in enumerate(reds) if phase == k
            ]
            updates = []
        for _, e in targets + updates:
            bad = e.free_symbols & unknown
            if bad:
                raise RuleError(f"internal: phase {k} reads reductions not yet computed", rule=rule.name)
        phases.append(_lower_phase(k, targets, updates, scalar - unknown, last))
    return phases


def _slots(phases: list[Phase], element_states: list[str], dtypes: dict[str, str]) -> tuple[Slot, ...]:
    """``p`` and ``g``, then each element state that a phase reads or the last one writes."""
    used = set()
    for ph in phases:
        for _, e in (*ph.body, *ph.stores, *ph.reduce):
            used |= {s.name for s in e.free_symbols}
    written = {n for n, _ in phases[-1].stores}
    slots = [
        Slot("p", "param", dtypes.get("p", "fp32"), True),
        Slot("g", "grad", dtypes.get("g", "fp32"), False),
    ]
    for s in element_states:
        if s in used or s in written:
            slots.append(Slot(s, "state", dtypes.get(s, "fp32"), s in written))
    return tuple(slots)


def _lower_phase(index, targets, updates, scalar, last) -> Phase:
    hoist = _Hoister(scalar, "__h")
    hoisted_targets = [(n, hoist(e)) for n, e in targets]

    # Per-step scalars: CSE over everything hoisted plus the scalar-state updates.
    hoisted_items = list(hoist.found.items())
    scalar_exprs = [e for e, _ in hoisted_items] + [e for _, e in updates]
    pro_repl, pro_reduced = sympy.cse(
        scalar_exprs, symbols=sympy.numbered_symbols("__c"), optimizations="basic"
    )
    prologue = list(pro_repl)
    for (_, sym), e in zip(hoisted_items, pro_reduced[: len(hoisted_items)]):
        prologue.append((sym, e))
    scalar_updates = list(zip([n for n, _ in updates], pro_reduced[len(hoisted_items) :]))

    body_repl, body_reduced = sympy.cse(
        [e for _, e in hoisted_targets], symbols=sympy.numbered_symbols("__t"), optimizations="basic"
    )
    results = list(zip([n for n, _ in hoisted_targets], body_reduced))

    # Readable names: s0, s1 ... for scalars, t0, t1 ... for per-element temporaries.
    mapping = {sym: sympy.Symbol(f"s{i}", real=True) for i, (sym, _) in enumerate(prologue)}
    mapping.update({sym: sympy.Symbol(f"t{i}", real=True) for i, (sym, _) in enumerate(body_repl)})

    def sub(e):
        return e.xreplace(mapping)

    prologue = tuple((mapping[s], sub(e)) for s, e in prologue)
    body = tuple((mapping[s], sub(e)) for s, e in body_repl)
    results = tuple((n, sub(e)) for n, e in results)
    return Phase(
        index=index,
        prologue=prologue,
        body=body,
        reduce=() if last else results,
        stores=results if last else (),
        scalar_updates=tuple((n, sub(e)) for n, e in scalar_updates) if last else (),
    )
