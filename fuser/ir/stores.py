"""Element states stored by the phase that computes them.

A step of several phases writes, by default, everything in its last phase, which
recomputes each state's new value from the old one and from whatever that value reads.
A state whose new value is known before the last phase (CAME's momentum, known in its
third phase; LAMB's moments, known in its first) can instead be stored by the earliest
phase that computes it: that phase, which already reads the state, writes it back, and
the later phases read the stored value in place of the expression. They then no longer
load what only that expression needed (CAME's and LAMB's last phases skip the gradient).

A state moves only where every later phase reads it through its new value (none needs
the old one, which the store overwrites), only fp32 states (so the later phases read
exactly the value they would compute, not one rounded for storage), and only where the
estimated traffic of the step, in bytes an element, goes down.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import combinations

import sympy

from fuser.rules.parse import symbol
from fuser.rules.shapes import ELEMENT

# Bytes an element of each storage dtype (8-bit formats: 1).
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# The states (in the rule's order) whose subsets are tried.
MAX_CANDIDATES = 6


@dataclass(frozen=True)
class EarlyStores:
    """The rule's values after moving stores: ``outputs`` (the last phase's, reading moved
    states' new values), ``reds`` (reductions, each over the values its phase reads) and
    ``stores`` (state -> (phase, new value over the values that phase reads))."""

    outputs: dict
    reds: list
    stores: dict


def plan_early_stores(outputs: dict, reds: list, skinds: dict, dtypes: dict, n_phases: int) -> EarlyStores:
    """Move fp32 element states' stores to the first phase that can compute each, where
    that is before the last phase and every later phase then reads only the new value.
    Of every subset of those moves, the smallest that moves fewest bytes is taken (none
    where nothing moves fewer than the last phase storing everything). ``outputs`` and
    ``reds`` are ``_extract_reductions``'."""
    first = {}
    for s, kind in skinds.items():
        if kind != ELEMENT or s not in outputs or dtypes.get(s, "fp32") != "fp32":
            continue
        k = 1 + max((f.phase for f in reds if f.symbol in outputs[s].free_symbols), default=-1)
        if k < n_phases - 1:  # (known before the last phase)
            first[s] = k
    last = n_phases - 1
    best = _apply(outputs, reds, {}, last)
    best_cost = _traffic(best, skinds, dtypes, n_phases)
    # (a rule has a handful of element states; LAMB's last phase skips the gradient only
    # when both its moments move, so single moves are not enough)
    for size in range(1, min(len(first), MAX_CANDIDATES) + 1):
        for subset in combinations(list(first)[:MAX_CANDIDATES], size):
            trial = _apply(outputs, reds, {s: first[s] for s in subset}, last)
            if trial is None:
                continue
            cost = _traffic(trial, skinds, dtypes, n_phases)
            if cost < best_cost:
                best, best_cost = trial, cost
    return best


def _apply(outputs: dict, reds: list, moved: dict[str, int], last: int) -> EarlyStores | None:
    """The values each phase computes when the states of ``moved`` (state -> phase) are
    stored early (``last``: the last phase's index), or None where some phase after a
    state's store would read its old value. Each value of phase ``j`` reads the new value
    of every state stored before ``j``: its expression (a subtree of the rule's, over old
    values) becomes the state's symbol, which then names what the slot holds."""
    holders = {s: sympy.Symbol(f"{s}__stored", real=True) for s in moved}

    def at(e, j):
        before = {s: k for s, k in moved.items() if k < j}
        # (xreplace matches the largest subtree first: a moved state whose new value
        # reads another's keeps that one inside its own expression)
        e = e.xreplace({outputs[s]: holders[s] for s in before})
        if any(symbol(s) in e.free_symbols for s in before):
            return None
        return e.xreplace({holders[s]: symbol(s) for s in before})

    new_outputs = {}
    for n, e in outputs.items():
        if n in moved:
            continue
        new_outputs[n] = at(e, last)
        if new_outputs[n] is None:
            return None
    new_reds = []
    for f in reds:
        arg = at(f.arg, f.phase)
        if arg is None:
            return None
        new_reds.append(replace(f, arg=arg))
    stores = {}
    for s, k in moved.items():
        stores[s] = (k, at(outputs[s], k))
        if stores[s][1] is None:
            return None
    return EarlyStores(new_outputs, new_reds, stores)


def _traffic(values: EarlyStores, skinds: dict, dtypes: dict, n_phases: int) -> int:
    """Bytes an element the phases read and write: each phase loads every element slot
    its values read and stores the states it writes (the last phase: ``p`` and every
    element state still in ``outputs``)."""
    names = {"p", "g", *(s for s, k in skinds.items() if k == ELEMENT)}
    reads = [set() for _ in range(n_phases)]
    writes = [set() for _ in range(n_phases)]
    for f in values.reds:
        reads[f.phase] |= {x.name for x in f.arg.free_symbols} & names
    for n, e in values.outputs.items():
        reads[-1] |= {x.name for x in e.free_symbols} & names
        if n in names and e != symbol(n):
            writes[-1].add(n)
    for s, (k, e) in values.stores.items():
        reads[k] |= {x.name for x in e.free_symbols} & names
        writes[k].add(s)
    size = {n: DTYPE_BYTES.get(dtypes.get(n, "fp32"), 1) for n in names}
    return sum(size[n] for phase in (*reads, *writes) for n in phase)
