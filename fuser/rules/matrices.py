"""Matrix values of an optimizer rule: states of shape ``[rows, rows]`` and ``[cols, cols]``
of a tensor's 2-D view, products (``@``), transposes and matrix functions, as sympy objects.

A rule that holds or computes a matrix is a *matrix rule* (``is_matrix_rule``); its step is
lowered by ``fuser.optim.matrix_rules`` into a matrix phase in torch, batched over matrices of
one shape, then one fused update kernel. ``*`` stays elementwise on matrices as on
everything else; ``@`` is the product.

What each value holds per tensor (``fuser.rules.shapes``' kinds, extended here): ``rowmat``
(``[rows, rows]``: a left factor), ``colmat`` (``[cols, cols]``: a right factor),
``element_t`` (the transpose of a per-element value, ``[cols, rows]``) and ``dimmat`` (one
``[d, d]`` factor per dimension ``d`` of the tensor's own shape: ``gram`` makes them, ``modes``
multiplies a value per element by them along every dimension; ``dimvec``, a vector per
dimension, their diagonals or products with vectors; ``dimscal``, a number per dimension,
their norms, which ``prod_dims`` multiplies together).
"""

from __future__ import annotations

import re

import sympy

ROWMAT, COLMAT, ELEMENT_T = "rowmat", "colmat", "element_t"
DIMMAT, DIMVEC, DIMSCAL = "dimmat", "dimvec", "dimscal"

# How a matrix state starts: a state declared ``"zeros(rows, rows)"`` is [rows, rows] of
# zeros, ``"eye(cols)"`` the [cols, cols] identity, ``"zeros(dims)"`` / ``"eye(dims)"`` one
# [d, d] matrix per dimension d of the tensor.
_INIT = re.compile(r"^\s*(?:zeros\(\s*(rows|cols)\s*,\s*(rows|cols)\s*\)|eye\(\s*(rows|cols)\s*\))\s*$")
_DIMS_INIT = re.compile(r"^\s*(zeros|eye)\(\s*dims\s*\)\s*$")


def matrix_init(value) -> tuple[str, str] | None:
    """``(kind, "zeros" | "eye")`` of a matrix state's declared start, or None for an
    element state's (a number or ``"p"``). Raises ValueError for ``zeros(rows, cols)``."""
    if not isinstance(value, str):
        return None
    m = _DIMS_INIT.match(value)
    if m is not None:
        return DIMMAT, m.group(1)
    m = _INIT.match(value)
    if m is None:
        return None
    if m.group(3):
        side, how = m.group(3), "eye"
    else:
        if m.group(1) != m.group(2):
            raise ValueError(
                f"a matrix state is [rows, rows] or [cols, cols], not {value!r} "
                "(a per-element state starts as a number)"
            )
        side, how = m.group(1), "zeros"
    return (ROWMAT if side == "rows" else COLMAT), how


class MatrixOp(sympy.Function):
    """Base of the matrix objects; ``spelling`` is the rule-language name."""

    is_real = True
    spelling = ""

    def _sympystr(self, printer):
        return f"{self.spelling}({', '.join(printer._print(a) for a in self.args)})"

    def _latex(self, printer, exp=None):
        inner = ", ".join(printer._print(a) for a in self.args)
        text = rf"\operatorname{{{self.spelling.replace('_', chr(92) + '_')}}}\left({inner}\right)"
        return text if exp is None else rf"\left({text}\right)^{{{exp}}}"


class MatMul(MatrixOp):
    """``a @ b``: the matrix product (not commutative: the arguments keep their order)."""

    nargs = 2
    spelling = "matmul"

    @classmethod
    def eval(cls, a, b):
        if a.is_Number or b.is_Number:  # (a number times a matrix: sympy folded a factor 0 or 1)
            return a * b
        return None

    def _sympystr(self, printer):
        a, b = (printer.parenthesize(x, 100) for x in self.args)
        return f"({a} @ {b})"

    def _latex(self, printer, exp=None):
        a, b = (_factor(printer, x) for x in self.args)
        text = rf"{a} \, {b}"
        return text if exp is None else rf"\left({text}\right)^{{{exp}}}"


class Transpose(MatrixOp):
    nargs = 1
    spelling = "transpose"

    @classmethod
    def eval(cls, x):
        if isinstance(x, Transpose):
            return x.args[0]
        if isinstance(x, (Eye, EyeDims, SymmetricFunction)) or x.is_Number:
            return x
        return None

    def _latex(self, printer, exp=None):
        x = self.args[0]
        inner = printer._print(x)
        if not (x.is_Symbol or isinstance(x, MatrixOp) and not isinstance(x, MatMul)):
            inner = rf"\left({inner}\right)"
        text = rf"{inner}^{{\top}}"
        return text if exp is None else rf"\left({text}\right)^{{{exp}}}"


class Eye(MatrixOp):
    """``eye(rows)`` or ``eye(cols)``: the identity of that side."""

    nargs = 1
    spelling = "eye"

    def _latex(self, printer, exp=None):
        return r"I" if exp is None else rf"I^{{{exp}}}"


class EyeDims(MatrixOp):
    """``eye_dims()``: the identity of every dimension (a ``dimmat`` value)."""

    nargs = 0
    spelling = "eye_dims"

    def _latex(self, printer, exp=None):
        return r"I" if exp is None else rf"I^{{{exp}}}"


class Gram(MatrixOp):
    """``gram(x)``: of a value per element, one ``[d, d]`` matrix per dimension ``i`` of the
    tensor, ``x`` unfolded along ``i`` times its transpose (the contraction of ``x`` with
    itself over every other dimension: ``x xᵀ`` and ``xᵀ x`` of a matrix)."""

    nargs = 1
    spelling = "gram"


class Modes(MatrixOp):
    """``modes(x, F)``: the value per element ``x`` multiplied along each dimension ``i`` by
    the factor ``F[i]`` (``x ×₁ F₁ ×₂ F₂ …``: ``F₀ x F₁ᵀ`` of a matrix)."""

    nargs = 2
    spelling = "modes"


class SolveModes(MatrixOp):
    """``solve_modes_upper(A, x)`` / ``solve_modes_lower(A, x)``: the value per element ``x``
    multiplied along each dimension ``i`` by ``A[i]⁻¹`` for triangular factors ``A`` (their
    other triangles not read); a solve not finite in fp32 is retried in fp64, and where that
    fails too its result is zero, with a warning."""

    nargs = 2
    upper = True


class SolveModesUpper(SolveModes):
    spelling = "solve_modes_upper"


class SolveModesLower(SolveModes):
    spelling = "solve_modes_lower"
    upper = False


class ProdDims(MatrixOp):
    """``prod_dims(s)``: the product over the tensor's dimensions of a number per dimension
    (``prod_dims(amax(abs(Q))) ** (1 / ndim)``, the geometric mean of the factors' sizes)."""

    nargs = 1
    spelling = "prod_dims"


class Trace(MatrixOp):
    """``trace(M)``: one number per tensor (per matrix of a batched view)."""

    nargs = 1
    spelling = "trace"


class Diag(MatrixOp):
    """``diag(M)``: the diagonal of a factor, one value per row (a ``[rows, rows]`` factor)
    or per column (``[cols, cols]``)."""

    nargs = 1
    spelling = "diag"


class Triu(MatrixOp):
    nargs = 1
    spelling = "triu"


class Tril(MatrixOp):
    nargs = 1
    spelling = "tril"


class Decomposition(MatrixOp):
    """A matrix function that may fail (``eigh``, ``qr``, ``inv_root``, ``inv_root_newton``):
    a rule assigns its value to a matrix state, which keeps its previous value where the
    function fails in fp32 and again in fp64 (with a warning)."""


class SymmetricFunction(Decomposition):
    """A decomposition whose value is symmetric (its transpose is itself)."""


class Eigh(Decomposition):
    """``eigh(M)``: the eigenvectors of the symmetric ``M`` as columns, sorted by
    eigenvalue, largest first."""

    nargs = 1
    spelling = "eigh"


class QR(Decomposition):
    """``qr(M)``: the orthogonal factor Q of ``M = QR`` (torch.linalg.qr's signs)."""

    nargs = 1
    spelling = "qr"


class InvRoot(SymmetricFunction):
    """``inv_root(M, k)``: ``M^(-1/k)`` of the symmetric ``M`` by its eigendecomposition
    (``V diag(λ^(-1/k)) Vᵀ``); a ``λ ≤ 0`` is a failure, so a rule adds ``eps * eye(...)``
    first. ``k`` a whole number from 1 to 8 written in the rule."""

    nargs = 2
    spelling = "inv_root"


class InvRootNewton(SymmetricFunction):
    """``inv_root_newton(M, k)``: ``M^(-1/k)`` of the symmetric positive-definite ``M`` by the
    coupled Newton iteration, matrix products only; a matrix that is not within its tolerance
    after its iteration limit (a singular ``M``) is a failure. ``k`` as in ``inv_root``."""

    nargs = 2
    spelling = "inv_root_newton"


class SortPerm(MatrixOp):
    """``sort_perm(d)``: of a value per row (per column), the permutation matrix ``P`` of
    that side whose columns sort ``d`` from largest to smallest: ``(Q @ P)``'s columns are
    ``Q``'s in that order, and ``transpose(P) @ v`` moves ``v``'s rows with them."""

    nargs = 1
    spelling = "sort_perm"


class ArgmaxOnehot(MatrixOp):
    """``argmax_onehot(d)``: of a value per row (per column), the value of that side that is
    1 at ``d``'s largest entry (the first of equal ones) and 0 elsewhere: ``M @
    argmax_onehot(diag(transpose(M) @ M))`` is ``M``'s column of largest norm (a power
    iteration's start)."""

    nargs = 1
    spelling = "argmax_onehot"


class Solve(MatrixOp):
    """``solve_upper(A, B)`` / ``solve_lower(A, B)``: ``A⁻¹ B`` for a triangular factor ``A``
    (its other triangle is not read), ``B`` a factor of its side, a value per element
    (``[rows, rows]`` ``A``), its transpose (``[cols, cols]`` ``A``) or a value per row or
    column; ``B A⁻¹`` is ``transpose(solve_lower(transpose(A), transpose(B)))``. A matrix whose
    solve is not finite in fp32 is retried in fp64; where that fails too its result is zero,
    with a warning."""

    nargs = 2
    upper = True

    def _latex(self, printer, exp=None):
        a, b = (_factor(printer, x) for x in self.args)
        text = rf"{a}^{{-1}} \, {b}"
        return text if exp is None else rf"\left({text}\right)^{{{exp}}}"


class SolveUpper(Solve):
    spelling = "solve_upper"


class SolveLower(Solve):
    spelling = "solve_lower"
    upper = False


def _factor(printer, x) -> str:
    """``x`` as a factor of a product: bracketed unless it is a name, a call or a product."""
    text = printer._print(x)
    if x.is_Symbol or isinstance(x, MatrixOp) or x.is_Function:
        return text
    return rf"\left({text}\right)"


def _eye(side):
    if not (isinstance(side, sympy.Symbol) and side.name in ("rows", "cols")):
        raise ValueError("eye() takes rows or cols: eye(rows) is the [rows, rows] identity")
    return Eye(side)


def _root(cls):
    """The builder of ``cls(M, k)``, ``k`` a whole number from 1 to 8 written in the rule, or
    (for per-dimension factors, whose order a tensor's ``ndim`` sets) a function of ``ndim``
    alone that is a whole number from 1 to 16 for each tensor (checked at the step)."""

    def build(m, k):
        k = sympy.sympify(k)
        of_ndim = bool(k.free_symbols) and {s.name for s in k.free_symbols} == {"ndim"}
        if not (of_ndim or (k.is_Integer and 1 <= int(k) <= 8)):
            raise ValueError(
                f"{cls.spelling}(M, k) needs k a whole number from 1 to 8 written in the rule, not {k} "
                "(of per-dimension factors, k may be a function of ndim such as 2 * ndim)"
            )
        return cls(m, k)

    return build


# name -> (builder, number of arguments), merged into the optimizer rules' functions.
MATRIX_FUNCTIONS: dict[str, tuple] = {
    "matmul": (MatMul, 2),
    "transpose": (Transpose, 1),
    "eye": (_eye, 1),
    "eye_dims": (EyeDims, 0),
    "gram": (Gram, 1),
    "modes": (Modes, 2),
    "solve_modes_upper": (SolveModesUpper, 2),
    "solve_modes_lower": (SolveModesLower, 2),
    "prod_dims": (ProdDims, 1),
    "trace": (Trace, 1),
    "diag": (Diag, 1),
    "triu": (Triu, 1),
    "tril": (Tril, 1),
    "eigh": (Eigh, 1),
    "qr": (QR, 1),
    "inv_root": (_root(InvRoot), 2),
    "inv_root_newton": (_root(InvRootNewton), 2),
    "sort_perm": (SortPerm, 1),
    "argmax_onehot": (ArgmaxOnehot, 1),
    "solve_upper": (SolveUpper, 2),
    "solve_lower": (SolveLower, 2),
}


def is_matrix_rule(rule) -> bool:
    """Whether ``rule`` (an optimizer ``Rule``) holds or computes a matrix."""
    if rule.kind != "optim":
        return False
    if any(matrix_init(v) for _, v in rule.state):
        return True
    return any(e.atoms(MatrixOp) for _, e in rule.outputs)
