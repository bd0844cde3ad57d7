"""What each value of an optimizer rule holds per tensor: one number (``scalar``), one
per row or column of the tensor's 2-D view (``row``, ``col``; of each of its matrices for
a batched view), or one per element.

A row value combined with a column value is per element (an outer product, as in
Adafactor's ``row_var * col_var``). A state's kind is the kind of what the rule assigns
to it, found by iterating to a fixed point: a state assigned only from per-tensor values
is one number per tensor (NAdam's ``mu_product``), one assigned from row values one number
per row, and so on; a state never assigned, or starting as ``p``, is per element.
"""

from __future__ import annotations

import functools

import sympy

from fuser.errors import RuleError
from fuser.rules.functions import OPTIM_REDUCTIONS, AxisReduction, MatrixFunction, RandomValue, Reduction
from fuser.rules.parse import Statement, symbol

SCALAR, ROW, COL, ELEMENT = "scalar", "row", "col", "element"
_NAMES = {cls: name for name, cls in OPTIM_REDUCTIONS.items()}


def join(a: str, b: str) -> str:
    """The kind of a value computed from values of kinds ``a`` and ``b``."""
    if a == b or b == SCALAR:
        return a
    return b if a == SCALAR else ELEMENT


def kind_of(e: sympy.Expr, kinds: dict[sympy.Symbol, str], memo: dict | None = None) -> str:
    """What ``e`` holds per tensor, given the kinds of its symbols (others are scalars).
    Raises ``RuleError`` for a reduction of a value it cannot reduce."""
    memo = {} if memo is None else memo
    if e in memo:
        return memo[e]
    if isinstance(e, RandomValue):  # (a draw per element, though it reads no symbol)
        kind = ELEMENT
    elif isinstance(e, Reduction):
        arg = kind_of(e.args[0], kinds, memo)
        name = _NAMES.get(type(e), e.op)
        if isinstance(e, MatrixFunction):
            if arg != ELEMENT:
                raise RuleError(f"{name}() takes a matrix: a value per element, not one per {arg}")
            kind = ELEMENT
        elif isinstance(e, AxisReduction):
            if arg not in (ELEMENT, SCALAR):
                raise RuleError(
                    f"{name}() reduces a value per element along one axis, but its argument "
                    f"holds one number per {arg}: use {e.op}() for a per-tensor result"
                )
            kind = e.axis
        else:
            if e.op.startswith("global_") and arg in (ROW, COL):
                raise RuleError(f"{e.op}() takes a value per element, not one per {arg}")
            kind = SCALAR
    elif e.is_Symbol:
        kind = kinds.get(e, SCALAR)
    else:
        kind = SCALAR
        for a in e.args:
            if isinstance(a, sympy.Basic):
                kind = join(kind, kind_of(a, kinds, memo))
    memo[e] = kind
    return kind


def state_kinds(rule) -> dict[str, str]:
    """What each state of ``rule`` (a ``Rule``) holds. Worked out once per rule: the
    runtime asks at every rebuild and for every loaded parameter."""
    return dict(_rule_kinds(rule))


@functools.lru_cache(maxsize=256)
def _rule_kinds(rule) -> tuple[tuple[str, str], ...]:
    return tuple(_state_kinds(dict(rule.outputs), rule.state).items())


def _state_kinds(outputs: dict, state) -> dict[str, str]:
    assigned = [s for s, init in state if s in outputs and init != "p"]
    kinds = {s: (SCALAR if s in assigned else ELEMENT) for s, _ in state}
    changed = True
    while changed:
        changed = False
        syms = {symbol(n): k for n, k in kinds.items()}
        syms.update({symbol("p"): ELEMENT, symbol("g"): ELEMENT})
        for s in assigned:
            k = join(kinds[s], kind_of(outputs[s], syms))
            if k != kinds[s]:
                kinds[s], changed = k, True
    return kinds


def check_kinds(statements: list[Statement], outputs: dict, state, lines: list[str] | None) -> None:
    """Raise ``RuleError`` at the first statement that reduces a value it cannot reduce
    (an axis reduction of row values, a global reduction of column values)."""
    kinds = {symbol(n): k for n, k in _state_kinds(outputs, state).items()}
    kinds.update({symbol("p"): ELEMENT, symbol("g"): ELEMENT})
    memo: dict = {}
    for st in statements:
        try:
            kind_of(st.expr, kinds, memo)
        except RuleError as e:
            src = lines[st.line - 1] if lines and 0 < st.line <= len(lines) else None
            raise RuleError(e.message, line=st.line, col=st.col, source_line=src) from None
