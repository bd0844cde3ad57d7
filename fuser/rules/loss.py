"""``fuser.loss``: rule text or a traced function -> a checked ``Rule`` of kind ``"loss"``.

A loss rule reads ``z`` (one raw logit), ``z[y]`` (the logit at the target), its
hyperparameters, its per-token inputs (``inputs=``) and vocabulary reductions, and assigns
``loss``, the per-token loss, or each of its ``outputs=``.
``z`` may be reassigned by elementwise transforms; every later ``z`` and ``z[y]`` means
the transformed value. In the sympy form, the symbol ``z`` always stands for the *raw*
logit and ``z_y`` for the raw logit at the target, so derivatives with respect to them are
derivatives with respect to the logits the matmul produced.

A rule may also read ``t``, the teacher's (reference model's) raw logit at the same
vocabulary index, and ``t[y]`` (``t_y``); ``t`` may be reassigned like ``z``. Such a rule
takes ``teacher_hidden=`` and ``teacher_weight=`` at the call, and no gradient reaches them.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import keyword
import textwrap

import sympy

from fuser.errors import RuleError
from fuser.rules.functions import ELEMENTWISE, LOSS_REDUCTIONS, Reduction
from fuser.rules.parse import Language, Statement, parse_text, symbol
from fuser.rules.rule import LOSS_INPUTS, TY, ZY, Rule, check_names, identifier

Z = symbol("z")
Z_Y = symbol(ZY)
T = symbol("t")  # the teacher's raw logit
T_Y = symbol(TY)
Y = symbol("y")
# Each per-element symbol and its value at the target.
AT_TARGET = {Z: Z_Y, T: T_Y}


def at_target(expr: sympy.Expr) -> sympy.Expr:
    """``expr`` (a function of the logits ``z`` and ``t``) evaluated at the target: every
    ``z`` (``t``) outside a vocabulary reduction becomes ``z_y`` (``t_y``); reductions are
    per-token values and stay as they are."""
    if isinstance(expr, Reduction):
        return expr
    if expr in AT_TARGET:
        return AT_TARGET[expr]
    if not expr.args:
        return expr
    return expr.func(*[at_target(a) for a in expr.args])


def outer_symbols(expr: sympy.Basic) -> set[sympy.Symbol]:
    """Free symbols of ``expr`` that are not inside a reduction."""
    if isinstance(expr, Reduction):
        return set()
    if isinstance(expr, sympy.Symbol):
        return {expr}
    out: set[sympy.Symbol] = set()
    for a in expr.args:
        out |= outer_symbols(a)
    return out


def loss_language(hyper: dict, inputs: tuple[str, ...] = ()) -> Language:
    return Language(
        readable=frozenset({"z", "y", "t", *hyper, *inputs}),
        frozen=frozenset({"y", *hyper, *inputs}),
        reductions=LOSS_REDUCTIONS,
        subscripts={("z", "y"): at_target, ("t", "y"): at_target},
        per_token=frozenset(inputs),
    )


def loss(
    source=None,
    *,
    name: str | None = None,
    hyper: dict | None = None,
    inputs=(),
    outputs=("loss",),
):
    """Define a loss epilogue from text or a function (see ``fuser.losses``).

    ``inputs`` names per-token float inputs the rule reads as scalars (given at the call by
    keyword as ``[T]`` tensors, no gradient to them); ``outputs`` names the per-token values
    the rule assigns, in the order a compiled call returns them (default ``("loss",)``, the
    per-token loss that ``reduction`` reduces)."""
    hyper = dict(hyper or {})
    if source is None:
        return lambda fn: loss(fn, name=name, hyper=hyper, inputs=inputs, outputs=outputs)
    rule_name = name or getattr(source, "__name__", None) or "loss"
    try:
        check_names("loss", hyper, {}, (*LOSS_INPUTS, TY))
        inputs, outputs = _check_io(source, hyper, inputs, outputs)
        return build_loss_rule(source, identifier(rule_name), hyper, inputs, outputs)
    except RuleError as e:
        raise e.with_rule(rule_name) from None


def _names(value, what: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    try:
        names = tuple(value)
    except TypeError:
        raise RuleError(f"{what} must be a tuple of names, not {value!r}") from None
    for n in names:
        if not isinstance(n, str) or not n.isidentifier() or keyword.iskeyword(n):
            raise RuleError(f"{what[:-1]} name {n!r} is not a valid identifier")
    if len(set(names)) != len(names):
        raise RuleError(f"{what} {list(names)} name one value twice")
    return names


def _check_io(source, hyper: dict, inputs, outputs) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``inputs`` and ``outputs`` as tuples of names, after raising ``RuleError`` for a name
    that is reserved, taken twice, or both an input and a hyperparameter (at its first use
    in rule text)."""
    inputs, outputs = _names(inputs, "inputs"), _names(outputs, "outputs")
    if not outputs:
        raise RuleError("outputs must name at least one per-token value the rule assigns")
    reserved = {*LOSS_INPUTS, ZY, TY, *ELEMENTWISE, *LOSS_REDUCTIONS}
    for what, names in (("input", inputs), ("output", outputs)):
        for n in names:
            if n in reserved:
                raise RuleError(f"{what} name {n!r} is reserved (it names z, y, t or a function)")
    for n in inputs:
        if n in hyper:
            raise _first_use(source, n, f"{n!r} is named as both a per-token input and a hyperparameter")
        if n in outputs:
            raise _first_use(source, n, f"{n!r} is named as both a per-token input and an output")
    for n in outputs:
        if n in hyper:
            raise _first_use(source, n, f"{n!r} is named as both an output and a hyperparameter")
    return inputs, outputs


def _first_use(source, name: str, message: str) -> RuleError:
    """``RuleError(message)`` at the first place rule text uses ``name`` (line 1 for a
    function, or text that does not parse)."""
    if callable(source) or not isinstance(source, str):
        return RuleError(message, line=1)
    text = textwrap.dedent(source).strip("\n")
    lines = text.splitlines()
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return RuleError(message, line=1)
    uses = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == name]
    if not uses:
        return RuleError(message, line=1)
    first = min(uses, key=lambda n: (n.lineno, n.col_offset))
    return RuleError(
        message, line=first.lineno, col=first.col_offset + 1, source_line=lines[first.lineno - 1]
    )


def is_token_rule(rule: Rule) -> bool:
    """Whether a loss rule reads per-token inputs, a teacher's logits or has outputs besides
    ``("loss",)``: its compiled call takes ``[T]`` inputs (and the teacher's head) by keyword
    and, for other outputs, returns them."""
    return bool(rule.inputs) or tuple(n for n, _ in rule.outputs) != ("loss",) or reads_teacher(rule)


def reads_teacher(rule: Rule) -> bool:
    """Whether a loss rule reads the teacher's logits ``t`` or ``t[y]``."""
    return rule.kind == "loss" and any(e.has(T, T_Y) for _, e in rule.outputs)


def reads_teacher_target(rule: Rule) -> bool:
    """Whether a loss rule reads ``t[y]``, the teacher's logit at the target."""
    return rule.kind == "loss" and any(e.has(T_Y) for _, e in rule.outputs)


def teacher_target_as_input(rule: Rule) -> Rule:
    """``rule`` reading ``t[y]`` as one more per-token input, its last, named apart from the
    rule's own names: the form in which the staged kernels (vocabulary-parallel, lean) take it,
    since their rows hold a slice of the vocabulary; the caller gives each token's value
    (``fuser.losses.tokens.teacher_at_target``)."""
    taken = {*rule.inputs, *(n for n, _ in rule.hyper), *(n for n, _ in rule.outputs)}
    name = "t_at_target"
    while name in taken:
        name += "_"
    value = symbol(name)
    outputs = tuple((n, e.xreplace({T_Y: value})) for n, e in rule.outputs)
    return dataclasses.replace(rule, outputs=outputs, inputs=(*rule.inputs, name))


def build_loss_rule(
    source, name: str, hyper: dict, inputs: tuple[str, ...] = (), outputs: tuple[str, ...] = ("loss",)
) -> Rule:
    """Parse (text) or trace (function) a loss epilogue and check it."""
    if callable(source):
        text, statements = _trace_loss(source, hyper, inputs, outputs)
        lines = text.splitlines()
    else:
        statements, _, lines = parse_text(source, loss_language(hyper, inputs))
        text = "\n".join(lines)
    values = _check(statements, lines, hyper, inputs, outputs)
    return Rule(
        "loss", name, text, tuple(hyper.items()), (), tuple(statements), tuple(zip(outputs, values)), inputs
    )


def _error(message: str, st: Statement | None, lines: list[str]) -> RuleError:
    if st is None:
        return RuleError(message)
    src = lines[st.line - 1] if lines and 0 < st.line <= len(lines) else None
    return RuleError(message, line=st.line, col=st.col, source_line=src)


def _check(
    statements: list[Statement],
    lines: list[str],
    hyper: dict,
    inputs: tuple[str, ...] = (),
    outputs: tuple[str, ...] = ("loss",),
) -> list[sympy.Expr]:
    """Validate the statements; return the final value of each output."""
    allowed = {Z, Z_Y, T, T_Y} | {symbol(h) for h in hyper} | {symbol(n) for n in inputs}
    last: dict[str, Statement] = {}
    for st in statements:
        expr = st.expr
        if Y in expr.free_symbols:
            raise _error("'y' is the target index: use it only as z[y], the logit at the target", st, lines)
        unknown = {s.name for s in expr.free_symbols} - {s.name for s in allowed}
        if unknown:
            raise _error(f"unknown symbols {sorted(unknown)}", st, lines)
        for red in sorted(expr.atoms(Reduction), key=sympy.default_sort_key):
            if not outer_symbols(red.args[0]) & {Z, T}:
                raise _error(
                    f"{red.op}(...) must reduce an expression of z (or t) over the vocabulary, "
                    f"but its argument {red.args[0]} does not depend on z or t",
                    st,
                    lines,
                )
        if st.target in outputs:
            last[st.target] = st
    values = []
    for out in outputs:
        if out not in last:
            what = "the per-token loss" if out == "loss" else "one of its outputs"
            raise RuleError(
                f"the rule never assigns {out} ({what})",
                line=statements[-1].line if statements else None,
            )
        st = last[out]
        for e in (Z, T):
            if e in outer_symbols(st.expr):
                raise _error(
                    f"{out} uses {e} outside a reduction: a per-token output may read {e}[y] and "
                    f"reductions such as logsumexp({e}), not {e} itself",
                    st,
                    lines,
                )
        values.append(st.expr)
    return values


# ---- the traced-function form ----------------------------------------------------------------


class _Target:
    """The target index ``y`` handed to a traced loss function: it may only index ``z``."""

    def __repr__(self) -> str:
        return "y"

    def __index__(self):
        raise TypeError("y is the target index: use it only as z[y]")


_TARGET = _Target()


def _unwrap(value):
    return value.expr if isinstance(value, Logits) else value


class Logits:
    """The logit ``z`` as seen by a traced loss function: arithmetic like a sympy expression
    (sympy defers to it through ``_op_priority``), plus ``z[y]``.

    fuser's elementwise functions keep the wrapper (``_fuser_rewrap``), so ``z[y]`` works
    after ``z = cap * fuser.tanh(z / cap)``.
    """

    _op_priority = 100.0
    __slots__ = ("expr",)

    def __init__(self, expr):
        self.expr = sympy.sympify(expr)

    def _sympy_(self):
        return self.expr

    def _fuser_rewrap(self, value):
        return Logits(value)

    def __getitem__(self, key):
        if key is not _TARGET:
            raise TypeError("the logits may only be indexed by the target: z[y]")
        return at_target(self.expr)

    def __bool__(self):
        raise TypeError("a logit has no truth value while tracing: use fuser.where(cond, a, b)")

    def __repr__(self) -> str:
        return f"Logits({self.expr})"

    def __add__(self, o):
        return Logits(self.expr + _unwrap(o))

    def __radd__(self, o):
        return Logits(_unwrap(o) + self.expr)

    def __sub__(self, o):
        return Logits(self.expr - _unwrap(o))

    def __rsub__(self, o):
        return Logits(_unwrap(o) - self.expr)

    def __mul__(self, o):
        return Logits(self.expr * _unwrap(o))

    def __rmul__(self, o):
        return Logits(_unwrap(o) * self.expr)

    def __truediv__(self, o):
        return Logits(self.expr / _unwrap(o))

    def __rtruediv__(self, o):
        return Logits(_unwrap(o) / self.expr)

    def __pow__(self, o):
        return Logits(self.expr ** _unwrap(o))

    def __rpow__(self, o):
        return Logits(_unwrap(o) ** self.expr)

    def __neg__(self):
        return Logits(-self.expr)

    def __pos__(self):
        return self

    def __abs__(self):
        return Logits(sympy.Abs(self.expr))

    def __lt__(self, o):
        return sympy.Lt(self.expr, _unwrap(o))

    def __le__(self, o):
        return sympy.Le(self.expr, _unwrap(o))

    def __gt__(self, o):
        return sympy.Gt(self.expr, _unwrap(o))

    def __ge__(self, o):
        return sympy.Ge(self.expr, _unwrap(o))

    __hash__ = None


def _reduction(name: str):
    cls = LOSS_REDUCTIONS[name]

    def reduce(e):
        value = sympy.sympify(_unwrap(e))
        return cls(value)

    reduce.__name__ = name
    reduce.__doc__ = (
        f"The vocabulary reduction ``{name}(e)`` for loss functions traced by fuser.loss; "
        "``e`` is an expression of the logit z."
    )
    return reduce


logsumexp = _reduction("logsumexp")
vocab_sum = _reduction("sum")
vocab_mean = _reduction("mean")
vocab_max = _reduction("max")


def _trace_loss(fn, hyper: dict, inputs=(), outputs=("loss",)) -> tuple[str, list[Statement]]:
    try:
        src = textwrap.dedent(inspect.getsource(fn)).strip("\n")
    except (OSError, TypeError):
        src = f"<function {getattr(fn, '__name__', '?')}>"
    args, kwargs = _trace_arguments(fn, hyper, inputs)
    try:
        result = fn(*args, **kwargs)
    except RuleError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the traced body is the rule's
        raise RuleError(
            f"tracing failed: {type(e).__name__}: {e} (loss functions use arithmetic, fuser's "
            "functions, fuser.losses reductions and z[y], with no `if` on values)",
            line=_traceback_line(e, fn),
        ) from None
    return src, [Statement(n, v, 1, 1) for n, v in zip(outputs, _output_values(result, outputs))]


def _trace_arguments(fn, hyper: dict, inputs=()) -> tuple[list, dict]:
    """What ``fn`` is called with: the logits ``z`` and target ``y`` positionally,
    hyperparameters and per-token inputs by keyword."""
    sig = inspect.signature(fn)
    args, kwargs = [], {}
    for pname, param in sig.parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise RuleError(f"the loss function may not take *{pname} or **{pname}; name each input", line=1)
        if param.kind == param.KEYWORD_ONLY:
            if pname not in hyper and pname not in inputs:
                raise RuleError(
                    f"keyword-only parameter {pname!r} is neither a hyperparameter nor an input", line=1
                )
            kwargs[pname] = symbol(pname)
        elif pname == "z":
            args.append(Logits(Z))
        elif pname == "t":
            args.append(Logits(T))
        elif pname == "y":
            args.append(_TARGET)
        else:
            hint = " (make it keyword-only, after *)" if pname in hyper or pname in inputs else ""
            raise RuleError(f"parameter {pname!r} is neither z nor y (nor t, the teacher's logit){hint}",
                            line=1)  # fmt: skip
    return args, kwargs


def _output_values(result, outputs: tuple[str, ...]) -> list[sympy.Expr]:
    """The per-token outputs a loss function returned (the value of a single output, or a
    dict of every output), checked, in ``outputs``' order."""
    if isinstance(result, dict):
        if set(result) != set(outputs):
            want = ", ".join(f"{n}=..." for n in outputs)
            raise RuleError(f"a loss function returns dict({want}), not keys {sorted(result)}", line=1)
        return [_loss_value(result[n], n) for n in outputs]
    if len(outputs) != 1:
        want = ", ".join(f"{n}=..." for n in outputs)
        raise RuleError(f"a loss function with several outputs returns dict({want})", line=1)
    return [_loss_value(result, outputs[0])]


def _loss_value(result, name: str = "loss") -> sympy.Expr:
    """One per-token value a loss function returned, checked."""
    if isinstance(result, Logits):
        raise RuleError(
            f"the loss function returns z itself as {name}: a per-token output may read z[y] and "
            "reductions such as logsumexp(z)",
            line=1,
        )
    try:
        value = sympy.sympify(result)
    except (sympy.SympifyError, TypeError):
        raise RuleError(
            f"the loss function returned {type(result).__name__}, not an expression", line=1
        ) from None
    if not isinstance(value, sympy.Expr) or value.has(sympy.zoo, sympy.oo, -sympy.oo, sympy.nan):
        raise RuleError("the loss function returned a non-finite or non-numeric value", line=1)
    return value


def _traceback_line(exc: BaseException, fn) -> int | None:
    code = getattr(fn, "__code__", None)
    tb = exc.__traceback__
    line = None
    while tb is not None:
        if tb.tb_frame.f_code is code:
            line = tb.tb_lineno - code.co_firstlineno + 1
        tb = tb.tb_next
    return line
