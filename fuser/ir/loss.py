"""Loss rule -> ``LossPlan``: the passes over one row of logits, and the derived gradient.

A loss rule is a per-token function ``L(z_y, R_1, ..., R_n)`` of the raw target logit and
of vocabulary reductions ``R_i = op_k f_i(z_k; z_y, R_<i)``. Lowering:

1. replaces every reduction by a per-token symbol (``mean(e)`` becomes ``sum(e) / V``) and
   orders them by dependency: a reduction that reads another runs in a later *pass* over
   the row;
2. derives ``dL/dz_j`` by reverse mode over that small graph of per-token scalars:
   ``adj(R_i) = dL/dR_i + sum_m adj(R_m) * dR_m/dR_i`` and likewise for ``z_y``, where
   ``dR_m/dc`` is itself a vocabulary reduction (``sum`` -> ``sum(df/dc)``, ``logsumexp``
   -> ``sum(softmax * df/dc)``, ``max`` -> ``df/dc`` at the argmax), simplified to a
   closed form when it has one (``sum(df/dc)`` with ``df/dc = k * f`` is ``k * R``), and
   otherwise added as an extra reduction (same pass for ``sum``, the next one for
   ``logsumexp`` and ``max``, which need their own result first). Then
   ``dL/dz_j = sum_i adj(R_i) * w_i(z_j) * df_i/dz(z_j) + [j == y] * adj(z_y)`` with the
   weights ``w`` = 1 (sum), ``exp(f - R)`` (logsumexp), ``[j == argmax]`` (max);
3. splits each pass and the gradient into per-token scalars hoisted out of the vocabulary
   loop and per-element work after ``sympy.cse``.

The target term ``[j == y] * adj(z_y)`` is part of the fp32 gradient expression, so the
kernel adds it before rounding the logit gradient to the storage dtype.

A *token* rule (per-token inputs, or outputs other than ``("loss",)``) lowers every output
``O_i`` and the gradient of ``L' = sum_i dout_i * O_i``, where ``dout_i`` (``dout$<i>``) is
the upstream gradient of output ``i``, one per-token input of the gradient sweep like the
rule's own inputs: one derivation covers any mix of upstream gradients.

A rule that reads the teacher's logit ``t`` (and ``t_y``) lowers it as a second
per-element (per-token) value beside ``z`` (``z_y``): reductions may reduce expressions of
both, and only the student's ``z`` is differentiated. A reduction that depends on no ``z``
(``logsumexp(t)``) takes no adjoint, so it adds no reductions to the derivation.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import sympy

from fuser.errors import RuleError
from fuser.rules.functions import LogSumExp, Max, Mean, Reduction, Sum
from fuser.rules.loss import T, is_token_rule, reads_teacher
from fuser.rules.parse import symbol
from fuser.rules.rule import ZY, Rule

DTYPES = ("fp32", "bf16", "fp16")

Z = symbol("z")  # the raw logit
Z_Y = symbol(ZY)  # the raw logit at the target

# Internal symbols carry a `$`, which no rule name can contain, so they never collide with
# a hyperparameter; the renderer maps them to kernel variables.
VOCAB = sympy.Symbol("vocab$", positive=True)
IS_Y = sympy.Symbol("is_y$", real=True)


def reduction_symbol(i: int) -> sympy.Symbol:
    return sympy.Symbol(f"r${i}", real=True)


def upstream_symbol(i: int) -> sympy.Symbol:
    """The upstream gradient of a token rule's output ``i`` (one number per token)."""
    return sympy.Symbol(f"dout${i}", real=True)


def argmax_indicator(i: int) -> sympy.Symbol:
    """1.0 at the column where reduction ``i`` (a max) attains its maximum, else 0.0."""
    return sympy.Symbol(f"is_max${i}", real=True)


@dataclass(frozen=True)
class Accumulator:
    """One vocabulary reduction: ``index`` names its result ``r$<index>``; ``arg`` is the
    per-element value reduced, over the pass's temporaries."""

    index: int
    op: str  # "logsumexp", "sum" or "max"
    arg: sympy.Expr


@dataclass(frozen=True)
class Pass:
    """One sweep over a row of logits: per-token scalars hoisted before the loop, per-element
    temporaries, and the reductions it accumulates."""

    prologue: tuple[tuple[sympy.Symbol, sympy.Expr], ...]
    body: tuple[tuple[sympy.Symbol, sympy.Expr], ...]
    accumulators: tuple[Accumulator, ...]


@dataclass(frozen=True)
class LossPlan:
    name: str
    rule_text: str
    hyper: tuple[str, ...]
    dtype: str  # storage dtype of the logits (and of the logit gradient written in place)
    passes: tuple[Pass, ...]
    # Per-token scalars after the reductions, in order; `loss` and the gradient read them.
    epilogue: tuple[tuple[sympy.Symbol, sympy.Expr], ...]
    loss: sympy.Expr
    grad: Pass  # the gradient sweep: no accumulators; `grad_value` is stored per element
    grad_value: sympy.Expr
    # The symbolic derivation, before CSE and hoisting, for `fuser show` and tests.
    derivation: tuple[tuple[str, sympy.Expr], ...]
    # A token rule's per-token inputs, its outputs and each output's value (``loss`` is the
    # first); its gradient is that of sum_i dout$i * output_i. Empty for other rules.
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ("loss",)
    values: tuple[sympy.Expr, ...] = ()
    # Whether the kernels read the teacher's fp32 logits (``t``, ``t_y``) beside the student's.
    teacher: bool = False

    @property
    def token(self) -> bool:
        """Whether this is a token rule's plan (see the module's docstring)."""
        return bool(self.values)

    @property
    def reductions(self) -> tuple[Accumulator, ...]:
        return tuple(a for p in self.passes for a in p.accumulators)


@dataclass
class _Node:
    index: int
    op: str  # logsumexp | sum | max
    arg: sympy.Expr  # over z, z_y, hyper, vocab, earlier r$ symbols, is_max$ indicators
    depth: int  # its pass

    @property
    def sym(self) -> sympy.Symbol:
        return reduction_symbol(self.index)


class _Graph:
    """Reductions found in a rule, deduplicated, each with the pass it needs."""

    def __init__(self):
        self.nodes: list[_Node] = []
        self.memo: dict[sympy.Basic, sympy.Expr] = {}
        self.depth_of: dict[sympy.Symbol, int] = {}

    def add(self, op: str, arg: sympy.Expr, depth: int | None = None) -> _Node:
        if depth is None:
            deps = [self.depth_of[s] + 1 for s in arg.free_symbols if s in self.depth_of]
            deps += [
                self.depth_of[reduction_symbol(int(s.name.split("$")[1]))] + 1
                for s in arg.free_symbols
                if s.name.startswith("is_max$")
            ]
            depth = max(deps, default=0)
        node = _Node(len(self.nodes), op, arg, depth)
        self.nodes.append(node)
        self.depth_of[node.sym] = depth
        return node

    def lower(self, e: sympy.Basic) -> sympy.Basic:
        """``e`` with every reduction replaced by its per-token value."""
        if isinstance(e, Reduction):
            if e not in self.memo:
                arg = self.lower(e.args[0])
                if isinstance(e, Mean):
                    self.memo[e] = self.add("sum", arg).sym / VOCAB
                elif isinstance(e, (Sum, LogSumExp, Max)):
                    self.memo[e] = self.add(e.op, arg).sym
                else:
                    raise RuleError(f"{e.op}() is not a loss reduction")
            return self.memo[e]
        if not e.args:
            return e
        return e.func(*[self.lower(a) for a in e.args])


def _diff(e: sympy.Expr, s: sympy.Symbol) -> sympy.Expr:
    # Derivatives of sign, Heaviside and Piecewise edges are Dirac deltas: zero almost
    # everywhere, as in torch's autograd.
    d = sympy.diff(e, s)
    if d.has(sympy.DiracDelta):
        d = d.replace(lambda a: isinstance(a, sympy.DiracDelta), lambda a: sympy.S.Zero)
    return d


def _element_free(e: sympy.Expr) -> bool:
    """Whether ``e`` is one number per token (reads no per-element symbol)."""
    return not any(s in (Z, T, IS_Y) or s.name.startswith("is_max$") for s in e.free_symbols)


def objective(rule: Rule) -> sympy.Expr:
    """What the gradient is taken of: the loss, or for a token rule
    ``sum_i dout$i * output_i``."""
    if not is_token_rule(rule):
        return rule.output("loss")
    return sympy.Add(*[upstream_symbol(i) * e for i, (_, e) in enumerate(rule.outputs)])


def derive(rule: Rule) -> tuple[_Graph, sympy.Expr, sympy.Expr, dict[int, sympy.Expr], sympy.Expr]:
    """Reductions, the loss over them, ``dL/dz`` for one element, each reduction's adjoint
    and the target adjoint, all as sympy over the per-token and per-element symbols."""
    graph = _Graph()
    loss = graph.lower(objective(rule))
    primary = len(graph.nodes)
    # The reductions that depend on the student's logits (of a teacher's alone: none of
    # them, so nothing is differentiated through them).
    student = set()
    for node in graph.nodes[:primary]:
        reads = node.arg.free_symbols
        if Z in reads or Z_Y in reads or any(s in student for s in reads):
            student.add(node.sym)

    # dR_m/dc for every reduction m and per-token scalar c it reads.
    jac: dict[int, dict[sympy.Symbol, sympy.Expr]] = {}
    for node in list(graph.nodes[:primary]):
        jac[node.index] = {}
        scalars = sorted(
            (s for s in node.arg.free_symbols if s == Z_Y or s in student),
            key=sympy.default_sort_key,
        )
        for c in scalars:
            g = _diff(node.arg, c)
            if g == 0:
                continue
            jac[node.index][c] = _reduction_derivative(graph, node, g)

    adj: dict[int, sympy.Expr] = {}
    for node in reversed(graph.nodes[:primary]):
        a = _diff(loss, node.sym)
        for m, d in jac.items():
            if node.sym in d:
                a += adj[m] * d[node.sym]
        adj[node.index] = a
    adj_y = _diff(loss, Z_Y)
    for m, d in jac.items():
        if Z_Y in d:
            adj_y += adj[m] * d[Z_Y]

    grad = IS_Y * adj_y
    for node in graph.nodes[:primary]:
        fz = _diff(node.arg, Z)
        if fz == 0 or adj[node.index] == 0:
            continue
        if node.op == "sum":
            w = sympy.S.One
        elif node.op == "logsumexp":
            w = sympy.exp(node.arg - node.sym)
        else:
            w = argmax_indicator(node.index)
        grad += adj[node.index] * w * fz
    return graph, loss, grad, adj, adj_y


# The largest ratio (in sympy's count of operations) that ``_reduction_derivative`` tries to
# simplify to a per-token value: a generalised JSD's summand takes sympy tens of seconds and
# simplifies to nothing; every ratio of the built-ins that simplify sees is under 35.
SIMPLIFY_OPS = 40


def _reduction_derivative(graph: _Graph, node: _Node, g: sympy.Expr) -> sympy.Expr:
    """d R / d c for reduction ``node`` where ``g = d f / d c`` per element."""
    if node.op == "sum":
        if _element_free(g):
            return g * VOCAB
        ratio = sympy.powsimp(g / node.arg)
        if not _element_free(ratio) and sympy.count_ops(ratio) <= SIMPLIFY_OPS:
            ratio = sympy.simplify(ratio)
        if _element_free(ratio):
            return ratio * node.sym
        return graph.add("sum", g, depth=node.depth).sym
    if _element_free(g):
        return g  # softmax weights sum to 1; the argmax picks one element
    if node.op == "logsumexp":
        return graph.add("sum", sympy.exp(node.arg - node.sym) * g).sym
    return graph.add("sum", argmax_indicator(node.index) * g).sym


class _Hoister:
    """Replace maximal per-token (element-free) subexpressions by symbols ``c$0, c$1 ...``."""

    def __init__(self, counter: list[int]):
        self.found: dict[sympy.Expr, sympy.Symbol] = {}
        self.counter = counter

    def name(self, e: sympy.Expr) -> sympy.Expr:
        if e.is_Atom or (
            isinstance(e, sympy.Mul) and len(e.args) == 2 and e.args[0] == -1 and e.args[1].is_Atom
        ):
            return e
        if e not in self.found:
            self.found[e] = sympy.Symbol(f"c${self.counter[0]}", real=True)
            self.counter[0] += 1
        return self.found[e]

    def __call__(self, e):
        if isinstance(e, sympy.Expr) and _element_free(e):
            return self.name(e)
        if e.is_Atom:
            return e
        if isinstance(e, (sympy.Add, sympy.Mul)):
            scalar_args = [a for a in e.args if isinstance(a, sympy.Expr) and _element_free(a)]
            rest = [self(a) for a in e.args if not (isinstance(a, sympy.Expr) and _element_free(a))]
            if len(scalar_args) > 1 or (scalar_args and not scalar_args[0].is_Atom):
                rest.insert(0, self.name(e.func(*scalar_args)))
            else:
                rest = scalar_args + rest
            return e.func(*rest, evaluate=False)
        return e.func(*[self(a) for a in e.args])


def _sweep(exprs: list[sympy.Expr], counters: dict[str, list[int]]):
    """Hoist per-token parts of ``exprs`` and CSE the per-element rest.

    Returns (prologue, body, reduced expressions).
    """
    hoist = _Hoister(counters["c"])
    hoisted = [hoist(e) for e in exprs]
    prologue = [(s, e) for e, s in hoist.found.items()]
    repl, reduced = sympy.cse(hoisted, symbols=_numbered("t", counters["t"]), optimizations="basic")
    return tuple(prologue), tuple(repl), reduced


def _numbered(prefix: str, counter: list[int]):
    while True:
        yield sympy.Symbol(f"{prefix}${counter[0]}", real=True)
        counter[0] += 1


def lower_loss(rule: Rule, dtype: str = "fp32") -> LossPlan:
    """Lower a loss rule for logits stored in ``dtype`` (math is fp32 whatever it is).
    Plans are frozen, so each (rule, dtype) is lowered once a process: sympy takes seconds
    on some rules (a softcap's), and the front end, the schedule choice and the renderers
    all ask for the same plan."""
    if rule.kind != "loss":
        raise TypeError(f"lower_loss takes a loss rule, not a {rule.kind} rule")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {DTYPES}")
    return _lower_loss(rule, dtype)


@functools.lru_cache(maxsize=256)
def _lower_loss(rule: Rule, dtype: str) -> LossPlan:
    graph, loss, grad, adj, adj_y = derive(rule)

    counters = {"c": [0], "t": [0], "e": [0]}
    passes = []
    for depth in range(max((n.depth for n in graph.nodes), default=-1) + 1):
        nodes = [n for n in graph.nodes if n.depth == depth]
        prologue, body, reduced = _sweep([n.arg for n in nodes], counters)
        accs = tuple(Accumulator(n.index, n.op, e) for n, e in zip(nodes, reduced))
        passes.append(Pass(prologue, body, accs))

    # Per-token scalars after the reductions: the loss (a token rule's outputs) and the
    # gradient's per-token parts.
    token = is_token_rule(rule)
    values = [graph.lower(e) for _, e in rule.outputs] if token else [loss]
    grad_hoist = _Hoister(counters["c"])
    grad_hoisted = grad_hoist(grad)
    scalar_exprs = values + [e for e, _ in grad_hoist.found.items()]
    repl, reduced = sympy.cse(scalar_exprs, symbols=_numbered("e", counters["e"]), optimizations="basic")
    k = len(values)
    epilogue = list(repl) + [(s, e) for (_, s), e in zip(grad_hoist.found.items(), reduced[k:])]
    g_repl, g_reduced = sympy.cse(
        [grad_hoisted], symbols=_numbered("t", counters["t"]), optimizations="basic"
    )
    derivation = [(n, v) for (n, _), v in zip(rule.outputs, values)] if token else [("loss", loss)]
    derivation += [("sum_i dout_i * output_i", loss)] if token else []
    derivation += [("dloss/dz", grad), ("adj(z_y)", adj_y)]
    derivation += [(f"adj(r{i})", a) for i, a in sorted(adj.items())]
    derivation += [(f"r{n.index} = {n.op}", n.arg) for n in graph.nodes]
    return LossPlan(
        name=rule.name,
        rule_text=rule.text,
        hyper=tuple(h for h, _ in rule.hyper),
        dtype=dtype,
        passes=tuple(passes),
        epilogue=tuple(epilogue),
        loss=reduced[0],
        grad=Pass((), tuple(g_repl), ()),
        grad_value=g_reduced[0],
        derivation=tuple(derivation),
        inputs=rule.inputs,
        outputs=tuple(n for n, _ in rule.outputs),
        values=tuple(reduced[:k]) if token else (),
        teacher=reads_teacher(rule),
    )


def hyper_symbols(plan: LossPlan) -> list[sympy.Symbol]:
    return [symbol(h) for h in plan.hyper]
