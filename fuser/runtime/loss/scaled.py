"""The *scaled* schedule: gradients in forward, with one matmul kernel in place of the logits
matmul and the row kernel.

For a rule whose logit gradient is ``A * exp(a(z) - r) + B * [target] + C`` (``r`` its one
logsumexp of ``a(z)``; ``A``, ``B``, ``C`` per token: ``fuser.codegen.loss_matmul.ScaledExp``),
or ``a'(z)`` times the first two terms (a softcap; ``E`` below then carries ``a'(z)``), the
schedule runs, with every per-token value computed in generated kernels
(``fuser.codegen.loss_matmul.render_scaled_tokens`` and ``render_scaled_terms``):

1. once per call, ``z[y]`` (a gathered dot product, fp32) and ``ref = a(z[y])`` per token;
2. per chunk of tokens, the scaled-exponential kernel (with ``Tiles.tma``, persistent
   programs, one per processor, moving tiles through tensor descriptors): each ``[BM, BN]``
   tile of ``hidden @ weight.T`` in fp32 registers, stored once as ``E = exp(a(z) - ref)``
   in the input dtype, with each tile's per-token partials (below, and the rule's other
   sums). No row maximum is needed before the kernel: ``E`` is ``exp(a(z) - a(z[y]))``,
   finite while no logit is more than ~60 above the target's in ``a``-units (a per-token
   loss under ~60);
3. per chunk, one kernel combines the tiles' partials in a fixed order into ``r`` (the
   logsumexp) and the other sums, and forms each token's ``s = A * exp(ref - r)``, ``B``
   and ``C``, times the gradient's scale;
4. per chunk, the gradient: ``d loss / d z = s * E + B * [target] + C``.
   ``grad_hidden = s * (E @ W) + B * W[y] + C * sum(W)`` (the matmul accumulated in fp32,
   the terms added and rounded once by one kernel, which also writes ``s * x`` rounded to
   the input dtype) and ``grad_weight += E.T @ (s * x)`` into the fp32 buffer;
5. once per call, the loss (the staged sequence's last kernel), and ``grad_weight``'s
   target term, ``B * x`` added to row ``y`` in fp32 over the tokens sorted by target (each
   run of one target summed in token order, in pieces of at most ``TARGET_PIECE`` tokens
   whose sums are then added in order: no atomics),
   and its constant term, the sum of ``C * x`` added to every row. The target term never
   passes through a rounding, so a target probability near 1 or near 0 keeps fp32's
   precision in ``p - 1``.

The kernel forms ``E`` as ``exp(a(z) - m) * exp(m - ref)`` with ``m`` each tile's maximum
of ``a(z)`` per token, and keeps the sum of ``exp(a(z) - m)`` and ``m``: the logsumexp, so
the loss, is exact whatever the logits. A token beyond the gradient's range (``r - ref``
over ``MAX_SPREAD``) is flagged on the device and copied for the host at the end of the
forward; backward reads it (``resolve``, the one host read, after queuing the gradients'
scaling by ``grad_output``, so that the GPU works on while the host waits) and, if any token
was flagged, takes the gradients again with the row kernel (``Chunked``) and scales them
again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fuser.cache import load_kernel
from fuser.codegen.loss_matmul import (
    PREPARE_ROWS,
    TERM_BLOCK,
    TOKEN_BLOCK,
    linear_sums,
    scaled_part_columns,
)
from fuser.runtime.loss.chunked import (
    Chunked,
    HostValue,
    accumulate_mm,
    accumulate_weight_grad,
    logits_buffer,
    processor_count,
)
from fuser.runtime.loss.residue import TargetRows

# The largest r - ref (in a-units) a token may have: the sums of E over 128256 columns of
# exp(60) and the fp32 products E' @ W stay far from fp32's limit (exp(88.7)).
MAX_SPREAD = 60.0
# Tokens per piece of grad_weight's target and constant terms (their fp32 temporaries).
TERM_ROWS = 4096


class TokenValues:
    """What the driver needs of a ``ScaledExp`` form besides its kernels: whether the
    gradient has a target term and a constant term, whether a sum is linear in ``z``, and
    the partials' width per token and tile (built once per rule and dtype)."""

    def __init__(self, plan, form, layout):
        self.form = form
        self.layout = layout
        self.has_target = form.target != 0
        self.has_const = form.const != 0
        self.linear = bool(linear_sums(plan))  # (the prepare kernel reads the weight's row sum)
        self.part_width = scaled_part_columns(plan)[0]


class ScaledExp:
    """The scaled schedule's kernels and what a call needs: ``kernel`` (the scaled-exponential
    matmul kernel), ``prepare`` and ``tokens`` (per call, each token's ``z[y]`` and ``ref``;
    per chunk, its per-token work: ``render_scaled_tokens``),
    ``hidden_terms`` and ``target_rows`` (``render_scaled_terms``), ``final`` (the staged
    sequence's loss kernel), ``values`` (``TokenValues``), ``fallback`` (a function that
    builds the row kernel's run, for a call out of range: built only then)."""

    schedule = "scaled"

    def __init__(
        self, kernels, final, values: TokenValues, tiles, device, hyper, ignore_index, chunk, fallback
    ):
        kernel, prepare, tokens, hidden_terms, target_pieces, target_runs = kernels
        self.kernel = load_kernel(kernel, device)
        self.prepare = load_kernel(prepare, device)
        self.tokens = load_kernel(tokens, device)
        self.hidden_terms = load_kernel(hidden_terms, device)
        self.target_rows = TargetRows(target_pieces, target_runs, device)
        self.final = load_kernel(final, device)
        self.values = values
        self.form, self.layout = values.form, values.layout
        self.has_target, self.has_const = values.has_target, values.has_const
        self.tiles = tiles
        self.hyper = hyper
        self.ignore_index = int(ignore_index)
        self.chunk = chunk
        self.fallback: Callable[[], Chunked] = fallback
        self._pending = None  # (out-of-range flag, the tensors of a rerun) of the last run
        self.processors = processor_count(device)  # (persistent programs with tiles.tma)

    def run(self, x, weight, bias, target, loss_tok, *, scale=None, gx=None, gw=None, gb=None) -> None:
        """As ``Chunked.run``: per-token losses into ``loss_tok``; with ``scale`` (one fp32
        value) also ``scale * dloss`` into ``gx`` (rows, input dtype), ``gw`` (fp32, added).
        Per-token work runs in one kernel per chunk, or once per call (``z[y]``, ``ref``,
        the loss, the target and constant terms of ``grad_weight``)."""
        n, vocab = x.shape[0], weight.shape[0]
        if n == 0:
            return
        if bias is not None or gb is not None or (scale is not None and scale.numel() != 1):
            raise ValueError("the scaled schedule takes no bias and one gradient scale per call")
        red = torch.zeros(n, self.layout.red_width, dtype=torch.float32, device=x.device)
        ref = torch.empty(n, dtype=torch.float32, device=x.device)
        hid = x.shape[1]
        const_term = scale is not None and self.has_const and gx is not None
        wsum = weight.sum(0, dtype=torch.float32) if self.values.linear or const_term else None
        self.prepare(
            (-(-n // PREPARE_ROWS),), x, weight, ref if wsum is None else wsum, target, red, ref, self.hyper,
            n, hid, vocab,
        )  # fmt: skip
        coef = torch.empty(n, 3, dtype=torch.float32, device=x.device)  # s, B, C per token
        factor = scale.reshape(1).float() if scale is not None else red.new_ones(1)
        bm, bn = self.tiles.bm, self.tiles.bn
        rows = min(self.chunk, n)
        if self.tiles.tma:  # (its descriptor store is clipped at the last token and column)
            e_buf = logits_buffer(rows, vocab, x)
        else:  # (whole tiles stored)
            e_buf = logits_buffer(-(-rows // bm) * bm, -(-vocab // bn) * bn, x)
        tiles_n = -(-vocab // bn)
        width = self.values.part_width
        part_buf = torch.empty(tiles_n * rows * width, dtype=torch.float32, device=x.device)
        for s in range(0, n, self.chunk):
            e = min(s + self.chunk, n)
            part = part_buf[: tiles_n * (e - s) * width].view(tiles_n, e - s, width)
            self._forward(x[s:e], weight, target[s:e], red[s:e], ref[s:e], part, e_buf, coef[s:e], factor)
            if scale is not None:
                self._gradient(s, e, x, weight, target, coef[s:e], e_buf, gx, gw, wsum)
        del e_buf, part_buf  # (their memory serves the terms below)
        rest = (self.hyper, vocab, self.ignore_index, 0, red, red, 0, vocab)
        self.final((n,), x, 0, target, loss_tok, loss_tok, loss_tok, 0, *rest)
        if scale is None:
            return
        live = (target != self.ignore_index) & (target >= 0) & (target < vocab)
        if gw is not None:
            self._weight_terms(x, target, live, coef, gw)
        spread = red[:, self.layout.red_cols[self.form.lse]] - ref
        out_of_range = HostValue((live & ~(spread <= MAX_SPREAD)).any())
        self._pending = (out_of_range, x, weight, target, scale, gx, gw)

    def resolve(self) -> bool:
        """Check the range of the gradients computed in the last ``run`` (a host read of a
        flag copied at the end of ``run``: it waits for the forward's work, not for what
        backward queued since): if a token was beyond ``MAX_SPREAD``, take them again with
        the row kernel into the same ``gx`` and ``gw`` and return True. The loss is right
        either way."""
        if self._pending is None:
            return False
        out_of_range, x, weight, target, scale, gx, gw = self._pending
        self._pending = None
        if not out_of_range.read():
            return False
        self._rerun(x, weight, target, scale, gx, gw)
        return True

    def _forward(self, xc, weight, y, red, ref, part, e_buf, coef, factor) -> None:
        """The chunk's ``E`` into ``e_buf``, its reductions into ``red`` and its ``s``, ``B``,
        ``C`` (times ``factor``) into ``coef``."""
        m, vocab = xc.shape[0], weight.shape[0]
        grid = (-(-m // self.tiles.bm) * part.shape[0],)
        if self.tiles.tma:  # persistent programs, one per processor
            grid = (min(grid[0], self.processors),)
        self.kernel(
            grid, xc, weight, weight, y, red, ref, part, e_buf, e_buf.stride(0), self.hyper,
            m, xc.shape[1], vocab, 0, vocab, self.ignore_index,
        )  # fmt: skip
        self.tokens(
            (-(-m // TOKEN_BLOCK),), part, part.shape[0], m, red, ref, y, coef, factor, self.hyper,
            vocab, self.ignore_index,
        )  # fmt: skip

    def _gradient(self, s, e, x, weight, target, coef, e_buf, gx, gw, wsum) -> None:
        """The chunk's rows of ``grad_hidden`` (with its target and constant terms) and its
        softmax term of ``grad_weight`` (rows without a target in range have ``s``, ``B``,
        ``C`` 0 and ``E`` rows of zeros)."""
        vocab, hid = weight.shape
        E = e_buf[: e - s, :vocab]
        xs = torch.empty_like(x[s:e])  # s * x computed in fp32, rounded once to x's dtype
        if gx is not None:  # (its kernel also writes xs)
            prod = torch.zeros(e - s, hid, dtype=torch.float32, device=x.device)
            accumulate_mm(prod, E, weight)
            self.hidden_terms(
                (e - s, -(-hid // TERM_BLOCK)), prod, coef, target[s:e], weight,
                prod if wsum is None else wsum, gx[s:e], x[s:e], xs, hid, vocab,
            )  # fmt: skip
        else:
            torch.mul(x[s:e], coef[:, :1], out=xs)
        if gw is not None:
            accumulate_weight_grad(gw, E, xs)

    def _weight_terms(self, x, target, live, coef, gw) -> None:
        """``grad_weight``'s target term (``B * x`` into row ``y``: ``TargetRows``, over the
        tokens sorted by target) and constant term (the sum of ``C * x`` into every row, over pieces
        of ``TERM_ROWS`` tokens), in fp32."""
        vocab, hid = gw.shape
        if self.has_target:
            runs = self.target_rows.runs(torch.where(live, target, vocab), vocab)
            self.target_rows.add(gw, x, coef, runs)
        if self.has_const:
            xsum = torch.zeros(1, hid, dtype=torch.float32, device=x.device)
            for s in range(0, x.shape[0], TERM_ROWS):
                e = min(s + TERM_ROWS, x.shape[0])
                xsum.addmm_(coef[s:e, 2][None, :], x[s:e].float())
            gw.add_(xsum)

    def _rerun(self, x, weight, target, scale, gx, gw) -> None:
        """The gradients again with the row kernel, ``gw`` cleared first."""
        if gw is not None:
            gw.zero_()
        loss = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        self.fallback().run(x, weight, None, target, loss, scale=scale, gx=gx, gw=gw)
