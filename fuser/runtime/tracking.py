"""Telling "nothing changed since the last step" cheaply.

After a step, what it read is kept in a ``Snapshot``; the next step compares against it
with C-level passes over lists (``map`` of tensor getters, identity tests), not a Python
loop per tensor. Assignments into ``optimizer.state`` are noticed by the dicts themselves
(``StateTable``, ``ParamState``), which set a shared ``Flag``. With ``static=True`` the
check compares nothing per tensor: the caller promises that parameters, gradients and
state keep their storage, as a CUDA graph would.
"""

from __future__ import annotations

import operator
import weakref
from collections import defaultdict
from dataclasses import dataclass
from itertools import chain, compress, repeat

import torch

from fuser.runtime import distributed
from fuser.runtime.distributed import local


def no_grad_ref() -> None:
    """Stands for a missing gradient in ``Snapshot.grad_refs``: called, like a dead weakref, gives None."""
    return None


def weak(g):
    """A weak reference to a gradient, or ``no_grad_ref`` for None."""
    return no_grad_ref if g is None else weakref.ref(g)


_data_ptr = torch.Tensor.data_ptr
_stride = torch.Tensor.stride
_numel = torch.Tensor.numel


def kind(t: torch.Tensor) -> tuple:
    return t.dtype, t.device


class Flag:
    """Set when anything in the state table changed since the snapshot."""

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


class Marked:
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


class ParamState(Marked, dict):
    """``optimizer.state[p]`` once a step has read it: a dict that notes any assignment
    (``state[p]["exp_avg"] = t``), so the next step re-reads the states only after one.
    Pickled and copied as a plain dict."""

    __slots__ = ("_flag",)

    def __reduce__(self):
        return (dict, (dict(self),))


class StateTable(Marked, defaultdict):
    """``optimizer.state`` once a step has read it: torch's ``defaultdict(dict)`` that notes
    which dict each parameter maps to changing (``optimizer.state[p] = {...}``, ``del``,
    ``clear``, a first read of a new parameter's entry), as ``ParamState`` notes changes
    inside one, so the step need not look each parameter up. Pickled and copied as a plain
    ``defaultdict``."""

    def __init__(self, table, flag: Flag):
        super().__init__(dict, table)
        self._flag = flag

    def __reduce__(self):
        return (defaultdict, (self.default_factory,), None, None, iter(self.items()))

    def copy(self):
        return defaultdict(self.default_factory, self)

    __copy__ = copy


@dataclass
class Snapshot:
    """What the last step read, kept so the next one can tell "nothing changed" from a few
    C-level passes over lists instead of the per-tensor walk of a full check.

    Holds no strong reference to a gradient (``model.zero_grad()`` must free them) and
    is built only for plain (not DTensor) dense tensors.
    """

    groups: list  # per param group: (its "params" list, that list's length)
    params: list  # every parameter of every group, in order
    grad_of: object  # parameter -> its gradient (an attrgetter of grad_attr)
    grad_refs: list  # per parameter: weakref to its gradient, or no_grad_ref
    has_grad: list  # per parameter: bool
    every_grad: bool  # all of has_grad
    param_ptrs: list  # data_ptr() of each parameter that has a gradient (its local shard's)
    param_strides: list  # stride() of each of those parameters (local shards)
    param_numels: list  # numel() of each of those parameters (local shards)
    grad_strides: list  # stride() of each of those gradients (local shards)
    grad_kinds: list | None  # (dtype, device) of each gradient where torch does not check them
    grad_layouts: list | None  # DTensor (placements, mesh) of each of those gradients; None: no DTensor
    table: StateTable  # optimizer.state (a new one, from load_state_dict say, is seen)
    flag: Flag  # set by any assignment to the table or to one of its states
    grads_by_kind: list  # gradients grouped by (device, dtype), for zero_grad of a static optimizer


def unchanged(snap: Snapshot, opt, engine) -> bool:
    """True when the tables still describe what the step would gather from ``opt`` (a
    ``FuserOptimizer``); ``engine.grads_moved(ptrs)`` is called where only the gradients'
    addresses may have changed. False sends the step to the full check."""
    groups = opt.param_groups
    if snap.flag.dirty or opt.state is not snap.table or len(groups) != len(snap.groups):
        return False
    for group, (params, n) in zip(groups, snap.groups):
        if group["params"] is not params or len(params) != n:
            return False
    if opt.options.static:
        return True
    flat = list(chain.from_iterable(params for params, _ in snap.groups))
    if not all(map(operator.is_, flat, snap.params)):
        return False
    try:
        grads = list(map(snap.grad_of, flat))
    except AttributeError:  # grad_attr missing from a parameter: the full check says how
        return False
    present_params = list(compress(flat, snap.has_grad))
    if not all(map(operator.is_, grads, map(operator.call, snap.grad_refs))):
        # New gradient objects (set to None between steps): only their addresses may move.
        if not _new_grads_fit(snap, grads, engine):
            return False
    locals_ = present_params if snap.grad_layouts is None else list(map(local, present_params))
    if list(map(_data_ptr, locals_)) != snap.param_ptrs:
        return False
    # Same storage, another view of it (p.data = p.data.t()). States replaced, or
    # assigned into, set the flag.
    return (
        list(map(_stride, locals_)) == snap.param_strides and list(map(_numel, locals_)) == snap.param_numels
    )


def _new_grads_fit(snap: Snapshot, grads: list, engine) -> bool:
    """Whether new gradient objects still fit the tables; if so, tell ``engine`` their
    addresses and note them in ``snap``."""
    # Same parameters with and without one, and the same strides (torch checks size, dtype
    # and device when a .grad is assigned; another attribute gets them checked here); then
    # only their addresses may have moved.
    if list(map(operator.is_not, grads, repeat(None))) != snap.has_grad:
        return False
    present = list(compress(grads, snap.has_grad))
    if snap.grad_layouts is not None:
        if list(map(distributed.layout, present)) != snap.grad_layouts:
            return False
        present = list(map(local, present))
    if snap.grad_kinds is not None and (
        list(map(kind, present)) != snap.grad_kinds or list(map(_numel, present)) != snap.param_numels
    ):
        return False
    try:
        if list(map(_stride, present)) != snap.grad_strides:
            return False
        ptrs = list(map(_data_ptr, present))
    except RuntimeError:  # sparse and other storage-less gradients
        return False
    engine.grads_moved(ptrs)
    # weakref.ref itself runs in C; weak (Python, once per tensor) only where some are None.
    snap.grad_refs = list(map(weakref.ref if snap.every_grad else weak, grads))
    return True


def take_snapshot(opt, items) -> Snapshot | None:
    """The ``Snapshot`` of a step of ``opt`` that gathered ``items`` (after the gather stored
    any redistributed DTensor gradient back), or None where the quick check cannot follow.
    Puts ``opt.state`` and each parameter's state in noting dicts."""
    attr = opt.options.grad_attr
    params = [p for group in opt.param_groups for p in group["params"]]
    grads = [getattr(p, attr, None) for p in params]
    dtensors = any(local(t) is not t for t in chain(params, grads) if t is not None)
    present = [(p, g) for p, g in zip(params, grads) if g is not None]
    if len(present) != len(items) or any(p is not q for (p, _), (q, _, _) in zip(present, items)):
        return None
    flag = _watch(opt, present)
    if flag is None:
        return None
    by_kind: dict = {}
    if opt.options.static:  # held only where the caller promised they stay
        for _, g in present:
            by_kind.setdefault((g.device, g.dtype), []).append(g)
    return Snapshot(
        groups=[(group["params"], len(group["params"])) for group in opt.param_groups],
        params=params,
        grad_of=operator.attrgetter(attr),
        grad_refs=list(map(weak, grads)),
        has_grad=[g is not None for g in grads],
        every_grad=len(present) == len(params),
        param_ptrs=[local(p).data_ptr() for p, _ in present],
        param_strides=[local(p).stride() for p, _ in present],
        param_numels=[local(p).numel() for p, _ in present],
        grad_strides=[local(g).stride() for _, g in present],
        grad_kinds=None if attr == "grad" else [kind(g) for _, g in present],
        grad_layouts=[distributed.layout(g) for _, g in present] if dtensors else None,
        table=opt.state,
        flag=flag,
        grads_by_kind=list(by_kind.values()),
    )


def _watch(opt, present) -> Flag | None:
    """A fresh flag, shared by ``opt.state`` and each present parameter's state dict (made
    noting dicts here); None where a parameter has no state yet."""
    flag = Flag()
    if type(opt.state) is StateTable:
        # The engines of one optimizer's rules step one after another and share the
        # table: a flag nothing has set since the last snapshot stays everyone's.
        if opt.state._flag is not None and not opt.state._flag.dirty:
            flag = opt.state._flag
        opt.state._flag = flag
    else:
        opt.state = StateTable(opt.state, flag)
    for p, _ in present:
        st = opt.state.get(p)
        if st is None:
            return None
        if type(st) is not ParamState:
            st = ParamState(st)
            opt.state[p] = st
        st._flag = flag
    flag.dirty = False
    return flag
