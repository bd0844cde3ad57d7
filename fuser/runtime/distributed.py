"""DTensor parameters (FSDP2, ``distribute_tensor``): one step over every rank's shards.

The kernels update each rank's local tensors (``to_local()``) with the same launches as
plain tensors. What a shard cannot know alone is combined between phases:

- a per-tensor reduction (``norm sum mean amax``, and the per-tensor totals behind
  ``global_norm``, ``global_sum``) sums, or maxes, the raw partials of every shard over the mesh
  dimensions on which the tensor is sharded: one ``all_reduce`` per (phase, process
  group, combine op) for all tensors at once, never one per tensor. Replicated mesh
  dimensions hold copies, so they are not reduced, and a replicated tensor counts once;
- ``global_norm`` and ``global_sum`` are then re-totalled from the combined per-tensor rows: it spans every
  parameter of the optimizer over all its shards, as ``clip_grad_norm_`` does on DTensors;
- ``numel`` (and so ``mean``) is the logical tensor's size, read from the tables.

Plain tensors, DDP's included, are this rank's own: nothing is exchanged for them. Every
rank of a shard group must step the same parameters in the same order (as FSDP2 does),
since each rank issues the same collectives in that order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fuser.counters import count
from fuser.ir.optim import ACCUMULATE
from fuser.runtime.quant import n_blocks

try:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # torch built without distributed support: no tensor is a DTensor
    dist = None

    class DTensor:
        pass


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor a kernel reads and writes: a DTensor's local shard, else ``t`` itself.

    ``_local_tensor`` rather than ``to_local()``: on a ``Parameter(DTensor)`` the latter
    returns a fresh view on every call (2.3 us against 0.02 us, measured on CPU), and
    this runs for every tensor of every step.
    """
    return t._local_tensor if isinstance(t, DTensor) else t


def layout(t: torch.Tensor):
    """A DTensor's (placements, mesh), ``None`` for a plain tensor: what must hold between
    steps for a gradient's shard to line up with its parameter's."""
    return (t._spec.placements, t.device_mesh) if isinstance(t, DTensor) else None


def local_pair(p: torch.Tensor, g: torch.Tensor, attr: str) -> tuple[torch.Tensor, ...]:
    """(``g`` laid out like ``p``, ``p``'s local tensor, ``g``'s), with one type check for
    a plain parameter: this runs for every tensor of every step.

    A DTensor gradient on other placements than its parameter's (``Replicate`` or
    ``Partial`` from autograd on hand-made shards, say) is redistributed once and stored
    back in ``p.<attr>``: the same logical values, in the layout the kernel walks, and the
    same object however often the step looks at it."""
    if not isinstance(p, DTensor):
        return g, p, g  # a DTensor gradient here is refused by check()
    if isinstance(g, DTensor):
        if g._spec.placements != p._spec.placements or not _same_mesh(g, p):
            g = g.redistribute(p.device_mesh, p.placements)
            setattr(p, attr, g)
        return g, p._local_tensor, g._local_tensor
    return g, p._local_tensor, g


def _same_mesh(a: DTensor, b: DTensor) -> bool:
    return a.device_mesh is b.device_mesh or a.device_mesh == b.device_mesh


def check(p: torch.Tensor, g: torch.Tensor, where: str, attr: str) -> None:
    """Raise unless the step can update ``p`` from ``g`` through their local shards."""
    if isinstance(p, DTensor) != isinstance(g, DTensor):
        kinds = ("a DTensor", "a plain tensor") if isinstance(p, DTensor) else ("a plain tensor", "a DTensor")
        raise RuntimeError(
            f"the .{attr} of a {where} is {kinds[1]} but the parameter is {kinds[0]}; "
            "both must be DTensors on the same mesh, or both plain tensors"
        )
    if isinstance(p, DTensor):
        if any(pl.is_partial() for pl in p.placements):
            raise RuntimeError(
                f"{where} is a DTensor with placements {p.placements}: a parameter must "
                "be sharded or replicated, not Partial"
            )


def like_param(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A per-element state ``value`` in the layout of its parameter ``p``: a DTensor with
    ``p``'s mesh and placements when ``p`` is one (a full tensor, as from a non-sharded
    checkpoint, is scattered from rank 0 with ``distribute_tensor``; every rank must
    call this together then), the full tensor when ``p`` is plain. Otherwise unchanged."""
    if isinstance(p, DTensor):
        if not isinstance(value, DTensor):
            if value.shape != p.shape:
                return value
            return distribute_tensor(value.detach().to(p._local_tensor.device), p.device_mesh, p.placements)
        if value._spec.placements != p._spec.placements or not _same_mesh(value, p):
            return value.redistribute(p.device_mesh, p.placements)
        return value
    if isinstance(value, DTensor):
        return value.full_tensor()
    return value


def from_local_like(p: torch.Tensor, local_value: torch.Tensor) -> torch.Tensor:
    """``local_value``, this rank's part of a state of ``p``: a DTensor laid out like
    ``p`` when ``p`` is one, else itself (``like_param`` takes full tensors instead)."""
    if not isinstance(p, DTensor):
        return local_value
    return DTensor.from_local(local_value, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())


def _sharded_dims(p: DTensor) -> list[int]:
    """The mesh dimensions on which ``p`` is sharded."""
    return [d for d, pl in enumerate(p.placements) if pl.is_shard()]


def _chunk(n: int, parts: int, c: int) -> tuple[int, int]:
    """[first, end) of part ``c`` of ``n`` items split ``torch.chunk``'s way, which
    ``Shard`` uses (trailing parts may be empty)."""
    size = -(-n // parts)
    first = min(n, c * size)
    return first, min(n, first + size)


def _shard_sizes(p: DTensor, dim: int) -> list[int]:
    """Elements of ``p`` held at each coordinate of mesh dimension ``dim`` (its only sharded
    one)."""
    tdim = p.placements[dim].dim
    n, parts = p.shape[tdim], p.device_mesh.size(dim)
    rest = p.numel() // n if n else 0
    return [(end - first) * rest for first, end in (_chunk(n, parts, c) for c in range(parts))]


def _scales_layout(p: torch.Tensor, block: int):
    """(mesh dimension, [S, L] shape) of ``scales_like``'s layout for ``p``; ``None`` where
    the scales stay as they are (a plain or replicated ``p``)."""
    if not isinstance(p, DTensor):
        return None
    sharded = _sharded_dims(p)
    if not sharded:
        return None
    if len(sharded) > 1:
        raise RuntimeError(
            f"a parameter of shape {tuple(p.shape)} is sharded over {len(sharded)} mesh dimensions "
            f"({p.placements}): compressed state dicts keep the block scales of parameters sharded on "
            "one; save the default state dict (fp32 states), which checkpoints reshard"
        )
    dim = sharded[0]
    width = max(n_blocks(n, block) for n in _shard_sizes(p, dim))
    return dim, (p.device_mesh.size(dim), width)


def scales_like(p: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """This rank's block scales of an 8-bit state of ``p``, laid out so that
    torch.distributed.checkpoint saves every rank's: for ``p`` sharded on one mesh
    dimension of size S, a DTensor of shape ``[S, L]`` whose row c (zero-padded to L, the
    most blocks any shard has) holds the scales of the shard at coordinate c, replicated
    over the other mesh dimensions. (A plain tensor under one key would be saved from one
    rank only.) The scales themselves for a plain or replicated ``p``. ``local_scales``
    inverts it."""
    layout = _scales_layout(p, block)
    if layout is None:
        return scales
    from torch.distributed.tensor import Replicate, Shard

    dim, (parts, width) = layout
    row = scales.new_zeros(1, width)
    row[0, : scales.numel()] = scales
    mesh = p.device_mesh
    placements = [Shard(0) if d == dim else Replicate() for d in range(mesh.ndim)]
    return DTensor.from_local(row, mesh, placements, shape=(parts, width), stride=(width, 1))


def local_scales(p: torch.Tensor, value: torch.Tensor, block: int) -> torch.Tensor:
    """This rank's block scales from a saved ``value``: ``scales_like``'s layout, or the
    plain scales of a plain or replicated ``p``. Raises for scales laid out for another
    sharding."""
    if not isinstance(value, DTensor):
        return value
    layout = _scales_layout(p, block)
    same = layout is not None and tuple(value.shape) == layout[1] and value.device_mesh.ndim > layout[0]
    if not (same and value.placements[layout[0]].is_shard(0)):
        raise RuntimeError(
            f"the saved scales of a parameter of shape {tuple(p.shape)} were laid out for another sharding "
            f"({tuple(value.shape)} on {value.placements}); a compressed state dict loads into the sharding "
            "it was saved from: save the default state dict (fp32 states) to reshard"
        )
    return value._local_tensor.reshape(-1)[: n_blocks(local(p).numel(), block)]


def row_shard(p: torch.Tensor):
    """(process group, this rank's rows [first, end) of ``p``'s 2-D view) for a DTensor
    sharded by those rows (``Shard(0)`` of a tensor of 2 or more dimensions, on one mesh
    dimension), as a matrix function gathers it; ``None`` for a plain or replicated
    tensor. Raises for other layouts."""
    if not isinstance(p, DTensor):
        return None
    sharded = _sharded_dims(p)
    if not sharded:
        return None
    if len(sharded) > 1 or not p.placements[sharded[0]].is_shard(0) or p.dim() < 2:
        raise RuntimeError(
            f"a matrix function gathers a DTensor's matrix from shards of whole rows of its 2-D view "
            f"(Shard(0) of a tensor of 2 or more dimensions, on one mesh dimension); a parameter of shape "
            f"{tuple(p.shape)} is placed {p.placements}: shard it by rows, or replicate it"
        )
    dim = sharded[0]
    mesh = p.device_mesh
    parts = mesh.size(dim)
    first, end = _chunk(p.shape[0], parts, mesh.get_local_rank(dim))
    if p._local_tensor.shape[0] != end - first:
        raise RuntimeError(
            f"a parameter of shape {tuple(p.shape)} holds {p._local_tensor.shape[0]} rows on this rank where "
            f"Shard(0) over {parts} ranks gives {end - first} (torch.chunk's split): a matrix function "
            "gathers shards of that split only"
        )
    return mesh.get_group(dim), (first, end)


def shard_groups(p: torch.Tensor) -> list:
    """Process groups of the mesh dimensions on which ``p`` is sharded (none when plain
    or replicated)."""
    if not isinstance(p, DTensor):
        return []
    return [p.device_mesh.get_group(dim) for dim in _sharded_dims(p)]


@dataclass
class _Exchange:
    """One all_reduce: the listed entries of some launches' ``red`` tables."""

    group: object  # torch.distributed.ProcessGroup
    op: object  # torch.distributed.ReduceOp
    segments: list  # (red table, flat int64 indices into it)


@dataclass
class _Retotal:
    """Recompute one launch's ``glob`` row from its combined per-tensor totals."""

    glob_row: torch.Tensor  # fp32 [n_global], a view of the device's global table
    glob_columns: torch.Tensor  # int64
    red: torch.Tensor
    red_columns: torch.Tensor  # int64, the per-tensor totals of those global reductions


class ShardReduction:
    """Called after each reduction phase: combines that phase's per-tensor partials of
    sharded tensors across their shard groups and refreshes the global totals. Built
    once per table rebuild; the hot path is index gathers, the collectives, and scatters,
    with no host synchronisation."""

    def __init__(self, exchanges: dict[int, list[_Exchange]], retotals: dict[int, list[_Retotal]]):
        self.exchanges = exchanges
        self.retotals = retotals

    def __call__(self, phase: int) -> None:
        for ex in self.exchanges.get(phase, ()):
            parts = [red.view(-1).index_select(0, idx) for red, idx in ex.segments]
            buf = parts[0] if len(parts) == 1 else torch.cat(parts)
            dist.all_reduce(buf, op=ex.op, group=ex.group)
            count("collectives")
            offset = 0
            for red, idx in ex.segments:
                red.view(-1).index_copy_(0, idx, buf[offset : offset + idx.numel()])
                offset += idx.numel()
        for rt in self.retotals.get(phase, ()):
            rt.glob_row.index_copy_(0, rt.glob_columns, rt.red.index_select(1, rt.red_columns).sum(0))


def shard_reduction(launches: list, params: list[list[torch.Tensor]], glob: dict) -> ShardReduction | None:
    """The exchanges a step over ``launches`` needs, or None when no tensor is sharded.

    ``launches[i]`` has ``plan``, ``red`` [n_tensors, n_reductions], ``part`` and its
    device's global table ``glob[device]``; ``params[i]`` are its parameters, in table rows.
    """
    if dist is None or not any(isinstance(p, DTensor) for ps in params for p in ps):
        return None
    # Rows of each (process group, device), groups in order of first appearance: every
    # rank of a group meets them in the same order, so the collectives match up.
    rows: dict[tuple, dict[int, list[int]]] = {}
    for li, ps in enumerate(params):
        for row, p in enumerate(ps):
            for group in shard_groups(p):
                rows.setdefault((group, launches[li].red.device), {}).setdefault(li, []).append(row)
    if not rows:
        return None
    plan = launches[0].plan
    exchanges: dict[int, list[_Exchange]] = {}
    retotals: dict[int, list[_Retotal]] = {}
    # (per-tensor reductions only: matrix functions gather their own matrices, runtime.matrix)
    per_tensor = [r for r in plan.reductions if r.column >= 0]
    for phase in sorted({r.phase for r in per_tensor}):
        reds = [r for r in per_tensor if r.phase == phase]
        for combine, op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
            columns = [r.column for r in reds if ACCUMULATE[r.op][1] == combine]
            if not columns:
                continue
            for (group, device), by_launch in rows.items():
                segments = []
                for li, launch_rows in by_launch.items():
                    red = launches[li].red
                    idx = torch.tensor(launch_rows)[:, None] * red.shape[1] + torch.tensor(columns)[None, :]
                    segments.append((red, idx.reshape(-1).to(device)))
                exchanges.setdefault(phase, []).append(_Exchange(group, op, segments))
        glob_reds = [r for r in reds if r.global_column >= 0]
        if glob_reds:
            for li in sorted({li for by_launch in rows.values() for li in by_launch}):
                launch = launches[li]
                device = launch.red.device
                retotals.setdefault(phase, []).append(
                    _Retotal(
                        glob[device][launch.part],
                        torch.tensor([r.global_column for r in glob_reds], device=device),
                        launch.red,
                        torch.tensor([r.column for r in glob_reds], device=device),
                    )
                )
    return ShardReduction(exchanges, retotals)
