"""Matrix functions of a step (``orthogonalize``): each tensor's matrix, written in bf16
by the phase that computes it, transformed by batched products, one launch per shape
group per product, then read by the later phases.

Each Newton–Schulz iteration is three launches per shape group: fuser's kernels for the
two symmetric products (``fuser.codegen.matrix``: ``A = X X^T``, then ``a I + b A + c A A``,
which also normalises on the first iteration), and ``torch.bmm`` for the general one.

Tensors of one 2-D shape share a stacked buffer ``[n, rows, cols]``; the pointer table's
``in`` slot of each tensor points at its matrix there, the ``out`` slot at its matrix in
the buffer that holds the result.

A DTensor sharded by rows of its 2-D view (``Shard(0)`` on one mesh dimension) has its
own shape group per shard group, of full matrices: each rank's kernel writes its rows in
place and the other rows are zeroed. The products are divided between the group's ranks
(``Split``): one ``reduce_scatter`` gives each rank the whole matrices of its share (each
row comes from one rank, so the sum is exact), each rank runs the products on its share
alone, and one ``all_gather`` brings every result to every rank, whose later phases read
their own rows of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fuser.cache import load_kernel
from fuser.codegen.matrix import GPU_MATRIX_TILES, INTERPRETER_MATRIX_TILES, render_gram, render_poly
from fuser.counters import count
from fuser.ir.optim import matrix_slot
from fuser.runtime.tables import view_2d


@dataclass
class ShapeGroup:
    """The matrices of one 2-D shape: ``x`` holds them stacked, ``y``, ``a``, ``b`` are
    the iteration's other operands (with ``split``, ``y`` receives the results, and the
    products run on the split's own stacks)."""

    x: torch.Tensor  # bf16 [n, rows, cols]
    y: torch.Tensor  # bf16 [n, rows, cols]
    a: torch.Tensor  # bf16 [n, k, k], k = min(rows, cols)
    b: torch.Tensor  # bf16 [n, k, k]
    tall: bool  # rows > cols: the products run on the transpose, as Muon's reference does
    kernels: tuple = ()  # (gram, poly of the first iteration, poly of the others)
    trace: torch.Tensor | None = None  # fp32 [n, ceil(k / BM)]: traces of A's diagonal tiles
    split: Split | None = None  # DTensor shards: the products divided between the ranks


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


def matrix_kernels(device, rows: int, cols: int) -> tuple:
    """(gram, first poly, poly) kernels for ``[rows, cols]`` matrices on ``device``."""
    tiles = GPU_MATRIX_TILES if torch.device(device).type == "cuda" else INTERPRETER_MATRIX_TILES
    m, k = min(rows, cols), max(rows, cols)
    # the products of A = X X^T are [m, m] by [m, m]: only m need fit the tiles
    even, even_square = tiles.even(m, k), tiles.even(m, m)
    return (
        load_kernel(render_gram(tiles, tall=rows > cols, even=even), device),
        load_kernel(render_poly(tiles, first=True, even=even_square), device),
        load_kernel(render_poly(tiles, first=False, even=even_square), device),
    )


def stack(n: int, rows: int, cols: int, device, kernels: tuple, work: bool = True) -> ShapeGroup:
    """Buffers of ``n`` matrices ``[rows, cols]``; ``work=False``: without the products'
    own operands (a stack whose products run on a ``Split``'s)."""
    k, n_work = min(rows, cols), n if work else 0
    kw = dict(dtype=torch.bfloat16, device=device)
    bm = dict(kernels[0].source.constexprs)["BM"]
    return ShapeGroup(
        torch.zeros(n, rows, cols, **kw),
        torch.zeros(n, rows, cols, **kw),
        torch.empty(n_work, k, k, **kw),
        torch.empty(n_work, k, k, **kw),
        rows > cols,
        kernels,
        torch.empty(n_work, -(-k // bm), dtype=torch.float32, device=device),
    )


def split_stack(group, spans: list[tuple[int, int]], rows: int, cols: int, device, kernels) -> ShapeGroup:
    """The stack of row-sharded matrices whose rows ``spans`` this rank holds, padded to a
    multiple of the shard group's size, with its ``Split``."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    n = -(-len(spans) // world) * world
    sg = stack(n, rows, cols, device, kernels, work=False)
    others = torch.ones(n, rows, 1, dtype=torch.bool)
    for j, (first, end) in enumerate(spans):
        others[j, first:end] = False
    sg.split = Split(group, others.to(device), stack(n // world, rows, cols, device, kernels))
    return sg


def build_matrices(reductions, shapes: list, device, shards=None) -> tuple[list[MatrixWork], list[dict]]:
    """Buffers for each matrix function of a launch group whose tensors have ``shapes``
    (of the whole tensors); ``shards[i]``, for a row-sharded DTensor, is (shard process
    group, this rank's rows [first, end) of its 2-D view), else ``None``. Returns the work
    of each function, and per tensor the tensors its ``in`` and ``out`` slots point at."""
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
                sg = stack(len(members), rows, cols, device, kernels)
                result = sg.x if r.args[0] % 2 == 0 else sg.y
            else:
                sg = split_stack(group, spans, rows, cols, device, kernels)
                result = sg.y
            for j, (i, (first, end)) in enumerate(zip(members, spans)):
                # this rank's rows (all of them for a whole tensor)
                slots[i][matrix_slot(index, "in")] = sg.x[j, first:end]
                slots[i][matrix_slot(index, "out")] = result[j, first:end]
            groups.append(sg)
        works.append(MatrixWork(index, r.phase, groups, r.args))
    return works, slots
