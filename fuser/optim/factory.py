"""``fuser.compile(optimizer_rule)`` -> a ``torch.optim.Optimizer`` subclass.

A step gathers the parameters that have gradients, checks that nothing changed since
the last step (addresses, sizes, dtypes, devices, strides, groups, state tensors), and
launches one kernel per (device, dtype plan) over all of them. Tables are rebuilt only
when something changed; hyperparameters are re-sent only when a group's values changed.

After a step, what it read is kept in a ``_Snapshot``; the next step compares against it
with C-level passes over lists (``map`` of tensor getters, identity tests), not a Python
loop per tensor. With ``static=True`` the step compares nothing per tensor: the caller
promises that parameters, gradients and state keep their storage, as a CUDA graph would.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import os
import sys
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from itertools import chain, compress, repeat

import sympy
import torch
import torch.optim.optimizer as _optimizer
import triton  # noqa: F401 - with the module, not inside the first step (~0.1-0.3 s)

from fuser.cache import load_kernel, rendered
from fuser.codegen.render import render_optim
from fuser.codegen.source import KernelSource
from fuser.display import NotebookDisplay
from fuser.ir.optim import DTYPES, ReductionPlan, Slot, lower_optim, scalar_state_names
from fuser.log import logger
from fuser.rules.rule import Rule
from fuser.runtime import distributed, stats
from fuser.runtime.distributed import local
from fuser.runtime.tables import Tables, build_tables, check_layout

TORCH_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
FROM_NAME = {v: k for k, v in TORCH_DTYPES.items()}


@dataclass(frozen=True)
class Options:
    """Compile options of an optimizer class."""

    state_dtype: str | None = None  # None: fp32; "param": each parameter's dtype; or a dtype name
    state_keys: tuple[tuple[str, str], ...] = ()  # rule state name -> key in optimizer.state[p]
    grad_attr: str = "grad"  # read each gradient from this attribute ("main_grad": Megatron's fp32)
    stochastic_rounding: bool = False  # bf16/fp16 stores round stochastically
    seed: int = 0  # of the stochastic rounding streams (with the step, tensor and element)
    static: bool = False  # storage of params, grads and states never replaced: no per-tensor check


def _options(
    state_dtype=None, state_keys=None, grad_attr="grad", stochastic_rounding=False, seed=0, static=False
) -> Options:
    if isinstance(state_dtype, torch.dtype):
        if state_dtype not in TORCH_DTYPES:
            raise ValueError(f"state_dtype must be float32, bfloat16 or float16, not {state_dtype}")
        state_dtype = TORCH_DTYPES[state_dtype]
    if state_dtype not in (None, "param", *DTYPES):
        raise ValueError(f"state_dtype must be a torch dtype, one of {DTYPES}, or 'param'")
    if not isinstance(grad_attr, str) or not grad_attr.isidentifier():
        raise ValueError("grad_attr must be an attribute name such as 'grad' or 'main_grad'")
    if not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be a non-negative integer below 2**63, not {seed!r}")
    if not isinstance(static, bool):
        raise ValueError(f"static must be True or False, not {static!r}")
    return Options(
        state_dtype,
        tuple(sorted((state_keys or {}).items())),
        grad_attr,
        bool(stochastic_rounding),
        seed,
        static,
    )


@dataclass(frozen=True)
class StepLayout:
    """What the runtime needs of a lowered plan: the pointer table's columns, the sizes
    of the reduction tables, and how each reduction combines (for DTensor shards)."""

    slots: tuple[Slot, ...]
    n_reductions: int
    n_global: int
    reductions: tuple[ReductionPlan, ...]  # symbols left out: (op, phase, column, global_column)


@functools.lru_cache(maxsize=256)
def _plan_and_sources(
    rule: Rule, dtypes: tuple[tuple[str, str], ...], stochastic_rounding: bool = False
) -> tuple[StepLayout, list[KernelSource]]:
    """The step's layout and kernels, from the on-disk memo when this rule was rendered
    before with the same code (sympy costs ~0.1-0.2 s per rule), else lowered and rendered."""
    key = rendered.fingerprint(
        "optim",
        rule.name,
        rule.text,
        rule.hyper,
        rule.state,
        [(n, sympy.srepr(e)) for n, e in rule.outputs],
        dtypes,
        stochastic_rounding,
        [os.environ.get(v) for v in ("FUSER_OPTIM_BLOCK", "FUSER_OPTIM_WARPS")],
    )
    memo = rendered.load(key)
    if memo is not None:
        try:
            layout = StepLayout(
                tuple(Slot(**s) for s in memo["slots"]),
                memo["n_reductions"],
                memo["n_global"],
                tuple(ReductionPlan(None, *r) for r in memo["reductions"]),
            )
            sources = [
                KernelSource(
                    text=k["text"],
                    entry=k["entry"],
                    signature=tuple(tuple(x) for x in k["signature"]),
                    constexprs=tuple(tuple(x) for x in k["constexprs"]),
                    num_warps=k["num_warps"],
                    num_stages=k["num_stages"],
                    meta=tuple(tuple(x) for x in k["meta"]),
                )
                for k in memo["sources"]
            ]
            return layout, sources
        except (KeyError, TypeError, ValueError):
            pass  # an entry of another shape: render again
    plan = lower_optim(rule, dict(dtypes), stochastic_rounding=stochastic_rounding)
    layout = StepLayout(
        plan.slots,
        len(plan.reductions),
        plan.n_global,
        tuple(dataclasses.replace(r, symbol=None) for r in plan.reductions),
    )
    sources = render_optim(plan)
    rendered.store(
        key,
        {
            "slots": [dataclasses.asdict(s) for s in layout.slots],
            "n_reductions": layout.n_reductions,
            "n_global": layout.n_global,
            "reductions": [(r.op, r.phase, r.column, r.global_column) for r in layout.reductions],
            "sources": [
                dict(
                    text=k.text,
                    entry=k.entry,
                    signature=k.signature,
                    constexprs=k.constexprs,
                    num_warps=k.num_warps,
                    num_stages=k.num_stages,
                    meta=k.meta,
                )
                for k in sources
            ],
        },
    )
    return layout, sources


def _dtype_plan(rule: Rule, options: Options, param_dtype: str, grad_dtype: str) -> tuple:
    if options.state_dtype is None:
        sd = "fp32"
    elif options.state_dtype == "param":
        sd = param_dtype
    else:
        sd = options.state_dtype
    return (("p", param_dtype), ("g", grad_dtype), *((s, sd) for s, _ in rule.state))


def kernel_sources(
    rule: Rule, dtype: str = "fp32", *, grad_dtype: str | None = None, **options
) -> list[KernelSource]:
    """Every kernel an optimizer compiled from ``rule`` with ``options`` (``fuser.compile``'s
    keywords) launches when parameters are stored in ``dtype`` and gradients in
    ``grad_dtype`` (default ``dtype``; ``"fp32"`` for Megatron's ``main_grad`` beside bf16
    parameters). Of the options, ``state_dtype`` and ``stochastic_rounding`` change the
    kernels; ``grad_attr``, ``state_keys`` and ``seed`` do not."""
    grad_dtype = dtype if grad_dtype is None else grad_dtype
    for what, value in (("dtype", dtype), ("grad_dtype", grad_dtype)):
        if value not in DTYPES:
            raise ValueError(f"{what} must be one of {DTYPES}, not {value!r}")
    opts = _options(**options)
    plan = _dtype_plan(rule, opts, dtype, grad_dtype)
    return list(_plan_and_sources(rule, plan, opts.stochastic_rounding)[1])


@dataclass
class _Launch:
    """Everything one launch needs, valid while the signature it was built for holds."""

    kernels: list  # one per phase
    plan: StepLayout
    tables: Tables
    scalars: torch.Tensor  # fp32 [n_tensors, 1 + n_scalar_states]
    red: torch.Tensor  # fp32 [n_tensors, n_reductions]: per-tensor reduction results
    partials: torch.Tensor  # fp32 [n_blocks, n_reductions]
    members: list[int]  # index in the step's parameter list of each table row
    grad_column: int  # column of the gradient in ``tables.ptrs``
    part: int  # row of this launch in its device's global-reduction table


def _no_grad() -> None:
    """Stands for a missing gradient in ``_Snapshot.grad_refs``: called, like a dead weakref, gives None."""
    return None


def _weak(g):
    return _no_grad if g is None else weakref.ref(g)


_data_ptr = torch.Tensor.data_ptr
_stride = torch.Tensor.stride
_numel = torch.Tensor.numel


def _kind(t: torch.Tensor) -> tuple:
    return t.dtype, t.device


class _Flag:
    __slots__ = ("dirty",)

    def __init__(self):
        self.dirty = True


def _marking(name: str):
    base = getattr(dict, name)

    def method(self, *args, **kwargs):
        self._flag.dirty = True
        return base(self, *args, **kwargs)

    method.__name__ = name
    return method


class _Marked:
    """Mixed into a dict: every method that changes it sets ``self._flag.dirty``."""

    __slots__ = ()
    __setitem__ = _marking("__setitem__")
    __delitem__ = _marking("__delitem__")
    __ior__ = _marking("__ior__")
    clear = _marking("clear")
    pop = _marking("pop")
    popitem = _marking("popitem")
    setdefault = _marking("setdefault")
    update = _marking("update")


class _ParamState(_Marked, dict):
    """``optimizer.state[p]`` once a step has read it: a dict that notes any assignment
    (``state[p]["exp_avg"] = t``), so the next step re-reads the states only after one.
    Pickled and copied as a plain dict."""

    __slots__ = ("_flag",)

    def __reduce__(self):
        return (dict, (dict(self),))


class _StateTable(_Marked, defaultdict):
    """``optimizer.state`` once a step has read it: torch's ``defaultdict(dict)`` that notes
    which dict each parameter maps to changing (``optimizer.state[p] = {...}``, ``del``,
    ``clear``, a first read of a new parameter's entry), as ``_ParamState`` notes changes
    inside one, so the step need not look each parameter up. Pickled and copied as a plain
    ``defaultdict``."""

    def __init__(self, table, flag: _Flag):
        super().__init__(dict, table)
        self._flag = flag

    def __reduce__(self):
        return (defaultdict, (self.default_factory,), None, None, iter(self.items()))

    def copy(self):
        return defaultdict(self.default_factory, self)

    __copy__ = copy


@dataclass
class _Snapshot:
    """What the last step read, kept so the next one can tell "nothing changed" from a few
    C-level passes over lists instead of the per-tensor walk of ``_gather``.

    Holds no strong reference to a gradient (``model.zero_grad()`` must free them) and
    is built only for plain (not DTensor) dense tensors.
    """

    groups: list  # per param group: (its "params" list, that list's length)
    params: list  # every parameter of every group, in order
    grad_of: object  # parameter -> its gradient (an attrgetter of grad_attr)
    grad_refs: list  # per parameter: weakref to its gradient, or _no_grad
    has_grad: list  # per parameter: bool
    every_grad: bool  # all of has_grad
    param_ptrs: list  # data_ptr() of each parameter that has a gradient (its local shard's)
    param_strides: list  # stride() of each of those parameters (local shards)
    param_numels: list  # numel() of each of those parameters (local shards)
    grad_strides: list  # stride() of each of those gradients (local shards)
    grad_kinds: list | None  # (dtype, device) of each gradient where torch does not check them
    grad_layouts: list | None  # DTensor (placements, mesh) of each of those gradients; None: no DTensor
    table: _StateTable  # optimizer.state (a new one, from load_state_dict say, is seen)
    flag: _Flag  # set by any assignment to the table or to one of its states
    grads_by_kind: list  # gradients grouped by (device, dtype), for zero_grad of a static optimizer


@dataclass
class _Engine:
    snapshot: _Snapshot | None = None
    signature: list = field(default_factory=list)
    grad_ptrs: list = field(default_factory=list)
    launches: list = field(default_factory=list)
    hyper_values: list = field(default_factory=list)  # per group: floats, None where a tensor
    hyper_tables: dict = field(default_factory=dict)  # device -> fp64 [n_groups, n_hyper]
    glob: dict = field(default_factory=dict)  # device -> fp32 [n_parts, n_global]
    n_parts: dict = field(default_factory=dict)  # device -> launches (dtype plans) on it
    amp_defaults: dict = field(default_factory=dict)  # device -> (grad_scale 1.0, found_inf 0.0)
    shards: object = None  # combines reductions of DTensor shards between phases (runtime.distributed)


class _Source:
    """``Optimizer.source``: the generated Triton kernel for fp32 tensors, rendered on first
    read (on the class, or on an instance whose rule was chosen by its constructor)."""

    def __get__(self, obj, cls):
        owner = obj if obj is not None else cls
        plan = _dtype_plan(owner.rule, owner.options, "fp32", "fp32")
        sources = _plan_and_sources(owner.rule, plan, owner.options.stochastic_rounding)[1]
        return "\n\n".join(src.text for src in sources)


class FuserOptimizer(NotebookDisplay, torch.optim.Optimizer):
    """Base of every compiled optimizer. Subclasses set ``rule`` and ``options``.

    Built-ins whose constructors take torch.optim's keywords call ``_init_fuser`` with
    their own defaults (and, for structural options such as ``amsgrad``, their own rule)
    and override ``_group_hyper`` to map a param group to the rule's hyperparameters.
    """

    rule: Rule
    options: Options
    source = _Source()
    # torch.amp.GradScaler sets `grad_scale` and `found_inf` on the optimizer and lets the
    # step unscale and skip on its own device, with no host synchronisation.
    _step_supports_amp_scaling = True

    def __init__(self, params, **hyper):
        defaults = dict(self.rule.hyper_defaults)
        unknown = set(hyper) - set(defaults)
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got unknown hyperparameters {sorted(unknown)}; "
                f"it takes {sorted(defaults)}"
            )
        defaults.update(hyper)
        self._init_fuser(params, defaults)

    def _init_fuser(
        self, params, defaults: dict, rule: Rule | None = None, options: Options | None = None
    ) -> None:
        if rule is not None:
            self.rule = rule
        if options is not None:
            self.options = options
        self._fuser = _Engine()
        torch.optim.Optimizer.__init__(self, params, defaults)

    # Hooks for built-ins whose constructor keywords differ from the rule's names.
    def _group_hyper(self, group: dict) -> dict:
        """The rule's hyperparameters for one param group."""
        return {h: group[h] for h in self.rule.hyper_defaults}

    @property
    def _state_keys(self) -> dict:
        keys = dict(self.options.state_keys)
        return {s: keys.get(s, s) for s, _ in self.rule.state}

    def step(self, closure=None):
        # torch wraps every optimizer's step in a profiler range and its hook loops (~20 us
        # a call); fuser does the same only when a hook is registered or the profiler runs.
        if (
            self._optimizer_step_pre_hooks
            or self._optimizer_step_post_hooks
            or _optimizer._global_optimizer_pre_hooks
            or _optimizer._global_optimizer_post_hooks
            or torch.autograd.profiler._is_profiler_enabled
        ):
            return _hooked_step(self, closure)
        return self._step(closure)

    step.hooked = True  # tells torch.optim.Optimizer not to wrap it again

    def _step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._fuser_step()
        return loss

    # the step --------------------------------------------------------------------------
    def _gather(self):
        """Parameters with gradients, and what the tables depend on: ``signature`` (all but
        the gradients' addresses) and ``grad_ptrs`` (those, which change every step when
        gradients are set to None between steps). Both are of the local tensors the kernels
        walk: a DTensor's own ``data_ptr()`` is 0."""
        attr = self.options.grad_attr
        keys = list(self._state_keys.values())
        items, signature, grad_ptrs = [], [], []
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                g = getattr(p, attr, None)
                if g is None:
                    continue
                g, pl, gl = distributed.local_pair(p, g, attr)
                items.append((p, g, gi))
                st = self.state.get(p)
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

    def refresh(self) -> None:
        """Re-read every parameter, gradient and state tensor at the next step. Needed only
        with ``static=True``, after replacing one (``p.data = ...``, ``p.grad = ...``)."""
        self._fuser.snapshot = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``; with ``static=True`` gradients are zeroed in place
        (``set_to_none`` is ignored: the step relies on their storage), one ``foreach``
        call per (device, dtype)."""
        snap = self._fuser.snapshot
        if self.options.static and snap is not None:
            for grads in snap.grads_by_kind:
                torch._foreach_zero_(grads)
            return
        super().zero_grad(set_to_none)

    def _unchanged(self, snap: _Snapshot) -> bool:
        """True when the tables still describe what the step would gather, refreshing the
        gradient column where only gradients moved; False sends the step to ``_gather``."""
        groups = self.param_groups
        if snap.flag.dirty or self.state is not snap.table or len(groups) != len(snap.groups):
            return False
        for group, (params, n) in zip(groups, snap.groups):
            if group["params"] is not params or len(params) != n:
                return False
        if self.options.static:
            return True
        flat = list(chain.from_iterable(params for params, _ in snap.groups))
        if not all(map(operator.is_, flat, snap.params)):
            return False
        try:
            grads = list(map(snap.grad_of, flat))
        except AttributeError:  # grad_attr missing from a parameter: _gather says how
            return False
        present_params = list(compress(flat, snap.has_grad))
        if not all(map(operator.is_, grads, map(operator.call, snap.grad_refs))):
            # New gradient objects (set to None between steps): same parameters with and
            # without one, and the same strides (torch checks size, dtype and device when
            # a .grad is assigned; another attribute gets them checked here); then only
            # their addresses may have moved.
            if list(map(operator.is_not, grads, repeat(None))) != snap.has_grad:
                return False
            present = list(compress(grads, snap.has_grad))
            if snap.grad_layouts is not None:
                if list(map(distributed.layout, present)) != snap.grad_layouts:
                    return False
                present = list(map(local, present))
            if snap.grad_kinds is not None and (
                list(map(_kind, present)) != snap.grad_kinds
                or list(map(_numel, present)) != snap.param_numels
            ):
                return False
            try:
                if list(map(_stride, present)) != snap.grad_strides:
                    return False
                ptrs = list(map(_data_ptr, present))
            except RuntimeError:  # sparse and other storage-less gradients
                return False
            eng = self._fuser
            if ptrs != eng.grad_ptrs:
                self._refresh_grad_column(ptrs)
            # weakref.ref itself runs in C; _weak (Python, once per tensor) only where some are None.
            snap.grad_refs = list(map(weakref.ref if snap.every_grad else _weak, grads))
        locals_ = present_params if snap.grad_layouts is None else list(map(local, present_params))
        if list(map(_data_ptr, locals_)) != snap.param_ptrs:
            return False
        # Same storage, another view of it (p.data = p.data.t()). States replaced, or
        # assigned into, set the flag.
        return (
            list(map(_stride, locals_)) == snap.param_strides
            and list(map(_numel, locals_)) == snap.param_numels
        )

    def _snapshot(self, items) -> _Snapshot | None:
        """The ``_Snapshot`` of a step that gathered ``items`` (after ``_gather`` stored any
        redistributed DTensor gradient back), or None where the quick check cannot follow."""
        attr = self.options.grad_attr
        params = [p for group in self.param_groups for p in group["params"]]
        grads = [getattr(p, attr, None) for p in params]
        dtensors = any(local(t) is not t for t in chain(params, grads) if t is not None)
        present = [(p, g) for p, g in zip(params, grads) if g is not None]
        if len(present) != len(items) or any(p is not q for (p, _), (q, _, _) in zip(present, items)):
            return None
        flag = _Flag()
        if type(self.state) is _StateTable:
            self.state._flag = flag
        else:
            self.state = _StateTable(self.state, flag)
        for p, _ in present:
            st = self.state.get(p)
            if st is None:
                return None
            if type(st) is not _ParamState:
                st = _ParamState(st)
                self.state[p] = st
            st._flag = flag
        flag.dirty = False
        by_kind: dict = {}
        if self.options.static:  # held only where the caller promised they stay
            for _, g in present:
                by_kind.setdefault((g.device, g.dtype), []).append(g)
        return _Snapshot(
            groups=[(group["params"], len(group["params"])) for group in self.param_groups],
            params=params,
            grad_of=operator.attrgetter(attr),
            grad_refs=list(map(_weak, grads)),
            has_grad=[g is not None for g in grads],
            every_grad=len(present) == len(params),
            param_ptrs=[local(p).data_ptr() for p, _ in present],
            param_strides=[local(p).stride() for p, _ in present],
            param_numels=[local(p).numel() for p, _ in present],
            grad_strides=[local(g).stride() for _, g in present],
            grad_kinds=None if attr == "grad" else [_kind(g) for _, g in present],
            grad_layouts=[distributed.layout(g) for _, g in present] if dtensors else None,
            table=self.state,
            flag=flag,
            grads_by_kind=list(by_kind.values()),
        )

    def _refresh_grad_column(self, grad_ptrs: list) -> None:
        """Same parameters, states and gradient layouts; only the gradients moved."""
        eng = self._fuser
        for launch in eng.launches:
            column = torch.tensor([grad_ptrs[i] for i in launch.members], dtype=torch.int64)
            launch.tables.ptrs[:, launch.grad_column].copy_(column)
        eng.grad_ptrs = grad_ptrs

    def _fuser_step(self):
        # Nothing here is recorded by autograd except what _prepare and _sync_hyper guard
        # themselves: a no_grad() around every step would cost more than the quick check.
        eng = self._fuser
        if eng.snapshot is None or not self._unchanged(eng.snapshot):
            eng.snapshot = None
            with torch.no_grad():
                if not self._prepare():
                    return
        self._launch()

    def _prepare(self) -> bool:
        """The full check: gather, rebuild what changed; False when no parameter has a gradient."""
        stats.count("full_checks")
        items, signature, grad_ptrs = self._gather()
        if not items:
            return False
        eng = self._fuser
        if signature != eng.signature:
            self._rebuild(items)
            # The rebuild created state and re-packed steps: take the signature afterwards.
            _, eng.signature, eng.grad_ptrs = self._gather()
        elif grad_ptrs != eng.grad_ptrs:
            self._refresh_grad_column(grad_ptrs)
        eng.snapshot = self._snapshot(items)
        return True

    def _launch(self) -> None:
        eng = self._fuser
        self._sync_hyper()
        seed = self.options.seed
        n_phases = len(eng.launches[0].kernels)
        for phase in range(n_phases):
            # Phase k of every launch before phase k + 1 of any: global reductions combine
            # the totals of every launch on the device.
            for launch in eng.launches:
                t = launch.tables
                device = t.ptrs.device
                grad_scale, found_inf = self._amp_tensors(device)
                launch.kernels[phase](
                    (t.n_blocks,),
                    t.ptrs,
                    t.numels,
                    t.groups,
                    t.block_tensor,
                    t.block_start,
                    t.tensor_first_block,
                    t.tensor_blocks,
                    eng.hyper_tables[device],
                    launch.scalars,
                    launch.red,
                    launch.partials,
                    t.counters,
                    eng.glob[device],
                    grad_scale,
                    found_inf,
                    t.n_tensors,
                    t.n_blocks,
                    launch.part,
                    eng.n_parts[device],
                    seed,
                )
            if eng.shards is not None and phase < n_phases - 1:
                eng.shards(phase)

    def _amp_tensors(self, device):
        """(grad_scale, found_inf) on ``device``: GradScaler's when it set them, else 1 and 0."""
        eng = self._fuser
        if device not in eng.amp_defaults:
            eng.amp_defaults[device] = (torch.ones(1, device=device), torch.zeros(1, device=device))
        scale, found = eng.amp_defaults[device]
        gs = getattr(self, "grad_scale", None)
        fi = getattr(self, "found_inf", None)
        if gs is not None:
            scale = gs.to(device=device, dtype=torch.float32).reshape(1)
        if fi is not None:
            found = fi.to(device=device, dtype=torch.float32).reshape(1)
        return scale, found

    def _validate(self, items) -> None:
        attr = self.options.grad_attr
        for p, g, _ in items:
            where = f"parameter of shape {tuple(p.shape)}"
            distributed.check(p, g, where, attr)
            p, g = local(p), local(g)
            if g.is_sparse or g.layout != torch.strided:
                raise RuntimeError(
                    f"{type(self).__name__} does not support sparse gradients ({where}); use a dense gradient"
                )
            if p.is_complex() or g.is_complex():
                raise RuntimeError(
                    f"{type(self).__name__} does not support complex tensors ({where}); "
                    "view them as real with torch.view_as_real"
                )
            if p.dtype not in TORCH_DTYPES:
                raise RuntimeError(
                    f"{where} is {p.dtype}; fuser updates float32, bfloat16 and float16 parameters"
                )
            if g.dtype not in TORCH_DTYPES:
                raise RuntimeError(
                    f"the .{attr} of a {where} is {g.dtype}; expected float32, bfloat16 or float16"
                )
            if p.device.type == "cpu" or p.device.type == "cuda":
                check_layout(f"the .{attr} of a {where}", g, p)
            else:
                raise RuntimeError(
                    f"{where} is on {p.device}; fuser runs on CUDA (and on CPU through Triton's interpreter)"
                )

    def _state_dtype(self, p: torch.Tensor) -> torch.dtype:
        sd = self.options.state_dtype
        if sd is None:
            return torch.float32
        return p.dtype if sd == "param" else FROM_NAME[sd]

    def _rebuild(self, items) -> None:
        """Check every tensor, create missing state, and rebuild tables: all checks run
        before anything is modified, so a bad input leaves the optimizer as it was."""
        self._validate(items)
        keys = self._state_keys
        init = dict(self.rule.state)
        scalar_names = scalar_state_names(self.rule)
        for p, _, _ in items:
            st = self.state[p]
            for s, key in keys.items():
                want = self._state_dtype(p)
                if s in scalar_names:
                    # One number per tensor, packed into the scalar table by _pack_scalars.
                    value = st.get(key)
                    if not (
                        value is None
                        or isinstance(value, (int, float))
                        or (torch.is_tensor(value) and value.numel() == 1)
                    ):
                        raise RuntimeError(
                            f"state {key!r} of a parameter must be one number, not a "
                            f"tensor of shape {tuple(value.shape)}"
                        )
                    continue
                if key not in st:
                    st[key] = (
                        p.detach().to(want, copy=True)
                        if init[s] == "p"
                        else torch.full_like(
                            p, float(init[s]), dtype=want, memory_format=torch.preserve_format
                        )
                    )
                elif not isinstance(st[key], torch.Tensor):
                    raise RuntimeError(
                        f"state {key!r} of a parameter is {type(st[key]).__name__}, not a tensor"
                    )
                st[key] = distributed.like_param(st[key], p)  # a DTensor parameter's state is sharded like it
                if st[key].shape == p.shape and (
                    st[key].dtype != want or st[key].device != p.device or st[key].stride() != p.stride()
                ):
                    fixed = torch.empty_like(p, dtype=want, memory_format=torch.preserve_format)
                    fixed.copy_(st[key])
                    st[key] = fixed
                check_layout(f"state {key!r}", local(st[key]), local(p))

        # Partition by device and dtype plan: one launch each.
        parts: dict[tuple, list] = {}
        for i, (p, g, gi) in enumerate(items):
            dplan = _dtype_plan(self.rule, self.options, TORCH_DTYPES[p.dtype], TORCH_DTYPES[g.dtype])
            parts.setdefault((p.device, dplan), []).append((i, p, g, gi))

        launches = []
        n_parts: dict = {}
        for (device, dplan), indexed in parts.items():
            members = [m[1:] for m in indexed]
            plan, sources = _plan_and_sources(self.rule, dplan, self.options.stochastic_rounding)
            kernels = [load_kernel(src, device) for src in sources]
            rows = []
            for p, g, _ in members:
                st = self.state[p]
                slot_tensor = {"p": p, "g": g, **{s: st[keys[s]] for s in keys if s not in scalar_names}}
                rows.append([local(slot_tensor[sl.name]) for sl in plan.slots])
            block = dict(sources[0].constexprs)["BLOCK"]
            tables = build_tables(
                rows, [gi for _, _, gi in members], block, device, [p.numel() for p, _, _ in members]
            )
            scalars = self._pack_scalars(members, scalar_names, device)
            nred = max(1, plan.n_reductions)
            red = torch.zeros(tables.n_tensors, nred, device=device)
            partials = torch.zeros(tables.n_blocks if plan.n_reductions else 1, nred, device=device)
            grad_column = [sl.name for sl in plan.slots].index("g")
            part = n_parts.get(device, 0)
            n_parts[device] = part + 1
            launches.append(
                _Launch(
                    kernels, plan, tables, scalars, red, partials, [m[0] for m in indexed], grad_column, part
                )
            )
        eng = self._fuser
        logger.info(
            "%s: tables rebuilt for %d tensors in %d launch group(s)",
            type(self).__name__,
            len(items),
            len(launches),
        )
        eng.launches = launches
        eng.n_parts = n_parts
        n_global = max(1, launches[0].plan.n_global)
        eng.glob = {d: torch.zeros(n, n_global, device=d) for d, n in n_parts.items()}
        eng.shards = distributed.shard_reduction(
            launches, [[items[i][0] for i in launch.members] for launch in launches], eng.glob
        )
        eng.hyper_values = []  # force a hyper table refresh

    def _pack_scalars(self, members, scalar_names, device) -> torch.Tensor:
        """One fp32 row per tensor: step, then each per-tensor scalar state; the optimizer's
        state holds views of it, so the kernel's updates are the state."""
        keys = self._state_keys
        init = dict(self.rule.state)
        cols = []
        for p, _, _ in members:
            st = self.state[p]
            vals = [st.get("step", 0.0)]
            vals += [st[keys[s]] if st.get(keys[s]) is not None else float(init[s]) for s in scalar_names]
            cols.append(
                torch.stack([torch.as_tensor(v, dtype=torch.float32).reshape(()).to(device) for v in vals])
            )
        scalars = torch.stack(cols)
        for i, (p, _, _) in enumerate(members):
            st = self.state[p]
            st["step"] = scalars[i, 0]
            for j, s in enumerate(scalar_names):
                st[keys[s]] = scalars[i, j + 1]
        return scalars

    def _sync_hyper(self) -> None:
        """Send the groups' hyperparameters to each device's table: numbers when they change
        (a host-to-device copy), tensors (an ``lr`` tensor, say) by a device copy every
        step, which a captured CUDA graph replays."""
        eng = self._fuser
        names = list(self.rule.hyper_defaults)
        rows, tensors = [], []
        for gi, group in enumerate(self.param_groups):
            hv = self._group_hyper(group)
            row = []
            for j, n in enumerate(names):
                v = hv[n]
                if torch.is_tensor(v):
                    tensors.append((gi, j, v))
                    row.append(None)
                else:
                    v = float(v)
                    if not math.isfinite(v):
                        raise ValueError(
                            f"hyperparameter {n!r} of param group {gi} is {v}; it must be finite"
                        )
                    row.append(v)
            rows.append(tuple(row))
        devices = {launch.tables.ptrs.device for launch in eng.launches}
        if rows != eng.hyper_values or set(eng.hyper_tables) != devices:
            numbers = [[math.nan if v is None else v for v in row] for row in rows]
            for device in devices:
                eng.hyper_tables[device] = (
                    torch.tensor(numbers, dtype=torch.float64).reshape(len(rows), len(names)).to(device)
                )
            eng.hyper_values = rows
        if tensors:
            with torch.no_grad():
                for device in devices:
                    table = eng.hyper_tables[device]
                    for gi, j, v in tensors:
                        table[gi, j].copy_(v.reshape(()))

    def state_dict(self) -> dict:
        # Plain dicts: torch.load(weights_only=True) takes nothing else.
        sd = super().state_dict()
        sd["state"] = {k: dict(v) if isinstance(v, _ParamState) else v for k, v in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict) -> None:
        # torch casts floating state to each parameter's dtype; fuser keeps its own state
        # dtype (fp32 by default), so restore the saved values at full precision.
        saved = state_dict["state"]
        # Saved ids in group order, as torch maps them: indices from state_dict(), or
        # parameter names from torch.distributed.checkpoint's set_optimizer_state_dict.
        saved_ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        super().load_state_dict(state_dict)
        id_to_param = dict(zip(saved_ids, (p for group in self.param_groups for p in group["params"])))
        scalar_names = scalar_state_names(self.rule)
        keys = self._state_keys
        element_keys = {keys[s] for s in keys if s not in scalar_names}
        # The step too: a live optimizer's state_dict() holds views of its scalar table,
        # which its next step advances.
        scalar_keys = {keys[s] for s in scalar_names} | {"step"}
        for pid, st in saved.items():
            p = id_to_param.get(pid)
            if p is None:
                continue
            for key, value in st.items():
                if not torch.is_tensor(value):
                    continue
                if key in element_keys and value.shape == p.shape:
                    value = distributed.like_param(value, p)
                    self.state[p][key] = value.to(device=p.device, dtype=self._state_dtype(p), copy=True)
                elif key in scalar_keys and value.numel() == 1:
                    self.state[p][key] = value.to(device=p.device, dtype=torch.float32, copy=True).reshape(())
        self._fuser.signature = []
        self._fuser.snapshot = None

    def add_param_group(self, param_group: dict) -> None:
        # torch's method is wrapped to keep torch.compile out of it, and that wrapper imports
        # torch._dynamo on its first call (~1 s). Where nothing has imported it, nothing
        # compiles, and the method itself runs.
        add = torch.optim.Optimizer.add_param_group
        if "torch._dynamo" not in sys.modules:
            add = getattr(add, "__wrapped__", add)
        add(self, param_group)
        self._fuser.signature = []
        self._fuser.snapshot = None


_hooked_step = torch.optim.Optimizer.profile_hook_step(FuserOptimizer._step)


def make_optimizer(rule: Rule, *, name: str | None = None, **options) -> type:
    """Build the optimizer class for ``rule`` (see ``fuser.compile``).

    Options: ``state_dtype`` (``torch.float32`` default, ``torch.bfloat16``, ...,
    or ``"param"`` to store each state like its parameter), ``grad_attr`` (``"main_grad"``
    reads Megatron-style fp32 gradients), ``stochastic_rounding`` and its ``seed``, and
    ``static``: the caller promises that no parameter, gradient or state tensor is replaced
    between steps (``p.data = ...``, ``p.grad = None``, ``optimizer.state[p][k] = ...``), so
    a step checks nothing per tensor (as a replayed CUDA graph would not); ``zero_grad()``
    then zeroes gradients in place, and ``refresh()`` re-reads everything once.
    """
    opts = _options(**options)
    _plan_and_sources(rule, _dtype_plan(rule, opts, "fp32", "fp32"), opts.stochastic_rounding)  # errors now
    cls_name = name or "".join(part.capitalize() for part in rule.name.split("_")) or "Optimizer"
    doc = (
        f"Optimizer compiled by fuser from rule {rule.name!r}.\n\nRule:\n\n"
        + "\n".join("    " + line for line in rule.text.splitlines())
        + f"\n\nHyperparameters (defaults): {dict(rule.hyper)}\nState: {dict(rule.state)}\n"
    )
    return type(
        cls_name,
        (FuserOptimizer,),
        {"rule": rule, "options": opts, "__doc__": doc, "__module__": "fuser.optim"},
    )
