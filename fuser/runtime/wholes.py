"""Whole tensors of DTensor parameters sharded by dim 0 (FSDP2's ``Shard(0)``), for the
optimizers whose matrix work reads whole tensors (SOAP, Shampoo, PSGDKron, the optimizers
of matrix rules).

Each such parameter is owned by one rank of its shard group (``Owners``: in the
parameters' order, each to the rank with the fewest elements so far). A step gathers
every rank's rows of what the matrix work reads into whole tensors on their owners
(``gather``: one ``all_to_all`` per shard group for all parameters), the owner runs that
work alone, and every rank gets its rows of the result back (``scatter``: one more
``all_to_all``). The owner keeps the parameter's matrix states whole; the other ranks
keep the marker ``{OWNER: rank}`` in their place.

``published`` and ``owned`` turn such a state into what state dicts hold and back: states
of the parameter's shape become DTensors laid out like it, everything else (factors,
counts) plain tensors replicated on every rank, so that torch.distributed.checkpoint
saves them and loads them into another number of ranks. Both are collectives of the
shard group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fuser.counters import count
from fuser.runtime.distributed import DTensor, dim0_split, dist, from_local_like, local

OWNER = "whole_on_rank"  # a non-owner's state of a parameter: {OWNER: the owner's group rank}


@dataclass(frozen=True)
class Whole:
    """A dim-0-sharded DTensor parameter and the rank of its shard group that owns it."""

    p: torch.Tensor
    group: object  # torch.distributed.ProcessGroup
    spans: tuple  # [first, end) of dim 0 held by each rank of the group
    owner: int
    me: int  # this process's rank in the group

    @property
    def mine(self) -> bool:
        return self.me == self.owner

    @property
    def row(self) -> int:
        """Elements per index of dim 0."""
        return self.p.numel() // self.p.shape[0] if self.p.shape[0] else 0

    def rows(self, whole: torch.Tensor, rank: int) -> torch.Tensor:
        """The flat elements of ``whole`` (shaped like ``p``, contiguous) that ``rank`` holds."""
        first, end = self.spans[rank]
        return whole.view(-1)[first * self.row : end * self.row]


class Owners:
    """Which rank owns each dim-0-sharded DTensor parameter of an optimizer: assigned once,
    in the parameters' order, each to the rank of its shard group holding the fewest
    elements so far (ties: the lowest rank), so an owner never changes as groups are
    added. Plain and replicated parameters have none."""

    def __init__(self, reader: str):
        self.reader = reader
        self.wholes: dict = {}  # p -> Whole
        self.loads: dict = {}  # process group -> elements owned by each rank
        self.seen: tuple = ()

    def update(self, params: list) -> None:
        ids = tuple(id(p) for p in params)
        if ids == self.seen:
            return
        for p in params:
            if p in self.wholes or not isinstance(p, DTensor):
                continue
            split = dim0_split(p, self.reader)
            if split is None:
                continue
            group, spans = split
            load = self.loads.setdefault(group, [0] * len(spans))
            owner = min(range(len(load)), key=lambda r: (load[r], r))
            load[owner] += p.numel()
            self.wholes[p] = Whole(p, group, tuple(spans), owner, dist.get_rank(group))
        self.seen = ids

    def get(self, p):
        return self.wholes.get(p)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _by_group(wholes: list) -> dict:
    groups: dict = {}
    for i, w in enumerate(wholes):
        groups.setdefault(w.group, []).append(i)
    return groups


def _exchange(group, send: list[list[torch.Tensor]], receive: list[int], device) -> torch.Tensor:
    """One all_to_all of bytes: ``send[r]`` to rank ``r``, ``receive[r]`` bytes from it."""
    chunks = [c for cs in send for c in cs]
    data = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=device)
    out = torch.empty(sum(receive), dtype=torch.uint8, device=device)
    sizes = [sum(c.numel() for c in cs) for cs in send]
    dist.all_to_all_single(out, data, receive, sizes, group=group)
    count("collectives")
    return out


def gather(wholes: list[Whole], parts: list[list[torch.Tensor]], into: list[list]) -> None:
    """Every rank's rows ``parts[i]`` (this rank's local tensors of ``wholes[i].p``'s
    layout) into ``into[i]`` (whole tensors, contiguous, on the owner; ignored elsewhere):
    one all_to_all per shard group, its groups in order of first appearance."""
    for group, members in _by_group(wholes).items():
        world, me = len(wholes[members[0]].spans), wholes[members[0]].me
        send = [[] for _ in range(world)]
        for i in members:
            send[wholes[i].owner] += [_bytes(t) for t in parts[i]]
        mine = [i for i in members if wholes[i].owner == me]
        receive = [
            sum(wholes[i].rows(t, r).numel() * t.element_size() for i in mine for t in into[i])
            for r in range(world)
        ]
        out = _exchange(group, send, receive, local(wholes[members[0]].p).device)
        at = 0
        for r in range(world):
            for i in mine:
                for t in into[i]:
                    seg = wholes[i].rows(t, r)
                    n = seg.numel() * t.element_size()
                    seg.view(torch.uint8).copy_(out[at : at + n])
                    at += n


def scatter(wholes: list[Whole], whole: list, here: list[torch.Tensor]) -> None:
    """Each rank's rows of ``whole[i]`` (on the owner; ignored elsewhere) into ``here[i]``
    (this rank's local tensor, of the same dtype): one all_to_all per shard group."""
    for group, members in _by_group(wholes).items():
        world, me = len(wholes[members[0]].spans), wholes[members[0]].me
        mine = [i for i in members if wholes[i].owner == me]
        send = [[_bytes(wholes[i].rows(whole[i], r)) for i in mine] for r in range(world)]
        receive = [0] * world
        for i in members:
            receive[wholes[i].owner] += here[i].numel() * here[i].element_size()
        out = _exchange(group, send, receive, local(wholes[members[0]].p).device)
        at = 0
        for r in range(world):
            for i in members:
                if wholes[i].owner == r:
                    n = here[i].numel() * here[i].element_size()
                    here[i].copy_(out[at : at + n].view(here[i].dtype).view(here[i].shape))
                    at += n


# --- state dicts ----------------------------------------------------------------------


def _skeleton(value):
    """``value``'s structure with each tensor as (shape, dtype, on the CPU)."""
    if torch.is_tensor(value):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type == "cpu")
    if isinstance(value, (list, tuple)):
        return [_skeleton(v) for v in value]
    return value


def _is_tensor(skeleton) -> bool:
    return isinstance(skeleton, tuple) and len(skeleton) == 4 and skeleton[0] == "tensor"


def _broadcast(w: Whole, skeleton, value):
    """The owner's ``value`` (of ``skeleton``'s structure) on every rank of its group."""
    if _is_tensor(skeleton):
        _, shape, dtype, on_cpu = skeleton
        device = local(w.p).device
        buf = value.to(device).contiguous() if w.mine else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(buf, group=w.group, group_src=w.owner)
        count("collectives")
        return buf.cpu() if on_cpu else buf
    if isinstance(skeleton, list):
        return [_broadcast(w, s, value[k] if w.mine else None) for k, s in enumerate(skeleton)]
    return skeleton


def is_like_param(p: torch.Tensor, key: str, value, keys=None) -> bool:
    """Whether state ``key``'s ``value`` is laid out like ``p``: of its shape, and named
    in ``keys`` where given (a square factor has the shape of a square parameter)."""
    return torch.is_tensor(value) and tuple(value.shape) == tuple(p.shape) and (keys is None or key in keys)


def published(w: Whole, state: dict, keys=None) -> dict:
    """The state dict entry of ``w.p`` from its owner's ``state`` (the others pass
    theirs, a marker): values laid out like the parameter (``is_like_param``) as
    DTensors like it, the rest replicated plain tensors (a collective of the shard
    group)."""
    skeleton = [{k: _skeleton(v) for k, v in state.items()} if w.mine else None]
    dist.broadcast_object_list(skeleton, group=w.group, group_src=w.owner)
    out = {}
    for key, sk in skeleton[0].items():
        value = _broadcast(w, sk, state.get(key) if w.mine else None)
        if is_like_param(w.p, key, value, keys):
            first, end = w.spans[w.me]
            value = from_local_like(w.p, value[first:end].clone())
        out[key] = value
    return out


def _whole(value):
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, (list, tuple)):
        return [_whole(v) for v in value]
    return value


def whole_values(state: dict) -> dict:
    """``state`` with each DTensor (in lists too) as its whole plain tensor (a collective
    of its mesh), the marker left out."""
    return {k: _whole(v) for k, v in state.items() if k != OWNER}


def owned(w: Whole, state: dict) -> dict:
    """A loaded state of ``w.p`` (DTensors laid out any way, or whole plain tensors) as
    this rank keeps it: every value whole and plain on the owner, the marker elsewhere
    (a collective of the DTensors' meshes where the state holds DTensors)."""
    out = whole_values(state)
    return out if w.mine else {OWNER: w.owner}
