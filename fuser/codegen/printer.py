"""``TritonPrinter``: sympy expressions -> Triton expression text.

One table, ``FUNCTIONS``, maps each sympy function to its Triton spelling. Every operator
whose Triton meaning differs from Python's is overridden: powers (integer powers become
products, square roots use the correctly rounded ``tl.sqrt_rn``), numbers (always float
literals, so ``1/2`` never becomes integer division), comparisons and boolean logic (``&``,
``|`` on tensors, each operand a true int1 through ``_cond``), ``Piecewise`` (``tl.where``).
"""

from __future__ import annotations

import sympy
from sympy.codegen.cfunctions import expm1, log1p
from sympy.printing.pycode import PythonCodePrinter

from fuser.rules.functions import Remainder, Sigmoid

# Triton spellings; helpers prefixed `_` are jitted functions in templates/helpers.py.jinja.
FUNCTIONS = {
    sympy.exp: "tl.exp",
    sympy.log: "tl.log",
    sympy.Abs: "tl.abs",
    sympy.sign: "_sign",
    sympy.tanh: "_tanh",
    Sigmoid: "_sigmoid",
    log1p: "_log1p",
    expm1: "_expm1",
    sympy.cos: "tl.cos",
    sympy.sin: "tl.sin",
    sympy.floor: "tl.floor",
    Remainder: "_mod",
}

_RELATIONS = {"<": "<", "<=": "<=", ">": ">", ">=": ">=", "==": "==", "!=": "!="}

# x**n for integer |n| up to this is written as a product.
MAX_PRODUCT_POWER = 8


class TritonPrinter(PythonCodePrinter):
    """Print sympy expressions as Triton code.

    ``names`` maps each symbol to the variable that holds it in the kernel, so rule names
    never collide with the kernel's own variables; ``fp64`` prints for fp64 scalars;
    ``fast_sqrt`` prints the hardware's approximate square root (an ulp or two) where a
    correctly rounded one would take several instructions more for nothing the stored
    values can show (8-bit states).
    """

    printmethod = "_tritoncode"

    def __init__(
        self, names: dict[sympy.Symbol, str] | None = None, *, fp64: bool = False, fast_sqrt: bool = False
    ):
        super().__init__(
            {
                "fully_qualified_modules": False,
                "inline": True,
                "allow_unknown_functions": False,
                "standard": "python3",
            }
        )
        self.names = dict(names or {})
        # tl.sqrt_rn is fp32-only; fp64 square roots are correctly rounded anyway.
        self.sqrt = "tl.sqrt" if fp64 or fast_sqrt else "tl.sqrt_rn"

    def doprint_expr(self, expr) -> str:
        return self._print(sympy.sympify(expr))

    def parenthesize(self, item, level, strict=False):
        # Numbers print as plain float literals: only a negative one needs parentheses.
        if isinstance(item, sympy.Number) and item >= 0:
            return self._print(item)
        return super().parenthesize(item, level, strict)

    # atoms ---------------------------------------------------------------------------
    def _print_Symbol(self, expr):
        try:
            return self.names[expr]
        except KeyError:
            raise KeyError(f"no kernel variable for symbol {expr.name!r}") from None

    def _print_float_literal(self, value: float) -> str:
        text = repr(float(value))
        return text if any(c in text for c in ".en") else text + ".0"

    def _print_Integer(self, expr):
        return self._print_float_literal(int(expr))

    def _print_Rational(self, expr):
        return self._print_float_literal(float(expr.p) / float(expr.q))

    def _print_Float(self, expr):
        return self._print_float_literal(float(expr))

    def _print_NegativeOne(self, expr):
        return "-1.0"

    def _print_One(self, expr):
        return "1.0"

    def _print_Zero(self, expr):
        return "0.0"

    def _print_Half(self, expr):
        return "0.5"

    def _print_Exp1(self, expr):
        return self._print_float_literal(float(sympy.E))

    def _print_Pi(self, expr):
        return self._print_float_literal(float(sympy.pi))

    def _print_BooleanTrue(self, expr):
        return "True"

    def _print_BooleanFalse(self, expr):
        return "False"

    # operators -----------------------------------------------------------------------
    def _print_Pow(self, expr, rational=False):
        base, e = expr.as_base_exp()
        b = self.parenthesize(base, 100)  # atoms and calls stay bare, the rest gets ()
        if e == sympy.Rational(1, 2):
            return f"{self.sqrt}({self._print(base)})"
        if e == sympy.Rational(-1, 2):
            return f"(1.0 / {self.sqrt}({self._print(base)}))"
        if e.is_Integer and 0 < abs(int(e)) <= MAX_PRODUCT_POWER:
            product = " * ".join([b] * abs(int(e)))
            return f"({product})" if e > 0 else f"(1.0 / ({product}))"
        if e.is_Integer and int(e) == 0:
            return "1.0"
        return f"_pow({self._print(base)}, {self._print(e)})"

    def _print_StepRand(self, expr):
        # rand_step(): the kernel's ``seed`` and the tensor's step (docs/rules.md)
        return f"_step_rand(seed, {self._print(expr.args[0])}, {expr.index})"

    def _print_Mod(self, expr):
        raise NotImplementedError("modulo has no meaning in a rule")

    def _print_Function(self, expr):
        name = FUNCTIONS.get(expr.func)
        if name is None:
            raise NotImplementedError(f"no Triton spelling for {expr.func}")
        return f"{name}({', '.join(self._print(a) for a in expr.args)})"

    _print_exp = _print_Function
    _print_log = _print_Function
    _print_Abs = _print_Function
    _print_sign = _print_Function
    _print_tanh = _print_Function
    _print_Sigmoid = _print_Function
    _print_log1p = _print_Function
    _print_expm1 = _print_Function
    _print_cos = _print_Function
    _print_sin = _print_Function
    _print_floor = _print_Function
    _print_Remainder = _print_Function

    # A draw's stream counters: 2i for the i-th call of the rule (and 2i + 1, randn's second
    # uniform). ``rng_key`` and ``offs`` are the step kernel's (codegen.render).
    def _print_Rand(self, expr):
        return f"_uniform(rng_key, offs, {2 * expr.index})"

    def _print_Randn(self, expr):
        return f"_normal(rng_key, offs, {2 * expr.index})"

    def _print_ApproxTanh(self, expr):
        # (every kernel that prints a rule takes INTERPRETED: the interpreter runs no assembly)
        return f"_approx_tanh({self._print(expr.args[0])}, INTERPRETED)"

    def _minmax(self, expr, fn):
        args = [self._print(a) for a in expr.args]
        out = args[-1]
        for a in reversed(args[:-1]):
            out = f"{fn}({a}, {out}, propagate_nan=tl.PropagateNan.ALL)"
        return out

    def _print_Min(self, expr):
        return self._minmax(expr, "tl.minimum")

    def _print_Max(self, expr):
        return self._minmax(expr, "tl.maximum")

    def _print_Heaviside(self, expr):
        x = self._print(expr.args[0])
        half = expr.args[1] if len(expr.args) > 1 else sympy.Rational(1, 2)
        return f"tl.where({x} > 0.0, 1.0, tl.where({x} < 0.0, 0.0, {self._print(half)}))"

    def _print_Piecewise(self, expr):
        *pairs, (last_value, last_cond) = expr.args
        if last_cond is not sympy.true:
            raise NotImplementedError("a Piecewise must end with an otherwise branch")
        out = self._print(last_value)
        for value, cond in reversed(pairs):
            out = f"tl.where({self._print(cond)}, {self._print(value)}, {out})"
        return out

    def _print_Relational(self, expr):
        op = _RELATIONS[expr.rel_op]
        return f"({self._print(expr.lhs)} {op} {self._print(expr.rhs)})"

    def _cond(self, expr) -> str:
        # Each operand of `&` and `|` passes through _cond (templates/helpers.py.jinja), so a
        # per-step condition joins a per-element one under the interpreter too.
        text = self._print(expr)
        if isinstance(expr, sympy.core.relational.Relational):
            text = text[1:-1]
        return f"_cond({text})"

    def _print_And(self, expr):
        return "(" + " & ".join(self._cond(a) for a in expr.args) + ")"

    def _print_Or(self, expr):
        return "(" + " | ".join(self._cond(a) for a in expr.args) + ")"

    def _print_Not(self, expr):
        return f"({self._print(expr.args[0])} == 0)"
