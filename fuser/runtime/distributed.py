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
- ``numel`` (and so ``mean``) is the logical tensor's size, read from the tables;
- rules of rows and columns walk the tiles of each shard, which holds whole rows of the
  2-D view (``Shard(0)``; a 1-D tensor's one row is split instead). A row reduction of
  a split row, a column reduction over split rows, and a per-tensor reduction over split
  rows or columns are partial, and combine as above; those plans reduce row or column
  values one phase later (``lower_optim(sharded=True)``), after the combine. A state of
  one number per row (column) is sharded with a split axis, else replicated.

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
            value = value.detach().to(p._local_tensor.device)
            if value.dtype != torch.int16:
                return distribute_tensor(value, p.device_mesh, p.placements)
            # (collectives carry no int16, a split master's low part: its bytes travel as fp16)
            moved = distribute_tensor(value.view(torch.float16), p.device_mesh, p.placements)
            return from_local_like(p, moved.to_local().view(torch.int16))
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


def _row_scales_shape(p: torch.Tensor, block: int) -> tuple[int, int] | None:
    """``[rows, blocks a row]`` of ``p``'s 2-D view ``[shape[0], prod(rest)]`` where its
    8-bit blocks tile whole rows (a row's length is a multiple of ``block``) and ``p`` is
    plain, replicated, or sharded by rows (``Shard(0)`` on one mesh dimension): then each
    block's place in the whole tensor, and its scale's, do not depend on the sharding.
    ``None`` otherwise."""
    if p.dim() < 2 or p.shape[0] == 0:
        return None
    rest = p.numel() // p.shape[0]
    if rest == 0 or rest % block:
        return None
    if isinstance(p, DTensor):
        sharded = _sharded_dims(p)
        if len(sharded) > 1 or (sharded and not p.placements[sharded[0]].is_shard(0)):
            return None
    return p.shape[0], rest // block


def scales_like(p: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """This rank's block scales of an 8-bit state of ``p``, laid out so that
    torch.distributed.checkpoint saves every rank's and can load them into another
    sharding where that is exact:

    - where ``p``'s blocks tile whole rows (``_row_scales_shape``): a ``[rows, blocks a
      row]`` tensor, a DTensor placed like ``p`` when ``p`` is sharded by rows, so that a
      checkpoint reshards the scales with the rows they scale, and the codes with ``p``;
    - else, for ``p`` sharded on one mesh dimension of size S, a DTensor of shape
      ``[S, L]`` whose row c (zero-padded to L, the most blocks any shard has) holds the
      scales of the shard at coordinate c, replicated over the other mesh dimensions (a
      plain tensor under one key would be saved from one rank only): it loads into the
      same sharding only;
    - else (a plain or replicated ``p``) the scales themselves.

    ``local_scales`` inverts it."""
    rows = _row_scales_shape(p, block)
    if rows is not None:
        # (an empty shard keeps one unused scale: n_blocks)
        here = local(p).shape[0]
        scales = scales[: here * rows[1]].view(here, rows[1])
        if isinstance(p, DTensor) and _sharded_dims(p):
            return DTensor.from_local(scales, p.device_mesh, p.placements, shape=rows, stride=(rows[1], 1))
        return scales
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
    """This rank's block scales from a saved ``value``: ``scales_like``'s layout (the
    rows of a ``[rows, blocks a row]`` value this rank holds, a DTensor's or, for ``p``
    sharded by rows, this rank's rows of a whole plain one), or the plain scales of a
    plain or replicated ``p``. Raises for scales laid out for another sharding."""
    rows = _row_scales_shape(p, block)
    if rows is not None and tuple(value.shape) == rows:
        if isinstance(value, DTensor) and (
            not isinstance(p, DTensor)
            or (value.device_mesh, value.placements) != (p.device_mesh, p.placements)
        ):
            value = value.full_tensor()  # (placed unlike p: another optimizer's state dict)
        if isinstance(value, DTensor):
            value = value._local_tensor
        else:
            shard = _dim0_shard(p, "8-bit block scales", 2)
            if shard is not None:  # (a whole plain value: this rank's rows)
                value = value[shard[1] : shard[2]]
        flat = value.reshape(-1)
        missing = n_blocks(local(p).numel(), block) - flat.numel()  # (an empty shard's one scale)
        return torch.cat([flat, flat.new_zeros(missing)]) if missing > 0 else flat
    if not isinstance(value, DTensor):
        return value
    layout = _scales_layout(p, block)
    same = layout is not None and tuple(value.shape) == layout[1] and value.device_mesh.ndim > layout[0]
    if not (same and value.placements[layout[0]].is_shard(0)):
        raise RuntimeError(
            f"the saved scales of a parameter of shape {tuple(p.shape)} were laid out for another sharding "
            f"({tuple(value.shape)} on {value.placements}); where a row of its 2-D view is not a whole "
            f"number of 8-bit blocks ({block} elements) a compressed state dict loads into the sharding it "
            "was saved from: save the default state dict (fp32 states) to reshard"
        )
    return value._local_tensor.reshape(-1)[: n_blocks(local(p).numel(), block)]


def _dim0_shard(p: torch.Tensor, reader: str, min_dims: int):
    """(mesh dimension, this rank's [first, end) of ``p``'s dim 0) for a DTensor sharded
    by its dim 0 (``Shard(0)`` on one mesh dimension, ``torch.chunk``'s split, at least
    ``min_dims`` dimensions); ``None`` for a plain or replicated tensor. Raises for other
    layouts, naming ``reader``, what needs them."""
    if not isinstance(p, DTensor):
        return None
    sharded = _sharded_dims(p)
    if not sharded:
        return None
    if len(sharded) > 1 or not p.placements[sharded[0]].is_shard(0) or p.dim() < min_dims:
        whole = "a tensor of 2 or more dimensions" if min_dims > 1 else "any tensor"
        raise RuntimeError(
            f"{reader} reads a DTensor in shards of whole rows of its 2-D view (Shard(0) of {whole}, "
            f"on one mesh dimension); a parameter of shape {tuple(p.shape)} is placed {p.placements}: "
            "shard it by rows, or replicate it"
        )
    dim = sharded[0]
    mesh = p.device_mesh
    parts = mesh.size(dim)
    first, end = _chunk(p.shape[0], parts, mesh.get_local_rank(dim))
    if p._local_tensor.shape[0] != end - first:
        raise RuntimeError(
            f"a parameter of shape {tuple(p.shape)} holds {p._local_tensor.shape[0]} rows on this rank where "
            f"Shard(0) over {parts} ranks gives {end - first} (torch.chunk's split): {reader} reads "
            "shards of that split only"
        )
    return dim, first, end


def row_shard(p: torch.Tensor):
    """(process group, this rank's rows [first, end) of ``p``'s 2-D view) for a DTensor
    sharded by those rows (``Shard(0)`` of a tensor of 2 or more dimensions, on one mesh
    dimension), as a matrix function gathers it; ``None`` for a plain or replicated
    tensor. Raises for other layouts."""
    found = _dim0_shard(p, "a matrix function", 2)
    if found is None:
        return None
    dim, first, end = found
    return p.device_mesh.get_group(dim), (first, end)


def dim0_split(p: torch.Tensor, reader: str):
    """(process group, [first, end) of ``p``'s dim 0 held by each rank of that group) for a
    DTensor sharded by its dim 0 (``Shard(0)`` on one mesh dimension, ``torch.chunk``'s
    split, any number of dimensions); ``None`` for a plain or replicated tensor. Raises for
    other layouts, naming ``reader``."""
    found = _dim0_shard(p, reader, 1)
    if found is None:
        return None
    dim = found[0]
    parts = p.device_mesh.size(dim)
    return p.device_mesh.get_group(dim), [_chunk(p.shape[0], parts, c) for c in range(parts)]


def split_axis(p: torch.Tensor) -> str | None:
    """Which axis of ``p``'s 2-D view its shards split, for rules that read rows and
    columns: ``"row"`` (``Shard(0)`` of 2 or more dimensions: each rank holds whole rows),
    ``"col"`` (``Shard(0)`` of a 1-D tensor: its one row is split), ``None`` when plain or
    replicated. Raises for other layouts."""
    if _dim0_shard(p, "a rule of rows and columns", 1) is None:
        return None
    return "row" if p.dim() >= 2 else "col"


def _reduced_placements(p: DTensor, kind: str, shape) -> tuple:
    """(placements, sharded dimension or None) of a state of one number per row
    (``kind="row"``) or column of ``p``'s 2-D view, of ``shape``: sharded where ``p``
    splits that axis, on the state's first dimension of that size (``torch.chunk`` splits
    it as it splits ``p``), replicated where every rank holds the whole axis."""
    from torch.distributed.tensor import Replicate, Shard

    placements = [Replicate()] * p.device_mesh.ndim
    if split_axis(p) != kind:
        return tuple(placements), None
    dim = list(shape).index(p.shape[0])
    placements[_sharded_dims(p)[0]] = Shard(dim)
    return tuple(placements), dim


def new_reduced(p: torch.Tensor, kind: str, shape, fill: float, dtype: torch.dtype) -> torch.Tensor:
    """A new row (column) state of ``shape`` filled with ``fill``, laid out for ``p``
    (``_reduced_placements``): this rank's part of a DTensor, or a plain tensor."""
    if not isinstance(p, DTensor):
        return torch.full(shape, fill, dtype=dtype, device=p.device)
    placements, dim = _reduced_placements(p, kind, shape)
    here = list(shape)
    if dim is not None:
        here[dim] = p._local_tensor.shape[0]
    value = torch.full(here, fill, dtype=dtype, device=p._local_tensor.device)
    shape = torch.Size(shape)
    return DTensor.from_local(value, p.device_mesh, placements, shape=shape, stride=_packed(shape))


def reduced_like(p: torch.Tensor, kind: str, value: torch.Tensor) -> torch.Tensor:
    """A whole row (column) state ``value`` laid out for ``p``: redistributed if a DTensor
    on other placements; scattered from rank 0 if plain while ``p`` is a DTensor (every
    rank calls this together then); gathered if a DTensor while ``p`` is plain."""
    if not isinstance(p, DTensor):
        return value.full_tensor() if isinstance(value, DTensor) else value
    placements, _ = _reduced_placements(p, kind, value.shape)
    if isinstance(value, DTensor):
        if value._spec.placements != placements or not _same_mesh(value, p):
            value = value.redistribute(p.device_mesh, placements)
        return value
    return distribute_tensor(value.detach().to(p._local_tensor.device), p.device_mesh, placements)


def with_local(value: torch.Tensor, here: torch.Tensor) -> torch.Tensor:
    """``value`` (a DTensor, or a plain tensor) with ``here`` as this rank's part."""
    if not isinstance(value, DTensor):
        return here
    return DTensor.from_local(
        here, value.device_mesh, value.placements, shape=value.shape, stride=_packed(value.shape)
    )


def _packed(shape) -> tuple:
    strides, step = [], 1
    for n in reversed(list(shape)):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


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

    ``launches[i]`` has ``plan``, ``red`` [n_tensors, n_reductions], ``part``, ``tables``,
    ``axis`` and its device's global table ``glob[device]``; ``params[i]`` are its
    parameters, in table rows.
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
    # (matrix functions gather their own matrices, runtime.matrix)
    shared = [r for r in plan.reductions if r.column >= 0 or r.axis]
    for phase in sorted({r.phase for r in shared}):
        reds = [r for r in shared if r.phase == phase]
        for combine, op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
            these = [r for r in reds if ACCUMULATE[r.op][1] == combine]
            for (group, _), by_launch in rows.items():
                segments = []
                for li, launch_rows in by_launch.items():
                    sharded = [(i, params[li][i]) for i in launch_rows]
                    segments += _partial_segments(launches[li], sharded, these)
                if segments:
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


def _partial_segments(launch, sharded: list, reds: list) -> list:
    """(buffer, flat indices) of what each shard of ``sharded`` ((table row, parameter)
    pairs) holds only a part of among the results of ``reds``: per-tensor reductions over
    elements, or over the rows (columns) that the shards split; axis reductions along the
    split axis (a column's sum over rows split across ranks). What every rank holds whole
    (a column's values when rows are split) is the same on each, so it is left alone."""
    out = []
    red = launch.red
    per_tensor = [r for r in reds if r.column >= 0]
    axis = [r for r in reds if r.axis]
    idx = []
    for row, p in sharded:
        split = split_axis(p) if launch.plan.tiled else "row"
        idx += [row * red.shape[1] + r.column for r in per_tensor if r.over in ("element", split)]
    if idx:
        out.append((red, torch.tensor(idx, dtype=torch.int64, device=red.device)))
    if axis:
        t = launch.tables
        starts, sizes = t.axis_starts.cpu(), t.numels[4:6].cpu()
        n_row = sum(r.axis == "row" for r in launch.plan.reductions)
        idx = []
        for row, p in sharded:
            split = split_axis(p)
            for r in axis:
                if r.axis == split:  # one result per row (column) here: whole
                    continue
                if r.axis == "row":
                    first = r.axis_column * t.total_rows + int(starts[0, row])
                    idx += range(first, first + int(sizes[0, row]))
                else:
                    first = n_row * t.total_rows + r.axis_column * t.total_cols + int(starts[1, row])
                    idx += range(first, first + int(sizes[1, row]))
        if idx:
            out.append((launch.axis, torch.tensor(idx, dtype=torch.int64, device=red.device)))
    return out
