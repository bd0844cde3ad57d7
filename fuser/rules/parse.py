"""Rule text -> sympy statements, through ``ast`` and a whitelist. Nothing is evaluated.

The walker below accepts a small expression language (numbers, names, + - * / **, unary
minus, calls of the functions in ``functions.ELEMENTWISE`` and the kind's reductions,
comparisons and ``and``/``or``/``not`` inside conditions, ``a if c else b``) and builds
sympy expressions from it. Everything else raises ``RuleError`` at the node's line and
column, so no rule text can run code.
"""

from __future__ import annotations

import ast
import math
import textwrap
from dataclasses import dataclass, field

import sympy

from fuser.errors import RuleError
from fuser.rules.functions import CONDITIONS, CONSTANTS, ELEMENTWISE, MatrixFunction, Reduction
from fuser.rules.matrices import MatMul

_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.Pow: lambda a, b: a**b,
}
_AUGOPS = {ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow}
_COMPARE = {
    ast.Lt: sympy.Lt,
    ast.LtE: sympy.Le,
    ast.Gt: sympy.Gt,
    ast.GtE: sympy.Ge,
    ast.Eq: sympy.Eq,
    ast.NotEq: sympy.Ne,
}
_CONSTRUCT_NAMES = {
    ast.Attribute: "attribute access",
    ast.Subscript: "subscripts",
    ast.Lambda: "lambdas",
    ast.Import: "imports",
    ast.ImportFrom: "imports",
    ast.ListComp: "comprehensions",
    ast.SetComp: "comprehensions",
    ast.DictComp: "comprehensions",
    ast.GeneratorExp: "comprehensions",
    ast.List: "lists",
    ast.Tuple: "tuples",
    ast.Dict: "dicts",
    ast.Set: "sets",
    ast.Starred: "starred expressions",
    ast.NamedExpr: "assignment expressions",
    ast.JoinedStr: "f-strings",
    ast.Await: "await",
    ast.Yield: "yield",
    ast.YieldFrom: "yield",
    ast.FunctionDef: "function definitions",
    ast.AsyncFunctionDef: "function definitions",
    ast.ClassDef: "class definitions",
    ast.If: "if statements (use where(cond, a, b))",
    ast.For: "loops",
    ast.While: "loops",
    ast.With: "with statements",
    ast.Try: "try statements",
    ast.Return: "return statements",
    ast.Delete: "del",
    ast.Global: "global",
    ast.Nonlocal: "nonlocal",
    ast.Raise: "raise",
    ast.Assert: "assert",
}


_OPERATOR_TEXT = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.Pow: "**"}


@dataclass(frozen=True)
class Statement:
    """One assignment of a rule: ``target = expr``; ``expr`` uses the values current then."""

    target: str
    expr: sympy.Expr
    line: int
    col: int
    # (each matrix product's and call's value -> the column of its `@` or name, for the
    # errors found after parsing: shapes.check_kinds)
    spots: dict | None = field(default=None, compare=False, hash=False, repr=False)


@dataclass(frozen=True)
class Language:
    """What a rule of one kind may read, write and call.

    ``readable`` names the symbols a rule starts with; ``frozen`` those it may read but
    never assign; ``reductions`` the reduction functions it may call. ``subscripts``
    allows ``base[index]`` for exactly those (base, index) name pairs and maps each to a
    function of the current value of ``base``. ``functions`` are the kind's own functions
    besides ``ELEMENTWISE`` (name -> (builder, number of arguments)); ``per_step`` the
    names that hold one number per step (what ``every(k)`` may read); ``per_token`` a loss
    rule's per-token inputs, which take no subscript.
    """

    readable: frozenset[str]
    frozen: frozenset[str]
    reductions: dict
    subscripts: dict
    functions: dict = field(default_factory=dict)
    per_step: frozenset[str] = frozenset()
    per_token: frozenset[str] = frozenset()


def symbol(name: str) -> sympy.Symbol:
    """The sympy symbol fuser uses for a rule name (real-valued)."""
    return sympy.Symbol(name, real=True)


def parse_text(text: str, lang: Language) -> tuple[list[Statement], dict[str, sympy.Expr], list[str]]:
    """Parse rule text.

    Returns the statements (each expression over the symbols current at its line), the
    final environment (each assigned name as an expression of the starting symbols) and
    the source lines, for error messages.
    """
    if not isinstance(text, str):
        raise RuleError(f"a rule is text or a function, not {type(text).__name__}")
    text = textwrap.dedent(text).strip("\n")
    lines = text.splitlines()
    if not text.strip():
        raise RuleError("the rule is empty")
    try:
        tree = ast.parse(text, mode="exec")
    except SyntaxError as e:
        line = e.lineno or 1
        src = lines[line - 1] if 0 < line <= len(lines) else None
        raise RuleError(f"syntax error: {e.msg}", line=line, col=e.offset, source_line=src) from None
    walker = Walker(lang, lines)
    statements = []
    for node in tree.body:
        statements.append(walker.statement(node))
    return statements, walker.env, lines


class Walker:
    """Turns the statements of a rule's text into sympy, checking each node against the
    language; subclasses (``display``'s as-written reading) override single node kinds."""

    def __init__(self, lang: Language, lines: list[str]):
        self.lang = lang
        self.lines = lines
        self.env: dict[str, sympy.Expr] = {n: symbol(n) for n in lang.readable}
        self.spots: dict = {}

    def error(self, node: ast.AST, message: str) -> RuleError:
        line = getattr(node, "lineno", None)
        col = getattr(node, "col_offset", None)
        src = self.lines[line - 1] if line and 0 < line <= len(self.lines) else None
        return RuleError(message, line=line, col=None if col is None else col + 1, source_line=src)

    def statement(self, node: ast.stmt) -> Statement:
        self.spots = {}
        if isinstance(node, ast.Assign):
            if len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
                raise self.error(node, "assign to one plain name per statement, e.g. `m = beta1 * m + g`")
            target = node.targets[0]
            value = self.expr(node.value)
        elif isinstance(node, ast.AugAssign):
            if not isinstance(node.target, ast.Name):
                raise self.error(node, "assign to one plain name per statement")
            if type(node.op) not in _AUGOPS:
                raise self.error(node, f"operator {type(node.op).__name__} is not supported")
            target = node.target
            current = self.name(
                ast.Name(id=target.id, ctx=ast.Load(), lineno=node.lineno, col_offset=node.col_offset)
            )
            value = _BINOPS[type(node.op)](current, self.expr(node.value))
        elif isinstance(node, ast.AnnAssign):
            raise self.error(node, "annotated assignments are not allowed")
        elif isinstance(node, ast.Expr):
            raise self.error(node, "a statement must assign its value to a name")
        else:
            what = _CONSTRUCT_NAMES.get(type(node), type(node).__name__)
            raise self.error(node, f"{what}: not allowed in a rule")
        name = target.id
        if name in self.lang.frozen:
            raise self.error(target, f"{name!r} is an input of the rule and cannot be assigned")
        if self.is_function(name):
            raise self.error(target, f"{name!r} is a function name and cannot be assigned")
        value = self.finite(node, value)
        self.env[name] = value
        return Statement(name, value, node.lineno, node.col_offset + 1, self.spots)

    def spot(self, value, node: ast.expr, at: str | None = None):
        """``value``, remembered at ``node``'s column (at its ``at`` operator when given)."""
        col = node.col_offset + 1
        line = self.lines[node.lineno - 1] if 0 < node.lineno <= len(self.lines) else ""
        if at is not None and getattr(node.left, "end_lineno", None) == node.lineno:
            found = line.find(at, node.left.end_col_offset)
            col = found + 1 if found >= 0 else col
        if isinstance(value, sympy.Basic):
            self.spots.setdefault(value, col)
        return value

    def finite(self, node: ast.AST, value) -> sympy.Expr:
        value = sympy.sympify(value)
        if value.has(sympy.zoo, sympy.oo, -sympy.oo, sympy.nan):
            raise self.error(node, "the expression has a non-finite value (a division by zero?)")
        return value

    def is_function(self, name: str) -> bool:
        return name in ELEMENTWISE or name in self.lang.reductions or name in self.lang.functions

    def name(self, node: ast.Name) -> sympy.Expr:
        if node.id in self.env:
            return self.env[node.id]
        if node.id in CONSTANTS:
            return CONSTANTS[node.id]
        if self.is_function(node.id):
            raise self.error(node, f"{node.id!r} is a function: call it, e.g. {node.id}(x)")
        known = ", ".join(sorted(self.env))
        raise self.error(node, f"unknown name {node.id!r} (known here: {known})")

    def expr(self, node: ast.expr, condition: bool = False):
        if isinstance(node, ast.Constant):
            v = node.value
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise self.error(node, f"constant {v!r} is not a number")
            if not math.isfinite(v):
                raise self.error(node, f"constant {v!r} is not finite")
            return sympy.Integer(v) if isinstance(v, int) else sympy.Float(v)
        if isinstance(node, ast.Name):
            return self.name(node)
        if (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.MatMult)
            and "transpose" in self.lang.functions
        ):
            product = MatMul(
                self.expr(node.left), self.expr(node.right)
            )  # (optimizer rules: matrix products)
            return self.spot(product, node, "@")
        if isinstance(node, ast.BinOp):
            op = _BINOPS.get(type(node.op))
            if op is None:
                hint = "; a remainder is mod(a, b)" if isinstance(node.op, (ast.Mod, ast.FloorDiv)) else ""
                name = type(node.op).__name__
                raise self.error(node, f"operator {name} is not supported (use + - * / **{hint})")
            value = self.finite(node, op(self.expr(node.left), self.expr(node.right)))
            return self.spot(value, node, _OPERATOR_TEXT.get(type(node.op)))
        if isinstance(node, ast.UnaryOp):
            if isinstance(node.op, ast.USub):
                return -self.expr(node.operand)
            if isinstance(node.op, ast.UAdd):
                return self.expr(node.operand)
            if isinstance(node.op, ast.Not) and condition:
                return sympy.Not(self.expr(node.operand, condition=True))
            raise self.error(node, f"operator {type(node.op).__name__} is not supported here")
        if isinstance(node, ast.Call):
            return self.spot(self.call(node, condition), node)
        if isinstance(node, ast.IfExp):
            cond = self.condition(node.test)
            return ELEMENTWISE["where"][0](cond, self.expr(node.body), self.expr(node.orelse))
        if isinstance(node, ast.Compare):
            if not condition:
                raise self.error(node, "comparisons are only allowed as the condition of where(cond, a, b)")
            left = self.expr(node.left)
            parts = []
            for op, right_node in zip(node.ops, node.comparators):
                rel = _COMPARE.get(type(op))
                if rel is None:
                    raise self.error(node, f"comparison {type(op).__name__} is not supported")
                right = self.expr(right_node)
                parts.append(rel(left, right))
                left = right
            return sympy.And(*parts) if len(parts) > 1 else parts[0]
        if isinstance(node, ast.BoolOp):
            return self.boolop(node, condition)
        if isinstance(node, ast.Subscript):
            return self.subscript(node)
        what = _CONSTRUCT_NAMES.get(type(node), type(node).__name__)
        raise self.error(node, f"{what}: not allowed in a rule")

    def boolop(self, node: ast.BoolOp, condition: bool):
        if not condition:
            raise self.error(
                node,
                "'and' and 'or' are only allowed in the condition of where(cond, a, b), "
                "e.g. where(step > 1 and g > 0, a, b)",
            )
        parts = [self.expr(v, condition=True) for v in node.values]
        return sympy.And(*parts) if isinstance(node.op, ast.And) else sympy.Or(*parts)

    def condition(self, node: ast.expr):
        cond = self.expr(node, condition=True)
        if not isinstance(cond, (sympy.logic.boolalg.Boolean, sympy.core.relational.Relational)):
            raise self.error(node, "a condition must be a comparison, e.g. where(g > 0, a, b)")
        return cond

    def subscript(self, node: ast.Subscript):
        if isinstance(node.value, ast.Name) and node.value.id in self.lang.per_token:
            raise self.error(
                node,
                f"{node.value.id!r} is a per-token input (one number per token): read it as "
                f"{node.value.id}, without a subscript",
            )
        if (
            isinstance(node.value, ast.Name)
            and isinstance(node.slice, ast.Name)
            and (node.value.id, node.slice.id) in self.lang.subscripts
        ):
            build = self.lang.subscripts[(node.value.id, node.slice.id)]
            return build(self.name(node.value))
        if self.lang.subscripts:
            allowed = ", ".join(f"{b}[{i}]" for b, i in self.lang.subscripts)
            raise self.error(node, f"subscripts are not allowed except {allowed}")
        raise self.error(node, "subscripts are not allowed in a rule")

    def matrix_call(self, node: ast.Call, cls):
        """A matrix function: one argument, then its keywords as numbers (``steps=5``)."""
        fname = node.func.id
        if len(node.args) != 1:
            raise self.error(node, f"{fname}() takes 1 argument and keywords, got {len(node.args)} arguments")
        kw = {}
        for k in node.keywords:
            if k.arg not in cls.keywords:
                raise self.error(
                    k, f"{fname}() has no keyword {k.arg!r} (it takes {', '.join(cls.keywords)})"
                )
            kw[k.arg] = _keyword_number(self, k, fname)
        steps = kw.get("steps", cls.keywords.get("steps", 1))
        if "steps" in cls.keywords and (not isinstance(steps, int) or not 1 <= steps <= 20):
            raise self.error(node, f"{fname}()'s steps= must be a whole number from 1 to 20, not {steps!r}")
        return cls.build(self.expr(node.args[0]), **kw)

    def call(self, node: ast.Call, condition: bool = False):
        if not isinstance(node.func, ast.Name):
            if isinstance(node.func, ast.Attribute):
                raise self.error(
                    node, "attribute access is not allowed: call functions by their bare name, e.g. sqrt(v)"
                )
            raise self.error(node, "only named functions can be called")
        fname = node.func.id
        cls = self.lang.reductions.get(fname)
        if cls is not None and issubclass(cls, MatrixFunction):
            return self.matrix_call(node, cls)
        if node.keywords:
            raise self.error(node, f"{fname}() takes positional arguments only")
        if fname in self.lang.reductions:
            if len(node.args) != 1:
                raise self.error(node, f"{fname}() takes 1 argument, got {len(node.args)}")
            arg = self.expr(node.args[0])
            return self.lang.reductions[fname](arg)
        entry = ELEMENTWISE.get(fname) or self.lang.functions.get(fname)
        if entry is None:
            allowed = ", ".join(sorted([*ELEMENTWISE, *self.lang.functions, *self.lang.reductions]))
            raise self.error(node, f"unknown function {fname!r} (allowed: {allowed})")
        builder, nargs = entry
        if len(node.args) != nargs:
            raise self.error(
                node, f"{fname}() takes {nargs} argument{'s' * (nargs != 1)}, got {len(node.args)}"
            )
        if fname in CONDITIONS and not condition:
            raise self.error(node, f"{fname}() is a condition: use it in where({fname}(...), a, b)")
        if fname == "where":
            args = [self.condition(node.args[0]), self.expr(node.args[1]), self.expr(node.args[2])]
        else:
            args = [self.expr(a) for a in node.args]
        if fname == "every":
            self.check_per_step(node.args[0], args[0], fname)
        try:
            value = builder(*args)
        except ValueError as e:  # a builder's check of its arguments (mod by 0, every(0))
            raise self.error(node, str(e)) from None
        return value if fname in CONDITIONS else self.finite(node, value)

    def check_per_step(self, node: ast.expr, value, fname: str) -> None:
        """``value`` (an argument of ``fname``) holds one number per step."""
        names = {s.name for s in sympy.sympify(value).free_symbols}
        if value.atoms(Reduction) or not names <= self.lang.per_step:
            raise self.error(
                node, f"{fname}()'s argument must be a number or a function of hyperparameters and step"
            )


def _keyword_number(walker: Walker, node: ast.keyword, fname: str):
    value = node.value
    negative = isinstance(value, ast.UnaryOp) and isinstance(value.op, ast.USub)
    inner = value.operand if negative else value
    if not (isinstance(inner, ast.Constant) and isinstance(inner.value, (int, float))) or isinstance(
        inner.value, bool
    ):
        raise walker.error(value, f"{fname}()'s {node.arg}= must be a number written in the rule")
    return -inner.value if negative else inner.value


def reductions_in(expr: sympy.Expr) -> set:
    """Every reduction call inside ``expr``."""
    return set(expr.atoms(Reduction))
