"""``fuser.rule``: text or a traced function -> a frozen ``Rule`` (loss epilogues: ``rules.loss``)."""

from __future__ import annotations

import inspect
import keyword
import math
import re
import textwrap
from dataclasses import dataclass
from types import MappingProxyType

import sympy

from fuser.errors import RuleError
from fuser.rules.functions import (
    ELEMENTWISE,
    LOSS_REDUCTIONS,
    OPTIM_FUNCTIONS,
    OPTIM_REDUCTIONS,
    MatrixFunction,
    RandomValue,
    StepRand,
    draw_symbol,
    restart_draws,
)
from fuser.rules.matrices import matrix_init
from fuser.rules.parse import Language, Statement, parse_text, symbol
from fuser.rules.shapes import check_kinds

# Names an optimizer rule starts with besides its hyperparameters and states.
OPTIM_INPUTS = ("p", "g", "step")
# Per-tensor sizes an optimizer rule may read: elements, and the rows and columns of the
# tensor's 2-D view (a 1-D tensor is one row; an N-D one is [shape[0], prod(rest)]).
SHAPE_SYMBOLS = ("numel", "rows", "cols", "ndim")
# The value a step's closure returned (``opt.step(closure)``), one number per step.
LOSS_VALUE = "loss"
LOSS_INPUTS = ("z", "y", "t")
# The symbols that stand for the logit at the target, z[y], and the teacher's there, t[y].
ZY = "z_y"
TY = "t_y"


@dataclass(frozen=True, eq=False)
class Rule:
    """A checked rule: its statements as sympy and the final value of each output.

    ``outputs`` maps each written name (``p`` and the states an optimizer rule assigns,
    ``loss`` for a loss rule) to its value as an expression of the starting symbols, with
    the statements before it substituted in.
    """

    kind: str  # "optim" or "loss"
    name: str
    text: str
    hyper: tuple[tuple[str, float], ...]
    state: tuple[tuple[str, float | str], ...]
    statements: tuple[Statement, ...]
    outputs: tuple[tuple[str, sympy.Expr], ...]
    # A loss rule's per-token inputs (one float per token each, read as scalars).
    inputs: tuple[str, ...] = ()

    @property
    def hyper_defaults(self) -> MappingProxyType:
        return MappingProxyType(dict(self.hyper))

    @property
    def state_init(self) -> MappingProxyType:
        return MappingProxyType(dict(self.state))

    def output(self, name: str) -> sympy.Expr:
        return dict(self.outputs)[name]

    def __repr__(self) -> str:
        return (
            f"<fuser.Rule {self.kind} {self.name!r}: "
            + "; ".join(f"{s.target} = {s.expr}" for s in self.statements)
            + ">"
        )

    def _repr_latex_(self) -> str | None:
        """Jupyter shows a rule as math, statement by statement (``display.rule_latex``,
        which the package registers with ``set_latex_renderer``: display sits above rules)."""
        return None if _latex_renderer is None else _latex_renderer(self)


_latex_renderer = None


def set_latex_renderer(render) -> None:
    """Set the function (``Rule -> str``) that ``Rule._repr_latex_`` calls."""
    global _latex_renderer
    _latex_renderer = render


def identifier(name: str) -> str:
    """``name`` made a Python identifier (kernel and class names are built from it)."""
    clean = re.sub(r"\W", "_", name)
    return clean if clean and not clean[0].isdigit() else f"r_{clean}"


def check_names(kind: str, hyper: dict, state: dict, inputs: tuple[str, ...]) -> None:
    """Raise ``RuleError`` for a hyperparameter or state name that is no identifier or is
    reserved, or whose default is not a finite number."""
    reserved = (
        set(inputs) | set(ELEMENTWISE) | set(OPTIM_FUNCTIONS) | set(OPTIM_REDUCTIONS) | set(LOSS_REDUCTIONS)
    )
    reserved |= {*SHAPE_SYMBOLS, ZY, "loss"}
    for what, names in (("hyperparameter", hyper), ("state", state)):
        for n in names:
            if not isinstance(n, str) or not n.isidentifier() or keyword.iskeyword(n):
                raise RuleError(f"{what} name {n!r} is not a valid identifier")
            if n in reserved:
                raise RuleError(f"{what} name {n!r} is reserved (it names an input or a function)")
    both = set(hyper) & set(state)
    if both:
        raise RuleError(f"{sorted(both)} named as both a hyperparameter and a state")
    for n, v in hyper.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise RuleError(f"hyperparameter {n!r} must default to a finite number, not {v!r}")
    for n, v in state.items():
        if v == "p":
            continue
        try:
            if kind == "optim" and matrix_init(v):
                continue
        except ValueError as e:
            raise RuleError(f"state {n!r}: {e}") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise RuleError(
                f"state {n!r} must start as a finite number or 'p' (or, for a matrix state, "
                f"'zeros(rows, rows)', 'zeros(cols, cols)', 'eye(rows)', 'eye(cols)', 'zeros(dims)' or "
                f"'eye(dims)'), not {v!r}"
            )


def rule(source=None, *, name: str | None = None, hyper: dict | None = None, state: dict | None = None):
    """Define an optimizer update rule from text or a function.

    Text: statements such as ``m = beta1 * m + (1 - beta1) * g``, run in order; it reads
    ``p``, ``g``, ``step``, ``numel``, ``rows``, ``cols``, each state and each
    hyperparameter, may call the per-tensor reductions ``norm sum mean amax``,
    ``global_norm`` and ``global_sum`` (over every tensor the step updates) and the axis reductions
    ``rowsum rowmean rownorm rowamax colsum colmean colnorm colamax`` of the tensor's 2-D
    view, and must assign ``p``. Besides the elementwise functions (``cos``, ``sin`` and
    ``mod(a, b)``, the remainder with the sign of ``b``, among them) and the constant
    ``pi``, it may gate on the step: ``where(every(k), a, b)`` takes ``a`` on steps ``k, 2k,
    ...``. Values of hyperparameters and ``step`` alone (a cosine schedule,
    ``lr * 0.5 * (1 + cos(pi * step / total))``) are computed once per step in fp64.
    ``rand()`` (uniform on [0, 1)) and ``randn()`` (standard normal) draw a value per
    element, afresh each step, reproducible from the compile option ``seed``, the step,
    the tensor and the element; each call is its own draw. ``loss`` is the value the step's closure
    returned (``opt.step(closure)``, one number per step, read from device memory).
    A state assigned from row (column) values holds one
    number per row (column); one assigned from per-tensor values, one number per tensor.
    A function is called once with sympy symbols (per-element inputs as positional
    parameters, hyperparameters and ``step`` as keyword-only ones) and returns a dict of
    the new ``p`` and states. Used as ``@fuser.rule(hyper=..., state=...)`` it decorates.
    """
    if hyper is None:
        raise RuleError("an optimizer rule needs hyper=dict(...) with its hyperparameters' defaults")
    hyper = dict(hyper)
    state = dict(state or {})
    if source is None:
        return lambda fn: rule(fn, name=name, hyper=hyper, state=state)
    check_names("optim", hyper, state, OPTIM_INPUTS)
    lang = optim_language(hyper, state)
    rule_name = name or getattr(source, "__name__", None) or "rule"
    try:
        lines = None
        restart_draws()
        if callable(source):
            text, statements, env = _trace_optim(source, lang, hyper, state)
        else:
            statements, env, lines = parse_text(source, lang)
            text = "\n".join(lines)
            if not any(s.target == "p" for s in statements):
                raise RuleError("the rule never assigns p (its last value is the new parameter)")
        statements, env = number_draws(statements, env)
        outputs = [("p", env["p"])]
        outputs += [(s, env[s]) for s in state if env[s] != symbol(s)]
        check_kinds(statements, dict(outputs), tuple(state.items()), lines)
    except RuleError as e:
        raise e.with_rule(rule_name) from None
    return Rule(
        "optim",
        identifier(rule_name),
        text,
        tuple(hyper.items()),
        tuple(state.items()),
        tuple(statements),
        tuple(outputs),
    )


def optim_language(hyper: dict, state: dict) -> Language:
    """What an optimizer rule with these hyperparameters and states may read and call."""
    per_step = frozenset({"step", *SHAPE_SYMBOLS, LOSS_VALUE, *hyper})
    return Language(
        readable=frozenset({*OPTIM_INPUTS, *per_step, *state}),
        frozen=frozenset({"g", *per_step}),
        reductions=OPTIM_REDUCTIONS,
        subscripts={},
        functions=OPTIM_FUNCTIONS,
        per_step=per_step,
    )


def reads_loss(rule: Rule) -> bool:
    """Whether an optimizer rule's update reads ``loss``, the value its step's closure
    returns."""
    loss = symbol(LOSS_VALUE)
    return rule.kind == "optim" and any(loss in e.free_symbols for _, e in rule.outputs)


def _numbered(draw, i: int):
    if isinstance(draw, StepRand):
        return StepRand(draw.args[0], sympy.Integer(i))
    return type(draw)(draw_symbol(i))


def number_draws(statements: list[Statement], env: dict) -> tuple[list[Statement], dict]:
    """The rule's ``rand()`` / ``randn()`` calls numbered 0, 1, ... in the order they were
    made: the same rule text gives the same kernel, and each call its own stream."""
    draws = set()
    for st in statements:
        draws |= st.expr.atoms(RandomValue, StepRand)
    if not draws:
        return statements, env
    order = sorted(draws, key=lambda d: d.index)
    mapping = {d: _numbered(d, i) for i, d in enumerate(order) if d.index != i}
    if not mapping:
        return statements, env
    statements = [
        Statement(s.target, s.expr.xreplace(mapping), s.line, s.col, _replaced(s.spots, mapping))
        for s in statements
    ]
    env = {n: e.xreplace(mapping) if isinstance(e, sympy.Basic) else e for n, e in env.items()}
    return statements, env


def _trace_optim(fn, lang: Language, hyper: dict, state: dict):
    """Call ``fn`` with symbols; return (source text, statements, final env)."""
    src, first_line = _function_source(fn)
    args, kwargs = _trace_arguments(fn, hyper, state, first_line)
    try:
        result = fn(*args, **kwargs)
    except RuleError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the traced body is the rule's
        line = _traceback_line(e, fn)
        raise RuleError(
            f"tracing failed: {type(e).__name__}: {e} (rule functions must use only "
            "arithmetic and fuser's functions, with no `if` on values)",
            line=line,
        ) from None
    statements, env = _traced_statements(result, lang, state, first_line)
    return src.strip("\n"), statements, env


def _function_source(fn) -> tuple[str, int | None]:
    """``fn``'s dedented source (or a placeholder) and the line it starts on, when known."""
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        src = f"<function {getattr(fn, '__name__', '?')}>"
    try:
        first_line = inspect.getsourcelines(fn)[1]
    except (OSError, TypeError):
        first_line = None
    return src, first_line


def _trace_arguments(fn, hyper: dict, state: dict, first_line: int | None) -> tuple[list, dict]:
    """The symbols ``fn`` is called with: ``p``, ``g`` and states positionally,
    hyperparameters, ``step``, ``numel``, ``rows``, ``cols`` and ``ndim`` by keyword."""
    sig = inspect.signature(fn)
    args, kwargs = [], {}
    element = {"p", "g", *state}
    keyword_only = {*hyper, "step", *SHAPE_SYMBOLS, LOSS_VALUE}
    for pname, param in sig.parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise RuleError(
                f"the rule function may not take *{pname} or **{pname}; name each input", line=first_line
            )
        if param.kind == param.KEYWORD_ONLY:
            if pname not in keyword_only:
                raise RuleError(
                    f"keyword-only parameter {pname!r} is neither a hyperparameter, 'step' nor 'loss'",
                    line=first_line,
                )
            kwargs[pname] = symbol(pname)
        else:
            if pname not in element:
                hint = " (make it keyword-only, after *)" if pname in keyword_only else ""
                raise RuleError(f"parameter {pname!r} is not p, g or a state{hint}", line=first_line)
            args.append(symbol(pname))
    return args, kwargs


def _traced_statements(result, lang: Language, state: dict, first_line: int | None) -> tuple[list, dict]:
    """(statements, final env) of the dict a rule function returned, each value checked."""
    if not isinstance(result, dict):
        raise RuleError(
            f"the rule function must return a dict such as dict(p=..., m=...), not {type(result).__name__}",
            line=first_line,
        )
    if "p" not in result:
        raise RuleError("the rule never assigns p: return dict(p=..., ...)", line=first_line)
    env = {n: symbol(n) for n in lang.readable}
    statements = []
    for key, value in result.items():
        if key not in {"p", *state}:
            raise RuleError(f"the rule returns {key!r}, which is neither p nor a state", line=first_line)
        try:
            value = sympy.sympify(value)
        except (sympy.SympifyError, TypeError):
            raise RuleError(f"the value returned for {key!r} is not an expression", line=first_line) from None
        if value.has(sympy.zoo, sympy.oo, -sympy.oo, sympy.nan):
            raise RuleError(f"the value returned for {key!r} is not finite", line=first_line)
        draws = {d.args[0] for d in value.atoms(RandomValue)}
        unknown = {s.name for s in value.free_symbols - draws} - set(lang.readable)
        if unknown:
            raise RuleError(
                f"the value returned for {key!r} uses unknown symbols {sorted(unknown)}", line=first_line
            )
        env[key] = value
        statements.append(Statement(key, value, first_line or 0, 1))
    return statements, env


def _traceback_line(exc: BaseException, fn) -> int | None:
    code = getattr(fn, "__code__", None)
    tb = exc.__traceback__
    line = None
    while tb is not None:
        if tb.tb_frame.f_code is code:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


# Traced functions call fuser.sqrt, fuser.where, ... : the same builders as rule text.
def _export(name: str):
    builder, nargs = ELEMENTWISE.get(name) or OPTIM_FUNCTIONS[name]

    def f(*args):
        if len(args) != nargs:
            raise TypeError(f"{name}() takes {nargs} argument(s), got {len(args)}")
        if name == "where" and isinstance(args[0], bool):  # (Python's ==: two expressions' forms)
            raise RuleError(
                f"where()'s condition is the Python bool {args[0]}, not a condition of the rule's "
                "values: in a traced rule, == and != compare two expressions as written; write "
                "sympy.Eq(a, b) or sympy.Ne(a, b), and & | ~ for and, or, not"
            )
        value = builder(*[sympy.sympify(a) for a in args])
        # A traced loss function's logits (fuser.rules.loss.Logits) stay wrapped, so
        # `z[y]` still works after `z = cap * fuser.tanh(z / cap)`.
        wrapped = next((a for a in args if hasattr(a, "_fuser_rewrap")), None)
        return value if wrapped is None else wrapped._fuser_rewrap(value)

    f.__name__ = name
    f.__doc__ = f"Symbolic {name} for rule functions traced by fuser.rule / fuser.loss."
    return f


def _export_reduction(name: str):
    cls = OPTIM_REDUCTIONS[name]

    def f(x, **keywords):
        if issubclass(cls, MatrixFunction):
            return cls.build(sympy.sympify(x), **keywords)
        if keywords:
            raise TypeError(f"{name}() takes no keywords")
        return cls(sympy.sympify(x))

    f.__name__ = name
    f.__doc__ = f"Symbolic {name} for optimizer rule functions traced by fuser.rule."
    return f


FUNCTIONS = {n: _export(n) for n in (*ELEMENTWISE, *OPTIM_FUNCTIONS)}
REDUCTIONS = {n: _export_reduction(n) for n in OPTIM_REDUCTIONS}


def _replaced(spots: dict | None, mapping: dict) -> dict | None:
    return None if spots is None else {k.xreplace(mapping): v for k, v in spots.items()}
