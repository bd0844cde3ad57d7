"""How fuser objects show themselves in Jupyter: rules as math, kernels as highlighted source.

``Rule._repr_latex_`` renders a rule statement by statement, as its author wrote it (each
right-hand side over the names current at that line, not with earlier lines substituted);
compiled optimizers render their generated Triton source through ``source_html``.
Highlighting uses pygments when it is installed and falls back to an escaped ``<pre>``.
"""

from __future__ import annotations

import ast
import html
import re
import textwrap

import sympy
from sympy.codegen.cfunctions import expm1, log1p
from sympy.printing.latex import LatexPrinter
from sympy.printing.str import StrPrinter

from fuser.rules.functions import (
    LOSS_REDUCTIONS,
    OPTIM_FUNCTIONS,
    OPTIM_REDUCTIONS,
    Reduction,
    Sigmoid,
    spelling,
)
from fuser.rules.parse import Language, Statement, Walker, symbol

_GREEK = {
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
    "rho",
    "sigma",
    "tau",
    "upsilon",
    "phi",
    "chi",
    "psi",
    "omega",
    "eps",
}


def symbol_latex(name: str) -> str:
    """LaTeX for a rule name: ``beta1`` is β₁, ``m`` is m, ``weight_decay`` is *weight_decay*;
    and for the loss derivation's own symbols (their names hold a ``$``): ``r$0`` is the
    reduction r₀, ``vocab$`` the vocabulary size V, ``is_y$`` the indicator [z is the target]."""
    if name == "z_y":
        return "z_{y}"
    if "$" in name:
        base, _, index = name.partition("$")
        special = {"vocab": "V", "is_y": "[z{=}z_{y}]"}
        if base in special:
            return special[base]
        if base == "is_max":
            return f"[z{{=}}\\max_{{{index}}}]"
        return f"{base}_{{{index}}}"
    m = re.fullmatch(r"([A-Za-z]+)(\d*)", name)
    if m and (len(m.group(1)) == 1 or m.group(1) in _GREEK):
        base = (
            "\\epsilon"
            if m.group(1) == "eps"
            else (f"\\{m.group(1)}" if m.group(1) in _GREEK else m.group(1))
        )
        return base + (f"_{{{m.group(2)}}}" if m.group(2) else "")
    return "\\mathit{" + name.replace("_", "\\_") + "}"


class RuleLatexPrinter(LatexPrinter):
    """sympy's LaTeX printer with fuser's names and functions."""

    def _print(self, expr, **kwargs):
        # Reductions first: fuser's Sum and Max share their names with sympy classes whose
        # printers would otherwise be picked.
        if isinstance(expr, Reduction):
            return self._print_Reduction(expr, kwargs.get("exp"))
        return super()._print(expr, **kwargs)

    def _print_Symbol(self, expr, style="plain"):
        return symbol_latex(expr.name)

    def _print_Sigmoid(self, expr, exp=None):
        return self._fn("\\sigma", expr, exp)

    def _print_log1p(self, expr, exp=None):
        return self._fn("\\operatorname{log1p}", expr, exp)

    def _print_expm1(self, expr, exp=None):
        return self._fn("\\operatorname{expm1}", expr, exp)

    def _print_Reduction(self, expr, exp=None):
        return self._fn(f"\\operatorname{{{spelling(expr)}}}", expr, exp)

    def _print_sign(self, expr, exp=None):
        return self._fn("\\operatorname{sign}", expr, exp)

    def _fn(self, name, expr, exp):
        args = ", ".join(self._print(a) for a in expr.args)
        head = f"{name}^{{{exp}}}" if exp else name
        return f"{head}\\left({args}\\right)"

    def _print_Function(self, expr, exp=None):
        if isinstance(expr, Sigmoid):
            return self._print_Sigmoid(expr, exp)
        if isinstance(expr, log1p):
            return self._print_log1p(expr, exp)
        if isinstance(expr, expm1):
            return self._print_expm1(expr, exp)
        if isinstance(expr, Reduction):
            return self._print_Reduction(expr, exp)
        return super()._print_Function(expr, exp)


class RuleStrPrinter(StrPrinter):
    """sympy expressions in the rule language's own spelling: ``where(c, a, b)``,
    ``norm(e)``, ``minimum``, ``sigmoid``, ``abs``."""

    def __init__(self):
        super().__init__({"order": "none"})

    def _print(self, expr, **kwargs):
        if isinstance(expr, Reduction):  # before sympy's Sum and Max printers
            return self._call(spelling(expr), expr)
        return super()._print(expr, **kwargs)

    def _print_Piecewise(self, expr):
        *pairs, (last, _) = expr.args
        text = self._print(last)
        for value, cond in reversed(pairs):
            text = f"where({self._print(cond)}, {self._print(value)}, {text})"
        return text

    def _print_Symbol(self, expr):
        # The loss derivation's own symbols hold a `$` (r$0, vocab$): print them bare.
        if expr.name == "z_y":
            return "z[y]"
        return expr.name.replace("$", "")

    def _call(self, name, expr):
        return f"{name}({', '.join(self._print(a) for a in expr.args)})"

    def _print_Function(self, expr):
        # sympy skips _print_<Base> for subclasses of functions: dispatch here.
        if isinstance(expr, Sigmoid):
            return self._call("sigmoid", expr)
        return super()._print_Function(expr)

    def _print_Min(self, expr):
        return self._call("minimum", expr)

    def _print_Max(self, expr):
        return self._call("maximum", expr)

    def _print_Abs(self, expr):
        return self._call("abs", expr)


def expr_text(expr) -> str:
    """An expression as rule text."""
    return RuleStrPrinter().doprint(sympy.sympify(expr))


def expr_latex(expr) -> str:
    return RuleLatexPrinter({"mul_symbol": None, "order": "none"}).doprint(sympy.sympify(expr))


class _AsWritten(Walker):
    """The parser's walker, except that each name stays a symbol after it is assigned, so
    every statement reads over the names current at its line (as the author wrote it)."""

    def name(self, node: ast.Name) -> sympy.Expr:
        if node.id in self.env:
            return symbol(node.id)
        return super().name(node)

    def subscript(self, node: ast.Subscript):
        if isinstance(node.value, ast.Name) and isinstance(node.slice, ast.Name):
            return symbol(f"{node.value.id}_{node.slice.id}")
        return super().subscript(node)

    def statement(self, node):
        st = super().statement(node)
        self.env[st.target] = symbol(st.target)
        return st


def written_statements(rule) -> tuple[Statement, ...]:
    """The rule's statements as written. Text rules are parsed again (they parsed once
    already, so this cannot fail); traced functions give one statement per output."""
    if not is_text(rule):
        return tuple(rule.statements)
    reductions = OPTIM_REDUCTIONS if rule.kind == "optim" else LOSS_REDUCTIONS
    optim = rule.kind == "optim"
    per_step = {
        *(n for n, _ in rule.hyper),
        *(("step", "numel", "rows", "cols", "ndim", "loss") if optim else ()),
    }
    readable = {*per_step, *(n for n, _ in rule.state), *(("p", "g") if optim else ("z", "y"))}
    lang = Language(
        readable=frozenset(readable),
        frozen=frozenset(),
        reductions=reductions,
        subscripts={},
        functions=OPTIM_FUNCTIONS if optim else {},
        per_step=frozenset(per_step),
    )
    text = textwrap.dedent(rule.text).strip("\n")
    walker = _AsWritten(lang, text.splitlines())
    try:
        return tuple(walker.statement(node) for node in ast.parse(text).body)
    except Exception:  # noqa: BLE001 - a display must never raise; show what the rule holds
        return tuple(rule.statements)


def is_text(rule) -> bool:
    """True for a rule written as text, False for a traced function."""
    text = rule.text.lstrip()
    return not (text.startswith("@") or text.startswith("def ") or text.startswith("<function"))


def rule_latex(rule) -> str:
    """The rule as display math: one ``target ← expression`` row per statement, then, for a
    loss rule, the gradient fuser derived with respect to one logit and the reductions it
    reads.

    A traced function gives each output as a function of the values before the step, so
    its rows name the new values with a prime: ``p' = ...``, ``m' = ...``.
    """
    if is_text(rule):
        rows = [
            f"{symbol_latex(s.target)} &\\leftarrow {expr_latex(s.expr)}" for s in written_statements(rule)
        ]
    else:
        rows = [f"{symbol_latex(s.target)}' &= {expr_latex(s.expr)}" for s in rule.statements]
    rows += _gradient_rows(rule)
    return "$$\\begin{aligned}\n" + " \\\\\n".join(rows) + "\n\\end{aligned}$$"


def _gradient_rows(rule) -> list[str]:
    """For a loss rule, the derivative of the per-token loss with respect to one logit as
    fuser derived it, then the vocabulary reductions it reads: rows of an aligned block."""
    if rule.kind != "loss":
        return []
    try:
        from fuser.ir.loss import lower_loss

        derivation = dict(lower_loss(rule).derivation)
    except Exception:  # noqa: BLE001 - a display must never raise; show the statements alone
        return []
    rows = [f"\\frac{{\\partial\\,\\mathit{{loss}}}}{{\\partial z}} &= {expr_latex(derivation['dloss/dz'])}"]
    for label, expr in derivation.items():
        if " = " in label:  # "r0 = logsumexp": a reduction over the vocabulary
            name, op = label.split(" = ")
            body = expr_latex(expr)
            rows.append(f"{name[0]}_{{{name[1:]}}} &= \\operatorname{{{op}}}_z\\left({body}\\right)")
    return rows


def source_html(text: str, title: str = "") -> str:
    """Python/Triton source as HTML: highlighted by pygments with inline styles (no
    stylesheet needed in the notebook), or escaped in a ``<pre>`` without pygments."""
    try:
        from pygments import highlight
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import PythonLexer
    except ImportError:
        body = f"<pre>{html.escape(text)}</pre>"
    else:
        body = highlight(text, PythonLexer(), HtmlFormatter(noclasses=True, nobackground=False))
    head = f"<summary>{html.escape(title)}</summary>" if title else ""
    return f"<details open>{head}{body}</details>"


def optimizer_html(obj) -> str:
    """HTML for a compiled optimizer class or instance: rule, hyperparameters (per param
    group for an instance) and the Triton source of each kernel it launches."""
    is_class = isinstance(obj, type)
    cls = obj if is_class else type(obj)
    rule = obj.rule
    parts = [
        f"<b>{html.escape(cls.__name__)}</b>: fuser optimizer compiled from rule "
        f"<code>{html.escape(rule.name)}</code>"
    ]
    if is_class:
        parts.append(_table(["hyperparameter", "default"], [[k, v] for k, v in rule.hyper]))
    else:
        names = list(rule.hyper_defaults)
        rows = []
        for i, group in enumerate(obj.param_groups):
            hv = obj._group_hyper(group)
            rows.append([i, len(group["params"]), *(hv[n] for n in names)])
        parts.append(_table(["group", "tensors", *names], rows))
    if rule.state:
        parts.append(
            "state: "
            + ", ".join(f"<code>{html.escape(s)}</code> = {html.escape(str(v))}" for s, v in rule.state)
        )
    for title, text in _kernel_texts(obj):
        parts.append(source_html(text, title))
    return "<div>" + "<br>\n".join(parts) + "</div>"


def loss_html(compiled) -> str:
    """HTML for a compiled loss: its rule's hyperparameters and the Triton row kernel (for
    bf16 inputs, as ``.source``), whose header quotes the derived gradient."""
    rule = compiled.rule
    parts = [f"<b>{html.escape(rule.name)}</b>: fuser fused linear + loss"]
    if rule.hyper:
        parts.append(_table(["hyperparameter", "default"], [[k, v] for k, v in rule.hyper]))
    src = compiled.kernel_source("bf16")
    parts.append(source_html(src.text, f"Triton kernel {src.entry} for bf16 inputs"))
    return "<div>" + "<br>\n".join(parts) + "</div>"


def _kernel_texts(obj) -> list[tuple[str, str]]:
    """(title, source) of each kernel: those an instance has launched, else those it
    launches for fp32 tensors."""
    from fuser.runtime.engine import launched_sources

    seen, out = set(), []
    for src in launched_sources(obj):
        if src.digest not in seen:
            seen.add(src.digest)
            out.append((f"Triton kernel {src.entry} for {dict(src.meta).get('dtypes', '')}", src.text))
    return out


def _table(header: list, rows: list[list]) -> str:
    def cells(tag, values):
        return "".join(f"<{tag}>{html.escape(str(v))}</{tag}>" for v in values)

    body = "".join(f"<tr>{cells('td', r)}</tr>" for r in rows)
    return f"<table><tr>{cells('th', header)}</tr>{body}</table>"


class NotebookDisplay:
    """Mixin: Jupyter shows a compiled optimizer, class or instance, as its kernel source.

    IPython looks up ``_repr_html_`` on the object and, for a class, uses it only when it
    is a bound method; the descriptor below binds to the instance or to the class.
    """

    class _Bound:
        def __init__(self, fn):
            self.fn = fn

        def __get__(self, obj, cls):
            import types

            return types.MethodType(self.fn, obj if obj is not None else cls)

    _repr_html_ = _Bound(optimizer_html)
