"""Which states of an optimizer rule never go negative: those ``state_dtype="q8"`` stores
in the unsigned 8-bit format.

A state is non-negative when it starts at a number >= 0 and sympy proves its update
non-negative, given that every such state is (a fixed point from all candidates down),
``p``, ``g`` and the other states are any real numbers, ``step`` is positive and every
hyperparameter lies in (0, 1) (written ``1 / (1 + u)``, ``u > 0``: what keeps
``beta * v + (1 - beta) * g**2`` non-negative). Functions sympy knows nothing of prove
nothing, and updates too long to expand (``MAX_OPS``) are not tried, so the answer errs
towards the signed format. ``interval_hyper`` names the
hyperparameters whose values the proofs took from (0, 1); the step refuses others.
"""

from __future__ import annotations

import functools

import sympy

from fuser.rules.parse import symbol
from fuser.rules.rule import Rule


@functools.lru_cache(maxsize=256)
def nonneg_states(rule: Rule) -> frozenset[str]:
    outputs = dict(rule.outputs)
    init = dict(rule.state)
    candidates = {s for s, v in init.items() if v != "p" and float(v) >= 0}
    hyper = {symbol(h): 1 / (1 + sympy.Dummy(h, positive=True)) for h, _ in rule.hyper}
    while True:
        dropped = {s for s in candidates if s in outputs and not _nonneg(outputs[s], candidates, hyper)}
        if not dropped:
            return frozenset(candidates)
        candidates -= dropped


# Updates of more operations are not tried (the signed format): expanding CAME's
# momentum (159 operations) takes sympy minutes; every non-negative state of the built-ins
# is proved from fewer than 70.
MAX_OPS = 100


def _nonneg(expr: sympy.Expr, nonneg: set[str], hyper: dict) -> bool:
    if sympy.count_ops(expr) > MAX_OPS:
        return False
    subs = dict(hyper)
    for s in expr.free_symbols:
        if s in subs:
            continue
        if s.name in nonneg:
            subs[s] = sympy.Dummy(s.name, nonnegative=True)
        elif s.name == "step":
            subs[s] = sympy.Dummy(s.name, positive=True)
        else:
            subs[s] = sympy.Dummy(s.name, real=True)
    e = expr.xreplace(subs)
    return bool(e.is_nonnegative) or bool(sympy.factor_terms(sympy.expand(e)).is_nonnegative)


@functools.lru_cache(maxsize=256)
def interval_hyper(rule: Rule) -> frozenset[str]:
    """Hyperparameters that the updates of ``nonneg_states(rule)`` read (their proofs
    assume values in [0, 1])."""
    outputs = dict(rule.outputs)
    hyper = {h for h, _ in rule.hyper}
    used = set()
    for s in nonneg_states(rule):
        if s in outputs:
            used |= {x.name for x in outputs[s].free_symbols if x.name in hyper}
    return frozenset(used)
