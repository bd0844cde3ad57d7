"""The *lean* schedule: the loss epilogue inside the logits matmul, nothing ``[T, V]`` in memory.

Forward: ``z[y]`` per token (a gathered dot product, fp32), then one sweep kernel per
reduction pass of the rule (``fuser.codegen.loss_matmul``): tiles of logits computed in
fp32 registers and reduced there. Each program covers BM tokens and one contiguous share of
the vocabulary; the shares' partials are combined here in a fixed order (logsumexp, sum,
or max keeping the first column), so the result does not depend on scheduling. The loss
kernel of the staged sequence then reads the combined ``red`` alone.

For a rule whose gradient has the scaled schedule's form (one logsumexp and sums:
``fuser.codegen.loss_matmul.scaled_exp_form``) and whose pass calls no function but ``exp``
and ``approx_tanh`` (``tile_sums_pay``), forward runs that schedule's kernels instead,
without its ``E`` (``TileSums``): ``z[y]`` and the sums linear in ``z`` by its per-call kernel,
then per block of ``TILE_SUMS_ROWS`` tokens the scaled matmul kernel storing only each tile's
partials (with ``Tiles.tma``, persistent programs through tensor descriptors) and the
per-token kernel that combines them in tile order into ``red`` (H200, the kernel alone over
every token, against the sweep: gist 11.79 -> 11.03 ms, llama8b 14.90 -> 12.30, T, H =
16384, 2048: 16.06 -> 13.17; the whole forward 12.86 -> 11.30, 15.90 -> 12.79, 17.07 ->
13.42; benchmarks/NOTES.md).

Backward (vocabulary slices, as ``Staged.backward_vocab``): the gradient kernel recomputes
each tile of a slice's logits (one program per tile, in groups of row blocks that share
weight tiles; with ``Tiles.tma``, one persistent program per processor taking the tiles in
that order, through tensor descriptors), forms ``scale * d loss / d logits`` in fp32 and
stores it rounded once into a ``[T, slice]`` buffer, which the two gradient matmuls read:
``grad_hidden`` accumulated in fp32 over slices, ``grad_weight`` written once per slice (or
added into ``weight.main_grad``). The kernel also writes each token's target-column residue
(its fp32 value less the rounding), which ``residue.SliceTerms`` adds to both in fp32.

Vocabulary-parallel (``Fused.shard``): each rank runs the same kernels over its slice of
the vocabulary rows; ``z[y]`` is summed across the group and each sweep's partials are
gathered (one collective each) and combined in rank order, then share order, which is the
vocabulary's order; ``grad_hidden`` is summed across the group, ``grad_weight`` stays local.

Ignored tokens: ``CompiledLoss`` passes only the rows whose target is not
``ignore_index``, so every matmul skips them.
"""

from __future__ import annotations

import torch

from fuser.cache import load_kernel
from fuser.codegen.loss_matmul import PREPARE_ROWS, TOKEN_BLOCK
from fuser.runtime.loss.chunked import (
    MIB,
    accumulate_mm,
    accumulate_weight_grad,
    logits_buffer,
    processor_count,
)
from fuser.runtime.loss.residue import SliceTerms

# Bytes of the fp32 temporaries of the gathered z[y] dot product.
ZY_BUDGET = 64 * MIB
# Tokens per launch of the tile-sums kernel: 16 MiB of partials at V = 128256, within 1% of
# larger blocks (benchmarks/NOTES.md, "The lean forward through the tile-sums kernel").
TILE_SUMS_ROWS = 4096


def target_logits(x, weight, bias, target, out) -> None:
    """``out[t] = x[t] . weight[target[t]] (+ bias)`` in fp32 for targets in range (0 elsewhere)."""
    n, vocab = x.shape[0], weight.shape[0]
    if vocab == 0:
        out.zero_()
        return
    rows = max(1, ZY_BUDGET // max(8 * x.shape[1], 1))
    for s in range(0, n, rows):
        e = min(s + rows, n)
        y = target[s:e]
        ok = (y >= 0) & (y < vocab)
        ys = torch.where(ok, y, 0)
        v = (x[s:e].float() * weight.index_select(0, ys).float()).sum(1)
        if bias is not None:
            v += bias.index_select(0, ys).float()
        out[s:e] = torch.where(ok, v, 0.0)


def shares(tiles_m: int, tiles_n: int, processors: int) -> int:
    """How many shares of the vocabulary each block of tokens is split into: the one (of 1
    to 8, at most ``tiles_n``) whose programs fill the processors' last wave best; ties
    to the fewest."""
    best, best_fill = 1, 0.0
    for n in range(1, min(8, max(tiles_n, 1)) + 1):
        total = tiles_m * n
        fill = total / (-(-total // processors) * processors)
        if fill > best_fill + 0.02:
            best, best_fill = n, fill
    return best


class TileSums:
    """The lean forward of a rule with a scaled-exponential form: the scaled matmul kernel
    without ``E`` (``kernel``: ``render_loss_scaled(store_e=False)``, block shape ``tiles``),
    the scaled schedule's ``prepare`` and ``tokens`` kernels and its ``TokenValues``."""

    def __init__(self, sources, values, tiles, device):
        kernel, prepare, tokens = sources
        self.kernel = load_kernel(kernel, device)
        self.prepare = load_kernel(prepare, device)
        self.tokens = load_kernel(tokens, device)
        self.values, self.tiles = values, tiles


class Fused:
    """The lean schedule's kernels for one (dtype, tiles, bias) and what a call needs;
    ``tiles``: the block shapes of the sweeps and of the gradient kernel; ``tile_sums``: a
    ``TileSums`` that takes the sweeps' place on one device without a bias."""

    schedule = "fused"

    def __init__(self, kernels, layout, tiles, device, hyper, ignore_index, cols, tile_sums=None):
        sweeps, grad, final = kernels
        self.sweeps = [load_kernel(s, device) for s in sweeps]
        self.grad_kernel = load_kernel(grad, device)
        self.final = load_kernel(final, device)
        self.layout = layout
        self.tiles, self.grad_tiles = tiles
        self.hyper = hyper
        self.ignore_index = int(ignore_index)
        self.cols = cols  # vocabulary rows per backward slice
        self.processors = processor_count(device)
        self.group, self.col_offset, self.vocab_total, self.widest = None, 0, None, None
        self.residue = None  # a Residue where the gradient kernel writes the target's residue
        self.tile_sums: TileSums | None = tile_sums

    def shard(self, group, sizes: tuple[int, ...], rank: int) -> None:
        """Run over rank ``rank``'s rows of a vocabulary split over ``group`` in rank order
        (``sizes``: every rank's row count): ``z[y]`` and each sweep's partials are combined
        across the ranks (one collective each), ``grad_hidden`` is summed."""
        self.group, self.col_offset, self.vocab_total = group, sum(sizes[:rank]), sum(sizes)
        self.widest = max(sizes)

    def _gather(self, part: torch.Tensor) -> torch.Tensor:
        """Every rank's ``part`` (``[shares, rows, width]``), in rank order along dim 0."""
        if self.group is None:
            return part
        import torch.distributed as dist

        world = dist.get_world_size(self.group)
        out = torch.empty((world,) + tuple(part.shape), dtype=part.dtype, device=part.device)
        dist.all_gather(list(out.unbind(0)), part.contiguous(), group=self.group)
        return out.flatten(0, 1)

    def _all_reduce(self, t: torch.Tensor) -> None:
        if self.group is not None:
            import torch.distributed as dist

            dist.all_reduce(t, group=self.group)

    def _common(self, x, weight, bias, target):
        return (x, weight, bias if bias is not None else weight, target)

    def forward(self, x, weight, bias, target, loss_tok) -> torch.Tensor:
        """Per-token losses into ``loss_tok``; returns ``red`` (per-token values) for
        ``backward``."""
        n, vocab = x.shape[0], weight.shape[0]
        total = vocab if self.vocab_total is None else self.vocab_total
        red = torch.zeros(n, self.layout.red_width, dtype=torch.float32, device=x.device)
        if n == 0:
            return red
        if self.tile_sums is not None and self.group is None and bias is None:
            self._tile_sums(x, weight, target, red)
        else:
            self._sweeps(x, weight, bias, target, red)
        rest = (self.hyper, vocab, self.ignore_index, 0, red, red, self.col_offset, total)
        self.final((n,), x, 0, target, loss_tok, loss_tok, loss_tok, 0, *rest)
        return red

    def _sweeps(self, x, weight, bias, target, red) -> None:
        """``red`` by the sweep kernels, one per reduction pass, their shares' partials
        combined in order (across the group's ranks where there is one)."""
        n, vocab = x.shape[0], weight.shape[0]
        total = vocab if self.vocab_total is None else self.vocab_total
        zy = torch.empty(n, dtype=torch.float32, device=x.device)
        target_logits(x, weight, bias, target - self.col_offset, zy)
        self._all_reduce(zy)  # (only the target's owner holds z[y])
        red[:, 0] = zy
        tiles_m = -(-n // self.tiles.bm)
        widest = vocab if self.widest is None else self.widest  # the same shares on every rank
        split = shares(tiles_m, -(-widest // self.tiles.bn), self.processors)
        tail = (self.hyper, n, x.shape[1], vocab, self.col_offset, total, self.ignore_index)
        for stage, kernel in enumerate(self.sweeps):
            part = torch.empty(split, n, self.layout.part_widths[stage], dtype=torch.float32, device=x.device)
            if vocab:
                kernel((tiles_m, split), *self._common(x, weight, bias, target), red, part, *tail)
            else:  # a rank with no rows of the vocabulary: partials of nothing
                self._empty_partials(stage, part)
            self._combine(stage, self._gather(part), red)

    def _tile_sums(self, x, weight, target, red) -> None:
        """``red`` (``z[y]``, then every reduction) by the ``TileSums`` kernels, in blocks of
        ``TILE_SUMS_ROWS`` tokens."""
        ts = self.tile_sums
        (n, hid), vocab = x.shape, weight.shape[0]
        ref = torch.empty(n, dtype=torch.float32, device=x.device)  # (the tokens kernel reads it)
        wsum = weight.sum(0, dtype=torch.float32) if ts.values.linear else None
        ts.prepare(
            (-(-n // PREPARE_ROWS),), x, weight, ref if wsum is None else wsum, target, red, ref, self.hyper,
            n, hid, vocab,
        )  # fmt: skip
        rows = min(TILE_SUMS_ROWS, n)
        tiles_n, width = -(-vocab // ts.tiles.bn), ts.values.part_width
        part_buf = torch.empty(tiles_n * rows * width, dtype=torch.float32, device=x.device)
        coef = torch.empty(rows, 3, dtype=torch.float32, device=x.device)  # (written, not read)
        one = torch.ones(1, dtype=torch.float32, device=x.device)
        for s in range(0, n, rows):
            e = min(s + rows, n)
            part = part_buf[: tiles_n * (e - s) * width].view(tiles_n, e - s, width)
            grid = (-(-(e - s) // ts.tiles.bm) * tiles_n,)
            if ts.tiles.tma:  # persistent programs, one per processor
                grid = (min(grid[0], self.processors),)
            ts.kernel(
                grid, x[s:e], weight, weight, target[s:e], red[s:e], part, self.hyper,
                e - s, hid, vocab, 0, vocab, self.ignore_index,
            )  # fmt: skip
            ts.tokens(
                (-(-(e - s) // TOKEN_BLOCK),), part, tiles_n, e - s, red[s:e], ref[s:e], target[s:e],
                coef, one, self.hyper, vocab, self.ignore_index,
            )  # fmt: skip

    def _empty_partials(self, stage: int, part: torch.Tensor) -> None:
        for _, op, c in self.layout.part_cols[stage]:
            part[:, :, c] = 0.0 if op == "sum" else float("-inf")
            if op == "max":
                part[:, :, c + 1] = 0.0

    def _combine(self, stage: int, part: torch.Tensor, red: torch.Tensor) -> None:
        """The shares' partials of sweep ``stage`` into ``red``, in share order."""
        for i, op, c in self.layout.part_cols[stage]:
            rc = self.layout.red_cols[i]
            vals = part[:, :, c]
            if op == "sum":
                red[:, rc] = vals.sum(0)
            elif op == "logsumexp":
                red[:, rc] = torch.logsumexp(vals, 0)
            else:
                best, share = vals.max(0)  # the first share holding the maximum
                red[:, rc] = best
                red[:, rc + 1] = part[:, :, c + 1].gather(0, share[None])[0]

    def backward(self, red, x, weight, bias, target, scale, *, need_x, need_w, need_b, main_grad):
        """``(grad_hidden, grad_weight, grad_bias)`` as ``Staged.backward_vocab`` returns
        them, from what ``forward`` returned."""
        n, vocab = x.shape[0], weight.shape[0]
        gx = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if need_x else None
        gw = (
            torch.empty(weight.shape, dtype=weight.dtype, device=x.device)
            if need_w and not main_grad
            else None
        )
        gb = torch.zeros(vocab, dtype=torch.float32, device=x.device) if need_b else None
        if n and vocab:
            self._slices(red, x, weight, bias, target, scale, gx, gw, gb, main_grad and need_w)
        elif gw is not None:
            gw.zero_()
        if gx is not None:
            self._all_reduce(gx)  # every rank's columns' share of grad_hidden
        return _as_input(gx, x), gw, gb

    def _slices(self, red, x, weight, bias, target, scale, gx, gw, gb, main_grad) -> None:
        """The backward over slices of this device's vocabulary rows."""
        n, vocab = x.shape[0], weight.shape[0]
        total = vocab if self.vocab_total is None else self.vocab_total
        cols = min(self.cols, vocab)
        buf = logits_buffer(n, cols, x)
        scale_stride = 0 if scale.numel() == 1 else 1
        tiles_m = -(-n // self.grad_tiles.bm)
        terms = self.residue and SliceTerms(self.residue, x, target, self.col_offset, vocab, cols)
        resid = terms.resid if terms else scale
        for v0 in range(0, vocab, cols):
            v1 = min(v0 + cols, vocab)
            dz, w = buf[:, : v1 - v0], weight[v0:v1]
            b = bias[v0:v1] if bias is not None else w
            grid = (tiles_m * -(-(v1 - v0) // self.grad_tiles.bn),)
            if self.grad_tiles.tma:  # persistent programs, one per processor
                grid = (min(grid[0], self.processors),)
            self.grad_kernel(
                grid, x, w, b, target, red, scale, scale_stride, dz, dz.stride(0), resid, self.hyper,
                n, x.shape[1], v1 - v0, self.col_offset + v0, total, self.ignore_index,
            )  # fmt: skip
            if gx is not None:
                accumulate_mm(gx, dz, w)
            if main_grad:
                accumulate_weight_grad(weight.main_grad[v0:v1], dz, x)
            elif gw is not None and terms:
                terms.weight_slice(gw, v0, v1, dz, x)
            elif gw is not None:
                torch.mm(dz.t(), x, out=gw[v0:v1])
            if gb is not None:
                torch.sum(dz, 0, dtype=torch.float32, out=gb[v0:v1])
        if terms:
            terms.finish(x, weight, gx, weight.main_grad if main_grad else None, gb)


def _as_input(gx, x):
    return gx if gx is None or gx.dtype == x.dtype else gx.to(x.dtype)


def slice_cols(n_tokens: int, hidden: int, element_size: int, bn: int, budget: int) -> int:
    """Vocabulary rows per backward slice: the ``[T, slice]`` gradient buffer and the fp32
    ``[T, H]`` hidden gradient within ``budget``; a multiple of ``bn``, at least ``bn``."""
    room = budget - 4 * n_tokens * hidden
    cols = room // max(n_tokens * element_size, 1)
    return int(max(bn, cols // bn * bn))
