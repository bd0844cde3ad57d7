"""The functions a rule may call, as sympy objects.

One table, ``FUNCTIONS``, maps each name a rule may use to the sympy builder that
implements it; the text parser and the traced-function front end both read it, and the
printer in ``fuser.codegen`` knows how to print every object these builders produce.
"""

from __future__ import annotations

import itertools
import threading

import sympy
from sympy.codegen.cfunctions import expm1 as _Expm1
from sympy.codegen.cfunctions import log1p as _Log1p

from fuser.rules.matrices import MATRIX_FUNCTIONS


class Sigmoid(sympy.Function):
    """1 / (1 + exp(-x)), kept whole so the printer can emit one call."""

    nargs = 1
    is_real = True

    def fdiff(self, argindex=1):
        s = Sigmoid(self.args[0])
        return s * (1 - s)

    def _eval_rewrite_as_exp(self, x, **kwargs):
        return 1 / (1 + sympy.exp(-x))


class ApproxTanh(sympy.Function):
    """``tanh`` through the GPU's one-instruction approximation (``tanh.approx.f32``, sm_75
    and later: a relative error within 2**-10.987 by the PTX ISA). Its derivative is
    ``1 - approx_tanh(x)**2``, so a derived gradient reuses the value. The interpreter,
    which runs no assembly, computes the exact ``tanh``."""

    nargs = 1
    is_real = True

    @classmethod
    def eval(cls, x):
        return sympy.S.Zero if x.is_zero else None

    def fdiff(self, argindex=1):
        return 1 - ApproxTanh(self.args[0]) ** 2

    def _eval_rewrite_as_tanh(self, x, **kwargs):
        return sympy.tanh(x)

    def _sympystr(self, printer):
        return f"approx_tanh({printer._print(self.args[0])})"

    def _latex(self, printer, exp=None):
        text = rf"\operatorname{{approx\_tanh}}{{\left({printer._print(self.args[0])} \right)}}"
        return text if exp is None else rf"{text}^{{{exp}}}"


class Remainder(sympy.Function):
    """``mod(a, b)``: the remainder of ``a / b`` with Python's sign convention for floats,
    ``a - b * floor(a / b)``: the sign of ``b`` (``mod(-1, 3) = 2``, ``mod(1, -3) = -2``),
    in ``[0, b)`` for ``b > 0`` (the kernel corrects the rounding of ``a / b`` that would
    leave it outside); ``mod(a, 0)`` is NaN in a kernel (a RuleError where ``b`` is
    written as 0)."""

    nargs = 2
    is_real = True

    @classmethod
    def eval(cls, a, b):
        if a.is_Number and b.is_Number and not b.is_zero:
            return a - b * sympy.floor(a / b)
        return None

    def fdiff(self, argindex=1):
        a, b = self.args
        return sympy.S.One if argindex == 1 else -sympy.floor(a / b)

    def _sympystr(self, printer):
        return f"mod({printer._print(self.args[0])}, {printer._print(self.args[1])})"

    def _latex(self, printer, exp=None):
        a, b = (printer._print(x) for x in self.args)
        text = rf"\operatorname{{mod}}\left({a}, {b}\right)"
        return text if exp is None else rf"{text}^{{{exp}}}"


class RandomValue(sympy.Function):
    """A random value per element, drawn afresh each step: ``rand()``, ``randn()``.

    The argument, a symbol ``draw$<i>``, numbers the call within its rule (0, 1, ... in
    the order the rule makes them, ``rule.number_draws``), so that two calls are two
    independent values and one value assigned to a name is the same wherever it is read,
    in every phase of a step. (A symbol, not a number: sympy's conditions over values
    that read no symbol at all fail to fold, ``where(m < 1, ...)`` after
    ``m = where(rand() < 0.9, ...)``.)
    Its bits come from the counter-based generator of stochastic rounding, on a stream of
    their own: reproducible from (``seed``, ``step``, tensor, element), with no state."""

    nargs = 1
    is_real = True
    spelling = ""

    @property
    def index(self) -> int:
        """The call's number within its rule."""
        return int(self.args[0].name.partition("$")[2])

    def fdiff(self, argindex=1):
        return sympy.S.Zero

    def _sympystr(self, printer):
        return f"{self.spelling}()"

    def _latex(self, printer, exp=None):
        text = rf"\operatorname{{{self.spelling}}}()"
        return text if exp is None else rf"{text}^{{{exp}}}"


class Rand(RandomValue):
    """``rand()``: uniform on [0, 1), a multiple of 2**-24: ``(bits >> 8) * 2**-24``."""

    spelling = "rand"

    def _eval_is_nonnegative(self):
        return True


class Randn(RandomValue):
    """``randn()``: standard normal, by Box and Muller from two uniforms,
    ``sqrt(-2 log u1) * cos(2 pi u2)``, ``u1 = ((bits1 >> 8) + 1) * 2**-24`` in (0, 1]."""

    spelling = "randn"


# Numbers each call of rand() / randn() as it is made, per thread; each rule restarts the
# count (``restart_draws``), so its calls are already 0, 1, ... and renumbering them rebuilds
# nothing (rebuilding re-evaluates every minimum, maximum and where above a draw).
_DRAWS = threading.local()


def restart_draws() -> None:
    """Number the next ``rand()`` / ``randn()`` call of this thread 0."""
    _DRAWS.count = itertools.count()


def draw_symbol(i: int) -> sympy.Symbol:
    """The argument of a rule's ``i``-th ``rand()`` / ``randn()``."""
    return sympy.Symbol(f"draw${i}", real=True)


def _drawer(cls):
    def draw():
        if not hasattr(_DRAWS, "count"):
            restart_draws()
        return cls(draw_symbol(next(_DRAWS.count)))

    return draw


class StepRand(sympy.Function):
    """``rand_step()``: one uniform value on [0, 1) per step (a multiple of 2**-24), the same
    for every tensor of the step, for gates such as ``where(rand_step() < prob, fit, Q)``.

    Its arguments are the ``step`` symbol (so it is a per-step value, computed with the
    other functions of hyperparameters and ``step``) and the call's number within its rule
    (numbered with ``rand()``'s calls). Its bits come from the counter-based generator, on
    a stream of their own: ``u = (hash32(key + j) >> 8) * 2**-24`` for the ``j``-th call,
    ``key = hash32(stream_key(seed, step, 0) ^ 0x53544550)``."""

    nargs = 2
    is_real = True

    @property
    def index(self) -> int:
        """The call's number within its rule."""
        return int(self.args[1])

    def fdiff(self, argindex=1):
        return sympy.S.Zero

    def _eval_is_nonnegative(self):
        return True

    def _sympystr(self, printer):
        return "rand_step()"

    def _latex(self, printer, exp=None):
        text = r"\operatorname{rand\_step}()"
        return text if exp is None else rf"{text}^{{{exp}}}"


def _step_drawer():
    if not hasattr(_DRAWS, "count"):
        restart_draws()
    return StepRand(sympy.Symbol("step", real=True), sympy.Integer(next(_DRAWS.count)))


class Reduction(sympy.Function):
    """A reduction of an expression to one number (per tensor, per device or per token).

    Subclasses name the reduction in ``op``; lowering decides where each one runs.
    """

    nargs = 1
    is_real = True
    op = ""


def spelling(r: Reduction) -> str:
    """The name a rule calls reduction ``r`` by (``rowmean``, ``norm``)."""
    return getattr(type(r), "axis", "") + r.op


class Norm(Reduction):
    op = "norm"


class Sum(Reduction):
    op = "sum"


class Mean(Reduction):
    op = "mean"


class Amax(Reduction):
    op = "amax"


class Max(Reduction):
    op = "max"


class GlobalNorm(Reduction):
    op = "global_norm"


class GlobalSum(Reduction):
    """The sum over every tensor a step updates: a dot product of two per-element values
    over all of them is ``global_sum(a * b)``."""

    op = "global_sum"


class MatrixFunction(Reduction):
    """A function of each matrix ``[rows, cols]`` of a tensor's 2-D view (an N-D tensor is
    ``[shape[0], prod(rest)]``, or with ``view="batched"`` a batch of its last two
    dimensions, each matrix on its own), one value per element. ``args`` are the argument then
    the keywords' values, in ``keywords``' order (numbers, fixed when the rule is made)."""

    keywords: dict = {}

    @classmethod
    def build(cls, arg, **kw):
        unknown = set(kw) - set(cls.keywords)
        if unknown:
            raise TypeError(
                f"{cls.op}() got unknown keyword(s) {sorted(unknown)}; it takes {sorted(cls.keywords)}"
            )
        values = {**cls.keywords, **kw}
        return cls(
            arg, *[sympy.Float(values[k]) if k != "steps" else sympy.Integer(values[k]) for k in cls.keywords]
        )


class Orthogonalize(MatrixFunction):
    """The orthogonal factor of the matrix, by Newton–Schulz's quintic iteration as Muon
    runs it (Jordan et al. 2024): ``X = M / (||M||_F + eps)`` (the transpose when rows >
    cols), then ``steps`` times ``A = X X^T; B = b A + c A^2; X = a X + B X``, bf16
    products with fp32 accumulation (``fuser.runtime.matrix``: the division is folded into
    the first iteration, ``a X`` into ``B``)."""

    op = "orthogonalize"
    nargs = 6
    keywords = {"steps": 5, "a": 3.4445, "b": -4.7750, "c": 2.0315, "eps": 1e-7}


class AxisReduction(Reduction):
    """A reduction along one axis of a tensor's 2-D view ``[rows, cols]`` (a 1-D tensor is
    one row; an N-D one is ``[shape[0], prod(rest)]``, or with ``view="batched"`` a batch
    of ``[shape[-2], shape[-1]]`` matrices): ``axis`` ``"row"`` gives one value per row
    (over its columns), ``"col"`` one per column of each matrix (over its rows). A
    per-tensor reduction of such values (``mean(row_var)``) runs over each matrix's rows or
    columns: one value per matrix of a batched view, where per-tensor reductions of element
    values run over the whole tensor."""

    axis = ""


class RowSum(AxisReduction):
    op, axis = "sum", "row"


class RowMean(AxisReduction):
    op, axis = "mean", "row"


class RowNorm(AxisReduction):
    op, axis = "norm", "row"


class RowAmax(AxisReduction):
    op, axis = "amax", "row"


class ColSum(AxisReduction):
    op, axis = "sum", "col"


class ColMean(AxisReduction):
    op, axis = "mean", "col"


class ColNorm(AxisReduction):
    op, axis = "norm", "col"


class ColAmax(AxisReduction):
    op, axis = "amax", "col"


class LogSumExp(Reduction):
    op = "logsumexp"


def _where(cond, a, b):
    cond = sympy.sympify(cond)
    if cond is sympy.true:
        return sympy.sympify(a)
    if cond is sympy.false:
        return sympy.sympify(b)
    return sympy.Piecewise((a, cond), (b, True))


def _small(e, nodes: int = 200) -> bool:
    """Whether ``e`` has at most ``nodes`` nodes (a matrix rule's values have thousands)."""
    return next(itertools.islice(sympy.preorder_traversal(e), nodes, None), None) is None


def _extreme(cls):
    """``minimum`` / ``maximum``: sympy's own, except that arguments not small are only
    folded when equal: sympy orders two expressions by factoring their difference, which
    over a matrix rule's values takes seconds."""

    def build(*args):
        args = [sympy.sympify(a) for a in args]
        if all(_small(a) for a in args) or len(set(args)) == 1:
            return cls(*args)
        return cls(*args, evaluate=False)

    return build


_MIN, _MAX = _extreme(sympy.Min), _extreme(sympy.Max)


def _clamp(x, lo, hi):
    return _MIN(_MAX(x, lo), hi)


def _mod(a, b):
    if sympy.sympify(b).is_zero:
        raise ValueError("mod(a, b) with b = 0 has no value")
    return Remainder(a, b)


def every(k, step=None):
    """The condition "this step is a multiple of ``k``": true on steps ``k, 2k, 3k, ...``
    (``mod(step, k) == 0``; ``step`` counts from 1), for ``where(every(k), a, b)``."""
    k = sympy.sympify(k)
    if k.is_Number and not k > 0:
        raise ValueError(f"every(k) needs k > 0, not {k}")
    return sympy.Eq(Remainder(sympy.Symbol("step", real=True) if step is None else step, k), 0)


# name -> (builder, number of arguments)
ELEMENTWISE: dict[str, tuple] = {
    "sqrt": (sympy.sqrt, 1),
    "rsqrt": (lambda x: 1 / sympy.sqrt(x), 1),
    "exp": (sympy.exp, 1),
    "log": (sympy.log, 1),
    "log1p": (_Log1p, 1),
    "expm1": (_Expm1, 1),
    "abs": (sympy.Abs, 1),
    "sign": (sympy.sign, 1),
    "tanh": (sympy.tanh, 1),
    "approx_tanh": (ApproxTanh, 1),
    "sigmoid": (Sigmoid, 1),
    "minimum": (_MIN, 2),
    "maximum": (_MAX, 2),
    "where": (_where, 3),
    "clamp": (_clamp, 3),
    "cos": (sympy.cos, 1),
    "sin": (sympy.sin, 1),
    "mod": (_mod, 2),
}

# Named constants of the rule language (a hyperparameter, state or temporary of the same
# name takes precedence, as in Python).
CONSTANTS: dict[str, sympy.Expr] = {"pi": sympy.pi}

# Functions of optimizer rules only (they read the step, or draw per step): name ->
# (builder, arguments).
# ``every(k)`` is a condition, for ``where``.
OPTIM_FUNCTIONS: dict[str, tuple] = {
    "every": (every, 1),
    "rand": (_drawer(Rand), 0),
    "randn": (_drawer(Randn), 0),
    "rand_step": (_step_drawer, 0),
    **MATRIX_FUNCTIONS,
}
CONDITIONS = frozenset({"every"})

# Reductions a rule of each kind may call, by the name it calls them.
OPTIM_REDUCTIONS: dict[str, type[Reduction]] = {
    "norm": Norm,
    "sum": Sum,
    "mean": Mean,
    "amax": Amax,
    "global_norm": GlobalNorm,
    "global_sum": GlobalSum,
    "rowsum": RowSum,
    "rowmean": RowMean,
    "rownorm": RowNorm,
    "rowamax": RowAmax,
    "colsum": ColSum,
    "colmean": ColMean,
    "colnorm": ColNorm,
    "colamax": ColAmax,
    "orthogonalize": Orthogonalize,
}
LOSS_REDUCTIONS: dict[str, type[Reduction]] = {
    "logsumexp": LogSumExp,
    "sum": Sum,
    "mean": Mean,
    "max": Max,
}
