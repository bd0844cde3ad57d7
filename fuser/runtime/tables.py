"""Device tables that let one launch update any number of tensors (DESIGN decision 1).

CUDA kernel arguments hold 4 KB, so the addresses of many tensors cannot be passed
directly: they live in device memory instead, with each tensor's size, its param group
and a block -> (tensor, start) map. Tables are built once and reused while no tensor's
storage, size, dtype or device changed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fuser.counters import count


@dataclass
class Tables:
    """Device tables for one launch: ``n_tensors`` rows, ``n_blocks`` programs."""

    ptrs: torch.Tensor  # int64 [n_tensors, n_slots]
    # int64 [6, n_tensors]: elements here, elements of the logical tensor, the rows and
    # columns of its 2-D view, then those of the 2-D view here (a DTensor's shard)
    numels: torch.Tensor
    groups: torch.Tensor  # int32 [n_tensors]
    block_tensor: torch.Tensor  # int32 [n_blocks]
    block_start: torch.Tensor  # int64 [n_blocks]
    tensor_first_block: torch.Tensor  # int32 [n_tensors]
    tensor_blocks: torch.Tensor  # int32 [n_tensors]
    counters: torch.Tensor  # int32 [n_tensors + 2]: zero between launches
    n_tensors: int
    n_blocks: int
    # Tiled launches (shape-aware rules) only: where each tensor's rows and columns here
    # start in the axis buffer (int64 [2, n_tensors]), and their totals.
    axis_starts: torch.Tensor | None = None
    total_rows: int = 0
    total_cols: int = 0


def view_2d(shape) -> tuple[int, int]:
    """(rows, cols) of a tensor's 2-D view: a scalar is 1 x 1, a 1-D tensor one row, an
    N-D tensor ``[shape[0], prod(shape[1:])]``."""
    shape = tuple(shape)
    if not shape:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    cols = 1
    for n in shape[1:]:
        cols *= n
    return shape[0], cols


# A rule's 2-D view of a tensor of 3 or more dimensions: "flatten" is one matrix
# [shape[0], prod(rest)]; "batched" a batch of [shape[-2], shape[-1]] matrices over the
# leading dimensions. Tensors of fewer dimensions have one view.
VIEWS = ("flatten", "batched")


def check_view(view, where: str) -> str:
    """``view`` if it names a view, else a ValueError naming ``where`` it was given."""
    if view not in VIEWS:
        raise ValueError(f"{where}: view must be 'flatten' or 'batched', not {view!r}")
    return view


def is_batched(shape, view: str) -> bool:
    """Whether ``view`` splits a tensor of ``shape`` into matrices of its last two
    dimensions (batched, 3 or more dimensions, some elements)."""
    shape = tuple(shape)
    return view == "batched" and len(shape) >= 3 and math.prod(shape) > 0


def n_matrices(shape, view: str) -> int:
    """Matrices of a tensor of ``shape`` in ``view``: the product of its leading dimensions
    where ``is_batched``, else one."""
    return math.prod(tuple(shape)[:-2]) if is_batched(shape, view) else 1


def matrix_2d(shape, view: str) -> tuple[int, int]:
    """(rows, cols) of each matrix of a tensor of ``shape`` in ``view``: its last two
    dimensions where ``is_batched``, else ``view_2d``."""
    return tuple(tuple(shape)[-2:]) if is_batched(shape, view) else view_2d(shape)


def _sizes(rows: list, numels: torch.Tensor, here: torch.Tensor, logical_shapes, views) -> torch.Tensor:
    """The numels table's rows: each tensor's numel here, its logical numel, its 2-D view's
    rows and cols, its rows and cols here, its logical number of dimensions."""
    n = len(rows)
    shapes_of = [row[0].shape for row in rows] if logical_shapes is None else logical_shapes
    logical = torch.tensor([math.prod(s) for s in shapes_of], dtype=torch.int64).reshape(n)
    ndims = torch.tensor([len(s) for s in shapes_of], dtype=torch.int64).reshape(n)
    sizes = torch.tensor(views or [view_2d(s) for s in shapes_of], dtype=torch.int64).reshape(n, 2)
    return torch.stack([numels, logical, sizes[:, 0], sizes[:, 1], here[:, 0], here[:, 1], ndims])


def build_tables(
    rows: list[list[torch.Tensor]],
    groups: list[int],
    block: int,
    device: torch.device,
    logical_shapes: list | None = None,
    tile: tuple[int, int] | None = None,
    views: list | None = None,
) -> Tables:
    """Tables for ``rows`` (one list of per-slot tensors per parameter, all of one numel).

    ``logical_shapes`` give what ``numel`` (and ``mean``), ``rows``, ``cols`` and ``ndim`` read: the
    whole tensor's where a row holds a shard of it (DTensor parameters), the rows' own by
    default; ``views`` the (rows, cols) where not those shapes' 2-D views (a batched view's
    matrices: their own). Kernels walk the tensors here, by their own sizes.

    Every tensor must be non-overlapping and dense with the same strides as the others of
    its row, so that element ``i`` of storage order is element ``i`` of each of them. An
    empty tensor still gets one (masked-off) block, so that every tensor reports its
    reductions and the step advances.

    With ``tile`` (rows, cols), a block is a tile of the 2-D view (``view_2d``) of the
    tensor here (contiguous; a shard of whole rows, or of a 1-D tensor's one row) and
    ``block_start`` its index among the tensor's tiles, row-major.
    """
    n = len(rows)
    ptrs = torch.tensor([[t.data_ptr() for t in row] for row in rows], dtype=torch.int64)
    numels = torch.tensor([row[0].numel() for row in rows], dtype=torch.int64)
    here = torch.tensor([view_2d(row[0].shape) for row in rows], dtype=torch.int64).reshape(n, 2)
    counts = ((numels + block - 1) // block).clamp_min(1)
    starts = None
    if tile is not None:
        tiles = ((here[:, 0] + tile[0] - 1) // tile[0]) * ((here[:, 1] + tile[1] - 1) // tile[1])
        counts = tiles.clamp_min(1)
        starts = (torch.cumsum(here, 0) - here).T.contiguous()
    total = int(counts.sum())
    block_tensor = torch.repeat_interleave(torch.arange(n, dtype=torch.int32), counts)
    first = torch.cumsum(counts, 0) - counts
    block_start = torch.arange(total, dtype=torch.int64) - first[block_tensor.long()]
    if tile is None:
        block_start = block_start * block
    count("table_builds")
    return Tables(
        ptrs=ptrs.to(device),
        numels=_sizes(rows, numels, here, logical_shapes, views).to(device),
        groups=torch.tensor(groups, dtype=torch.int32).to(device),
        block_tensor=block_tensor.to(device),
        block_start=block_start.to(device),
        tensor_first_block=first.to(torch.int32).to(device),
        tensor_blocks=counts.to(torch.int32).to(device),
        counters=torch.zeros(n + 2, dtype=torch.int32, device=device),
        n_tensors=n,
        n_blocks=total,
        axis_starts=None if starts is None else starts.to(device),
        total_rows=int(here[:, 0].sum()) if tile is not None else 0,
        total_cols=int(here[:, 1].sum()) if tile is not None else 0,
    )


def check_layout(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    """Raise unless ``t`` can be walked in storage order alongside ``like``."""
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but its parameter is on {like.device}")
    if t.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)} but its parameter has {tuple(like.shape)}")
    if t.is_contiguous() and like.is_contiguous():
        return
    if not (_dense(t) and _dense(like) and t.stride() == like.stride()):
        raise ValueError(
            f"{name} has strides {t.stride()} and its parameter {like.stride()}: fuser updates "
            "tensors in storage order, so both must be dense with the same strides "
            "(make the parameter contiguous, or its gradient match its layout)"
        )


def _dense(t: torch.Tensor) -> bool:
    if t.numel() <= 1:
        return True
    # Non-overlapping and dense: sorted strides form the packed strides of the sorted sizes.
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for s, n in dims:
        if s != expected:
            return False
        expected *= n
    return True
