"""Optimizer rule -> ``OptimPlan``: the kernels of one step and what each computes.

A step is one or more *phases*, each one launch over every tensor. Rules without
reductions have one phase. A reduction (``norm``, ``sum``, ``mean``, ``amax``,
``global_norm``) splits the rule: the phase before it accumulates per-tensor partials in
fp32 (re-reading what it needs), the next phase reads the results as per-tensor scalars.
The last phase stores the new parameter and states, except the fp32 states an earlier
phase can compute, where storing them there saves the later phases loads
(``fuser.ir.stores``: CAME's momentum, LAMB's moments). Within a phase the work is
separated by how often it must run:

- *per-step scalars* (``prologue``): every maximal subexpression that depends only on
  hyperparameters, ``step``, ``numel``, ``loss``, reduction results and per-tensor scalar states
  (bias corrections, ``1 - lr*wd``, trust ratios) is hoisted out of the per-element work
  and computed once per program in fp64;
- *per-element work* (``body``): the rest, after ``sympy.cse``, in fp32;
- *per-tensor scalar states* (``scalar_updates``): states whose update reads no
  per-element value (NAdam's ``mu_product``) are one number per tensor, not a tensor.

*Shape-aware* rules (``rows``, ``cols``, the axis reductions ``rowmean`` ... ``colamax``,
states of one number per row or column) run their phases over tiles of each tensor's 2-D
view (``OptimPlan.tiled``). An axis reduction accumulates per-row (per-column) partials of
its phase's tiles; the program that finishes a tensor's last tile of a phase then runs
that tensor's *tails*: loops over its rows or columns that reduce row or column values
to per-tensor numbers (``mean(row_var)``) and, in the last phase, write the new row and
column states, once every program has read their old values.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from fuser.errors import RuleError
from fuser.ir.stores import plan_early_stores
from fuser.rules.functions import AxisReduction, MatrixFunction, RandomValue, Reduction
from fuser.rules.parse import symbol
from fuser.rules.rule import LOSS_VALUE, Rule, reads_loss
from fuser.rules.shapes import COL, ELEMENT, ROW, SCALAR, kind_of, state_kinds

# Storage dtypes a tensor may have, by the short name used in plans and cache entries.
DTYPES = ("fp32", "bf16", "fp16")
# 8-bit blockwise formats of element states: codes, and one fp32 scale per QBLOCK elements
# in the slot ``<state>__absmax``. Companded codes after FlashOptim (Gonzalez Ortiz et al.,
# arXiv:2602.23349, Algorithms 2-3): softsign for signed states, square root for
# non-negative ones; linear absmax codes; or fp8 (e4m3, e5m2) of the value over its
# block's absmax.
QFORMATS = ("int8", "uint8", "int8_linear", "uint8_linear", "fp8e4m3", "fp8e5m2")
# Split master weights: the low part of an fp32 master beside a bf16 parameter, in slot
# MASTER_SLOT, as a fraction of the parameter's bf16 spacing (``runtime.quant``).
MASTER_DTYPES = ("int8", "int16")
MASTER_SLOT = "p__lo"

STEP = symbol("step")
NUMEL = symbol("numel")
ROWS = symbol("rows")
COLS = symbol("cols")
NDIM = symbol("ndim")
LOSS = symbol(LOSS_VALUE)


# How a reduction accumulates over elements and how its result is read back.
# op -> (value accumulated per element, combine: "sum" or "max")
ACCUMULATE = {
    "sum": (lambda e: e, "sum"),
    "mean": (lambda e: e, "sum"),
    "norm": (lambda e: e * e, "sum"),
    "global_norm": (lambda e: e * e, "sum"),
    "global_sum": (lambda e: e, "sum"),
    "amax": (lambda e: e, "max"),
}
# Reductions over every tensor a step updates (per-device totals, then across shards).
GLOBAL_OPS = ("global_norm", "global_sum")


@dataclass(frozen=True)
class Slot:
    """One tensor of the step: its rule name, role, storage dtype, and whether the kernel
    writes it. Roles: ``param``, ``grad``, ``state`` (per element), ``row`` and ``col``
    (a state of one number per row or column)."""

    name: str
    role: str
    dtype: str
    written: bool


@dataclass(frozen=True)
class ReductionPlan:
    """One reduction of the rule: ``symbol`` stands for its result in later phases.

    ``axis`` is ``"row"`` or ``"col"`` for an axis reduction (one result per row or
    column, accumulated in ``axis_column`` of the axis buffer), else ``""``. ``over`` says
    what a per-tensor reduction runs over: ``"element"`` (accumulated by every program
    of ``phase``), or ``"row"`` / ``"col"`` (row or column values, reduced by the tail of
    ``phase``)."""

    symbol: sympy.Symbol
    op: str
    phase: int  # the phase that accumulates it; its result is usable from phase + 1
    column: int  # column in the per-tensor result table (-1 for axis reductions)
    global_column: int  # column in the per-device table (global reductions), else -1
    axis: str = ""
    axis_column: int = -1  # index among the reductions of its axis
    over: str = ELEMENT
    args: tuple = ()  # a matrix function's keywords' values (orthogonalize: steps, a, b, c, eps)

    @property
    def matrix(self) -> bool:
        """A matrix function: phase ``phase`` stores its argument in bf16, the runtime
        transforms each tensor's matrix (batched by shape), later phases read the result."""
        return self.op == "orthogonalize"


@dataclass(frozen=True)
class Tail:
    """A loop over one tensor's rows (``axis="row"``) or columns, run once the phase's
    programs have finished that tensor: temporaries, then per-tensor reductions of row
    values (``reduce``: (reduction column, value)) or new row states (``stores``)."""

    axis: str
    body: tuple[tuple[sympy.Symbol, sympy.Expr], ...]
    reduce: tuple[tuple[int, sympy.Expr], ...]
    stores: tuple[tuple[str, sympy.Expr], ...]


@dataclass(frozen=True)
class Phase:
    """One launch: scalars, per-element temporaries, then the last phase's stores, or an
    earlier phase's reductions and the states it stores early (``fuser.ir.stores``)."""

    index: int
    prologue: tuple[tuple[sympy.Symbol, sympy.Expr], ...]  # fp64 per-step scalars, in order
    body: tuple[tuple[sympy.Symbol, sympy.Expr], ...]  # fp32 per-element temporaries
    reduce: tuple[tuple[int, sympy.Expr], ...]  # (reduction column, per-element value accumulated)
    stores: tuple[tuple[str, sympy.Expr], ...]  # slot name -> value stored (``ir.stores``)
    scalar_updates: tuple[tuple[str, sympy.Expr], ...]  # new scalar-state values (last phase only)
    axis_reduce: tuple[tuple[int, sympy.Expr], ...] = ()  # (reduction index, per-element value)
    tails: tuple[Tail, ...] = ()
    matrix_stores: tuple[tuple[int, sympy.Expr], ...] = ()  # (reduction index, matrix element)


@dataclass(frozen=True)
class OptimPlan:
    name: str
    rule_text: str
    hyper: tuple[str, ...]  # columns of a param group's row in the hyper table
    slots: tuple[Slot, ...]  # columns of the pointer table, in order
    scalar_states: tuple[str, ...]  # columns 1.. of the per-tensor scalar table (0 is step)
    reductions: tuple[ReductionPlan, ...]
    phases: tuple[Phase, ...]
    stochastic_rounding: bool = False
    tiled: bool = False  # phases walk tiles of each tensor's 2-D view (shape-aware rules)
    reads_ndim: bool = False  # the kernel loads each tensor's number of dimensions

    @property
    def dtype_key(self) -> str:
        return "-".join(f"{s.name}:{s.dtype}" for s in self.slots)

    @property
    def n_global(self) -> int:
        return sum(1 for r in self.reductions if r.global_column >= 0)

    @property
    def n_axis(self) -> tuple[int, int]:
        """(row reductions, column reductions): the axis buffer's two parts."""
        return tuple(sum(1 for r in self.reductions if r.axis == a) for a in (ROW, COL))


def scale_slot(state: str) -> str:
    """The slot of an 8-bit state's per-block scales."""
    return f"{state}__absmax"


def symbol_kinds(rule: Rule) -> dict[sympy.Symbol, str]:
    kinds = {symbol(n): k for n, k in state_kinds(rule).items()}
    kinds.update({symbol("p"): ELEMENT, symbol("g"): ELEMENT})
    return kinds


def scalar_state_names(rule: Rule) -> tuple[str, ...]:
    """States whose every update reads only hyperparameters, ``step``, sizes, reduction
    results and other such states: one number per tensor."""
    kinds = state_kinds(rule)
    return tuple(s for s, _ in rule.state if kinds[s] == SCALAR)


def is_tiled(rule: Rule) -> bool:
    """Whether the rule reduces along rows or columns (axis reductions, states per row or
    column): its phases then walk tiles of each tensor's 2-D view."""
    if any(k in (ROW, COL) for k in state_kinds(rule).values()):
        return True
    return any(e.atoms(AxisReduction) for _, e in rule.outputs)


def has_matrix_functions(rule: Rule) -> bool:
    """Whether the rule transforms whole matrices (``orthogonalize``)."""
    return any(e.atoms(MatrixFunction) for _, e in rule.outputs)


class _Hoister:
    """Replace maximal scalar-only subexpressions by fresh symbols."""

    def __init__(self, scalar: set[sympy.Symbol], prefix: str):
        self.scalar = scalar
        self.prefix = prefix
        self.found: dict[sympy.Expr, sympy.Symbol] = {}

    def is_scalar(self, e) -> bool:
        # (a random value reads no symbol but is one per element)
        return isinstance(e, sympy.Expr) and e.free_symbols <= self.scalar and not e.has(RandomValue)

    def name(self, e: sympy.Expr) -> sympy.Expr:
        if e.is_Atom:
            return e
        if e not in self.found:
            self.found[e] = sympy.Symbol(f"{self.prefix}{len(self.found)}", real=True)
        return self.found[e]

    def __call__(self, e):
        if self.is_scalar(e):
            return self.name(e)
        if e.is_Atom:
            return e
        if isinstance(e, (sympy.Add, sympy.Mul)):
            scalar_args = [a for a in e.args if self.is_scalar(a)]
            rest = [self(a) for a in e.args if not self.is_scalar(a)]
            if scalar_args:
                rest.insert(0, self.name(e.func(*scalar_args)))
            return e.func(*rest, evaluate=False)
        return e.func(*[self(a) for a in e.args])


@dataclass(frozen=True)
class _Found:
    """A reduction found in the rule, with its argument over earlier results."""

    symbol: sympy.Symbol
    op: str
    arg: sympy.Expr
    phase: int
    axis: str  # "row" / "col" for an axis reduction
    over: str  # what a per-tensor reduction reduces: element, row or col values
    args: tuple = ()  # a matrix function's keywords' values


def _extract_reductions(outputs: dict[str, sympy.Expr], kinds: dict, sharded: bool = False):
    """Replace every reduction call by a symbol ``r<i>``, innermost first.

    A reduction of per-element values runs in the phase after the last one its argument
    reads; a reduction of row or column values runs in the tail of the phase of the last
    result its argument reads, or, ``sharded``, in the phase after it: a DTensor shard's
    results are partial until the collective between phases combines them. Returns
    (outputs over the symbols, [_Found], kinds of the symbols, with each result's).
    """
    found: dict[tuple, _Found] = {}
    kinds = dict(kinds)

    def visit(e):
        if not e.args:
            return e
        if not isinstance(e, Reduction):
            return e.func(*[visit(a) for a in e.args])
        arg = visit(e.args[0])
        key = (type(e), arg, e.args[1:])
        if key not in found:
            over = kind_of(arg, kinds)
            over = ELEMENT if over == SCALAR else over
            inner = [f.phase for f in found.values() if f.symbol in arg.free_symbols]
            axis = e.axis if isinstance(e, AxisReduction) else ""
            if over == ELEMENT or sharded:
                phase = 1 + max(inner, default=-1)
            else:
                phase = max(inner, default=0)
            sym = sympy.Symbol(f"r{len(found)}", real=True)
            args = tuple(int(a) if a.is_Integer else float(a) for a in e.args[1:])
            found[key] = _Found(sym, e.op, arg, phase, axis, over, args)
            kinds[sym] = ELEMENT if isinstance(e, MatrixFunction) else (axis or SCALAR)
        return found[key].symbol

    replaced = {n: visit(e) for n, e in outputs.items()}
    return replaced, list(found.values()), kinds


def lower_optim(
    rule: Rule,
    dtypes: dict[str, str] | None = None,
    *,
    stochastic_rounding: bool = False,
    sharded: bool = False,
) -> OptimPlan:
    """Lower an optimizer rule for one dtype plan.

    ``dtypes`` gives the storage dtype of ``p``, ``g`` and each state by name (missing
    ones are fp32). ``sharded``: some tensors are DTensor shards of whole rows, so no tail
    reduces what its own phase accumulated (``_extract_reductions``). Raises ``RuleError``
    when the rule cannot run as a step.
    """
    if rule.kind != "optim":
        raise TypeError(f"lower_optim takes an optimizer rule, not a {rule.kind} rule")
    dtypes = dict(dtypes or {})
    for k, v in dtypes.items():
        allowed = MASTER_DTYPES if k == MASTER_SLOT else DTYPES + QFORMATS
        if v not in allowed:
            raise ValueError(f"dtype {v!r} of {k!r} is not one of {allowed}")
    try:
        skinds = state_kinds(rule)
        outputs, reds, kinds = _extract_reductions(dict(rule.outputs), symbol_kinds(rule), sharded)
    except RuleError as e:
        raise e.with_rule(rule.name) from None
    check_compressed(rule, dtypes)
    scalar_states = tuple(s for s, _ in rule.state if skinds[s] == SCALAR)
    early = plan_early_stores(outputs, reds, skinds, dtypes, 2 + max((f.phase for f in reds), default=-1))
    reductions = _reduction_plans(early.reds)
    phases = _lower_phases(rule, early, reductions, skinds, kinds)
    return OptimPlan(
        name=rule.name,
        rule_text=rule.text,
        hyper=hyper_columns(rule),
        slots=_slots(phases, skinds, dtypes, reductions),
        scalar_states=scalar_states,
        reductions=reductions,
        phases=tuple(phases),
        stochastic_rounding=stochastic_rounding,
        tiled=is_tiled(rule),
        reads_ndim=any(e.has(NDIM) for _, e in rule.outputs),
    )


def hyper_columns(rule: Rule) -> tuple[str, ...]:
    """The columns of a param group's row in the hyper table: the rule's hyperparameters,
    then ``loss`` where the rule reads the closure's value (the step writes it there on
    the device, as it does tensors' hyperparameters)."""
    return tuple(h for h, _ in rule.hyper) + ((LOSS_VALUE,) if reads_loss(rule) else ())


def check_compressed(rule: Rule, dtypes: dict[str, str]) -> None:
    """8-bit formats are for element states, and split master weights for bf16
    parameters."""
    skinds = state_kinds(rule)
    quantized = [s for s in skinds if dtypes.get(s) in QFORMATS]
    for s in quantized:
        if skinds[s] != ELEMENT:
            raise ValueError(
                f"state {s!r} of rule {rule.name!r} holds one number per {skinds[s]}; 8-bit formats "
                "are for states of one value per element (store it as fp32 or bf16)"
            )
    if MASTER_SLOT in dtypes and dtypes.get("p") != "bf16":
        raise ValueError(f"split master weights need bf16 parameters, not {dtypes.get('p')}")


def _reduction_plans(reds: list[_Found]) -> tuple[ReductionPlan, ...]:
    """One plan per reduction, in order: per-tensor ones get a column of ``red`` (global
    norms also one of ``glob``), axis ones a part of the axis buffer."""
    reductions, col, gcol, acol = [], 0, 0, {ROW: 0, COL: 0}
    for f in reds:
        if f.axis:
            reductions.append(ReductionPlan(f.symbol, f.op, f.phase, -1, -1, f.axis, acol[f.axis], f.over))
            acol[f.axis] += 1
            continue
        if f.args:
            reductions.append(ReductionPlan(f.symbol, f.op, f.phase, -1, -1, args=f.args))
            continue
        glob = gcol if f.op in GLOBAL_OPS else -1
        reductions.append(ReductionPlan(f.symbol, f.op, f.phase, col, glob, "", -1, f.over))
        col += 1
        gcol += f.op in GLOBAL_OPS
    return tuple(reductions)


def _lower_phases(rule: Rule, early, plans, skinds, kinds) -> list[Phase]:
    """A phase per level of reductions (each computes those whose arguments read only the
    earlier ones' results, and stores the states ``early`` moved to it), then the last:
    the other stores and the scalar states' updates."""
    outputs, reds = early.outputs, early.reds
    by_symbol = {r.symbol: r for r in plans}
    scalar = {symbol(h) for h, _ in rule.hyper} | {STEP, NUMEL, ROWS, COLS, NDIM, LOSS}
    scalar |= {symbol(s) for s, k in skinds.items() if k == SCALAR}
    scalar |= {r.symbol for r in plans if not r.axis and not r.matrix}
    n_phases = 1 + max((f.phase for f in reds), default=-1) + 1

    phases = []
    for k in range(n_phases):
        last = k == n_phases - 1
        # Results of reductions of phase k and later are not known when phase k starts.
        unknown = {f.symbol for f in reds if f.phase >= k}
        if last:
            targets = [
                (n, outputs[n]) for n in ("p", *skinds) if n in outputs and _kind(n, skinds) == ELEMENT
            ]
            targets = [
                (n, sympy.collect(e, sorted(_element_symbols(kinds), key=str), evaluate=True))
                for n, e in targets
            ]
            updates = [(s, outputs[s]) for s, kd in skinds.items() if kd == SCALAR and s in outputs]
            tails = [
                _TailSpec(
                    a, (), tuple((s, outputs[s]) for s, kd in skinds.items() if kd == a and s in outputs)
                )
                for a in (ROW, COL)
            ]
            axis, matrix = [], []
        else:
            here = [f for f in reds if f.phase == k]
            targets = [
                (by_symbol[f.symbol].column, ACCUMULATE[f.op][0](f.arg))
                for f in here
                if f.over == ELEMENT and not f.axis and not f.args
            ]
            matrix = [(plans.index(by_symbol[f.symbol]), f.arg) for f in here if f.args]
            axis = [(plans.index(by_symbol[f.symbol]), ACCUMULATE[f.op][0](f.arg)) for f in here if f.axis]
            tails = [
                _TailSpec(f.over, ((by_symbol[f.symbol].column, ACCUMULATE[f.op][0](f.arg)),), ())
                for f in here
                if f.over != ELEMENT
            ]
            updates = []
        stored = [(s, e) for s, (j, e) in early.stores.items() if j == k]
        tails = [t for t in tails if t.reduce or t.stores]
        _check_known(rule, k, unknown, targets + stored, updates, tails, axis + matrix, reds)
        phases.append(
            _lower_phase(k, targets, updates, (axis, matrix, stored), tails, scalar - unknown, last)
        )
    return phases


@dataclass(frozen=True)
class _TailSpec:
    axis: str
    reduce: tuple
    stores: tuple


def _kind(name: str, skinds: dict) -> str:
    return ELEMENT if name == "p" else skinds[name]


def _element_symbols(kinds: dict) -> set:
    return {s for s, k in kinds.items() if k == ELEMENT}


def _check_known(rule, k, unknown, targets, updates, tails, axis, reds) -> None:
    """Each value of phase ``k`` reads only results finished before it (a tail also those
    its own phase finished before it)."""
    same_phase_ok = {f.symbol for f in reds if f.phase == k}
    for _, e in [*targets, *updates, *axis]:
        if e.free_symbols & unknown:
            raise RuleError(f"internal: phase {k} reads reductions not yet computed", rule=rule.name)
    for t in tails:
        for _, e in (*t.reduce, *t.stores):
            if e.free_symbols & (unknown - same_phase_ok):
                raise RuleError(
                    f"internal: a tail of phase {k} reads reductions not yet computed", rule=rule.name
                )


def _slots(
    phases: list[Phase], skinds: dict[str, str], dtypes: dict[str, str], reductions
) -> tuple[Slot, ...]:
    """``p`` and ``g``, then each state stored in a tensor that a phase reads or the last
    one writes."""
    used = set()
    for ph in phases:
        exprs = [*ph.body, *ph.stores, *ph.reduce, *ph.axis_reduce]
        for t in ph.tails:
            exprs += [*t.body, *t.reduce, *t.stores]
        for _, e in exprs:
            used |= {s.name for s in e.free_symbols}
    written = {n for ph in phases for n, _ in ph.stores}
    written |= {n for t in phases[-1].tails for n, _ in t.stores}
    slots = [
        Slot("p", "param", dtypes.get("p", "fp32"), True),
        Slot("g", "grad", dtypes.get("g", "fp32"), False),
    ]
    if MASTER_SLOT in dtypes:
        slots.append(Slot(MASTER_SLOT, "master", dtypes[MASTER_SLOT], True))
    roles = {ELEMENT: "state", ROW: "row", COL: "col"}
    for s, kind in skinds.items():
        if kind != SCALAR and (s in used or s in written):
            slots.append(Slot(s, roles[kind], dtypes.get(s, "fp32"), s in written))
            if dtypes.get(s) in QFORMATS:
                slots.append(Slot(scale_slot(s), "scale", "fp32", s in written))
    for i, r in enumerate(reductions):
        if r.matrix:
            slots += [
                Slot(matrix_slot(i, "in"), "matrix", "bf16", True),
                Slot(matrix_slot(i, "out"), "matrix", "bf16", False),
            ]
    return tuple(slots)


def matrix_slot(index: int, which: str) -> str:
    """The slot of reduction ``index``'s matrix: ``"in"`` (its argument, stored by the phase
    that computes it) or ``"out"`` (the function's value, read by later phases)."""
    return f"mat{which}{index}__"


def _lower_phase(index, targets, updates, stores, tails, scalar, last) -> Phase:
    """One phase: ``stores`` are (axis partials, matrix elements, early state stores) of
    non-last phases."""
    axis, matrix, early = stores
    hoist = _Hoister(scalar, "__h")
    hoisted_targets = [(n, hoist(e)) for n, e in targets]
    hoisted_axis = [(n, hoist(e)) for n, e in axis]
    hoisted_matrix = [(n, hoist(e)) for n, e in matrix]
    hoisted_early = [(n, hoist(e)) for n, e in early]
    hoisted_tails = [
        (t, [(n, hoist(e)) for n, e in t.reduce], [(n, hoist(e)) for n, e in t.stores]) for t in tails
    ]

    # Per-step scalars: CSE over everything hoisted plus the scalar-state updates.
    hoisted_items = list(hoist.found.items())
    scalar_exprs = [e for e, _ in hoisted_items] + [e for _, e in updates]
    pro_repl, pro_reduced = sympy.cse(
        scalar_exprs, symbols=sympy.numbered_symbols("__c"), optimizations="basic"
    )
    prologue = list(pro_repl)
    for (_, sym), e in zip(hoisted_items, pro_reduced[: len(hoisted_items)]):
        prologue.append((sym, e))
    scalar_updates = list(zip([n for n, _ in updates], pro_reduced[len(hoisted_items) :]))

    elementwise = hoisted_targets + hoisted_axis + hoisted_matrix + hoisted_early
    body_repl, body_reduced = sympy.cse(
        [e for _, e in elementwise], symbols=sympy.numbered_symbols("__t"), optimizations="basic"
    )
    n_t, n_a, n_m = len(hoisted_targets), len(hoisted_axis), len(hoisted_matrix)
    results = list(zip([n for n, _ in hoisted_targets], body_reduced))
    axis_results = list(zip([n for n, _ in hoisted_axis], body_reduced[n_t : n_t + n_a]))
    matrix_results = list(zip([n for n, _ in hoisted_matrix], body_reduced[n_t + n_a : n_t + n_a + n_m]))
    early_results = list(zip([n for n, _ in hoisted_early], body_reduced[n_t + n_a + n_m :]))

    # Readable names: s0, s1 ... for scalars, t0, t1 ... for per-element temporaries.
    mapping = {sym: sympy.Symbol(f"s{i}", real=True) for i, (sym, _) in enumerate(prologue)}
    mapping.update({sym: sympy.Symbol(f"t{i}", real=True) for i, (sym, _) in enumerate(body_repl)})

    def sub(e):
        return e.xreplace(mapping)

    results = tuple((n, sub(e)) for n, e in results)
    return Phase(
        index=index,
        prologue=tuple((mapping[s], sub(e)) for s, e in prologue),
        body=tuple((mapping[s], sub(e)) for s, e in body_repl),
        reduce=() if last else results,
        stores=results if last else tuple((n, sub(e)) for n, e in early_results),
        scalar_updates=tuple((n, sub(e)) for n, e in scalar_updates) if last else (),
        axis_reduce=tuple((n, sub(e)) for n, e in axis_results),
        matrix_stores=tuple((n, sub(e)) for n, e in matrix_results),
        tails=tuple(_lower_tail(j, spec, red, st, sub) for j, (spec, red, st) in enumerate(hoisted_tails)),
    )


def _lower_tail(j: int, spec: _TailSpec, reduce, stores, sub) -> Tail:
    """A tail's values after CSE, its temporaries named ``k<j>_<i>``."""
    values = [e for _, e in reduce] + [e for _, e in stores]
    repl, reduced = sympy.cse(values, symbols=sympy.numbered_symbols("__k"), optimizations="basic")
    mapping = {sym: sympy.Symbol(f"k{j}_{i}", real=True) for i, (sym, _) in enumerate(repl)}

    def sub2(e):
        return sub(e).xreplace(mapping)

    n = len(reduce)
    return Tail(
        axis=spec.axis,
        body=tuple((mapping[s], sub2(e)) for s, e in repl),
        reduce=tuple((c, sub2(e)) for (c, _), e in zip(reduce, reduced[:n])),
        stores=tuple((name, sub2(e)) for (name, _), e in zip(stores, reduced[n:])),
    )
