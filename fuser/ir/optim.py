"""Optimizer rule -> ``OptimPlan``: what one fused step kernel loads, computes and stores.

The plan separates the work by how often it must run:

- *per-step scalars* (``prologue``): every maximal subexpression that depends only on
  hyperparameters, ``step`` and per-tensor scalar states (bias corrections, ``1 - lr*wd``)
  is hoisted out of the per-element work and computed once per program in fp64;
- *per-element work* (``body``): the rest, after ``sympy.cse``, in fp32;
- *per-tensor scalar states* (``scalar_updates``): states whose update reads no
  per-element value (NAdam's ``mu_product``) are one number per tensor, not a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from fuser.errors import RuleError
from fuser.rules.parse import symbol
from fuser.rules.rule import Rule

# Storage dtypes a tensor may have, by the short name used in plans and cache entries.
DTYPES = ("fp32", "bf16", "fp16")

STEP = symbol("step")


@dataclass(frozen=True)
class Slot:
    """One per-element tensor of the step: its rule name, role, storage dtype, and
    whether the kernel writes it."""

    name: str
    role: str  # "param", "grad" or "state"
    dtype: str
    written: bool


@dataclass(frozen=True)
class OptimPlan:
    name: str
    rule_text: str
    hyper: tuple[str, ...]  # columns of a param group's row in the hyper table
    slots: tuple[Slot, ...]  # columns of the pointer table, in order
    scalar_states: tuple[str, ...]  # columns 1.. of the per-tensor scalar table (0 is step)
    prologue: tuple[tuple[sympy.Symbol, sympy.Expr], ...]  # fp64 per-step scalars, in order
    scalar_updates: tuple[tuple[str, sympy.Expr], ...]  # new value of each scalar state
    body: tuple[tuple[sympy.Symbol, sympy.Expr], ...]  # fp32 per-element temporaries
    stores: tuple[tuple[str, sympy.Expr], ...]  # slot name -> value stored

    @property
    def dtype_key(self) -> str:
        return "-".join(f"{s.name}:{s.dtype}" for s in self.slots)

    def scalar_symbols(self) -> set[sympy.Symbol]:
        return {symbol(h) for h in self.hyper} | {STEP} | {symbol(s) for s in self.scalar_states}


def scalar_state_names(rule: Rule) -> tuple[str, ...]:
    """States whose every update reads only hyperparameters, ``step`` and other such states."""
    outputs = dict(rule.outputs)
    candidates = {s for s, init in rule.state if s in outputs and init != "p"}
    base = {symbol(h) for h, _ in rule.hyper} | {STEP}
    changed = True
    while changed:
        changed = False
        allowed = base | {symbol(s) for s in candidates}
        for s in sorted(candidates):
            if not outputs[s].free_symbols <= allowed:
                candidates.discard(s)
                changed = True
    return tuple(s for s, _ in rule.state if s in candidates)


class _Hoister:
    """Replace maximal scalar-only subexpressions by fresh symbols ``s0, s1, ...``."""

    def __init__(self, scalar: set[sympy.Symbol]):
        self.scalar = scalar
        self.found: dict[sympy.Expr, sympy.Symbol] = {}

    def is_scalar(self, e) -> bool:
        return isinstance(e, sympy.Expr) and e.free_symbols <= self.scalar

    def name(self, e: sympy.Expr) -> sympy.Expr:
        if e.is_Atom:
            return e
        if e not in self.found:
            self.found[e] = sympy.Symbol(f"__h{len(self.found)}", real=True)
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


def lower_optim(rule: Rule, dtypes: dict[str, str] | None = None) -> OptimPlan:
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
    outputs = dict(rule.outputs)
    scalar_states = scalar_state_names(rule)
    scalar = {symbol(h) for h, _ in rule.hyper} | {STEP} | {symbol(s) for s in scalar_states}
    element_states = [s for s, _ in rule.state if s not in scalar_states]
    element = {symbol(n) for n in ("p", "g", *element_states)}

    # Per-element outputs, collected by the per-element symbols so that `p - lr*wd*p`
    # becomes `p*(1 - lr*wd)` and its scalar factor is hoisted whole.
    stores_raw = []
    for name in ("p", *element_states):
        if name in outputs:
            expr = sympy.collect(outputs[name], sorted(element, key=str), evaluate=True)
            stores_raw.append((name, expr))

    hoist = _Hoister(scalar)
    stores_hoisted = [(n, hoist(e)) for n, e in stores_raw]

    # Per-step scalars: CSE over everything hoisted plus the scalar-state updates.
    hoisted_items = list(hoist.found.items())
    scalar_exprs = [e for e, _ in hoisted_items] + [outputs[s] for s in scalar_states]
    pro_repl, pro_reduced = sympy.cse(scalar_exprs, symbols=sympy.numbered_symbols("__c"),
                                      optimizations="basic")
    prologue = list(pro_repl)
    for (_, sym), e in zip(hoisted_items, pro_reduced[: len(hoisted_items)]):
        prologue.append((sym, e))
    scalar_updates = tuple(zip(scalar_states, pro_reduced[len(hoisted_items):]))

    body_repl, body_reduced = sympy.cse([e for _, e in stores_hoisted],
                                        symbols=sympy.numbered_symbols("__t"), optimizations="basic")

    # Rename temporaries to the readable t0, t1 ... / s0, s1 ... of the generated kernel.
    prologue, body, stores, scalar_updates = _rename(
        prologue, list(body_repl), list(zip([n for n, _ in stores_hoisted], body_reduced)),
        list(scalar_updates))

    used_in_body = set().union(*[e.free_symbols for _, e in body], *[e.free_symbols for _, e in stores]) \
        if (body or stores) else set()
    read = {s.name for s in used_in_body}
    slots = [Slot("p", "param", dtypes.get("p", "fp32"), True),
             Slot("g", "grad", dtypes.get("g", "fp32"), False)]
    written = {n for n, _ in stores}
    for s in element_states:
        if s in read or s in written:
            slots.append(Slot(s, "state", dtypes.get(s, "fp32"), s in written))
    unknown = {s.name for s in used_in_body} - {sl.name for sl in slots} - {
        s.name for s, _ in prologue} - {s.name for s, _ in body} - {h for h, _ in rule.hyper} - {"step"}
    if unknown:
        raise RuleError(f"internal: per-element code reads unknown values {sorted(unknown)}",
                        rule=rule.name)
    return OptimPlan(
        name=rule.name,
        rule_text=rule.text,
        hyper=tuple(h for h, _ in rule.hyper),
        slots=tuple(slots),
        scalar_states=scalar_states,
        prologue=tuple(prologue),
        scalar_updates=tuple(scalar_updates),
        body=tuple(body),
        stores=tuple(stores),
    )


def _rename(prologue, body, stores, scalar_updates):
    mapping = {}
    for i, (sym, _) in enumerate(prologue):
        mapping[sym] = sympy.Symbol(f"s{i}", real=True)
    for i, (sym, _) in enumerate(body):
        mapping[sym] = sympy.Symbol(f"t{i}", real=True)

    def sub(e):
        return e.xreplace(mapping)

    return (
        [(mapping[s], sub(e)) for s, e in prologue],
        [(mapping[s], sub(e)) for s, e in body],
        [(n, sub(e)) for n, e in stores],
        [(n, sub(e)) for n, e in scalar_updates],
    )
