"""The target column's rounding residue, and rows of per-token terms added without atomics.

The schedules that store ``d loss / d logits`` in 16 bits (the row kernel's chunks, the
staged ``whole`` and ``vocab`` schedules, the lean gradient kernel) round the target's
column like every other. That column carries the target term (``p - 1`` for
cross-entropy), which every token of one target adds to the same row of ``grad_weight``:
where a token's gradient scale is not a power of two (a mean over 27 live tokens), the
rounding errors of one row agree in sign and add up instead of averaging out (1 token in
7 ignored at 32768 x 768 x 128256: ``main_grad`` 2.25e-3 off float64 where the rest of it
is ~1e-6). So the kernels also write, per token, ``resid = d - rounded(d)`` at the target's
column, in fp32 (``fuser.codegen.loss.has_residue``), and this module adds
``resid[t] * W[y_t]`` to ``grad_hidden``, ``resid[t] * hidden[t]`` to row ``y_t`` of
``grad_weight`` (in fp32, before its one rounding) and ``resid[t]`` to ``grad_bias[y_t]``:
the target's column then enters every gradient as if it had been stored in fp32.

``grad_weight``'s rows come from ``target_rows_pieces`` / ``target_rows_runs``
(``fuser.codegen.loss_matmul.render_target_rows``): the tokens sorted by target once per
call (``KeyRuns``), each run of one target summed in token order, so the result does not
depend on scheduling.
"""

from __future__ import annotations

from functools import cached_property

import torch

from fuser.cache import load_kernel
from fuser.codegen.loss_matmul import TERM_BLOCK
from fuser.codegen.source import KernelSource
from fuser.runtime.loss.chunked import BLOCK_BUDGET, HostValue, processor_count, product_fp32


class KeyRuns:
    """Tokens sorted by key (``n_keys`` for a token without one; ties in token order) and
    the runs of one key: what the target-row kernels read. ``piece``: the kernels' ``L``;
    ``count``: copy the count of pieces for the host now, for ``count_pieces``."""

    def __init__(self, keys: torch.Tensor, n_keys: int, piece: int, count: bool = False):
        n = keys.shape[0]
        self.n_keys = n_keys
        self.key, self.order = torch.sort(keys, stable=True)
        self.starts = torch.searchsorted(self.key, self.key)
        self.ends = torch.searchsorted(self.key, self.key, right=True)
        # a run longer than `piece` is summed in pieces: every piece-th position starts one,
        # its sum in row `slot` of `pieces` (at most 2 n / piece of them)
        pos = torch.arange(n, device=keys.device)
        long_piece = (self.ends - self.starts > piece) & ((pos - self.starts) % piece == 0)
        self.slot = torch.cumsum(long_piece & (self.key < n_keys), 0) - 1
        self.pieces_rows = 2 * -(-n // piece)
        self.counted = False
        self._last = HostValue(self.slot[-1]) if n and count else None  # (count_pieces reads it)

    def count_pieces(self) -> None:
        """``pieces_rows`` as the pieces there are, at least 1, in place of the bound (the
        bound takes 4 MiB at 8192 tokens of 4096, where most calls have no run that long):
        a host read the first time; of the count copied when the runs were found where
        ``count`` asked for it, so that it waits for that point of the stream, not for the
        work queued since."""
        if not self.counted:
            if self._last is not None:
                last = self._last.read()
            else:
                last = int(self.slot[-1]) if self.slot.numel() else -1
            self.pieces_rows = max(1, last + 1)
            self.counted = True

    def positions(self, edges: list[int]) -> list[int]:
        """The first sorted position whose key is at least each of ``edges`` (one host read)."""
        at = torch.tensor(edges, dtype=self.key.dtype, device=self.key.device)
        return torch.searchsorted(self.key, at).tolist()


class TargetRows:
    """``out[key[t]] += c[t] * x[t]`` for every token ``t`` with a key, ``out`` fp32: the two
    kernels of ``render_target_rows``, ``c[t]`` read from ``coef`` where their ``CS``, ``CC``
    say."""

    def __init__(self, pieces: KernelSource, runs: KernelSource, device: torch.device):
        self.pieces, self.run_sums = load_kernel(pieces, device), load_kernel(runs, device)
        self.piece = dict(pieces.constexprs)["L"]

    def runs(self, keys: torch.Tensor, n_keys: int, count: bool = False) -> KeyRuns:
        return KeyRuns(keys, n_keys, self.piece, count)

    def add(self, out, x, coef, runs: KeyRuns, lo: int = 0, hi: int | None = None, key0: int = 0) -> None:
        """The rows of the tokens at sorted positions ``[lo, hi)`` (every key of them whole),
        into ``out`` whose first row is key ``key0``."""
        n, hid = x.shape
        hi = n if hi is None else hi
        if hi <= lo:
            return
        pieces = torch.empty(runs.pieces_rows, hid, dtype=torch.float32, device=x.device)
        grid = (hi - lo, -(-hid // TERM_BLOCK))
        args = (runs.starts, runs.ends, runs.slot, pieces, out, lo, key0, hid, runs.n_keys)
        self.pieces(grid, x, coef, runs.key, runs.order, *args)
        self.run_sums(grid, runs.key, *args)


class WeightGrad:
    """Slices of a 16-bit ``grad_weight``, ``dz.T @ x`` with their residue rows, rounded once:
    the kernels of ``render_weight_grad``. The target-row kernels write each target's
    residue row into ``grad_weight``; the weight-gradient kernel (persistent programs,
    tensor descriptors) adds the rows ``flag`` marks to its product."""

    def __init__(self, sources, device: torch.device):
        pieces, runs, kernel = sources
        self.rows = TargetRows(pieces, runs, device)
        self.kernel = load_kernel(kernel, device)
        c = dict(kernel.constexprs)
        self.bm, self.bn = c["BM"], c["BN"]
        self.processors = processor_count(device)

    def fits(self, gw, dz, x) -> bool:
        """Whether tensor descriptors can address the three (16-byte aligned, rows of 16-byte
        multiples, the last dimension contiguous) and the slice has tiles for every
        processor twice (fewer ran slower than cuBLAS's products through fp32 blocks:
        T=32768, H=768, 2304 rows, 54 tiles: 0.49 against 0.26 ms; H100)."""
        es = x.element_size()
        tiles = -(-gw.shape[0] // self.bm) * -(-gw.shape[1] // self.bn)
        return (
            all(
                t.data_ptr() % 16 == 0 and t.stride(1) == 1 and t.stride(0) * es % 16 == 0
                for t in (gw, dz, x)
            )
            and gw.stride(0) == x.stride(0) == x.shape[1]
            and tiles >= 2 * self.processors
        )

    @staticmethod
    def flags(runs: KeyRuns) -> torch.Tensor:
        """``[n_keys + 1]`` int8: 1 at every key some token has (the last: no key)."""
        flag = torch.zeros(runs.n_keys + 1, dtype=torch.int8, device=runs.key.device)
        return flag.index_fill_(0, runs.key, 1)

    def __call__(self, gw, dz, x, resid, runs: KeyRuns, flag, key0: int, lo: int = 0, hi: int | None = None):
        """``gw = dz.T @ x`` plus ``resid[t] * x[t]`` in row ``y_t - key0`` for the tokens at
        sorted positions ``[lo, hi)``: those whose target is one of gw's rows."""
        (n_cols, hid), n_tok = gw.shape, x.shape[0]
        runs.count_pieces()  # (the whole schedule's peak, at llama8b's 3 GiB, holds its pieces)
        self.rows.add(gw, x, resid, runs, lo, hi, key0)
        grid = (min(-(-n_cols // self.bm) * -(-hid // self.bn), self.processors),)
        self.kernel(grid, dz, dz.stride(0), x, gw, flag, key0, n_tok, hid, n_cols)


class Residue:
    """What the gradients need of the residues a call's kernels wrote (``buffer``: one fp32
    value per token, 0 where none is written): ``TargetRows`` into fp32 rows (``main_grad``,
    fp32 buffers and blocks, ``grad_bias``), the gather kernel for ``grad_hidden`` and, where
    given, the kernel that writes a 16-bit ``grad_weight`` with its rows (``WeightGrad``)."""

    def __init__(self, sources, device: torch.device, ignore_index: int, weight_grad=None):
        pieces, runs, gather = sources  # (CompiledLoss.residue_sources)
        self.rows = TargetRows(pieces, runs, device)
        self.gather = load_kernel(gather, device)
        self._weight_grad = weight_grad  # (CompiledLoss.weight_grad_sources; loaded when used)
        self.device = device
        self.ignore_index = int(ignore_index)

    @cached_property
    def weight_grad(self) -> WeightGrad | None:
        return WeightGrad(self._weight_grad, self.device) if self._weight_grad else None

    @staticmethod
    def buffer(n: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.float32, device=device)

    def local(self, target, col_offset: int, n_cols: int) -> torch.Tensor:
        """Each token's target as a row of this call's ``n_cols`` weight rows (from
        ``col_offset``), ``n_cols`` where it has none there."""
        y = target - col_offset
        ok = (target != self.ignore_index) & (y >= 0) & (y < n_cols)
        return torch.where(ok, y, n_cols)

    def runs(self, target, col_offset: int, n_cols: int, count: bool = False) -> KeyRuns:
        return self.rows.runs(self.local(target, col_offset, n_cols), n_cols, count)

    def hidden(self, resid, weight, target, col_offset: int, out: torch.Tensor) -> None:
        """``resid[t] * W[y_t]`` added to the fp32 ``out`` (``[T, H]``)."""
        n, hid = out.shape
        if n:
            key = self.local(target, col_offset, weight.shape[0])
            self.gather((n, -(-hid // TERM_BLOCK)), weight, resid, key, out, hid, weight.shape[0])

    def weight_rows(self, out, x, resid, runs: KeyRuns, lo: int = 0, hi: int | None = None, key0: int = 0):
        """``resid[t] * x[t]`` added to row ``y_t - key0`` of ``out``, for the tokens at sorted
        positions ``[lo, hi)``."""
        self.rows.add(out, x, resid, runs, lo, hi, key0)

    def bias_rows(self, gb, resid, runs: KeyRuns, dtype: torch.dtype) -> None:
        """``resid[t]`` added to ``grad_bias[y_t]`` (fp32); ``dtype``: the inputs'."""
        ones = torch.ones(resid.shape[0], 1, dtype=dtype, device=resid.device)
        self.rows.add(gb.view(-1, 1), ones, resid, runs)


class SliceTerms:
    """The residue's terms in a backward over slices of ``cols`` of this call's ``n_cols``
    weight rows (the lean and ``vocab`` schedules; ``whole``: one slice): ``resid`` for the
    kernels (each slice's launch writes the tokens whose target it holds); ``weight_slice``
    writes a slice of a 16-bit ``grad_weight``; ``finish`` adds the rest once every slice
    has run."""

    def __init__(self, residue: Residue, x, target, col_offset: int, n_cols: int, cols: int):
        self.residue = residue
        self.resid = residue.buffer(x.shape[0], x.device)
        self.target, self.col_offset = target, col_offset
        self.runs = residue.runs(target, col_offset, n_cols, count=True)  # (WeightGrad counts)
        self.rows = max(1, BLOCK_BUDGET // max(4 * x.shape[1], 1))
        self.n_cols, self.cols = n_cols, cols
        self.at = self.flag = None

    def _positions(self) -> dict:
        """The first sorted position of every slice's and every block's first key (one host
        read, the first time)."""
        if self.at is None:
            n_cols, cols = self.n_cols, self.cols
            edges = [a for s in range(0, n_cols, cols) for a in range(s, min(s + cols, n_cols), self.rows)]
            edges += [s for s in range(0, n_cols, cols)] + [n_cols]
            edges = sorted(set(edges))
            self.at = dict(zip(edges, self.runs.positions(edges)))
        return self.at

    def weight_slice(self, gw, v0: int, v1: int, dz, x) -> None:
        """``gw[v0:v1] = dz.T @ x`` with the slice's residue rows (``dz``: the slice's
        ``[T, v1 - v0]`` columns), rounded once: by the residue's ``WeightGrad`` kernels where
        it has them and they fit, else through fp32 blocks of ``rows`` rows. (Taking the
        product in 16 bits and only the target rows again in fp32, from their gathered
        columns, ran slower: the gather; H100, benchmarks/NOTES.md.)"""
        kernel = self.residue.weight_grad
        if kernel is not None and kernel.fits(gw[v0:v1], dz, x):
            if self.flag is None:
                self.flag = kernel.flags(self.runs)
            lo, hi = (0, None) if v1 - v0 == self.n_cols else (self._positions()[v0], self._positions()[v1])
            kernel(gw[v0:v1], dz, x, self.resid, self.runs, self.flag, v0, lo, hi)
            return
        at = self._positions()
        block = torch.empty(min(self.rows, v1 - v0), x.shape[1], dtype=torch.float32, device=x.device)
        for a in range(v0, v1, self.rows):
            b = min(a + self.rows, v1)
            part = block[: b - a]
            product_fp32(part, dz[:, a - v0 : b - v0].t(), x)
            self.residue.weight_rows(part, x, self.resid, self.runs, at[a], at[b], key0=a)
            gw[a:b].copy_(part)

    def finish(self, x, weight, gx, main_grad, gb) -> None:
        """The fp32 ``gx`` (``[T, H]``), ``main_grad`` and ``gb`` terms (each may be ``None``)."""
        if gx is not None:
            self.residue.hidden(self.resid, weight, self.target, self.col_offset, gx)
        if main_grad is not None:
            self.residue.weight_rows(main_grad, x, self.resid, self.runs)
        if gb is not None:
            self.residue.bias_rows(gb, self.resid, self.runs, x.dtype)
