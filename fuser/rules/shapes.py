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
from fuser.rules import matrices as mx
from fuser.rules.functions import (
    OPTIM_REDUCTIONS,
    Amax,
    AxisReduction,
    MatrixFunction,
    Mean,
    Norm,
    RandomValue,
    Reduction,
    Sum,
)
from fuser.rules.parse import Statement, symbol

SCALAR, ROW, COL, ELEMENT = "scalar", "row", "col", "element"
ROWMAT, COLMAT, ELEMENT_T = mx.ROWMAT, mx.COLMAT, mx.ELEMENT_T
DIMMAT, DIMVEC, DIMSCAL = mx.DIMMAT, mx.DIMVEC, mx.DIMSCAL
_NAMES = {cls: name for name, cls in OPTIM_REDUCTIONS.items()}
_MATRIX_LIKE = frozenset({ROWMAT, COLMAT, ELEMENT_T, DIMMAT, DIMVEC, DIMSCAL})
_PER_DIM = frozenset({DIMMAT, DIMVEC, DIMSCAL})
# How an error names each kind of value.
DESCRIBE = {
    SCALAR: "a number per tensor",
    ROW: "a value per row",
    COL: "a value per column",
    ELEMENT: "a value per element ([rows, cols])",
    ROWMAT: "a [rows, rows] matrix",
    COLMAT: "a [cols, cols] matrix",
    ELEMENT_T: "a transposed value per element ([cols, rows])",
    DIMMAT: "a [d, d] matrix per dimension d of the tensor",
    DIMVEC: "a [d] vector per dimension d of the tensor",
    DIMSCAL: "a number per dimension of the tensor",
}


def join(a: str, b: str) -> str:
    """The kind of a value computed from values of kinds ``a`` and ``b``."""
    if a == b or b == SCALAR:
        return a
    if a == SCALAR:
        return b
    if DIMSCAL in (a, b) and {a, b} <= _PER_DIM:  # (a number per dimension scales each factor)
        return b if a == DIMSCAL else a
    if a in _MATRIX_LIKE or b in _MATRIX_LIKE:
        raise RuleError(
            f"{DESCRIBE[a]} and {DESCRIBE[b]} cannot be combined elementwise "
            "(`*`, `+` and functions act element by element; `@` is the matrix product)"
        )
    return ELEMENT


# Products: (left, right) -> result.
_PRODUCTS = {
    (ROWMAT, ROWMAT): ROWMAT,
    (COLMAT, COLMAT): COLMAT,
    (ROWMAT, ELEMENT): ELEMENT,
    (ELEMENT, COLMAT): ELEMENT,
    (ELEMENT, ELEMENT_T): ROWMAT,
    (ELEMENT_T, ELEMENT): COLMAT,
    (COLMAT, ELEMENT_T): ELEMENT_T,
    (ELEMENT_T, ROWMAT): ELEMENT_T,
    (ROWMAT, ROW): ROW,
    (COLMAT, COL): COL,
    (DIMMAT, DIMMAT): DIMMAT,
    (DIMMAT, DIMVEC): DIMVEC,
}


def product_kind(a: str, b: str) -> str | None:
    """The kind of ``a @ b`` for operands of kinds ``a`` and ``b`` (None: sizes that do not match)."""
    return _PRODUCTS.get((a, b))


_TRANSPOSED = {ROWMAT: ROWMAT, COLMAT: COLMAT, ELEMENT: ELEMENT_T, ELEMENT_T: ELEMENT, DIMMAT: DIMMAT}
_SQUARE = (ROWMAT, COLMAT)
# What per-dimension factors take besides elementwise work with numbers and each other.
_OF_DIMS = (mx.MatMul, mx.Transpose, mx.Decomposition, mx.Diag, mx.Triu, mx.Tril, mx.Trace, mx.Solve)


def _dims_kind(e, args: list[str]) -> str | None:
    """The kind of a value of per-dimension factors (None: ``e`` is not one)."""
    made = _dims_function(e, args)
    return made if made is not None else _of_factors(e, args)


def _dims_function(e, args: list[str]) -> str | None:
    """The kind of a function that makes or reads per-dimension values (None: not one)."""
    if isinstance(e, mx.EyeDims):
        return DIMMAT
    if isinstance(e, mx.ProdDims):
        if args[0] not in (DIMSCAL, SCALAR):
            raise RuleError(
                f"prod_dims() takes a number per dimension (amax(F), norm(F)), not {DESCRIBE[args[0]]}"
            )
        return SCALAR
    if isinstance(e, mx.SolveModes):
        if tuple(args) != (DIMMAT, ELEMENT):
            raise RuleError(
                f"{e.spelling}(A, x) takes A a triangular matrix per dimension and x a value per element, "
                f"not {DESCRIBE[args[0]]} and {DESCRIBE[args[1]]}"
            )
        return ELEMENT
    if isinstance(e, mx.ArgmaxOnehot) and args[0] == DIMVEC:
        return DIMVEC
    if isinstance(e, mx.Gram):
        if args[0] != ELEMENT:
            raise RuleError(f"gram() takes a value per element, not {DESCRIBE[args[0]]}")
        return DIMMAT
    if isinstance(e, mx.Modes):
        if tuple(args) != (ELEMENT, DIMMAT):
            raise RuleError(
                "modes(x, F) takes x a value per element and F a matrix per dimension "
                f"(gram(), 'zeros(dims)'), not {DESCRIBE[args[0]]} and {DESCRIBE[args[1]]}"
            )
        return ELEMENT
    if isinstance(e, mx.SortPerm) and args[0] == DIMVEC:
        return DIMMAT
    return None


def _of_factors(e, args: list[str]) -> str | None:
    """The kind of a matrix function of per-dimension values (None: of none)."""
    if DIMSCAL in args:
        raise RuleError(f"{e.spelling}() does not take {DESCRIBE[DIMSCAL]} (prod_dims does)")
    if DIMVEC in args and not (isinstance(e, mx.MatMul) and tuple(args) == (DIMMAT, DIMVEC)):
        what = "`@`" if isinstance(e, mx.MatMul) else f"{e.spelling}()"
        raise RuleError(
            f"{what} does not take {DESCRIBE[DIMVEC]} here (sort_perm, argmax_onehot and a factor's "
            "product with it, F @ v, do)"
        )
    if DIMMAT not in args:
        if isinstance(e, (mx.InvRoot, mx.InvRootNewton)) and not e.args[1].is_Integer:
            raise RuleError(f"{e.spelling}(M, k) with k a function of ndim takes per-dimension factors")
        return None
    if not isinstance(e, _OF_DIMS):
        raise RuleError(
            f"{e.spelling}() does not take per-dimension factors (their products, transposes, eigh, qr, "
            "diag, trace, triu, tril, solves, inv_root and inv_root_newton do)"
        )
    if isinstance(e, mx.Solve) and tuple(args) != (DIMMAT, DIMMAT):
        raise RuleError(
            f"{e.spelling}(A, B) of per-dimension factors takes both per dimension, not {DESCRIBE[args[0]]} "
            f"and {DESCRIBE[args[1]]} (a value per element: solve_modes_{'upper' if e.upper else 'lower'})"
        )
    if isinstance(e, mx.Trace):
        return DIMSCAL
    if isinstance(e, mx.MatMul):
        found = _PRODUCTS.get(tuple(args))
        if found is None:
            raise RuleError(
                f"`@` cannot multiply {DESCRIBE[args[0]]} by {DESCRIBE[args[1]]}: a value per element takes "
                "per-dimension factors through modes(x, F)"
            )
        return found
    return DIMVEC if isinstance(e, mx.Diag) else DIMMAT


def _matrix_kind(e, args: list[str]) -> str:
    """The kind of a matrix object ``e`` (``fuser.rules.matrices``) of arguments' kinds."""
    name = e.spelling
    dims = _dims_kind(e, args)
    if dims is not None:
        return dims
    if isinstance(e, mx.MatMul):
        a, b = args
        if SCALAR in (a, b):
            raise RuleError("`@` multiplies matrices: multiply by a number with `*`")
        found = _PRODUCTS.get((a, b))
        if found is None:
            raise RuleError(f"`@` cannot multiply {DESCRIBE[a]} by {DESCRIBE[b]}: their sizes do not match")
        return found
    if isinstance(e, mx.Solve):
        a, b = args
        found = _PRODUCTS.get((a, b)) if a in _SQUARE else None
        if found is None:
            raise RuleError(
                f"{name}(A, B) takes A a [rows, rows] or [cols, cols] factor and B of its side, "
                f"not {DESCRIBE[a]} and {DESCRIBE[b]}"
            )
        return found
    if isinstance(e, mx.Transpose):
        if args[0] not in _TRANSPOSED:
            raise RuleError(f"transpose() takes a matrix or a value per element, not {DESCRIBE[args[0]]}")
        return _TRANSPOSED[args[0]]
    if isinstance(e, mx.Eye):
        return ROWMAT if e.args[0].name == "rows" else COLMAT
    if isinstance(e, mx.SortPerm):
        if args[0] not in (ROW, COL):
            raise RuleError(f"sort_perm() takes a value per row or per column, not {DESCRIBE[args[0]]}")
        return ROWMAT if args[0] == ROW else COLMAT
    if isinstance(e, mx.ArgmaxOnehot):
        if args[0] not in (ROW, COL):
            raise RuleError(f"argmax_onehot() takes a value per row or per column, not {DESCRIBE[args[0]]}")
        return args[0]
    if args[0] not in _SQUARE:
        raise RuleError(f"{name}() takes a [rows, rows] or [cols, cols] matrix, not {DESCRIBE[args[0]]}")
    if isinstance(e, mx.Trace):
        return SCALAR
    if isinstance(e, mx.Diag):
        return ROW if args[0] == ROWMAT else COL
    return args[0]


def kind_of(e: sympy.Expr, kinds: dict[sympy.Symbol, str], memo: dict | None = None) -> str:
    """What ``e`` holds per tensor, given the kinds of its symbols (others are scalars).
    Raises ``RuleError`` for a reduction of a value it cannot reduce."""
    memo = {} if memo is None else memo
    if e in memo:
        return memo[e]
    try:
        kind = _kind_of(e, kinds, memo)
    except RuleError as err:
        if getattr(err, "node", None) is None:
            err.node = e  # (the innermost value that failed: check_kinds places the caret)
        raise
    memo[e] = kind
    return kind


def _kind_of(e: sympy.Expr, kinds: dict, memo: dict) -> str:
    if isinstance(e, RandomValue):  # (a draw per element, though it reads no symbol)
        kind = ELEMENT
    elif isinstance(e, mx.MatrixOp):
        order = isinstance(e, mx.SymmetricFunction)  # (inv_root's k: a number, or one of ndim)
        args = [
            kind_of(a, kinds, memo)
            for i, a in enumerate(e.args)
            if not (a.is_Number or isinstance(e, mx.Eye) or (order and i == 1))
        ]
        kind = _matrix_kind(e, args)
    elif isinstance(e, Reduction):
        arg = kind_of(e.args[0], kinds, memo)
        name = _NAMES.get(type(e), e.op)
        if arg in _PER_DIM:
            if not isinstance(e, (Norm, Sum, Mean, Amax)) or arg == DIMSCAL:
                raise RuleError(
                    f"{name}() does not take {DESCRIBE[arg]} (norm, sum, mean and amax of factors do)"
                )
            kind = DIMSCAL
        elif arg in _MATRIX_LIKE:
            if not isinstance(e, (Norm, Sum, Mean, Amax)):
                raise RuleError(f"{name}() does not take {DESCRIBE[arg]} (norm, sum, mean and amax do)")
            kind = SCALAR
        elif isinstance(e, MatrixFunction):
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
    return kind


def state_kinds(rule) -> dict[str, str]:
    """What each state of ``rule`` (a ``Rule``) holds. Worked out once per rule: the
    runtime asks at every rebuild and for every loaded parameter."""
    return dict(_rule_kinds(rule))


@functools.lru_cache(maxsize=256)
def _rule_kinds(rule) -> tuple[tuple[str, str], ...]:
    return tuple(_state_kinds(dict(rule.outputs), rule.state).items())


def _state_kinds(outputs: dict, state) -> dict[str, str]:
    declared = {s: mx.matrix_init(init)[0] for s, init in state if mx.matrix_init(init)}
    assigned = [s for s, init in state if s in outputs and init != "p" and s not in declared]
    kinds = {s: declared.get(s) or (SCALAR if s in assigned else ELEMENT) for s, _ in state}
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
    declared = {s for s, init in state if mx.matrix_init(init)}
    try:
        found, failed = _state_kinds(outputs, state), False
    except RuleError:  # (located below, statement by statement)
        found, failed = {s: (mx.matrix_init(init) or (ELEMENT,))[0] for s, init in state}, True
    kinds = {symbol(n): k for n, k in found.items()}
    kinds.update({symbol("p"): ELEMENT, symbol("g"): ELEMENT})
    memo: dict = {}
    for st in statements:
        src = lines[st.line - 1] if lines and 0 < st.line <= len(lines) else None
        try:
            kind = kind_of(st.expr, kinds, memo)
            if kind == ELEMENT_T and (st.target == "p" or st.target in found):
                raise RuleError(
                    f"{st.target} is {DESCRIBE[kind]}: transpose it back, or multiply it by a matrix"
                )
            if st.target in found and st.target not in declared and kind in (ROWMAT, COLMAT, DIMMAT):
                raise RuleError(
                    f"state {st.target!r} starts as a number, so it holds values per element, row, column or "
                    f"tensor; this assigns it {DESCRIBE[kind]}: declare it as 'zeros(rows, rows)', "
                    "'zeros(cols, cols)' or 'zeros(dims)' (or 'eye(...)')"
                )
            want = found.get(st.target)
            if st.target in declared and kind not in (want, SCALAR):
                raise RuleError(
                    f"state {st.target!r} is {DESCRIBE[want]}, but this assigns it {DESCRIBE[kind]}"
                )
            if st.target == "p" and kind in _MATRIX_LIKE:
                raise RuleError(f"p is a value per element, but this assigns it {DESCRIBE[kind]}")
        except RuleError as e:
            col = (st.spots or {}).get(getattr(e, "node", None), st.col)
            raise RuleError(e.message, line=st.line, col=col, source_line=src) from None
    if failed:  # (a failure no single statement shows)
        _state_kinds(outputs, state)
