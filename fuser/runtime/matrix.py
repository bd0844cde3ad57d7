"""Matrix functions of a step (``orthogonalize``): each tensor's matrix, written in bf16
by the phase that computes it, transformed by batched products, one launch per shape
group per product, then read by the later phases.

Each Newton–Schulz iteration is three launches per shape group: fuser's kernels for the
two symmetric products (``fuser.codegen.matrix``: ``A = X X^T``, then ``a I + b A + c A A``,
which also normalises on the first iteration), and ``torch.bmm`` for the general one.

Tensors of one 2-D shape share a stacked buffer ``[n, rows, cols]``; the pointer table's
``in`` slot of each tensor points at its matrix there, the ``out`` slot at its matrix in
the buffer that holds the result.

The stacks are a per-step *workspace*, not state: each device's lie in one byte buffer
(``Workspace``) allocated when a step starts and freed when it ends, so between steps an
optimizer holds its states alone. The tables keep each matrix slot's offset into the
buffer and are rewritten (one device copy per launch group) whenever the buffer comes back
at another address. Under CUDA-graph capture the buffer is kept from then on: a graph
replays fixed addresses. Where the launch groups can run one after another (no global
reduction, no DTensor), a launch group is cut into slices whose stacks fit
``FUSER_MATRIX_WORKSPACE`` (``workspace_budget``, ``plan_slices``); the slices share the
buffer, which then holds the largest slice.

A DTensor sharded by rows of its 2-D view (``Shard(0)`` on one mesh dimension) has its
own shape group per shard group, of full matrices: each rank's kernel writes its rows in
place and the other rows are zeroed. The products are divided between the group's ranks
(``Split``): one ``reduce_scatter`` gives each rank the whole matrices of its share (each
row comes from one rank, so the sum is exact), each rank runs the products on its share
alone, and one ``all_gather`` brings every result to every rank, whose later phases read
their own rows of it.

``inv_root_newton`` (inverse p-th roots by coupled Newton iterations, products only) is the
matrix rules' ``inv_root_newton`` and ``fuser.optim.Shampoo``'s ``root_method="newton"``.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fuser.cache import load_kernel
from fuser.codegen.matrix import GPU_MATRIX_TILES, INTERPRETER_MATRIX_TILES, render_gram, render_poly
from fuser.counters import count
from fuser.ir.optim import matrix_slot
from fuser.runtime.tables import view_2d

# Where each buffer of the workspace starts: a multiple of the caching allocator's own
# alignment, so a stack's matrices lie as in an allocation of their own.
ALIGN = 512

WORKSPACE_ENV = "FUSER_MATRIX_WORKSPACE"
DEFAULT_WORKSPACE = 1 << 30  # bytes of stacks per slice (1 GiB)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})


def workspace_budget() -> int | None:
    """Bytes of Newton–Schulz stacks a slice of a launch group may hold, from
    ``FUSER_MATRIX_WORKSPACE``: a size (``1073741824``, ``512MiB``, ``2GB``; the default
    1 GiB) or ``unlimited`` (None: one slice per launch group). A slice holds at least
    one tensor, whatever the budget."""
    text = os.environ.get(WORKSPACE_ENV, "").strip()
    if not text:
        return DEFAULT_WORKSPACE
    if text.lower() == "unlimited":
        return None
    found = re.fullmatch(r"(\d+(?:\.\d*)?)\s*([a-zA-Z]*)", text)
    unit = found and _UNITS.get(found.group(2).lower())
    if not unit:
        raise ValueError(
            f"{WORKSPACE_ENV} must be a size in bytes (1073741824, 512MiB, 2GB: units B, KB, MB, GB, "
            f"TB, KiB, MiB, GiB, TiB) or 'unlimited', not {text!r}"
        )
    return int(float(found.group(1)) * unit)


# inv_root_newton's stopping rule, Meta's distributed Shampoo's (CoupledNewtonConfig): a
# matrix is done once the largest entry of |Y - I| is at most NEWTON_TOLERANCE; one that is
# not within it after NEWTON_MAX_ITERATIONS has failed (a singular M seldom gets there)...
NEWTON_TOLERANCE = 1e-6
NEWTON_MAX_ITERATIONS = 100
# ... and one whose X^k M has an entry more than this off the identity's has failed too.
NEWTON_ROOT_CHECK = 1.0


def inv_root_newton(m: torch.Tensor, k: int) -> torch.Tensor:
    """``M^(-1/k)`` of each symmetric positive-definite matrix of the stack ``m``, ``[n, d, d]``,
    by the coupled Newton iteration (Guo & Higham 2006), matrix products only. With
    ``z = (k + 1) / (2 ||M||_F)`` (``z M``'s eigenvalues lie in ``(0, (k + 1) / 2]``, where
    it converges), ``X = z^(1/k) I`` and ``Y = z M``, a step takes ``T = ((k + 1) I - Y) / k``,
    ``X <- X T`` and ``Y <- T^k Y``: ``Y = X^k M`` throughout, so as ``Y`` tends to ``I``,
    ``X`` tends to ``M^(-1/k)``. Each matrix stops once its own residual is within
    NEWTON_TOLERANCE (one host sync a step); one that is not within it after
    NEWTON_MAX_ITERATIONS, or is not finite, comes out NaN (a failure)."""
    eye = torch.eye(m.shape[-1], dtype=m.dtype, device=m.device)
    z = (k + 1) / (2 * torch.linalg.matrix_norm(m).reshape(-1, 1, 1))
    x, y = z ** (1.0 / k) * eye, z * m
    residual = (y - eye).abs().amax((-2, -1))
    for _ in range(NEWTON_MAX_ITERATIONS):
        todo = (residual > NEWTON_TOLERANCE).nonzero().flatten()  # (a NaN residual is done)
        if len(todo) == 0:
            break
        t = ((k + 1) * eye - y[todo]) / k
        x[todo] = x[todo] @ t
        y[todo] = torch.linalg.matrix_power(t, k) @ y[todo]
        residual[todo] = (y[todo] - eye).abs().amax((-2, -1))
    x = (x + x.mT) / 2  # (symmetric, as the rule language takes it: rounding made it slightly not)
    # Where M is singular, rounding lets Y reach I while X grows without bound: X^k M is checked
    # too (it stays within ~0.7 of I at condition 1e7 in fp32, and is >= 3 off for singular M).
    off = (torch.linalg.matrix_power(x, k) @ m - eye).abs().amax((-2, -1))
    ok = (residual <= NEWTON_TOLERANCE) & (off <= NEWTON_ROOT_CHECK)
    return torch.where(ok.reshape(-1, 1, 1), x, float("nan"))


def budget_slices(items: list, size: Callable[[object], int], budget: int | None) -> list[list]:
    """``items`` in consecutive slices of at most ``budget`` bytes, ``size(item)`` bytes each,
    at least one item a slice (``None``: all in one slice; no items: no slice)."""
    if budget is None:
        return [items] if items else []
    out, total = [], 0
    for item in items:
        n = size(item)
        if not out or total + n > budget:
            out.append([])
            total = 0
        out[-1].append(item)
        total += n
    return out


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def stack_layout(n: int, rows: int, cols: int, bm: int, work: bool = True) -> list[tuple]:
    """(dtype, shape, bytes) of the buffers ``x, y, a, b, trace`` of a stack of ``n``
    matrices ``[rows, cols]`` whose products take ``bm`` tiles; ``work=False``: without
    the products' own operands (a stack whose products run on a ``Split``'s)."""
    k, n_work = min(rows, cols), n if work else 0
    parts = [(torch.bfloat16, (n, rows, cols))] * 2 + [(torch.bfloat16, (n_work, k, k))] * 2
    parts.append((torch.float32, (n_work, -(-k // bm))))
    return [(dtype, shape, _aligned(dtype.itemsize * math.prod(shape))) for dtype, shape in parts]


def stack_bytes(n: int, rows: int, cols: int, bm: int, work: bool = True) -> int:
    """Bytes of the workspace a stack of ``n`` matrices ``[rows, cols]`` takes."""
    return sum(nbytes for _, _, nbytes in stack_layout(n, rows, cols, bm, work))


@dataclass
class ShapeGroup:
    """The matrices of one 2-D shape, their buffers at byte ``at`` of their device's
    workspace: ``x`` holds them stacked, ``y``, ``a``, ``b`` are the iteration's other
    operands (with ``split``, ``y`` receives the results, and the products run on the
    split's own stacks). The tensors are views of the workspace during a step
    (``bind``), None between steps."""

    n: int
    rows: int
    cols: int
    kernels: tuple  # (gram, poly of the first iteration, poly of the others)
    at: int  # byte offset of its buffers in the workspace
    work: bool = True  # False: the products run on split.mine's buffers
    split: Split | None = None  # DTensor shards: the products divided between the ranks
    x: torch.Tensor | None = None  # bf16 [n, rows, cols]
    y: torch.Tensor | None = None  # bf16 [n, rows, cols]
    a: torch.Tensor | None = None  # bf16 [n, k, k], k = min(rows, cols)
    b: torch.Tensor | None = None  # bf16 [n, k, k]
    trace: torch.Tensor | None = None  # fp32 [n, ceil(k / BM)]: traces of A's diagonal tiles

    @property
    def tall(self) -> bool:
        """rows > cols: the products run on the transpose, as Muon's reference does."""
        return self.rows > self.cols

    @functools.cached_property
    def layout(self) -> list[tuple]:
        """(dtype, shape, bytes) of ``x, y, a, b, trace`` (``stack_layout``)."""
        bm = dict(self.kernels[0].source.constexprs)["BM"]
        return stack_layout(self.n, self.rows, self.cols, bm, self.work)

    @property
    def end(self) -> int:
        """The byte after its buffers in the workspace."""
        return self.at + sum(nbytes for _, _, nbytes in self.layout)

    def offset(self, which: str, j: int, row: int) -> int:
        """Byte offset in the workspace of row ``row`` of matrix ``j`` of ``x`` or ``y``."""
        first = self.at + (0 if which == "x" else self.layout[0][2])
        return first + 2 * (j * self.rows + row) * self.cols

    def bind(self, buffer: torch.Tensor) -> None:
        """Point ``x, y, a, b, trace`` at their part of ``buffer`` (uint8, the workspace)."""
        at, views = self.at, []
        for dtype, shape, nbytes in self.layout:
            size = dtype.itemsize * math.prod(shape)
            views.append(buffer[at : at + size].view(dtype).view(shape))
            at += nbytes
        self.x, self.y, self.a, self.b, self.trace = views

    def unbind(self) -> None:
        self.x = self.y = self.a = self.b = self.trace = None


@dataclass
class Split:
    """The products of row-sharded DTensors' matrices, divided between the ranks of their
    shard group. The stack holds a multiple of the group's size (padded with zero
    matrices); each rank zeroes the rows it did not write (one launch), ``reduce_scatter``
    sums the stacks so that this rank holds the whole matrices of its share (``mine``),
    the products run on them, and ``all_gather`` brings every share's results into the
    stack's ``y`` on every rank."""

    group: object  # torch.distributed.ProcessGroup
    others: torch.Tensor  # bool [n, rows, 1]: rows of the stack this rank did not write
    mine: ShapeGroup  # this rank's share, n / world matrices

    def __call__(self, sg: ShapeGroup, steps: int, a: float, b: float, c: float, eps: float) -> None:
        import torch.distributed as dist

        sg.x.masked_fill_(self.others, 0.0)
        dist.reduce_scatter_tensor(self.mine.x, sg.x, group=self.group)
        newton_schulz(self.mine, steps, a, b, c, eps)
        result = self.mine.x if steps % 2 == 0 else self.mine.y
        dist.all_gather_into_tensor(sg.y, result, group=self.group)
        count("collectives", 2)


@dataclass
class MatrixWork:
    """One matrix function over one launch group: its shape groups and keywords."""

    index: int  # the reduction's index in the plan
    phase: int  # the phase that writes its argument
    groups: list[ShapeGroup]
    args: tuple  # orthogonalize: steps, a, b, c, eps

    def __call__(self) -> None:
        for sg in self.groups:
            if sg.split is not None:
                sg.split(sg, *self.args)
            else:
                newton_schulz(sg, *self.args)


def shape_groups(works: list[MatrixWork]) -> list[ShapeGroup]:
    """Every stack of ``works`` with buffers in the workspace (a split's share too)."""
    out = []
    for w in works:
        for sg in w.groups:
            out += [sg] if sg.split is None else [sg, sg.split.mine]
    return out


def extent(works: list[MatrixWork], at: int = 0) -> int:
    """The byte after the last buffer of ``works`` (``at`` when they have none)."""
    return max([at, *(sg.end for sg in shape_groups(works))])


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class Workspace:
    """One device's matrix buffers: ``nbytes`` allocated when a step starts (``acquire``)
    and freed when it ends (``release``). ``tables`` are (pointer table, its matrix
    columns, their byte offsets into the workspace) of each launch group on the device,
    rewritten by one device copy each when the buffer's address moved. Under CUDA-graph
    capture the buffer is kept from then on (``persistent``): a graph replays fixed
    addresses."""

    def __init__(self, device, nbytes: int, groups: list[ShapeGroup], tables: list[tuple] = ()):
        self.device, self.nbytes = torch.device(device), nbytes
        self.groups, self.tables = groups, list(tables)
        self.base = None  # the buffer's address the tables hold
        self.buffer: torch.Tensor | None = None
        self.persistent = False

    def acquire(self) -> None:
        if capturing(self.device):
            self.persistent = True
        if self.buffer is None:
            self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        base = self.buffer.data_ptr()
        if base != self.base:
            for ptrs, columns, offsets in self.tables:
                ptrs.index_copy_(1, columns, offsets + base)
            self.base = base
        for sg in self.groups:
            sg.bind(self.buffer)

    def release(self) -> None:
        for sg in self.groups:
            sg.unbind()
        if not self.persistent:
            self.buffer = None


def newton_schulz(sg: ShapeGroup, steps: int, a: float, b: float, c: float, eps: float) -> None:
    """Muon's quintic iteration on every matrix of ``sg`` at once: ``X /= ||X||_F + eps``,
    then ``steps`` times ``A = X X^T; B = b A + c A A; X = a X + B X`` (``X^T X`` and
    ``X B`` for tall matrices, the same iteration on the transpose). ``a X`` is folded into
    ``B``, and the normalisation into the first ``B`` (``||X||_F^2`` is the trace of ``A``,
    which the first kernel sums in fp32 per diagonal tile).
    The result is in ``sg.x`` for an even number of steps, else in ``sg.y``."""
    x, y = sg.x, sg.y
    n, m = sg.a.shape[0], sg.a.shape[1]
    if n == 0 or x.numel() == 0:
        return
    gram, poly_first, poly = sg.kernels
    t = sg.trace.shape[1]
    grid = (t * (t + 1) // 2, n)
    k = x.shape[1] if sg.tall else x.shape[2]
    for step in range(steps):
        gram(grid, x, sg.a, sg.trace, m, k)
        (poly_first if step == 0 else poly)(grid, sg.a, sg.b, sg.trace, m, a, b, c, eps)
        if sg.tall:
            torch.bmm(x, sg.b, out=y)
        else:
            torch.bmm(sg.b, x, out=y)
        x, y = y, x
    count("launches", steps)  # the kernels count their own


def matrix_tiles(device):
    """The matrix kernels' tiles on ``device``."""
    return GPU_MATRIX_TILES if torch.device(device).type == "cuda" else INTERPRETER_MATRIX_TILES


def matrix_kernels(device, rows: int, cols: int) -> tuple:
    """(gram, first poly, poly) kernels for ``[rows, cols]`` matrices on ``device``."""
    tiles = matrix_tiles(device)
    m, k = min(rows, cols), max(rows, cols)
    # the products of A = X X^T are [m, m] by [m, m]: only m need fit the tiles
    even, even_square = tiles.even(m, k), tiles.even(m, m)
    return (
        load_kernel(render_gram(tiles, tall=rows > cols, even=even), device),
        load_kernel(render_poly(tiles, first=True, even=even_square), device),
        load_kernel(render_poly(tiles, first=False, even=even_square), device),
    )


def plan_slices(shapes: list[list[tuple[int, int]]], budget: int | None, device) -> list[list[int]]:
    """Slices of a launch group's tensors, ``shapes[i]`` the (rows, cols) of tensor ``i``'s
    matrices: each slice's stacks take at most ``budget`` bytes of workspace, or one tensor
    alone where that tensor's take more. Tensors of one shape go together, so each slice
    batches as many of a shape as fit. One slice, in the tensors' order, where all fit."""
    bm = matrix_tiles(device).bm

    def add(i: int, counts: dict) -> int:
        """Bytes tensor ``i`` adds to a slice whose stacks hold ``counts`` (updated)."""
        more = 0
        for shape in shapes[i]:
            n = counts.get(shape, 0)
            more += stack_bytes(n + 1, *shape, bm) - stack_bytes(n, *shape, bm)
            counts[shape] = n + 1
        return more

    slices, counts, used = [[]], {}, 0
    for i in sorted(range(len(shapes)), key=lambda i: shapes[i][:1]):
        trial = dict(counts)
        more = add(i, trial)
        if budget is not None and slices[-1] and used + more > budget:
            slices.append([])
            trial, used = {}, 0
            more = add(i, trial)
        slices[-1].append(i)
        counts, used = trial, used + more
    return slices if len(slices) > 1 else [list(range(len(shapes)))]


def build_matrices(
    reductions, shapes: list, device, shards=None, at: int = 0
) -> tuple[list[MatrixWork], list[dict]]:
    """The stacks of each matrix function of a launch group whose tensors have ``shapes``
    (of the whole tensors), laid out in the workspace from byte ``at`` (``extent`` gives
    the end); ``shards[i]``, for a row-sharded DTensor, is (shard process group, this
    rank's rows [first, end) of its 2-D view), else ``None``. Returns the work of each
    function, and per tensor the byte offsets in the workspace of what its ``in`` and
    ``out`` slots point at."""
    works, slots = [], [{} for _ in shapes]
    shards = shards or [None] * len(shapes)
    for index, r in enumerate(reductions):
        if not r.matrix:
            continue
        by_shape: dict[tuple, list[int]] = {}
        for i, shape in enumerate(shapes):
            group = None if shards[i] is None else shards[i][0]
            by_shape.setdefault((view_2d(shape), group), []).append(i)
        groups = []
        for ((rows, cols), group), members in by_shape.items():
            kernels = matrix_kernels(device, rows, cols)
            spans = [(0, rows) if shards[i] is None else shards[i][1] for i in members]
            if group is None:
                sg = ShapeGroup(len(members), rows, cols, kernels, at)
                result = "x" if r.args[0] % 2 == 0 else "y"
            else:
                sg = split_stack(group, spans, rows, cols, device, kernels, at)
                result = "y"
            at = extent([MatrixWork(index, r.phase, [sg], r.args)], at)
            for j, (i, (first, _)) in enumerate(zip(members, spans)):
                # this rank's rows (all of them for a whole tensor)
                slots[i][matrix_slot(index, "in")] = sg.offset("x", j, first)
                slots[i][matrix_slot(index, "out")] = sg.offset(result, j, first)
            groups.append(sg)
        works.append(MatrixWork(index, r.phase, groups, r.args))
    return works, slots


def split_stack(group, spans: list[tuple[int, int]], rows, cols, device, kernels, at: int) -> ShapeGroup:
    """The stack of row-sharded matrices whose rows ``spans`` this rank holds, padded to a
    multiple of the shard group's size, with its ``Split``, at byte ``at`` of the
    workspace (its share's stack after it)."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    n = -(-len(spans) // world) * world
    sg = ShapeGroup(n, rows, cols, kernels, at, work=False)
    others = torch.ones(n, rows, 1, dtype=torch.bool)
    for j, (first, end) in enumerate(spans):
        others[j, first:end] = False
    sg.split = Split(group, others.to(device), ShapeGroup(n // world, rows, cols, kernels, sg.end))
    return sg
