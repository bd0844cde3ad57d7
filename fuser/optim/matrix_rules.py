"""The optimizer of a matrix rule (``fuser.rules.matrices``): a step of two phases.

1. **The matrix phase**, in torch: every value of the rule that holds or reads a matrix
   (a factor's update, products, transposes, traces, decompositions), evaluated once per
   step over stacks of the matrices of one shape (``[n, rows, cols]``, batched products and
   decompositions over every tensor of that 2-D shape in a param group; with per-dimension
   factors, ``"zeros(dims)"``, of one whole shape, each dimension's factors a stack), each
   common subexpression once. Its results that the update reads per element are written to fp32
   buffers; the new matrix states are written last, so every value reads the step's
   starting ones.
2. **The update phase**: the rule's ``p`` and element states, with those results as inputs,
   as one fused fuser kernel over every tensor (the step engine's, as for any rule).

A decomposition (``eigh``, ``qr``, ``inv_root``, ``inv_root_newton``) is the value of a
matrix state (or a branch of a ``where`` that is); a matrix whose decomposition fails or is
not finite in fp32 is retried in fp64, and where that fails too its state keeps its
previous value (a RuntimeWarning), so no NaN reaches a parameter. ``inv_root_newton`` fails
where its iteration is not within ``fuser.runtime.matrix.NEWTON_TOLERANCE`` after
``NEWTON_MAX_ITERATIONS``. A
``where`` whose condition holds one number per step (``every(k)``, ``step == 1``)
evaluates only the branch it takes: the decompositions of a refresh run on refresh steps
only. A side over ``max_matrix_dim`` (a constructor keyword, default 8192) has no factor:
every ``[n, n]`` value of that side is the identity (its states stay the identity, held as
an empty tensor; products with it are skipped; its trace is ``n``, its diagonal ones),
times the numbers that multiply it (``lr * PL @ g`` is ``lr * g``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import warnings
from collections import defaultdict

import sympy
import torch
from sympy.codegen.cfunctions import expm1 as Expm1
from sympy.codegen.cfunctions import log1p as Log1p

from fuser.errors import RuleError
from fuser.optim import diagonal_factors as dg
from fuser.optim.builtins._base import RuleKernel as _RuleKernel
from fuser.optim.builtins._base import own_loaded_states, published_state_dict, whole_tensor_step
from fuser.optim.diagonal_factors import Diagonal
from fuser.optim.factory import rule_class
from fuser.rules import matrices as mx
from fuser.rules.functions import Amax as _Amax
from fuser.rules.functions import (
    ApproxTanh,
    AxisReduction,
    Norm,
    Randn,
    RandomValue,
    Reduction,
    Remainder,
    Sigmoid,
    StepRand,
)
from fuser.rules.functions import Mean as _Mean
from fuser.rules.functions import Sum as _Sum
from fuser.rules.parse import Statement, symbol
from fuser.rules.rule import Rule
from fuser.rules.shapes import COL, ELEMENT, ROW, SCALAR, kind_of, product_kind, state_kinds
from fuser.runtime.distributed import DTensor
from fuser.runtime.matrix import budget_slices, inv_root_newton, workspace_budget
from fuser.runtime.plans import MASTER_WEIGHTS, QFORMATS, Options, dtype_plan, plan_and_sources, state_dtype
from fuser.runtime.quant import master_join
from fuser.runtime.state import validate
from fuser.runtime.tables import check_view, is_batched, matrix_2d
from fuser.runtime.wholes import OWNER

DEFAULT_MAX_MATRIX_DIM = 8192
_STEP = "matrix_step"  # the update kernel reads the step as a hyperparameter of this name
_MATRIX_LIKE = frozenset({mx.ROWMAT, mx.COLMAT, mx.ELEMENT_T, mx.DIMMAT, mx.DIMVEC, mx.DIMSCAL})
_PER_DIM = frozenset({mx.DIMMAT, mx.DIMVEC, mx.DIMSCAL})
_OF_DIMS = (mx.Modes, mx.SolveModes, mx.ProdDims)  # (values of other kinds made from factors)


def dims_keys(state: str, shape) -> list[str]:
    """The keys under which a per-dimension matrix state (``"zeros(dims)"``) of a tensor of
    ``shape`` is kept: ``F[0]``, ``F[1]``, ... one ``[d, d]`` tensor per dimension."""
    return [f"{state}[{i}]" for i in range(len(shape))]


def factor_dims(shape, view: str) -> tuple[tuple, tuple]:
    """``(lead, dims)`` of per-dimension factors: under a batched view each matrix's
    ``(rows, cols)``, one factor a matrix stacked over ``lead``; else the tensor's own shape."""
    if is_batched(shape, view):
        return tuple(shape[:-2]), tuple(shape[-2:])
    return (), tuple(shape)


class Identity:
    """An ``[n, n]`` identity, never built where products can skip it: ``eye(...)``, and
    the values of a side over ``max_matrix_dim`` (``absorbing``: every value of that side is
    the identity, so elementwise work on it is too), ``scale`` (a float, or one number per
    matrix ``[n, 1, 1]``) times the identity: numbers multiplying it keep their scale
    (``lr * PL @ g`` is ``lr * g``)."""

    def __init__(self, n: int, absorbing: bool = False, scale=1.0):
        self.n, self.absorbing, self.scale = n, absorbing, scale

    def tensor(self, count: int, device) -> torch.Tensor:
        return torch.eye(self.n, device=device).expand(count, self.n, self.n) * self.scale


def _scaled(x, scale):
    """``x`` (a tensor or an ``Identity``) times ``scale``."""
    if isinstance(x, Identity):
        return Identity(x.n, x.absorbing, x.scale * scale)
    return x if isinstance(scale, float) and scale == 1.0 else x * scale


def _of_identities(e, args: list) -> Identity:
    """An elementwise value of an absent side's identities: a product with numbers per tensor
    scales it; a sum of identities of one scale keeps it (sympy writes ``2 * (R + g @ x)`` as
    ``2 * R + 2 * (g @ x)``); any other function of one (``L + eps * eye(rows)``) is the
    identity."""
    ident = next(a for a in args if isinstance(a, Identity))
    if isinstance(e, sympy.Mul):
        out = Identity(ident.n, True)
        for a in args:
            out = _scaled(out, a.scale if isinstance(a, Identity) else a)
        return out
    if isinstance(e, sympy.Add) and all(isinstance(a, Identity) for a in args):
        scales = [a.scale for a in args]
        if all(isinstance(x, float) for x in scales) and len(set(scales)) == 1:
            return Identity(ident.n, True, scales[0])
    return Identity(ident.n, True)


class Permutation:
    """``sort_perm``'s value, never built where a product can gather instead: ``P`` with
    ``P[:, j] = e[idx[j]]`` (``idx`` ``[n, k]``, one permutation per matrix), or ``Pᵀ``."""

    def __init__(self, idx: torch.Tensor, transposed: bool = False):
        self.idx, self.transposed = idx, transposed

    def tensor(self) -> torch.Tensor:
        p = torch.nn.functional.one_hot(self.idx, self.idx.shape[-1]).to(torch.float32).mT
        return p.mT if self.transposed else p

    def t(self) -> Permutation:
        return Permutation(self.idx, not self.transposed)

    def _order(self, left: bool) -> torch.Tensor:
        # P's columns are e[idx]: P @ X takes X's rows in the inverse order, X @ P its
        # columns in idx's; the transpose swaps the two.
        inverse = left != self.transposed
        return torch.argsort(self.idx, dim=-1) if inverse else self.idx

    def left(self, x: torch.Tensor) -> torch.Tensor:
        """``self @ x``."""
        order = self._order(True)
        return torch.gather(x, -2, order.unsqueeze(-1).expand(*order.shape, x.shape[-1]))

    def right(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ self``."""
        order = self._order(False)
        return torch.gather(x, -1, order.unsqueeze(-2).expand(order.shape[0], x.shape[-2], order.shape[-1]))


class Factors:
    """A per-dimension value (``dimmat``): one entry per dimension of the stack's tensors,
    each an ``[n, d, d]`` tensor, an ``Identity`` (a dimension over ``max_matrix_dim``, or
    ``eye_dims()``) or a ``Diagonal`` (a dimension ``diagonal_dims`` marks)."""

    def __init__(self, entries: list):
        self.entries = list(entries)


class MatrixProgram:
    """A matrix rule lowered: ``boundaries`` (buffer name, value) the update kernel reads
    per element, ``matrix_outputs`` (state, value), the update rule, the decompositions'
    states (``owners``) and every symbol's kind."""

    def __init__(self, rule: Rule):
        self.rule = rule
        self.matrix_states = {s: mx.matrix_init(v) for s, v in rule.state if mx.matrix_init(v)}
        found = state_kinds(rule)
        # States of one number per tensor, row or column live in the matrix phase with the
        # matrices (the update kernel reads them as values per element); the rest per element.
        self.phase_states = {s: (found[s], float(v)) for s, v in rule.state if found[s] in (SCALAR, ROW, COL)}
        self.element_states = [
            (s, v) for s, v in rule.state if s not in self.matrix_states and s not in self.phase_states
        ]
        kinds = {symbol("p"): ELEMENT, symbol("g"): ELEMENT}
        kinds.update({symbol(s): kind for s, (kind, _) in self.matrix_states.items()})
        kinds.update({symbol(s): kind for s, (kind, _) in self.phase_states.items()})
        kinds.update({symbol(s): ELEMENT for s, _ in self.element_states})
        self.kinds, self._memo, self._uses = kinds, {}, {}
        # (per-dimension factors: the stacks are of one whole shape, not of one 2-D view)
        self.per_dims = any(kind == mx.DIMMAT for kind, _ in self.matrix_states.values()) or any(
            e.atoms(mx.Gram, mx.Modes, mx.EyeDims) for _, e in rule.outputs
        )
        outputs = dict(rule.outputs)
        for s in self.phase_states:
            if s in outputs and any(r.op.startswith("global_") for r in outputs[s].atoms(Reduction)):
                raise RuleError(
                    f"state {s!r}: a global reduction (one number over every tensor) in a matrix rule "
                    "is not supported yet"
                ).with_rule(rule.name)
        written = {*self.matrix_states, *self.phase_states}
        self.matrix_outputs = [(s, e) for s, e in rule.outputs if s in written]
        self.boundaries: dict = {}  # value -> buffer name
        update = []
        for name, e in rule.outputs:
            if name not in written:
                update.append((name, self._split(e)))
        for _, e in rule.outputs:
            self._check_torch_values(e)
        self.owners = self._owners()
        self.update_rule = self._update_rule(update)

    def kind(self, e) -> str:
        return kind_of(e, self.kinds, self._memo)

    def uses(self, outputs: tuple) -> dict:
        """How many distinct values read each value of the matrix phase that writes the
        buffers and the matrix states ``outputs`` (each root once more: its writer); counted
        once per set of outputs (a side over the limit writes none of its states)."""
        if outputs not in self._uses:
            roots = [*self.boundaries, *(e for s, e in self.matrix_outputs if s in outputs)]
            uses: dict = defaultdict(int)
            seen = set()
            stack = list(roots)
            for r in roots:
                uses[r] += 1
            while stack:
                e = stack.pop()
                if e in seen or e.is_Symbol or e.is_Number:
                    continue
                seen.add(e)
                for a in _children(e):
                    uses[a] += 1
                    stack.append(a)
            self._uses[outputs] = dict(uses)
        return self._uses[outputs]

    def needs_torch(self, e) -> bool:
        if e.atoms(mx.MatrixOp, RandomValue):
            return True
        return any(self.kinds.get(s) in _MATRIX_LIKE or s.name in self.phase_states for s in e.free_symbols)

    def _split(self, e, memo=None):
        """``e`` (a per-element value) with each matrix-phase value it reads replaced by a
        buffer's symbol (``memo``: each shared subexpression once)."""
        memo = {} if memo is None else memo
        if e not in memo:
            memo[e] = self._split_one(e, memo)
        return memo[e]

    def _split_one(self, e, memo):
        if not self.needs_torch(e):
            return e
        # (A draw too: the matrix phase makes every draw of a matrix rule, so that one value
        # read both there and by the update is the same.)
        rooted = (
            (e.is_Symbol and e.name in self.phase_states)
            or isinstance(e, (mx.MatrixOp, RandomValue))
            or (isinstance(e, Reduction) and self.kind(e.args[0]) in _MATRIX_LIKE)
        )
        if rooted:
            name = self.boundaries.setdefault(e, f"matrix_value{len(self.boundaries)}")
            return symbol(name)
        return e.func(*[self._split(a, memo) if isinstance(a, sympy.Basic) else a for a in e.args])

    def _check_torch_values(self, e) -> None:
        """No global reduction, ``orthogonalize`` or ``loss`` inside a matrix value (each
        distinct subexpression visited once, inside a matrix value or not)."""
        seen, stack = set(), [(e, False)]
        while stack:
            node, inside = stack.pop()
            if (node, inside) in seen:
                continue
            seen.add((node, inside))
            inside = inside or isinstance(node, mx.MatrixOp)
            if (
                inside
                and isinstance(node, Reduction)
                and (node.op == "orthogonalize" or node.op.startswith("global_"))
            ):
                raise RuleError(
                    f"{node.op}() inside a matrix value is not supported in a matrix rule"
                ).with_rule(self.rule.name)
            if inside and node == symbol("loss"):
                raise RuleError("a matrix value cannot read loss").with_rule(self.rule.name)
            stack.extend((a, inside) for a in node.args if isinstance(a, sympy.Basic))

    def _owners(self) -> dict:
        """Each decomposition -> the matrix state that keeps its old value where it fails."""
        owners = {}

        def branches(e):
            if isinstance(e, sympy.Piecewise):
                for value, _ in e.args:
                    yield from branches(value)
            else:
                yield e

        for s, e in self.matrix_outputs:
            for b in branches(e):
                if isinstance(b, mx.Decomposition):
                    owners.setdefault(b, s)
        for _, e in self.rule.outputs:
            for d in e.atoms(mx.Decomposition):
                if d not in owners:
                    # (at the first statement that computes it)
                    st = next((st for st in self.rule.statements if st.expr.has(d)), None)
                    lines = self.rule.text.splitlines()
                    line = st.line if st is not None and self.rule.statements[0].line > 0 else None
                    raise RuleError(
                        f"{d.spelling}() must be the value of a matrix state (directly, or a branch of "
                        f"where(...)): where it fails that state keeps its previous value",
                        line=line,
                        col=st.col if line else None,
                        source_line=lines[line - 1] if line and 0 < line <= len(lines) else None,
                    ).with_rule(self.rule.name)
        return owners

    def _update_rule(self, update: list) -> Rule:
        step = symbol("step")
        outputs = tuple((n, e.xreplace({step: symbol(_STEP)})) for n, e in update)
        state = (*self.element_states, *((b, 0.0) for b in self.boundaries.values()))
        statements = tuple(Statement(n, e, 1, 1) for n, e in outputs)
        return Rule(
            "optim",
            f"{self.rule.name}_update",
            "\n".join(f"{n} = {e}" for n, e in outputs),
            (*self.rule.hyper, (_STEP, 1.0)),
            tuple(state),
            statements,
            outputs,
        )


class MatrixRuleOptimizer(torch.optim.Optimizer):
    """Base of the optimizers ``fuser.compile`` makes of matrix rules (``rule``, ``program``,
    ``options`` set on the subclass). State per parameter: ``step`` (a float tensor, as
    torch.optim keeps it), the element states (the parameter's shape, fp32 or as
    ``state_dtype`` asks), a split master's ``master_lo`` (``master_weights``, bf16
    parameters) and the matrix states (fp32 ``[rows, rows]`` / ``[cols, cols]``, or an empty
    tensor for a side over ``max_matrix_dim``). A DTensor parameter sharded by dim 0 is
    stepped whole by the rank that owns it, which keeps these states whole; the other ranks
    keep the marker ``{"whole_on_rank": owner}`` (``builtins._base.whole_tensor_gradients``)."""

    rule: Rule
    program: MatrixProgram
    options: Options

    def __init__(
        self, params, *, view=None, max_matrix_dim: int = DEFAULT_MAX_MATRIX_DIM, diagonal_dims=None, **hyper
    ):
        if view is not None:  # (the compiled view for this instance; a group's "view" still wins)
            self.options = dataclasses.replace(self.options, view=check_view(view, type(self).__name__))
        defaults = dict(self.rule.hyper_defaults)
        unknown = set(hyper) - set(defaults)
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got unknown hyperparameters {sorted(unknown)}; "
                f"it takes {sorted(defaults)}, view, max_matrix_dim and diagonal_dims"
            )
        if diagonal_dims is not None and not (callable(diagonal_dims) and self.program.per_dims):
            raise TypeError(
                f"{type(self).__name__}: diagonal_dims must be a function of a tensor's shape giving one "
                "bool per dimension, for a rule with per-dimension factors ('eye(dims)'), not "
                f"{diagonal_dims!r}" + ("" if self.program.per_dims else " (this rule has none)")
            )
        if isinstance(max_matrix_dim, bool) or not isinstance(max_matrix_dim, int) or max_matrix_dim < 1:
            raise ValueError(f"max_matrix_dim must be a positive whole number, not {max_matrix_dim!r}")
        defaults.update(hyper)
        self.max_matrix_dim, self.diagonal_dims, self._diagonal = max_matrix_dim, diagonal_dims, {}
        super().__init__(params, defaults)
        self._kernel = _UpdateKernel(self.program.update_rule, self.options)

    def state_dict(self) -> dict:
        # (a collective of every shard group where parameters are DTensors sharded by rows)
        keys = {s for s, _ in self.program.element_states} | {_MASTER}
        return published_state_dict(self, super().state_dict(), keys)

    def load_state_dict(self, state_dict) -> None:
        # torch casts each loaded state to its parameter's dtype (a bf16 parameter's fp32
        # factors rounded to bf16) and keeps a tensor of that dtype shared with the saved dict
        # (a live optimizer's, whose steps would then move this one's states and step count):
        # take the saved values back, copied, in the state's dtype (fp32 but for element
        # states under state_dtype; a split master's integer low part as saved).
        saved = state_dict["state"]
        ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        params = dict(zip(ids, (p for group in self.param_groups for p in group["params"])))
        super().load_state_dict(state_dict)
        for pid, st in saved.items():
            p = params.get(pid)
            if p is None:
                continue
            elements = {s for s, _ in self.program.element_states}
            for key, value in st.items():
                if key == "step" and torch.is_tensor(value):  # (a count on the CPU, as made)
                    self.state[p][key] = value.detach().to("cpu", torch.float32, copy=True)
                elif torch.is_tensor(value):
                    dtype = torch.float32 if value.is_floating_point() else value.dtype
                    if key in elements:
                        dtype = state_dtype(self.options, p.dtype, self.program.update_rule, key)
                    self.state[p][key] = value.to(device=p.device, dtype=dtype, copy=True)
        own_loaded_states(self)  # (a DTensor parameter's states whole on its owner)

    # --- one step --------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One step. A DTensor parameter sharded by rows is stepped whole by the rank that
        owns it (``whole_tensor_gradients``: its rows gathered, the result's sent back)."""
        return whole_tensor_step(self, closure, self._step_found, check=MatrixRuleOptimizer._check)

    def _step_found(self, found: list) -> None:
        items = [(self.param_groups[gi], p, t, g) for p, t, g, gi in found]
        if items:
            self._step(items)

    def _step(self, items: list) -> None:
        """The step of ``items`` (group, parameter, its whole tensor, gradient)."""
        for group, p, t, _ in items:
            if len(self.state[p]) == 0:
                self._init_state(p, t, group.get("max_matrix_dim", self.max_matrix_dim), self._view(group))
            self._stored_as_asked(self.state[p], t, self._view(group))
            if self.options.master_weights and t.dtype == torch.bfloat16 and _MASTER not in self.state[p]:
                lo = getattr(torch, MASTER_WEIGHTS[self.options.master_weights])
                self.state[p][_MASTER] = torch.zeros_like(t, dtype=lo)  # (the master is p at first)
        for _, p, t, _ in items:  # (no elements, nothing to update: its states stay as initialised)
            if t.numel() == 0:
                self.state[p]["step"] += 1
        items = [item for item in items if item[2].numel() > 0]
        if not items:
            return
        steps = {p: int(self.state[p]["step"].item()) + 1 for _, p, _, _ in items}  # (CPU counts)
        batches = defaultdict(list)
        for group, p, t, g in items:
            shape = factor_dims(p.shape, self._view(group))[1] if self.program.per_dims else None
            key = (id(group), steps[p], matrix_2d(p.shape, self._view(group)), shape)
            batches[key].append((group, p, t, g))
        buffers = {}
        new_matrices = []
        positions = {p: i for i, p in enumerate(p for group in self.param_groups for p in group["params"])}
        for (_, step, (rows, cols), shape), members in batches.items():
            for part in _slices(members):
                where = [positions[p] for _, p, _, _ in part]
                out = _Batch(self, part, step, rows, cols, where, shape).run()
                buffers.update(out[0])
                new_matrices += out[1]
        groups = defaultdict(list)
        for group, p, t, _ in items:
            groups[(id(group), steps[p])].append((group, p, t))
        launch, states = [], {}
        for (_, step), members in groups.items():
            group = members[0][0]
            hyper = {k: float(group[k]) for k, _ in self.rule.hyper}
            hyper[_STEP] = float(step)
            launch.append(([t for _, _, t in members], hyper))
            for _, p, t in members:
                st = self.state[p]
                states[t] = {s: st[s] for s, _ in self.program.element_states}
                if _MASTER in st:
                    states[t][_MASTER] = st[_MASTER]
                states[t].update(buffers[p])
        self._kernel.views = {t: self._view(group) for group, _, t, _ in items}
        self._kernel.run(launch, states)
        for _, p, t, _ in items:  # (a state the kernel stored anew, in the layout of its tensor)
            for key, value in self._kernel.state[t].items():
                if key in states[t] and value is not states[t][key] and key in self.state[p]:
                    self.state[p][key] = value
        for tensor, value in new_matrices:
            tensor.copy_(value)
        for _, p, _, _ in items:
            self.state[p]["step"] += 1
        self._kernel.forget()  # (the buffers and their tables go; the states stay)

    def _stored_as_asked(self, st: dict, t: torch.Tensor, view: str) -> None:
        """Element states given in another dtype or on another device (assigned, loaded)
        stored as the options ask before the step reads them, as every fuser optimizer's
        are: both phases then read the same values."""
        for s, _ in self.program.element_states:
            want = state_dtype(self.options, t.dtype, self.program.update_rule, s)
            value = st.get(s)
            if torch.is_tensor(value) and (value.dtype != want or value.device != t.device):
                st[s] = value.to(device=t.device, dtype=want)
        keys = self._matrix_keys(factor_dims(t.shape, view)[1])
        for s in (*self.program.phase_states, *keys):  # (fp32, as made)
            value = st.get(s)
            if torch.is_tensor(value) and (value.dtype != torch.float32 or value.device != t.device):
                st[s] = value.to(device=t.device, dtype=torch.float32)

    def diagonal_of(self, shape) -> tuple[bool, ...]:
        """The dimensions of a tensor of ``shape`` whose per-dimension factors are diagonal
        (``diagonal_dims`` asked once a shape: a step reads them for every tensor)."""
        shape = tuple(shape)
        if shape not in self._diagonal:
            self._diagonal[shape] = dg.diagonal_marks(self.diagonal_dims, shape, type(self).__name__)
        return self._diagonal[shape]

    def _matrix_keys(self, shape) -> list[str]:
        """The state keys of the matrix states of a tensor of ``shape``."""
        out = []
        for s, (kind, _) in self.program.matrix_states.items():
            out += dims_keys(s, shape) if kind == mx.DIMMAT else [s]
        return out

    def _check(self, found: list) -> None:
        """Raise, before anything changes on any rank, on what this step cannot run:
        ``found`` is (parameter, gradient laid out like it, group index)."""
        for gi in sorted({gi for _, _, gi in found}):
            self._check_hyper(self.param_groups[gi])
        for p, g, _ in found:
            if type(p) not in (torch.nn.Parameter, torch.Tensor) and not isinstance(p, DTensor):
                raise TypeError(
                    f"{type(self).__name__} (a matrix rule) takes plain tensors and DTensors, "
                    f"not {type(p).__name__}"
                )
            if g.shape != p.shape:
                raise ValueError(
                    f"a gradient of shape {tuple(g.shape)} for a parameter of shape {tuple(p.shape)}"
                )
        for p, _, gi in found:
            batched = is_batched(p.shape, self._view(self.param_groups[gi]))
            if isinstance(p, DTensor) and batched:
                raise NotImplementedError(
                    f"{type(self).__name__} takes a batched 2-D view of a parameter of shape "
                    f"{tuple(p.shape)}, a DTensor: batched views of sharded tensors are not supported; "
                    "use view='flatten' for its param group, or a plain tensor"
                )
        for p, _, gi in found:
            if self.program.per_dims:  # (its marks checked before any tensor's first state)
                self.diagonal_of(factor_dims(p.shape, self._view(self.param_groups[gi]))[1])
            self._check_state_shapes(p, self.param_groups[gi])
        # What the update kernel checks of its tensors, here on every rank's shards.
        validate(_update_checks(type(self).__name__)(self), found)

    def _check_state_shapes(self, p: torch.Tensor, group: dict) -> None:
        """Raise on a state of ``p`` (assigned by hand, loaded from another model) that is
        missing or not of the shape its first step gave it."""
        st = self.state.get(p)
        if not st or OWNER in st:  # (no state yet, or another rank's parameter)
            return
        view = self._view(group)
        rows, cols = matrix_2d(p.shape, view)
        lead = tuple(p.shape[:-2]) if is_batched(p.shape, view) else ()
        limit = group.get("max_matrix_dim", self.max_matrix_dim)
        want = {s: tuple(p.shape) for s, _ in self.program.element_states}
        for s, (kind, _) in self.program.phase_states.items():
            want[s] = (*lead, *{SCALAR: (), ROW: (rows,), COL: (cols,)}[kind])
        for s, (kind, _) in self.program.matrix_states.items():
            if kind == mx.DIMMAT:
                _, dims = factor_dims(p.shape, view)
                for key, d, diagonal in zip(dims_keys(s, dims), dims, self.diagonal_of(dims)):
                    want[key] = (*lead, d) if diagonal else (0,) if d > limit else (*lead, d, d)
                continue
            n = rows if kind == mx.ROWMAT else cols
            want[s] = (0,) if n > limit else (*lead, n, n)
        if _MASTER in st:
            want[_MASTER] = tuple(p.shape)
        for s, shape in want.items():
            value = st.get(s)
            found = tuple(value.shape) if torch.is_tensor(value) else None
            if found != shape:
                what = (
                    "missing" if s not in st else (f"of shape {found}" if found is not None else repr(value))
                )
                raise ValueError(
                    f"{type(self).__name__}: state {s!r} of a parameter of shape {tuple(p.shape)} is "
                    f"{what}; it must be a tensor of shape {shape} (view {view!r}, max_matrix_dim "
                    f"{limit}): give it that shape or leave the parameter's state empty to start anew"
                )

    def _check_hyper(self, group: dict) -> None:
        limit = group.get("max_matrix_dim", self.max_matrix_dim)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"max_matrix_dim must be a positive whole number, not {limit!r}")
        for k, _ in self.rule.hyper:
            v = group[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"hyperparameter {k!r} must be a finite number, not {v!r}")

    def _view(self, group: dict) -> str:
        return check_view(group.get("view", self.options.view), f"{type(self).__name__}'s param group")

    def _init_state(self, p: torch.Tensor, t: torch.Tensor, limit: int, view: str) -> None:
        """``p``'s first states, from ``t`` (``p``, or its whole tensor)."""
        st = self.state[p]
        st["step"] = torch.tensor(0.0)
        device = t.device
        for s, init in self.program.element_states:
            dtype = state_dtype(self.options, t.dtype, self.program.update_rule, s)
            st[s] = (
                t.detach().to(dtype, copy=True)
                if init == "p"
                else torch.full(t.shape, float(init), dtype=dtype, device=device)
            )
        rows, cols = matrix_2d(t.shape, view)
        lead = tuple(t.shape[:-2]) if is_batched(t.shape, view) else ()
        for s, (kind, init) in self.program.phase_states.items():
            tail = {SCALAR: (), ROW: (rows,), COL: (cols,)}[kind]
            st[s] = torch.full((*lead, *tail), init, device=device)
        for s, (kind, how) in self.program.matrix_states.items():
            if kind == mx.DIMMAT:
                _, dims = factor_dims(t.shape, view)
                for key, d, diagonal in zip(dims_keys(s, dims), dims, self.diagonal_of(dims)):
                    st[key] = _start_factor(how, lead, d, limit, diagonal, device)
                continue
            st[s] = _start_factor(how, lead, rows if kind == mx.ROWMAT else cols, limit, False, device)


def _start_factor(how: str, lead: tuple, n: int, limit: int, diagonal: bool, device) -> torch.Tensor:
    """A matrix state's first value: ``how`` ("eye" or "zeros") of ``[*lead, n, n]``, its
    diagonal ``[*lead, n]`` for a diagonal dimension, an empty tensor for a side over ``limit``."""
    if diagonal:
        return (torch.ones if how == "eye" else torch.zeros)(*lead, n, device=device)
    if n > limit:
        return torch.empty(0, device=device)
    if how == "eye":
        return torch.eye(n, device=device).expand(*lead, n, n).clone()
    return torch.zeros(*lead, n, n, device=device)


_MASTER = "master_lo"  # a split master's low part (master_weights), as FuserOptimizer keeps it


def _master(st: dict, t: torch.Tensor) -> torch.Tensor:
    """The fp32 value of parameter ``t``: with a split master, bf16 ``t`` and its low part."""
    lo = st.get(_MASTER)
    return t.float() if lo is None else master_join(t, lo)


def _uniform(c):
    """A condition of one number per matrix that is the same for every matrix of the stack
    (PSGD's refresh counter, a state per tensor that all step alike) as that bool, so that
    ``where`` evaluates only the branch it takes (one host sync); else ``c``."""
    if not torch.is_tensor(c) or c.dim() < 2 or c.shape[-2:] != (1, 1) or c.numel() == 0:
        return c
    held = int(c.count_nonzero())  # (the one sync)
    return c if 0 < held < c.numel() else held > 0


def _chain_order(dims: list, kinds: list):
    """The multiplication order of fewest flops of factors of sizes ``dims`` (``(rows, cols)``
    each) whose every partial product is a kind of value (``product_kind``): a tree of
    factor indices (``((0, 1), 2)`` is left to right), or None if none is."""
    n = len(dims)
    best = {(i, i): (0, i, kinds[i]) for i in range(n)}  # (flops, tree, kind)
    for width in range(2, n + 1):
        for i in range(n - width + 1):
            j = i + width - 1
            for k in range(i, j):
                left, right = best.get((i, k)), best.get((k + 1, j))
                kind = left and right and product_kind(left[2], right[2])
                if not kind:
                    continue
                flops = left[0] + right[0] + dims[i][0] * dims[k][1] * dims[j][1]
                if (i, j) not in best or flops < best[(i, j)][0]:
                    best[(i, j)] = (flops, (left[1], right[1]), kind)
    return best[(0, n - 1)][1] if (0, n - 1) in best else None


def _is_left_to_right(tree) -> bool:
    while isinstance(tree, tuple):
        if not isinstance(tree[1], int):
            return False
        tree = tree[0]
    return True


def _quadratic_form(e):
    """``(Q, M)`` where ``e`` is ``diag(transpose(Q) @ M @ Q)``, else None."""
    if not isinstance(e, mx.Diag):
        return None
    outer = e.args[0]
    if not (isinstance(outer, mx.MatMul) and isinstance(outer.args[0], mx.MatMul)):
        return None
    (t, m), q = outer.args[0].args, outer.args[1]
    if isinstance(t, mx.Transpose) and t.args[0] == q:
        return q, m
    return None


def _transposed(x):
    """The transpose of one dimension's factor (a tensor, an identity or a permutation)."""
    if isinstance(x, Permutation):
        return x.t()
    return x if isinstance(x, (Identity, Diagonal)) else x.mT


def _as_diagonal(x, d: int, device):
    """``x`` as an operand at a diagonal dimension: an identity (times its scale) as the
    diagonal of ones, anything else as it is."""
    if isinstance(x, Identity):
        return Diagonal(torch.ones(1, d, 1, device=device) * x.scale)
    return x


def _sort_perm(d: torch.Tensor) -> Permutation:
    """The permutation sorting each row of ``d`` (``[n, k]``) from largest to smallest."""
    return Permutation(torch.argsort(d, dim=-1, descending=True, stable=True))


def _children(e) -> set:
    """The values ``e`` reads (a ``where``'s branches and conditions themselves)."""
    if e.is_Symbol or e.is_Number:
        return set()
    if isinstance(e, sympy.Piecewise):
        return {x for pair in e.args for x in pair.args}
    return {a for a in e.args if isinstance(a, sympy.Basic)}


def _slices(members: list) -> list[list]:
    """``members`` (one stack's tensors) cut so that a stack of values per element holds at
    most an eighth of ``FUSER_MATRIX_WORKSPACE`` (1 GiB by default: 128 MiB), a tensor at
    least: the matrix phase keeps a few such stacks alive at once, freeing each value once
    its last reader has run."""
    budget = workspace_budget()
    return budget_slices(members, lambda m: m[1].numel() * 4, None if budget is None else budget // 8)


class _UpdateChecks:
    """What ``runtime.state.validate`` reads of an optimizer, for the update kernel's rule
    over a matrix optimizer's param groups."""

    def __init__(self, opt: MatrixRuleOptimizer):
        self.rule, self.options, self.param_groups = opt.program.update_rule, opt.options, opt.param_groups
        self._state_keys = {s: s for s, _ in self.rule.state}
        self._view_of = opt._view


@functools.cache
def _update_checks(name: str) -> type:
    """``_UpdateChecks`` named as the optimizer, which ``validate``'s messages name."""
    return type(name, (_UpdateChecks,), {})


class _UpdateKernel(_RuleKernel):
    """The update's launch, each tensor in its param group's view (``views``, set per step)."""

    views: dict = {}

    def _view_of(self, group: dict) -> str:
        return self.views.get(group["params"][0], "flatten") if group["params"] else "flatten"


class _Batch:
    """The matrix phase of the tensors of one param group, step and 2-D shape: ``members``
    (group, parameter, its whole tensor, gradient)."""

    def __init__(
        self, opt: MatrixRuleOptimizer, members: list, step: int, rows: int, cols: int, positions, shape=None
    ):
        self.opt, self.members, self.step, self.rows, self.cols = opt, members, step, rows, cols
        self.positions, self.shape = positions, shape  # (shape: the tensors' own, per-dimension rules)
        self.program = opt.program
        group = members[0][0]
        self.limit = group.get("max_matrix_dim", opt.max_matrix_dim)
        # Each tensor's matrices (one, or a batched view's several), stacked: [n, rows, cols].
        self.counts = [p.numel() // (rows * cols) if rows * cols else 0 for _, p, _, _ in members]
        self.starts = [sum(self.counts[:k]) for k in range(len(members))]
        n = sum(self.counts)
        env = {symbol("step"): float(step), symbol("rows"): float(rows), symbol("cols"): float(cols)}
        env[symbol("numel")] = self.per_matrix([float(p.numel()) for _, p, _, _ in members])
        env[symbol("ndim")] = self.per_matrix([float(p.dim()) for _, p, _, _ in members])
        if shape is not None:  # (per-dimension factors: the order of each factored matrix or tensor)
            env[symbol("ndim")] = float(len(shape))
        env.update({symbol(k): float(group[k]) for k, _ in opt.rule.hyper})

        # The tensors' stacks, built when the rule first reads them (p often only the update).
        self.shapes = {symbol("p"): (rows, cols), symbol("g"): (rows, cols)}
        self.shapes.update({symbol(s): (rows, cols) for s, _ in self.program.element_states})
        for s, (kind, _) in self.program.phase_states.items():
            self.shapes[symbol(s)] = {SCALAR: (1, 1), ROW: (rows, 1), COL: (1, cols)}[kind]
        for s, (kind, _) in self.program.matrix_states.items():
            if kind == mx.DIMMAT:
                continue  # (built when read: ``_factors``)
            side = self.side(kind)
            if side > self.limit:
                env[symbol(s)] = Identity(side, True)
            else:
                self.shapes[symbol(s)] = (side, side)
        self.n, self.device = n, members[0][2].device
        self.env, self.memo = env, {}
        self.diag = opt.diagonal_of(shape) if shape is not None else ()

    def per_matrix(self, values: list):
        """One number per tensor as one per matrix of the stack (a float where all agree)."""
        if len(set(values)) == 1:
            return values[0]
        return torch.tensor(values).repeat_interleave(torch.tensor(self.counts)).reshape(-1, 1, 1)

    def per_tensor(self, x: torch.Tensor, how: str = "sum") -> torch.Tensor:
        """``x`` ([n, 1, 1], one partial per matrix) reduced over each tensor's matrices and
        given back to each matrix (a batched view's per-tensor reductions cover the tensor)."""
        if all(c == 1 for c in self.counts):
            return x
        parts = [x[a : a + c] for a, c in zip(self.starts, self.counts)]
        whole = [
            (q.amax(0) if how == "max" else q.sum(0)).expand(c, 1, 1) for q, c in zip(parts, self.counts)
        ]
        return torch.cat(whole)

    def stack(self, name: sympy.Symbol) -> torch.Tensor:
        """The fp32 stack ``[n, r, c]`` of ``name``'s tensor (p, g or a state) per member."""
        r, c = self.shapes[name]
        if name.name == "p":  # (a split master's fp32 value)
            tensors = [_master(self.opt.state[p], t.detach()) for _, p, t, _ in self.members]
        elif name.name == "g":
            tensors = [g.float() for _, _, _, g in self.members]
        else:
            tensors = [self.opt.state[p][name.name].float() for _, p, _, _ in self.members]
        return torch.cat([t.reshape(-1, r, c) for t in tensors])

    def side(self, kind: str) -> int:
        return self.rows if kind in (mx.ROWMAT, ROW) else self.cols

    def run(self):
        buffers = defaultdict(dict)
        # (a state of a side with no factor is the identity, whatever its rule computes: a
        # gate of one number per tensor, PSGD's counter, would otherwise build that side's value)
        dims = {s for s, (kind, _) in self.program.matrix_states.items() if kind == mx.DIMMAT}
        outputs = [(s, e) for s, e in self.program.matrix_outputs if symbol(s) in self.shapes or s in dims]
        self.uses = dict(self.program.uses(tuple(s for s, _ in outputs)))  # (counted down as read)
        for value, name in self.program.boundaries.items():
            v = self.ev(value)
            self.release(value)
            if isinstance(v, Identity):  # (a diagonal or trace of an identity is computed, not this)
                raise AssertionError("an identity where a value per element was expected")
            v = torch.as_tensor(v, dtype=torch.float32, device=self.device)
            v = torch.broadcast_to(v if v.dim() == 3 else v.reshape(-1, 1, 1), (self.n, self.rows, self.cols))
            for a, c, (_, p, _, _) in zip(self.starts, self.counts, self.members):
                buffers[p][name] = v[a : a + c].reshape(p.shape).contiguous()
        new = []
        for s, value in outputs:
            v = self.ev(value)
            self.release(value)
            if s in dims:
                new += self._factor_outputs(s, v)
                continue
            if isinstance(v, Identity) and v.absorbing:
                continue
            v = self.real(v)
            v = torch.broadcast_to(torch.as_tensor(v, dtype=torch.float32), (self.n, *self.shapes[symbol(s)]))
            for a, c, (_, p, _, _) in zip(self.starts, self.counts, self.members):
                state = self.opt.state[p][s]
                new.append((state, v[a : a + c].reshape(state.shape)))
        return buffers, new

    def _factor_outputs(self, s: str, v) -> list:
        """(state tensor, new value) of each built factor of per-dimension state ``s``."""
        if not isinstance(v, Factors):  # (a number: every factor that value times the identity)
            v = Factors([Identity(d, False, v if torch.is_tensor(v) else float(v)) for d in self.shape])
        new = []
        for key, d, x, diagonal in zip(dims_keys(s, self.shape), self.shape, v.entries, self.diag):
            if diagonal:
                x = _as_diagonal(x, d, self.device)
                if not isinstance(x, Diagonal):
                    raise ValueError(dg.full_message(f"state {key!r}'s new value, a full matrix,"))
                x = torch.broadcast_to(x.v, (self.n, d, 1))
                new += self._per_member(key, x)
                continue
            if d > self.limit:
                continue
            x = torch.broadcast_to(torch.as_tensor(self.real(x), dtype=torch.float32), (self.n, d, d))
            new += self._per_member(key, x)
        return new

    def _per_member(self, key: str, x: torch.Tensor) -> list:
        """(state tensor, new value) of each member: its matrices' rows of the stack ``x``."""
        out = []
        for a, c, (_, p, _, _) in zip(self.starts, self.counts, self.members):
            state = self.opt.state[p][key]
            out.append((state, x[a : a + c].reshape(state.shape)))
        return out

    def _factors(self, name: sympy.Symbol) -> Factors:
        """The stacks of per-dimension state ``name``: ``[n, d, d]`` a dimension (a diagonal
        ``[n, d, 1]``), an absorbing identity for a dimension over the limit."""
        out = []
        for key, d, diagonal in zip(dims_keys(name.name, self.shape), self.shape, self.diag):
            if d > self.limit and not diagonal:
                out.append(Identity(d, True))
                continue
            tail = (d, 1) if diagonal else (d, d)  # (a batched view's factors: one a matrix)
            stack = torch.cat([self.opt.state[p][key].reshape(-1, *tail) for _, p, _, _ in self.members])
            out.append(Diagonal(stack) if diagonal else stack)
        return Factors(out)

    # --- evaluation ------------------------------------------------------------------------
    def ev(self, e):
        if e in self.memo:
            return self.memo[e]
        v = self._ev(e)
        self.memo[e] = v
        for a in _children(e):
            self.release(a)
        return v

    def release(self, e) -> None:
        """One reader of ``e`` has run: the last one frees its value (stacks are large)."""
        left = self.uses.get(e, 0) - 1
        self.uses[e] = left
        if left <= 0 and not e.is_Symbol:
            self.memo.pop(e, None)

    def _ev(self, e):
        if e.is_Symbol:
            if e not in self.env:
                dims = self.program.kinds.get(e) == mx.DIMMAT
                self.env[e] = self._factors(e) if dims else self.stack(e)
            return self.env[e]
        if e.is_Number:
            return float(e)
        if e is sympy.true or e is sympy.false:
            return bool(e)
        if isinstance(e, RandomValue):
            return self._draw(e)
        if isinstance(e, StepRand):
            key = _hash32(_stream_key(self.opt.options.seed, self.step, 0) ^ 0x53544550)
            return float(_hash32((key + e.index) & _M32) >> 8) * 2.0**-24
        if isinstance(e, sympy.Piecewise):
            return self._piecewise(e)
        if isinstance(e, mx.MatrixOp):
            dims = isinstance(e, _OF_DIMS) or self.program.kind(e) in _PER_DIM
            return self._dims(e) if dims else self._matrix(e)
        if isinstance(e, Reduction):
            return self._reduce(e)
        args = [self.ev(a) for a in e.args]
        if any(isinstance(a, Factors) for a in args):  # (per dimension: each factor alike)
            k = len(self.shape)
            per = [[a.entries[i] if isinstance(a, Factors) else a for a in args] for i in range(k)]
            return Factors([self._elementwise(e, xs) for xs in per])
        return self._elementwise(e, args)

    def _elementwise(self, e, args: list):
        if any(isinstance(a, Diagonal) for a in args):
            if type(e) not in _ELEMENTWISE:
                raise RuleError(f"{type(e).__name__} is not supported inside a matrix value")
            d = next(a for a in args if isinstance(a, Diagonal)).d
            args = [_as_diagonal(a, d, self.device) for a in args]
            return dg.elementwise(_ELEMENTWISE[type(e)], args, type(e).__name__)
        if any(isinstance(a, Identity) and a.absorbing for a in args):
            return _of_identities(e, args)
        args = [self.real(a) for a in args]
        if type(e) not in _ELEMENTWISE:
            raise RuleError(f"{type(e).__name__} is not supported inside a matrix value")
        return _ELEMENTWISE[type(e)](*args)

    def _draw(self, e):
        """``rand()`` / ``randn()`` per element, from the counter-based generator the kernels
        use (docs/rules.md), with ``t`` the parameter's position in the optimizer."""
        out = []
        for t, c in zip(self.positions, self.counts):
            offs = torch.arange(c * self.rows * self.cols, dtype=torch.int64, device=self.device)
            key = _hash32(_stream_key(self.opt.options.seed, self.step, t) ^ 0x52414E44)
            j = 2 * e.index
            u1 = (_hash32(offs ^ _hash32((key + j) & _M32)) >> 8).to(torch.float32)
            if isinstance(e, Randn):
                u2 = (_hash32(offs ^ _hash32((key + j + 1) & _M32)) >> 8).to(torch.float32) * 2.0**-24
                value = torch.sqrt(-2.0 * torch.log((u1 + 1.0) * 2.0**-24)) * torch.cos(
                    6.283185307179586 * u2
                )
            else:
                value = u1 * 2.0**-24
            out.append(value.reshape(c, self.rows, self.cols))
        return torch.cat(out)

    def real(self, x):
        """``x`` as a value elementwise work can read (an identity or a permutation built)."""
        if isinstance(x, Diagonal):  # (each operation takes a diagonal's meaning itself)
            raise AssertionError("a diagonal factor where a full matrix was expected")
        if isinstance(x, Identity):
            return x.tensor(self.n, self.device)
        return x.tensor() if isinstance(x, Permutation) else x

    def _piecewise(self, e):
        out = None
        pending = []  # (value, condition tensor) still to combine
        for value, cond in e.args:
            c = _uniform(self.ev(cond))
            if isinstance(c, bool):
                if c:
                    out = self.ev(value)
                    break
                continue
            pending.append((self.ev(value), c))
        if out is None:
            raise RuleError("a where() without a branch that holds")
        for value, c in reversed(pending):
            if any(isinstance(x, Factors) for x in (value, out, c)):  # (per dimension, each alike)
                k = len(self.shape)
                sides = [x.entries if isinstance(x, Factors) else [x] * k for x in (c, value, out)]
                out = Factors([self._where(*abc) for abc in zip(*sides)])
                continue
            out = self._where(c, value, out)
        return out

    def _where(self, c, a, b):
        if any(isinstance(x, Diagonal) for x in (c, a, b)):
            d = next(x for x in (c, a, b) if isinstance(x, Diagonal)).d
            return dg.where(c, _as_diagonal(a, d, self.device), _as_diagonal(b, d, self.device))
        if isinstance(a, Identity) and a.absorbing:  # (a dimension with no factor stays the identity)
            return a
        return torch.where(c, torch.as_tensor(self.real(a)), torch.as_tensor(self.real(b)))

    def _reduce(self, e):
        if isinstance(e, AxisReduction):
            return self._axis(e)
        x = self.ev(e.args[0])
        if isinstance(x, Factors):  # (a number per dimension: each factor's, [n, 1, 1])
            return Factors([self._reduced(e, v) for v in x.entries])
        return self._reduced(e, x)

    def _reduced(self, e, x):
        if isinstance(x, Diagonal):
            return dg.reduced({Norm: "norm", _Sum: "sum", _Mean: "mean", _Amax: "amax"}[type(e)], x)
        x = self.real(x) if isinstance(x, Permutation) else x
        if isinstance(x, Identity):  # (n > max_matrix_dim >= 1: off the diagonal are zeros)
            n, s = x.n, x.scale
            if isinstance(e, _Amax):
                return max(s, 0.0) if isinstance(s, float) else s.clamp_min(0.0)
            return {Norm: math.sqrt(n) * abs(s), _Sum: n * s, _Mean: s / n}[type(e)]
        x = torch.as_tensor(x)
        if x.dim() < 3:
            x = x.reshape(-1, 1, 1)
        # A matrix value reduces per matrix; a value per element over the whole tensor.
        of_tensor = self.program.kind(e.args[0]) not in _MATRIX_LIKE
        whole = self.per_tensor if of_tensor else (lambda y, how="sum": y)
        size = x.shape[-2] * x.shape[-1]
        if isinstance(e, Norm):
            return whole(x.square().sum((-2, -1), keepdim=True)).sqrt()
        if isinstance(e, _Sum):
            return whole(x.sum((-2, -1), keepdim=True))
        if isinstance(e, _Mean):
            if of_tensor:
                size = size * self.per_matrix([float(c) for c in self.counts])
            return whole(x.sum((-2, -1), keepdim=True)) / size
        if isinstance(e, _Amax):
            return whole(x.amax((-2, -1), keepdim=True), "max")
        raise RuleError(f"{e.op}() is not supported inside a matrix value")

    def _axis(self, e):
        """``rowsum``, ``colmean``, ...: over each matrix's columns (a value per row) or rows."""
        x = torch.as_tensor(self.real(self.ev(e.args[0])))
        x = torch.broadcast_to(x if x.dim() == 3 else x.reshape(-1, 1, 1), (self.n, self.rows, self.cols))
        dim = -1 if e.axis == "row" else -2
        if e.op == "sum":
            return x.sum(dim, keepdim=True)
        if e.op == "mean":
            return x.mean(dim, keepdim=True)
        if e.op == "norm":
            return x.square().sum(dim, keepdim=True).sqrt()
        return x.amax(dim, keepdim=True)

    def _matrix(self, e):
        kind = self.program.kind(e)
        quadratic = self._quadratic(e, kind)
        if quadratic is None:
            quadratic = self._diagonal_of_product(e)
        if quadratic is not None:
            return quadratic
        if kind in (mx.ROWMAT, mx.COLMAT) and self.side(kind) > self.limit:
            # (products, transposes and triangles of its identities keep their scales)
            of_identities = isinstance(e, (mx.MatMul, mx.Solve, mx.Transpose, mx.Triu, mx.Tril)) and all(
                self.program.kind(a) == kind for a in e.args
            )
            if not of_identities:
                return Identity(self.side(kind), True)
        if isinstance(e, mx.Eye):
            return Identity(self.rows if e.args[0].name == "rows" else self.cols)
        if isinstance(e, mx.MatMul):
            chained = self._chain(e)
            if chained is not None:
                return chained
        args = [self.ev(a) for a in e.args]
        if isinstance(e, mx.Solve):
            return self._solve(e, *args)
        if isinstance(e, mx.MatMul):
            return self._product(e, *args)
        x = args[0]
        if isinstance(e, mx.Transpose):
            if isinstance(x, Permutation):
                return x.t()
            return x if isinstance(x, (Identity, float)) else torch.as_tensor(x).mT
        x = self.real(x) if isinstance(x, Permutation) else x
        built = (mx.Decomposition, mx.Triu, mx.Tril)
        if isinstance(x, Identity) and not x.absorbing and isinstance(e, built):
            x = self.real(x)  # (eigh of an identity is torch's, not assumed)
        if isinstance(e, mx.Trace):
            if isinstance(x, Identity):
                return x.n * x.scale
            return x.diagonal(dim1=-2, dim2=-1).sum(-1).reshape(-1, 1, 1)
        if isinstance(e, mx.Diag):
            arg_kind = self.program.kind(e.args[0])
            if isinstance(x, Identity):
                return x.scale
            d = x.diagonal(dim1=-2, dim2=-1)
            return d.unsqueeze(-1) if arg_kind == mx.ROWMAT else d.unsqueeze(-2)
        if isinstance(e, mx.ArgmaxOnehot):
            return self._argmax_onehot(self.real(x), kind)
        if isinstance(x, Identity):
            return x
        if isinstance(e, mx.Triu):
            return torch.triu(x)
        if isinstance(e, mx.Tril):
            return torch.tril(x)
        if isinstance(e, mx.SortPerm):
            d = torch.as_tensor(x)
            d = d.reshape(self.n, -1) if d.dim() == 3 else d.expand(self.n, self.side(kind)).clone()
            return _sort_perm(d)
        if isinstance(e, mx.Decomposition):
            return self._decompose(e, torch.as_tensor(x).expand(self.n, *x.shape[-2:]), args[1:])
        raise RuleError(f"{e.spelling}() is not supported here")

    def _dims(self, e):
        """A value of per-dimension factors (``gram``, ``modes``, ``eye_dims``, their products,
        transposes, diagonals, sorts and decompositions), each dimension's factor over the
        stack ``[n, d, d]`` (a diagonal ``[n, d]``)."""
        if isinstance(e, mx.EyeDims):
            ones = [Diagonal(torch.ones(1, d, 1, device=self.device)) for d in self.shape]
            return Factors(
                [
                    one if diagonal else Identity(d, d > self.limit)
                    for one, d, diagonal in zip(ones, self.shape, self.diag)
                ]
            )
        if isinstance(e, mx.Gram):
            return self._gram(self._as_tensors(self.real(self.ev(e.args[0]))))
        if isinstance(e, mx.Modes):
            return self._modes(self._as_tensors(self.real(self.ev(e.args[0]))), self.ev(e.args[1]))
        if isinstance(e, mx.SolveModes):
            return self._solve_modes(e, self.ev(e.args[0]), self._as_tensors(self.real(self.ev(e.args[1]))))
        quadratic = _quadratic_form(e)
        if quadratic is not None:  # (diag(transpose(Q) @ F @ Q): one product a dimension)
            q, m = (self.ev(x).entries for x in quadratic)
            return Factors([self._quadratic_entry(a, b, d) for a, b, d in zip(q, m, self.shape)])
        args = [self.ev(a) for a in e.args]
        if isinstance(e, mx.ProdDims):
            return (
                functools.reduce(operator.mul, args[0].entries, 1.0)
                if isinstance(args[0], Factors)
                else args[0]
            )
        factors = args[0].entries
        if isinstance(e, mx.MatMul):
            pairs = zip(factors, args[1].entries, self.shape)
            return Factors([self._product_entry(e, x, y, d) for x, y, d in pairs])
        if isinstance(e, mx.Solve):
            pairs = zip(factors, args[1].entries, self.shape)
            return Factors([self._solve_entry(e, x, y, d) for x, y, d in pairs])
        if isinstance(e, mx.Trace):
            return Factors([self._trace(x) for x in factors])
        if isinstance(e, mx.Transpose):
            return Factors([_transposed(x) for x in factors])
        if isinstance(e, mx.Diag):  # (a [n, d] vector per dimension)
            return Factors([self._diagonal(x, d) for x, d in zip(factors, self.shape)])
        if isinstance(e, mx.SortPerm):
            return Factors([x if isinstance(x, Identity) else _sort_perm(x.squeeze(-1)) for x in factors])
        if isinstance(e, (mx.Triu, mx.Tril)):
            tri = torch.triu if isinstance(e, mx.Triu) else torch.tril
            kept = [isinstance(x, Diagonal) or (isinstance(x, Identity) and x.absorbing) for x in factors]
            return Factors([x if keep else tri(self.real(x)) for x, keep in zip(factors, kept)])
        if isinstance(e, mx.ArgmaxOnehot):
            return Factors([self._onehot(x, d) for x, d in zip(factors, self.shape)])
        if isinstance(e, mx.Decomposition):
            return self._decompose_factors(e, factors, args[1:])
        raise RuleError(f"{e.spelling}() is not supported for per-dimension factors")

    def _gram(self, x: torch.Tensor) -> Factors:
        """Per dimension ``i``: ``x`` (``[n, *shape]``) unfolded along ``i`` times its transpose."""
        out = []
        for i, d in enumerate(self.shape):
            u = x.movedim(i + 1, 1).reshape(self.n, d, -1)
            if self.diag[i]:  # (the diagonal of that product: sums of squares)
                out.append(Diagonal(u.square().sum(-1, keepdim=True)))
            elif d > self.limit:
                out.append(Identity(d, True))
            else:
                out.append(torch.matmul(u, u.mT))
        return Factors(out)

    def _modes(self, x: torch.Tensor, factors: Factors) -> torch.Tensor:
        """``x ×₁ F₁ ×₂ F₂ …`` (``x`` ``[n, *shape]``), as the stack ``[n, rows, cols]``."""
        for i, f in enumerate(factors.entries):
            if isinstance(f, Identity):
                x = _scaled(x, f.scale)
                continue
            if isinstance(f, Diagonal):
                x = x * dg.along(f.v, i, len(self.shape))
                continue
            moved = x.movedim(i + 1, 1)
            unfolded = moved.reshape(self.n, moved.shape[1], -1)
            y = f.left(unfolded) if isinstance(f, Permutation) else torch.matmul(f, unfolded)
            x = y.reshape(moved.shape).movedim(1, i + 1)
        return x.reshape(self.n, self.rows, self.cols)

    def _decompose_factors(self, e, factors: list, k: list) -> Factors:
        if not factors:  # (a 0-d tensor has no dimension, so no factor and no root to take)
            return Factors([])
        if k and not (isinstance(k[0], float) and k[0] == int(k[0]) and 1 <= k[0] <= 16):
            raise ValueError(
                f"{self.opt.rule.name}: {e.spelling}(M, k) with k {e.args[1]} = {k[0]!r} for a tensor "
                f"of shape {self.shape}: k must be a whole number from 1 to 16"
            )
        old = self._ev(symbol(self.program.owners[e]))
        out = []
        for x, was, d, diagonal in zip(factors, old.entries, self.shape, self.diag):
            if diagonal:
                out.append(self._decompose_diagonal(e, _as_diagonal(x, d, self.device), k, was))
                continue
            if isinstance(x, Identity) and x.absorbing:
                out.append(x)
                continue
            x = torch.as_tensor(self.real(x))
            out.append(self._decompose(e, x.expand(self.n, *x.shape[-2:]), k, old=was))
        return Factors(out)

    def _decompose_diagonal(self, e, x, k: list, old) -> Diagonal:
        """``inv_root``/``inv_root_newton`` of a diagonal factor: each entry's root (eigh and qr
        would make a full matrix: refused)."""
        if not isinstance(e, (mx.InvRoot, mx.InvRootNewton)) or not isinstance(x, Diagonal):
            raise ValueError(dg.full_message(f"{e.spelling}() ({self.opt.rule.name})"))
        state = self.program.owners[e]
        warn = (
            f"{self.opt.rule.name}: {e.spelling}() of a diagonal {x.d}x{x.d} factor with an entry not "
            f"positive; state {state!r} keeps its previous value"
        )
        return dg.inv_root(x, int(k[0]), old, warn)

    def _singular(self, e, d: int) -> str:
        return (
            f"{self.opt.rule.name}: {e.spelling}() with a singular diagonal {d}x{d} factor; its "
            "result is zero"
        )

    def _quadratic_entry(self, q, m, d: int):
        """``diag(qᵀ m q)`` of one dimension's factors as ``[n, d, 1]``."""
        if isinstance(q, Diagonal) or isinstance(m, Diagonal):
            q, m = (_as_diagonal(x, d, self.device) for x in (q, m))
            if not (isinstance(q, Diagonal) and isinstance(m, Diagonal)):
                raise ValueError(dg.full_message("diag(transpose(Q) @ F @ Q) of full and diagonal factors"))
            return (q.v * m.v * q.v).expand(self.n, d, 1)
        if isinstance(q, Identity) and q.absorbing:
            return q
        if torch.is_tensor(q) and torch.is_tensor(m):
            return (q * torch.matmul(m, q)).sum(-2).unsqueeze(-1)
        q, m = torch.as_tensor(self.real(q)), torch.as_tensor(self.real(m))
        return self._diagonal(q.mT @ m @ q, d)

    def _trace(self, x):
        if isinstance(x, Diagonal):
            return dg.reduced("trace", x)
        if isinstance(x, Identity):
            return x.n * x.scale
        x = torch.as_tensor(self.real(x))
        return x.diagonal(dim1=-2, dim2=-1).sum(-1).reshape(-1, 1, 1)

    def _diagonal(self, x, d: int):
        """A factor's diagonal as ``[n, d, 1]`` (a vector per dimension is a column)."""
        if isinstance(x, Diagonal):
            return x.v.expand(self.n, d, 1)
        if isinstance(x, Identity) and x.absorbing:
            return x
        x = torch.as_tensor(self.real(x))
        return x.diagonal(dim1=-2, dim2=-1).expand(self.n, d).unsqueeze(-1)

    def _onehot(self, x, d: int):
        """1 at the first largest entry of each ``[n, d, 1]`` vector, 0 elsewhere."""
        if isinstance(x, Identity) and x.absorbing:
            return x
        return self._first_largest(self.real(x), (self.n, d, 1))

    def _solve_modes(self, e, factors: Factors, x: torch.Tensor) -> torch.Tensor:
        """``x`` multiplied along each dimension ``i`` by ``A[i]⁻¹`` (``A[i]`` triangular)."""
        for i, a in enumerate(factors.entries):
            if isinstance(a, Identity):
                x = _scaled(x, 1.0 / a.scale)
                continue
            if isinstance(a, Diagonal):
                x = dg.finite_or_zero(x / dg.along(a.v, i, len(self.shape)), self._singular(e, a.d))
                continue
            moved = x.movedim(i + 1, 1)
            mats = torch.broadcast_to(torch.as_tensor(self.real(a)), (self.n, moved.shape[1], moved.shape[1]))
            y = self._triangular(e, mats, moved.reshape(self.n, moved.shape[1], -1))
            x = y.reshape(moved.shape).movedim(1, i + 1)
        return x.reshape(self.n, self.rows, self.cols)

    def _as_tensors(self, x) -> torch.Tensor:
        """A value per element of the stack as ``[n, *shape]``."""
        x = torch.as_tensor(x, dtype=torch.float32, device=self.device)
        x = torch.broadcast_to(x if x.dim() == 3 else x.reshape(-1, 1, 1), (self.n, self.rows, self.cols))
        return x.reshape(self.n, *self.shape)

    def _argmax_onehot(self, x, kind):
        """1 at the first largest entry of each matrix's row (column) values, 0 elsewhere."""
        side = self.side(kind)
        return self._first_largest(x, (self.n, side, 1) if kind == ROW else (self.n, 1, side))

    def _first_largest(self, x, shape: tuple):
        """1 at the first largest of each matrix's values (a column or a row ``shape``)."""
        d = torch.as_tensor(x, dtype=torch.float32, device=self.device)
        d = torch.broadcast_to(d if d.dim() == 3 else d.reshape(-1, 1, 1), shape).reshape(self.n, -1)
        return torch.nn.functional.one_hot(d.argmax(-1), d.shape[-1]).to(torch.float32).reshape(shape)

    def _quadratic(self, e, kind):
        """``diag(transpose(Q) @ M @ Q)`` as the column sums of ``Q * (M @ Q)``: one product,
        not two (None where ``e`` is not that, or ``Q`` or ``M`` is not built)."""
        quadratic = _quadratic_form(e)
        if quadratic is None or (kind in (ROW, COL) and self.side(kind) > self.limit):
            return None
        q, m = (self.real(self.ev(x)) for x in quadratic)
        if any(isinstance(x, (Identity, Permutation)) for x in (q, m)):
            return None
        d = (q * torch.matmul(m, q)).sum(-2)
        return d.unsqueeze(-1) if kind == ROW else d.unsqueeze(-2)

    def _diagonal_of_product(self, e):
        """``diag(A @ B)`` as the row sums of ``A * Bᵀ`` where nothing else reads ``A @ B``:
        ``k²`` a side, not a ``k³`` product (PSGD's power-iteration start); None otherwise."""
        ab = e.args[0] if isinstance(e, mx.Diag) else None
        if not isinstance(ab, mx.MatMul) or self.uses.get(ab, 0) != 1 or ab in self.memo:
            return None
        kind = self.program.kind(ab)
        if self.side(kind) > self.limit:
            return None
        a, b = (self.ev(x) for x in ab.args)
        if not (torch.is_tensor(a) and torch.is_tensor(b)):
            return None  # (an identity or a permutation: the product as usual)
        d = (a * b.mT).sum(-1)
        for x in _children(ab):  # (the product's turn as their reader)
            self.release(x)
        return d.unsqueeze(-1) if kind == mx.ROWMAT else d.unsqueeze(-2)

    def _product_entry(self, e, a, b, d: int):
        """One dimension's ``a @ b`` (a diagonal's product, or ``_product``)."""
        if isinstance(a, Diagonal) or isinstance(b, Diagonal):
            return dg.product(_as_diagonal(a, d, self.device), _as_diagonal(b, d, self.device))
        return self._product(e, a, b)

    def _solve_entry(self, e, a, b, d: int):
        """One dimension's ``a⁻¹ b`` (a diagonal's, or ``_solve``)."""
        if isinstance(a, Diagonal) or isinstance(b, Diagonal):
            a, b = _as_diagonal(a, d, self.device), _as_diagonal(b, d, self.device)
            return dg.solve(a, b, self._singular(e, d))
        return self._solve(e, a, b)

    def _product(self, e, a, b):
        """``a @ b``: an identity skipped, a permutation gathered, else batched matmul."""
        if isinstance(a, Identity):
            return _scaled(b, a.scale)
        if isinstance(b, Identity):
            return _scaled(a, b.scale)
        kb = self.program.kind(e.args[1])
        if isinstance(a, Permutation) and not isinstance(b, Permutation) and kb != COL:
            return a.left(torch.as_tensor(self.real(b)).expand(self.n, *torch.as_tensor(b).shape[-2:]))
        if isinstance(b, Permutation) and not isinstance(a, Permutation):
            return b.right(torch.as_tensor(self.real(a)).expand(self.n, *torch.as_tensor(a).shape[-2:]))
        a, b = self.real(a), self.real(b)
        if kb == COL:  # a column value is [n, 1, cols]: as a vector [n, cols, 1]
            return torch.matmul(a, torch.as_tensor(b).mT).mT
        return torch.matmul(a, b)

    def _chain(self, e):
        """``e``, a product of three or more factors whose inner products nothing else reads,
        multiplied in the order of fewest flops for this stack's sizes (``transpose(QL) @ QL
        @ m`` as ``QLᵀ (QL m)``: ``r² c`` twice, not ``r³ + r² c``); None where the written
        order is that order, or a factor is an identity, a permutation or a number."""
        leaves, inner = self._chain_factors(e)
        if len(leaves) < 3:
            return None
        dims = {
            mx.ROWMAT: (self.rows, self.rows),
            mx.COLMAT: (self.cols, self.cols),
            ELEMENT: (self.rows, self.cols),
        }
        dims.update({mx.ELEMENT_T: (self.cols, self.rows), ROW: (self.rows, 1), COL: (self.cols, 1)})
        kinds = [self.program.kind(x) for x in leaves]
        order = _chain_order([dims[k] for k in kinds], kinds) if all(k in dims for k in kinds) else None
        values = [self.ev(x) for x in leaves]
        if order is None or _is_left_to_right(order) or not all(torch.is_tensor(v) for v in values):
            return None  # (the written order: its inner products evaluate as usual)
        mats = [v.mT if k == COL else v for v, k in zip(values, kinds)]  # (a column value as [cols, 1])

        def product(tree):
            return mats[tree] if isinstance(tree, int) else torch.matmul(product(tree[0]), product(tree[1]))

        out = product(order)
        for node in inner:  # (their readers' turn: the factors they would have read)
            for a in _children(node):
                self.release(a)
        return out.mT if self.program.kind(e) == COL else out

    def _chain_factors(self, e) -> tuple[list, list]:
        """The factors of the product ``e`` through the inner products only it reads, left to
        right, and those inner products."""
        leaves, inner = [], []

        def walk(x):
            if isinstance(x, mx.MatMul) and (x is e or (self.uses.get(x, 0) == 1 and x not in self.memo)):
                if x is not e:
                    inner.append(x)
                walk(x.args[0])
                walk(x.args[1])
            else:
                leaves.append(x)

        walk(e)
        return leaves, inner

    def _solve(self, e, a, b):
        """``A⁻¹ B`` per matrix of the stack (``Solve``), retried in fp64 where not finite,
        zero (with a warning) where that fails too."""
        if isinstance(a, Identity):
            return _scaled(b, 1.0 / a.scale)
        b = self.real(b)
        column = self.program.kind(e.args[1]) == COL  # (a column value is [n, 1, cols])
        rhs = torch.as_tensor(b).mT if column else torch.as_tensor(b)
        rhs = torch.broadcast_to(rhs, (self.n, *rhs.shape[-2:]))
        mats = torch.broadcast_to(torch.as_tensor(a), (self.n, *a.shape[-2:]))
        out = self._triangular(e, mats, rhs)
        return out.mT if column else out

    def _triangular(self, e, mats: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
        """``mats⁻¹ rhs`` per matrix, retried in fp64 where not finite, zero (with a warning)
        where that fails too."""

        def solve(m, r):
            return torch.linalg.solve_triangular(m, r, upper=e.upper)

        out = solve(mats, rhs)
        bad = (~torch.isfinite(out)).flatten(1).any(1)
        if bool(bad.any()):
            out = out.clone()
            for j in bad.nonzero().flatten().tolist():
                q = solve(mats[j : j + 1].double(), rhs[j : j + 1].double())[0].float()
                if not bool(torch.isfinite(q).all()):
                    q = torch.zeros_like(q)
                    warnings.warn(
                        f"{self.opt.rule.name}: {e.spelling}() with a singular {mats.shape[-1]}x"
                        f"{mats.shape[-1]} factor in fp32 and fp64; its result is zero",
                        RuntimeWarning,
                        stacklevel=5,
                    )
                out[j] = q
        return out

    def _decompose(self, e, mats: torch.Tensor, extra: list, old=None):
        fn = _DECOMPOSITIONS[type(e)]
        k = int(extra[0]) if extra else None
        try:
            out = fn(mats, k)
            ok = torch.isfinite(out).flatten(1).all(1)
        except RuntimeError:
            out = torch.zeros_like(mats)
            ok = torch.zeros(len(mats), dtype=torch.bool, device=mats.device)
        if bool(ok.all()):
            return out
        state = self.program.owners[e]
        if old is None:
            old = self._ev(symbol(state))  # (its stack, built if the rule never read it)
        old = torch.as_tensor(self.real(old)).expand_as(mats)
        out = out.clone()
        for j in (~ok).nonzero().flatten().tolist():
            try:
                q = fn(mats[j : j + 1].double(), k)[0].float()
                good = bool(torch.isfinite(q).all())
            except RuntimeError:
                good = False
            if good:
                out[j] = q
            else:
                out[j] = old[j]
                warnings.warn(
                    f"{self.opt.rule.name}: {e.spelling}() of a {mats.shape[-1]}x{mats.shape[-1]} matrix "
                    f"failed in fp32 and fp64; state {state!r} keeps its previous value",
                    RuntimeWarning,
                    stacklevel=5,
                )
        return out


_M32 = 0xFFFFFFFF


def _hash32(x):
    """The kernels' 32-bit mixer (templates/helpers.py.jinja) on Python ints or int64 tensors
    holding uint32 values (a product's low 32 bits are the same in int64's wrap)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _stream_key(seed: int, step: int, t: int) -> int:
    k = _hash32((seed & _M32) ^ _hash32(((seed >> 32) & _M32) ^ 0x9E3779B9))
    k = _hash32(k ^ (step & _M32))
    return _hash32(k ^ (t & _M32) ^ 0x85EBCA6B)


def _eigh(m: torch.Tensor, _k) -> torch.Tensor:
    return torch.linalg.eigh(m)[1].flip(-1)  # columns by eigenvalue, largest first


def _qr(m: torch.Tensor, _k) -> torch.Tensor:
    return torch.linalg.qr(m)[0]


def _inv_root(m: torch.Tensor, k: int) -> torch.Tensor:
    lam, vec = torch.linalg.eigh(m)
    root = torch.where(lam > 0, lam.clamp_min(torch.finfo(lam.dtype).tiny) ** (-1.0 / k), float("nan"))
    return (vec * root.unsqueeze(-2)) @ vec.mT


_DECOMPOSITIONS = {mx.Eigh: _eigh, mx.QR: _qr, mx.InvRoot: _inv_root, mx.InvRootNewton: inv_root_newton}


def _t(x):
    return torch.as_tensor(x) if not isinstance(x, torch.Tensor) else x


def _pow(a, b):
    if isinstance(a, float) and isinstance(b, float):
        return a**b
    return torch.pow(_t(a), b) if isinstance(b, float) else torch.pow(_t(a), _t(b))


def _fold(op):
    """``op`` over any number of arguments, left to right (sympy's Add, Mul, Min, Max)."""
    return lambda *xs: functools.reduce(op, xs)


def _compare(op):
    def f(a, b):
        if isinstance(a, float) and isinstance(b, float):
            return bool(op(a, b))
        return op(_t(a), _t(b))

    return f


def _logical(op, fold):
    """``and`` / ``or``: Python's of per-step conditions, elementwise of per-element ones."""

    def f(*xs):
        if all(isinstance(x, bool) for x in xs):
            return fold(xs)
        return functools.reduce(op, (_t(x) for x in xs))

    return f


def _mod(a, b):
    if isinstance(a, float) and isinstance(b, float):
        return a - b * math.floor(a / b)
    return _t(a) - _t(b) * torch.floor(_t(a) / _t(b))


_ELEMENTWISE = {
    sympy.Add: _fold(operator.add),
    sympy.Mul: _fold(operator.mul),
    sympy.Pow: _pow,
    sympy.exp: lambda x: math.exp(x) if isinstance(x, float) else torch.exp(x),
    sympy.log: lambda x: math.log(x) if isinstance(x, float) else torch.log(x),
    sympy.Abs: lambda x: abs(x) if isinstance(x, float) else torch.abs(x),
    sympy.sign: lambda x: float(math.copysign(1, x)) * (x != 0) if isinstance(x, float) else torch.sign(x),
    sympy.tanh: lambda x: math.tanh(x) if isinstance(x, float) else torch.tanh(x),
    ApproxTanh: lambda x: math.tanh(x) if isinstance(x, float) else torch.tanh(x),
    Sigmoid: lambda x: 1 / (1 + math.exp(-x)) if isinstance(x, float) else torch.sigmoid(x),
    sympy.cos: lambda x: math.cos(x) if isinstance(x, float) else torch.cos(x),
    sympy.sin: lambda x: math.sin(x) if isinstance(x, float) else torch.sin(x),
    sympy.floor: lambda x: float(math.floor(x)) if isinstance(x, float) else torch.floor(x),
    sympy.Min: _fold(lambda a, b: torch.minimum(_t(a), _t(b))),
    sympy.Max: _fold(lambda a, b: torch.maximum(_t(a), _t(b))),
    Remainder: _mod,
    sympy.StrictLessThan: _compare(lambda a, b: a < b),
    sympy.LessThan: _compare(lambda a, b: a <= b),
    sympy.StrictGreaterThan: _compare(lambda a, b: a > b),
    sympy.GreaterThan: _compare(lambda a, b: a >= b),
    sympy.Equality: _compare(lambda a, b: a == b),
    sympy.Unequality: _compare(lambda a, b: a != b),
    sympy.And: _logical(operator.and_, all),
    sympy.Or: _logical(operator.or_, any),
    Log1p: lambda x: math.log1p(x) if isinstance(x, float) else torch.log1p(x),
    Expm1: lambda x: math.expm1(x) if isinstance(x, float) else torch.expm1(x),
    sympy.Not: lambda x: (not x) if isinstance(x, bool) else ~_t(x),
}


def make_matrix_optimizer(rule: Rule, name: str | None, opts: Options) -> type:
    """The optimizer class of a matrix rule (``fuser.compile``)."""
    program = MatrixProgram(rule)
    opts = update_options(rule, program, opts)
    plan_and_sources(program.update_rule, dtype_plan(program.update_rule, opts, "fp32", "fp32"), False)
    return rule_class(rule, name, MatrixRuleOptimizer, "matrix rule", program=program, options=opts)


def update_options(rule: Rule, program: MatrixProgram, opts: Options) -> Options:
    """``opts`` with ``state_dtype`` given per state of the update kernel: the element
    states as asked, the buffers it reads from the matrix phase fp32. Matrix, row, column
    and per-tensor states are fp32 (the matrix phase's torch work); 8-bit formats are
    refused."""
    sd = opts.state_dtype
    if sd is None:
        return opts
    asked = dict(sd) if isinstance(sd, tuple) else {"default": sd}
    elements = [s for s, _ in program.element_states]
    for s, fmt in asked.items():
        if s != "default" and s not in elements:
            held = "a matrix" if s in program.matrix_states else "a row, column or per-tensor"
            if s not in dict(rule.state):
                raise ValueError(
                    f"state_dtype names {s!r}, which rule {rule.name!r} does not have; its states are "
                    f"{sorted(dict(rule.state))} (and 'default' names the rest)"
                )
            raise ValueError(
                f"state_dtype[{s!r}]: {s!r} is {held} state of matrix rule {rule.name!r}, kept in fp32 "
                f"for the matrix phase; state_dtype applies to its element states {elements}"
            )
        if fmt in (*QFORMATS, "q8"):
            raise ValueError(
                f"state_dtype {fmt!r} for matrix rule {rule.name!r}: 8-bit states are not supported "
                "for matrix rules; use 'bf16', 'fp16' or 'param'"
            )
    default = asked.get("default")
    per_state = {s: asked.get(s, default) for s in elements}
    per_state = {s: f for s, f in per_state.items() if f is not None}
    return dataclasses.replace(opts, state_dtype=(*sorted(per_state.items()), ("default", "fp32")))
