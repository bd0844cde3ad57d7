"""The step engine of a compiled optimizer: what a step checks, what it rebuilds when
something changed, and the launches it makes.

A step gathers the parameters that have gradients, checks that nothing changed since the
last step (addresses, sizes, dtypes, devices, strides, groups, state tensors: a quick
check in ``tracking`` first, a full one when that cannot tell), and walks its *program*:
a list of steps made when the tables were built, one ``KernelStep`` per (phase, launch
group) and a ``CollectiveStep`` where shards must combine a phase's reductions before
the next. A launch group is one (device, dtype plan) with its own pointer tables, or a
slice of one where matrix functions' stacks must fit a budget (``runtime.matrix``: their
workspace is allocated for each step); tables are rebuilt only when something changed;
hyperparameters are re-sent only when a group's values changed. A new kind of phase is a
new kind of step in the program.

The engine reads its front end (``fuser.optim.FuserOptimizer``) through ``param_groups``,
``state``, ``rule``, ``options``, ``_state_keys``, ``_group_hyper`` and GradScaler's
``grad_scale``/``found_inf``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import triton  # noqa: F401 - with the module, not inside the first step (~0.1-0.3 s)

from fuser.cache import load_kernel
from fuser.codegen.render import device_profile
from fuser.counters import count
from fuser.ir.optim import ACCUMULATE, MASTER_SLOT, hyper_columns, is_tiled, scalar_state_names, scale_slot
from fuser.log import logger
from fuser.rules.functions import RandomValue
from fuser.rules.signs import interval_hyper, nonneg_states
from fuser.runtime import distributed
from fuser.runtime.matrix import (
    Workspace,
    build_matrices,
    extent,
    plan_slices,
    shape_groups,
    workspace_budget,
)
from fuser.runtime.plans import TORCH_DTYPES, StepLayout, dtype_plan, plan_and_sources
from fuser.runtime.state import ensure_states, pack_scalars, validate
from fuser.runtime.tables import Tables, build_tables, is_batched, matrix_2d, n_matrices
from fuser.runtime.tracking import Snapshot, take_snapshot, unchanged


@dataclass
class LaunchGroup:
    """Everything the launches of one (device, dtype plan) need, valid while the signature
    it was built for holds."""

    kernels: list  # one per phase
    plan: StepLayout
    tables: Tables
    scalars: torch.Tensor  # fp32 [n_tensors, 1 + n_scalar_states]
    red: torch.Tensor  # fp32 [n_tensors, n_reductions]: per-tensor reduction results
    partials: torch.Tensor  # fp32 [n_blocks, n_reductions]
    members: list[int]  # index in the step's parameter list of each table row (a tensor's matrices: one each)
    grad_column: int  # column of the gradient in ``tables.ptrs``
    part: int  # row of this launch in its device's global-reduction table
    axis: torch.Tensor | None = None  # fp32: axis reductions' per-row, then per-column results
    axis_init: torch.Tensor | None = None  # what ``axis`` holds before a step (0, or -inf for amax)
    matrices: list = field(default_factory=list)  # MatrixWork of each matrix function
    grad_offsets: list = field(default_factory=list)  # bytes into its gradient of each table row
    combine: BatchCombine | None = None  # batched views: per-tensor totals over each tensor's matrices
    matrix_columns: torch.Tensor | None = None  # int64: columns of ``tables.ptrs`` in the matrix workspace
    matrix_offsets: torch.Tensor | None = None  # int64 [n_tensors, columns]: their byte offsets in it
    workspace_end: int = 0  # the byte after this group's matrix stacks in its device's workspace


@dataclass(frozen=True)
class KernelStep:
    """One phase's kernel over one launch group's tables."""

    kernel: object
    group: LaunchGroup
    first: bool = False  # the step's first launch of the group: it resets the axis buffer

    def __call__(self, engine: StepEngine, opt, seed: int) -> None:
        g = self.group
        t = g.tables
        device = t.ptrs.device
        grad_scale, found_inf = engine.amp_tensors(opt, device)
        tiled = ()
        if g.plan.tiled:
            if self.first and g.axis_init is not None:
                g.axis.copy_(g.axis_init)
            tiled = (t.axis_starts, g.axis, t.total_rows, t.total_cols)
        self.kernel(
            (t.n_blocks,),
            t.ptrs,
            t.numels,
            t.groups,
            t.block_tensor,
            t.block_start,
            t.tensor_first_block,
            t.tensor_blocks,
            engine.hyper_tables[device],
            g.scalars,
            g.red,
            g.partials,
            t.counters,
            engine.glob[device],
            grad_scale,
            found_inf,
            t.n_tensors,
            t.n_blocks,
            g.part,
            engine.n_parts[device],
            seed,
            *tiled,
        )


@dataclass(frozen=True)
class MatrixStep:
    """A matrix function's batched products over one launch group (``runtime.matrix``)."""

    work: object

    def __call__(self, engine: StepEngine, opt, seed: int) -> None:
        self.work()


@dataclass(frozen=True)
class CombineStep:
    """Combine the per-tensor reductions of a batched tensor's matrices after ``phase``."""

    combine: object
    phase: int

    def __call__(self, engine: StepEngine, opt, seed: int) -> None:
        self.combine(self.phase)


@dataclass(frozen=True)
class CollectiveStep:
    """Combine the reductions of DTensor shards after ``phase`` (``runtime.distributed``)."""

    phase: int

    def __call__(self, engine: StepEngine, opt, seed: int) -> None:
        engine.shards(self.phase)


def program(groups: list[LaunchGroup], shards, one_by_one: bool = False) -> list:
    """The launch sequence: phase k of every group before phase k + 1 of any (global
    reductions combine the totals of every launch on the device), with the shards'
    collective between phases; ``one_by_one`` (nothing combines across groups): each
    group's phases, then the next group's, so that the groups' matrix stacks can share
    one workspace."""
    if one_by_one:
        return [step for group in groups for step in program([group], None)]
    steps = []
    n_phases = len(groups[0].kernels)
    for phase in range(n_phases):
        steps += [KernelStep(group.kernels[phase], group, phase == 0) for group in groups]
        steps += [CombineStep(group.combine, phase) for group in groups if group.combine is not None]
        if shards is not None and phase < n_phases - 1:
            steps.append(CollectiveStep(phase))
        steps += [MatrixStep(w) for group in groups for w in group.matrices if w.phase == phase]
    return steps


@dataclass
class StepEngine:
    snapshot: Snapshot | None = None
    signature: list = field(default_factory=list)
    grad_ptrs: list = field(default_factory=list)
    launches: list = field(default_factory=list)  # LaunchGroup per (device, dtype plan)
    program: list = field(default_factory=list)  # what a step calls, in order (see program())
    hyper_values: list = field(default_factory=list)  # per group: floats, None where a tensor
    hyper_tables: dict = field(default_factory=dict)  # device -> fp64 [n_groups, n_hyper]
    glob: dict = field(default_factory=dict)  # device -> fp32 [n_parts, n_global]
    n_parts: dict = field(default_factory=dict)  # device -> launches (dtype plans) on it
    amp_defaults: dict = field(default_factory=dict)  # device -> (grad_scale 1.0, found_inf 0.0)
    shards: object = None  # combines reductions of DTensor shards between phases (runtime.distributed)
    workspaces: list = field(default_factory=list)  # runtime.matrix.Workspace per device with matrix stacks

    def step(self, opt, loss=None) -> None:
        """One step; ``loss``: the closure's value, for a rule that reads it (a tensor of
        one element, or a number)."""
        # Nothing here is recorded by autograd except what prepare and sync_hyper guard
        # themselves: a no_grad() around every step would cost more than the quick check.
        if self.snapshot is None or not unchanged(self.snapshot, opt, self):
            self.snapshot = None
            with torch.no_grad():
                if not self.prepare(opt):
                    return
        self.launch(opt, loss)

    def forget(self) -> None:
        """Re-read everything at the next step (new param groups, loaded state)."""
        self.signature = []
        self.snapshot = None

    # the full check ------------------------------------------------------------------
    def prepare(self, opt) -> bool:
        """The full check: gather, rebuild what changed; False when no parameter has a gradient."""
        count("full_checks")
        items, signature, grad_ptrs = gather(opt)
        if not items:
            return False
        if signature != self.signature:
            self.rebuild(opt, items)
            # The rebuild created state and re-packed steps: take the signature afterwards.
            _, self.signature, self.grad_ptrs = gather(opt)
        elif grad_ptrs != self.grad_ptrs:
            self.refresh_grad_column(grad_ptrs)
        self.snapshot = take_snapshot(opt, items)
        return True

    def rebuild(self, opt, items) -> None:
        """Check every tensor, create missing state, and rebuild tables: all checks run
        before anything is modified, so a bad input leaves the optimizer as it was."""
        validate(opt, items)
        # Every group has the same phases (the program runs phase k of each before phase
        # k + 1 of any): one sharded tensor of a rule of rows and columns lowers them all so.
        sharded = is_tiled(opt.rule) and any(distributed.split_axis(p) for p, _, _ in items)
        parts = partition(opt, items)
        one_by_one, budget = slicing(opt, items, next(iter(parts))[1], sharded)
        ensure_states(opt, items)
        groups, n_parts, ends = [], {}, {}
        for (device, dplan), indexed in parts.items():
            for piece in slice_group(opt, indexed, budget, device) if one_by_one else [indexed]:
                part = n_parts.get(device, 0)
                n_parts[device] = part + 1
                at = 0 if one_by_one else ends.get(device, 0)
                groups.append(build_group(opt, device, dplan, piece, part, sharded, at))
                ends[device] = max(ends.get(device, 0), groups[-1].workspace_end)
        logger.info(
            "%s: tables rebuilt for %d tensors in %d launch group(s)",
            type(opt).__name__,
            len(items),
            len(groups),
        )
        self.launches = groups
        self.n_parts = n_parts
        n_global = max(1, groups[0].plan.n_global)
        self.glob = {d: torch.zeros(n, n_global, device=d) for d, n in n_parts.items()}
        self.shards = distributed.shard_reduction(
            groups, [[items[i][0] for i in group.members] for group in groups], self.glob
        )
        self.program = program(groups, self.shards, one_by_one)
        self.workspaces = workspaces(groups, ends)
        self.hyper_values = []  # force a hyper table refresh

    def grads_moved(self, grad_ptrs: list) -> None:
        """New gradient tensors passed the quick check: rewrite the gradient column if they moved."""
        if grad_ptrs != self.grad_ptrs:
            self.refresh_grad_column(grad_ptrs)

    def refresh_grad_column(self, grad_ptrs: list) -> None:
        """Same parameters, states and gradient layouts; only the gradients moved."""
        for group in self.launches:
            column = [grad_ptrs[i] + off for i, off in zip(group.members, group.grad_offsets)]
            column = torch.tensor(column, dtype=torch.int64)
            group.tables.ptrs[:, group.grad_column].copy_(column)
        self.grad_ptrs = grad_ptrs

    # the launches --------------------------------------------------------------------
    def launch(self, opt, loss=None) -> None:
        self.sync_hyper(opt, loss)
        seed = opt.options.seed
        for workspace in self.workspaces:
            workspace.acquire()
        try:
            for step in self.program:
                step(self, opt, seed)
        finally:
            for workspace in self.workspaces:
                workspace.release()

    def amp_tensors(self, opt, device):
        """(grad_scale, found_inf) on ``device``: GradScaler's when it set them, else 1 and 0."""
        if device not in self.amp_defaults:
            self.amp_defaults[device] = (torch.ones(1, device=device), torch.zeros(1, device=device))
        scale, found = self.amp_defaults[device]
        gs = getattr(opt, "grad_scale", None)
        fi = getattr(opt, "found_inf", None)
        if gs is not None:
            scale = gs.to(device=device, dtype=torch.float32).reshape(1)
        if fi is not None:
            found = fi.to(device=device, dtype=torch.float32).reshape(1)
        return scale, found

    def sync_hyper(self, opt, loss=None) -> None:
        """Send the groups' hyperparameters to each device's table: numbers when they change
        (a host-to-device copy), tensors (an ``lr`` tensor, say) by a device copy every
        step, which a captured CUDA graph replays. A rule that reads ``loss`` has it in the
        last column, written each step the same way (no host sync for a device tensor)."""
        names = list(opt.rule.hyper_defaults)
        rows, tensors = hyper_rows(opt, names)
        columns = len(hyper_columns(opt.rule))
        devices = {group.tables.ptrs.device for group in self.launches}
        if rows != self.hyper_values or set(self.hyper_tables) != devices:
            check_unsigned_states(opt, names, rows)
            numbers = [
                [math.nan if v is None else v for v in row] + [math.nan] * (columns - len(names))
                for row in rows
            ]
            for device in devices:
                self.hyper_tables[device] = (
                    torch.tensor(numbers, dtype=torch.float64).reshape(len(rows), columns).to(device)
                )
            self.hyper_values = rows
        if columns > len(names):
            tensors = [*tensors, *((gi, len(names), loss) for gi in range(len(rows)))]
        if tensors:
            with torch.no_grad():
                for device in devices:
                    table = self.hyper_tables[device]
                    for gi, j, v in tensors:
                        if torch.is_tensor(v):
                            table[gi, j].copy_(v.detach().reshape(()))
                        else:
                            table[gi, j].fill_(float(v))


def check_unsigned_states(opt, names: list[str], rows: list[tuple]) -> None:
    """Raise where ``state_dtype="q8"`` stores a state unsigned on a proof that holds for
    hyperparameters in [0, 1] and a param group's value lies outside."""
    if "q8" not in str(opt.options.state_dtype):
        return
    for h in sorted(interval_hyper(opt.rule)):
        j = names.index(h)
        for gi, row in enumerate(rows):
            if row[j] is not None and not 0.0 <= row[j] <= 1.0:
                raise ValueError(
                    f"state_dtype='q8' stores {sorted(nonneg_states(opt.rule))} unsigned: the rule keeps "
                    f"them non-negative for {h} in [0, 1], and param group {gi} has {h}={row[j]}; "
                    "name their formats instead, e.g. state_dtype=dict(name='int8')"
                )


def hyper_rows(opt, names: list[str]) -> tuple[list[tuple], list]:
    """Per param group, its hyperparameters as numbers (None where a tensor), and the
    tensors as (group, column, tensor)."""
    rows, tensors = [], []
    for gi, group in enumerate(opt.param_groups):
        hv = opt._group_hyper(group)
        row = []
        for j, n in enumerate(names):
            v = hv[n]
            if torch.is_tensor(v):
                tensors.append((gi, j, v))
                row.append(None)
            else:
                v = float(v)
                if not math.isfinite(v):
                    raise ValueError(f"hyperparameter {n!r} of param group {gi} is {v}; it must be finite")
                row.append(v)
        rows.append(tuple(row))
    return rows, tensors


def gather(opt):
    """Parameters with gradients, and what the tables depend on: ``signature`` (all but
    the gradients' addresses) and ``grad_ptrs`` (those, which change every step when
    gradients are set to None between steps). Both are of the local tensors the kernels
    walk: a DTensor's own ``data_ptr()`` is 0."""
    attr = opt.options.grad_attr
    keys = list(opt._state_keys.values())
    keys += [k + "_absmax" for k in keys] + ["master_lo"]  # 8-bit scales, split masters' low parts
    items, signature, grad_ptrs = [], [], []
    for gi, group in enumerate(opt.param_groups):
        for p in group["params"]:
            g = getattr(p, attr, None)
            if g is None:
                continue
            g, pl, gl = distributed.local_pair(p, g, attr)
            items.append((p, g, gi))
            st = opt.state.get(p)
            try:
                grad_ptrs.append(gl.data_ptr())
                sig = (
                    gi,
                    pl.data_ptr(),
                    pl.dtype,
                    gl.dtype,
                    pl.device,
                    gl.device,
                    pl.shape,
                    gl.shape,
                    pl.stride(),
                    gl.stride(),
                )
            except RuntimeError:  # sparse and other storage-less gradients
                sig = (gi, id(g))
            if st:
                # States are fuser's own tensors: a new one (load_state_dict, assignment)
                # is a new object, so identity is enough and far cheaper than data_ptr().
                sig += tuple(id(st.get(k)) for k in keys) + (id(st.get("step")),)
            signature.append(sig)
    return items, signature, grad_ptrs


def partition(opt, items) -> dict[tuple, list]:
    """(device, dtype plan) -> [(index in items, p, g, group index)]: one launch group each."""
    parts: dict[tuple, list] = {}
    for i, (p, g, gi) in enumerate(items):
        dplan = dtype_plan(opt.rule, opt.options, TORCH_DTYPES[p.dtype], TORCH_DTYPES[g.dtype])
        parts.setdefault((p.device, dplan), []).append((i, p, g, gi))
    return parts


@dataclass(frozen=True)
class Entry:
    """One table row: matrix ``index`` of ``count`` of member ``member``'s 2-D view (a
    batched view's matrices are rows of their own, ``batched``; ``count`` is 1 otherwise),
    whose ``rows`` and ``cols`` the rule reads."""

    member: int
    index: int
    count: int
    rows: int
    cols: int
    batched: bool = False


def table_entries(opt, members: list, shaped: bool) -> list[Entry]:
    """The table rows of ``members`` ((p, g, group index)): one per tensor, or where a
    rule of rows, columns or matrices takes a batched view, one per matrix."""
    entries = []
    for k, (p, _, gi) in enumerate(members):
        view = opt._view_of(opt.param_groups[gi]) if shaped else "flatten"
        rows, cols = matrix_2d(p.shape, view)
        n = n_matrices(p.shape, view)
        entries += [Entry(k, j, n, rows, cols, is_batched(p.shape, view)) for j in range(n)]
    return entries


def entry_slice(t: torch.Tensor, role: str, e: Entry) -> torch.Tensor:
    """Entry ``e``'s part of a slot's tensor ``t`` (a plain, contiguous tensor where ``e``
    is one of several matrices; 8-bit scales: its blocks, each matrix a whole number of
    them, ``state._validate_batched``)."""
    if not e.batched or role == "matrix":
        return t
    per = {"row": (e.rows,), "col": (e.cols,), "scale": (-1,)}.get(role, (e.rows, e.cols))
    return t.reshape(e.count, *per)[e.index]


def build_group(
    opt, device, dplan: tuple, indexed: list, part: int, sharded: bool = False, at: int = 0
) -> LaunchGroup:
    """The kernels, pointer tables, scalar table and reduction buffers of one launch group
    (``sharded``: lowered for DTensor shards of a rule of rows and columns), its matrix
    stacks from byte ``at`` of its device's workspace."""
    members = [m[1:] for m in indexed]
    profile = device_profile(device)
    plan, sources = plan_and_sources(opt.rule, dplan, opt.options.stochastic_rounding, sharded, profile)
    kernels = [load_kernel(src, device) for src in sources]
    matrix = any(r.matrix for r in plan.reductions)
    entries = table_entries(opt, members, plan.tiled or matrix)
    shards = [distributed.row_shard(members[e.member][0]) for e in entries] if matrix else None
    shapes = [(e.rows, e.cols) if e.batched else members[e.member][0].shape for e in entries]
    matrices, matrix_slots = build_matrices(plan.reductions, shapes, device, shards, at)
    # The matrix slots point into the workspace: null until a step's Workspace.acquire.
    null = {name: _NULL for name in (matrix_slots[0] if matrix_slots else {})}
    rows = [entry_row(opt, plan, members[e.member], e, null) for e in entries]
    block = dict(sources[0].constexprs)["BLOCK"]
    tables = build_tables(
        rows,
        [members[e.member][2] for e in entries],
        block,
        device,
        [members[e.member][0].shape for e in entries],
        plan.tile if plan.tiled else None,
        [(e.rows, e.cols) for e in entries],
    )
    scalars = pack_scalars(opt, [members[e.member] for e in entries], scalar_state_names(opt.rule), device)
    nred = max(1, plan.n_reductions)
    red = torch.zeros(tables.n_tensors, nred, device=device)
    partials = torch.zeros(tables.n_blocks if plan.n_reductions else 1, nred, device=device)
    grad_column = [sl.name for sl in plan.slots].index("g")
    axis, axis_init = axis_buffers(plan, tables, device)
    return LaunchGroup(
        kernels,
        plan,
        tables,
        scalars,
        red,
        partials,
        [indexed[e.member][0] for e in entries],
        grad_column,
        part,
        axis,
        axis_init,
        matrices,
        [_grad_offset(members[e.member][1], e) for e in entries],
        batch_combine(plan, entries, red),
        *matrix_columns(plan, matrix_slots, device),
        extent(matrices, at),
    )


_NULL = torch.empty(0)  # data_ptr() 0


def matrix_columns(plan: StepLayout, matrix_slots: list[dict], device) -> tuple:
    """(columns of the pointer table that point into the workspace, int64 on ``device``;
    their byte offsets there, [rows, columns]), or (None, None) without matrix functions."""
    if not matrix_slots or not matrix_slots[0]:
        return None, None
    names = [sl.name for sl in plan.slots]
    columns = [names.index(name) for name in matrix_slots[0]]
    offsets = [[mats[names[c]] for c in columns] for mats in matrix_slots]
    as_tensor = dict(dtype=torch.int64, device=device)
    return torch.tensor(columns, **as_tensor), torch.tensor(offsets, **as_tensor)


def workspaces(groups: list[LaunchGroup], ends: dict) -> list[Workspace]:
    """A ``Workspace`` of ``ends[device]`` bytes for each device whose groups have matrix stacks."""
    out = []
    for device, nbytes in ends.items():
        device = torch.device(device)
        here = [g for g in groups if g.tables.ptrs.device == device and g.matrix_columns is not None]
        if nbytes and here:
            stacks = [sg for g in here for sg in shape_groups(g.matrices)]
            tables = [(g.tables.ptrs, g.matrix_columns, g.matrix_offsets) for g in here]
            out.append(Workspace(device, nbytes, stacks, tables))
    return out


def slicing(opt, items, dplan: tuple, sharded: bool) -> tuple[bool, int | None]:
    """(whether launch groups run one after another, each slice's workspace budget or
    None). One after another where a rule has matrix functions and nothing combines
    across groups: no global reduction, no DTensor (its collectives run over every
    group). Slices where, moreover, no random stream is keyed by a table row (stochastic
    rounding, ``rand()``): a row's index in a slice would change its stream."""
    plan, _ = plan_and_sources(opt.rule, dplan, opt.options.stochastic_rounding, sharded)
    if not any(r.matrix for r in plan.reductions) or plan.n_global:
        return False, None
    if any(isinstance(p, distributed.DTensor) for p, _, _ in items):
        return False, None
    budget = workspace_budget()
    if opt.options.stochastic_rounding or any(e.has(RandomValue) for _, e in opt.rule.outputs):
        budget = None
    return True, budget


def slice_group(opt, indexed: list, budget: int | None, device) -> list[list]:
    """``indexed`` (one launch group's (index, p, g, group index)) cut into slices whose
    matrix stacks fit ``budget`` (``matrix.plan_slices``)."""
    if budget is None:
        return [indexed]
    entries = table_entries(opt, [m[1:] for m in indexed], True)
    shapes = [[] for _ in indexed]
    for e in entries:
        shapes[e.member].append((e.rows, e.cols))
    return [[indexed[k] for k in piece] for piece in plan_slices(shapes, budget, device)]


def entry_row(opt, plan: StepLayout, member: tuple, e: Entry, mats: dict) -> list[torch.Tensor]:
    """The pointer table's tensors of entry ``e`` of ``member`` (p, g, group index), one
    per slot of ``plan``."""
    p, g, _ = member
    keys = opt._state_keys
    scalar_names = scalar_state_names(opt.rule)
    st = opt.state[p]
    slot_tensor = {"p": p, "g": g, **{s: st[keys[s]] for s in keys if s not in scalar_names}, **mats}
    slot_tensor.update({scale_slot(s): st[keys[s] + "_absmax"] for s in keys if keys[s] + "_absmax" in st})
    if "master_lo" in st:
        slot_tensor[MASTER_SLOT] = st["master_lo"]
    return [entry_slice(distributed.local(slot_tensor[sl.name]), sl.role, e) for sl in plan.slots]


def _grad_offset(g: torch.Tensor, e: Entry) -> int:
    """Bytes from the gradient's start to entry ``e``'s part of it."""
    return e.index * e.rows * e.cols * g.element_size()


def batch_combine(plan: StepLayout, entries: list[Entry], red: torch.Tensor):
    """Where a batched view splits a tensor into matrices: the combine that makes each
    matrix's per-tensor reductions of element values the whole tensor's, else None."""
    if all(e.count == 1 for e in entries):
        return None
    owner, first = [], 0
    for i, e in enumerate(entries):
        first = i if e.index == 0 else first
        owner.append(first)
    return BatchCombine(plan.reductions, torch.tensor(owner, dtype=torch.int64, device=red.device), red)


class BatchCombine:
    """Per-tensor reductions of element values (``norm(p)``, ``mean(g)``) over every matrix
    of a batched tensor: after the phase that accumulates them, each matrix's raw
    partial total (a sum, or a max for ``amax``) becomes the sum (max) over the tensor's
    matrices, in place, on the device. Reductions of row or column values stay one per
    matrix (``mean(row_var)``: each matrix's rows)."""

    def __init__(self, reductions, owner: torch.Tensor, red: torch.Tensor):
        self.owner, self.red = owner, red
        self.columns: dict[int, list] = {}
        for r in reductions:
            if r.column >= 0 and r.global_column < 0 and not r.matrix and r.over == "element":
                combine = ACCUMULATE[r.op][1]
                self.columns.setdefault(r.phase, []).append((r.column, combine))

    def __call__(self, phase: int) -> None:
        for column, combine in self.columns.get(phase, ()):
            values = self.red[:, column]
            if combine == "sum":
                total = torch.zeros_like(values).index_add_(0, self.owner, values)
            else:
                total = torch.full_like(values, -math.inf).scatter_reduce_(0, self.owner, values, "amax")
            values.copy_(total.index_select(0, self.owner))


def axis_buffers(plan: StepLayout, tables: Tables, device) -> tuple:
    """The axis reductions' buffer (each row reduction's results for every tensor's rows,
    then each column reduction's) and its value before a step; (None, None) without them."""
    if not plan.tiled:
        return None, None
    parts = []
    for axis, total in (("row", tables.total_rows), ("col", tables.total_cols)):
        for r in plan.reductions:
            if r.axis == axis:
                parts.append(torch.full((total,), -math.inf if r.op == "amax" else 0.0))
    if not parts:
        return torch.zeros(1, device=device), None
    init = torch.cat(parts).to(device)
    return init.clone(), init


def launched_sources(obj) -> list:
    """The kernel sources of an optimizer: those an instance has launched, else those it
    launches for fp32 tensors (a class, or an instance before its first step)."""
    engine = None if isinstance(obj, type) else getattr(obj, "_fuser", None)
    groups = engine.launches if isinstance(engine, StepEngine) else []
    sources = [kernel.source for group in groups for kernel in group.kernels]
    if not sources:
        dplan = dtype_plan(obj.rule, obj.options, "fp32", "fp32")
        sources = plan_and_sources(obj.rule, dplan, obj.options.stochastic_rounding)[1]
    return sources
