"""The *scaled* schedule: gradients in forward, with one matmul kernel in place of the logits
matmul and the row kernel.

For a rule whose logit gradient is ``A * exp(a(z) - r) + B * [target] + C`` (``r`` its one
logsumexp of ``a(z)``; ``A``, ``B``, ``C`` per token: ``fuser.codegen.loss_matmul.ScaledExp``),
each chunk of tokens runs:

1. (once per call) ``z[y]`` (a gathered dot product, fp32) and ``ref = a(z[y])`` per token;
2. the scaled-exponential kernel (with ``Tiles.tma``, persistent programs, one per
   processor, moving tiles through tensor descriptors): each ``[BM, BN]`` tile of
   ``hidden @ weight.T`` in fp32 registers, stored once as ``E = exp(a(z) - ref)`` in the
   input dtype, with each tile's per-token partials (below, and the rule's other sums).
   No row maximum is needed before
   the kernel: ``E`` is ``exp(a(z) - a(z[y]))``, finite while no logit is more than ~60
   above the target's in ``a``-units (a per-token loss under ~60);
3. ``r`` (the logsumexp) and the other sums, combined over the tiles in a fixed order, and
   the loss from them (the staged sequence's last kernel, once per call);
4. the gradient: ``d loss / d z = s * E + B * [target] + C`` with ``s = A * exp(ref - r)``.
   ``grad_hidden = s * (E @ W) + B * W[y] + C * sum(W)`` (the matmul accumulated and
   scaled in fp32, rounded once) and ``grad_weight += E.T @ (s * x)`` into the fp32 buffer
   (``s * x`` rounded to the input dtype), then ``B * x`` added to row ``y`` and ``C * x``
   summed into every row, in fp32. The target term never passes through a rounding, so a
   target probability near 1 or near 0 keeps fp32's precision in ``p - 1``.

The kernel forms ``E`` as ``exp(a(z) - m) * exp(m - ref)`` with ``m`` each tile's maximum
of ``a(z)`` per token, and keeps the sum of ``exp(a(z) - m)`` and ``m``: the logsumexp, so
the loss, is exact whatever the logits. A token beyond the gradient's range (``r - ref``
over ``MAX_SPREAD``) is flagged on the device; backward reads the flag (``resolve``, the
one host read, once the forward's work is queued) and, if any token was flagged, takes the
gradients again with the row kernel (``Chunked``).
"""

from __future__ import annotations

import sympy
import torch

from fuser.cache import load_kernel
from fuser.codegen.loss_matmul import scaled_part_columns
from fuser.ir.loss import VOCAB, Z_Y, hyper_symbols, reduction_symbol
from fuser.runtime.loss.chunked import Chunked, accumulate_mm, accumulate_weight_grad, logits_buffer
from fuser.runtime.loss.fused import processor_count, target_logits

# The largest r - ref (in a-units) a token may have: the sums of E over 128256 columns of
# exp(60) and the fp32 products E' @ W stay far from fp32's limit (exp(88.7)).
MAX_SPREAD = 60.0
# Tokens per piece of grad_weight's target and constant terms (their fp32 temporaries).
TERM_ROWS = 4096


def _torch_functions() -> dict:
    def wrap(f):
        return lambda v: f(torch.as_tensor(v, dtype=torch.float32))

    return {name: wrap(f) for name, f in (("exp", torch.exp), ("log", torch.log), ("tanh", torch.tanh),
                                          ("sqrt", torch.sqrt), ("Abs", torch.abs))}  # fmt: skip


class TokenValues:
    """``a(z[y])``, ``A``, ``B`` and ``C`` of a ``ScaledExp`` form as torch functions of a
    chunk's per-token values (built once per rule and dtype)."""

    def __init__(self, plan, form, layout):
        self.form = form
        self.layout = layout
        self.reds = sorted(layout.red_cols)
        self.n_hyper = len(plan.hyper)
        symbols = [Z_Y, VOCAB] + [reduction_symbol(i) for i in self.reds] + hyper_symbols(plan)
        fns = [_torch_functions(), "math"]
        self.ref, self.a, self.b, self.c = (
            sympy.lambdify(symbols, e, modules=fns, dummify=True)
            for e in (form.ref, form.scale, form.target, form.const)
        )
        self.has_target = form.target != 0
        self.has_const = form.const != 0
        self.part_width, self.part_cols = scaled_part_columns(plan)

    def __call__(self, fn, zy, vocab: int, red, hyper) -> torch.Tensor | float:
        """``fn`` per token of a chunk (``zy``: its ``z[y]``; ``red``: its reductions): a
        tensor, or a float where ``fn`` is a constant (no copy to the device, which would
        wait for the queue)."""
        args = [zy, float(vocab)] + [red[:, self.layout.red_cols[i]] for i in self.reds]
        v = fn(*args, *hyper[: self.n_hyper].unbind(0))
        if isinstance(v, torch.Tensor) and v.device == zy.device:
            return v.float().expand(zy.shape[0])
        return float(v)


class ScaledExp:
    """The scaled schedule's kernels and what a call needs: ``kernel`` and ``final`` (the
    scaled-exponential kernel and the staged sequence's loss kernel), ``values``
    (``TokenValues``), ``fallback`` (the row kernel's run, for a call out of range)."""

    schedule = "scaled"

    def __init__(
        self, kernel, final, values: TokenValues, tiles, device, hyper, ignore_index, chunk, fallback
    ):
        self.kernel = load_kernel(kernel, device)
        self.final = load_kernel(final, device)
        self.values = values
        self.form, self.layout = values.form, values.layout
        self.has_target, self.has_const = values.has_target, values.has_const
        self.tiles = tiles
        self.hyper = hyper
        self.ignore_index = int(ignore_index)
        self.chunk = chunk
        self.fallback: Chunked = fallback
        self._pending = None  # (out-of-range flag, the tensors of a rerun) of the last run
        self.processors = processor_count(device)  # (persistent programs with tiles.tma)

    def _values(self, fn, zy, vocab, red):
        return self.values(fn, zy, vocab, red, self.hyper)

    def run(self, x, weight, bias, target, loss_tok, *, scale=None, gx=None, gw=None, gb=None) -> None:
        """As ``Chunked.run``: per-token losses into ``loss_tok``; with ``scale`` (one fp32
        value) also ``scale * dloss`` into ``gx`` (rows, input dtype), ``gw`` (fp32, added).
        Per-token work runs once per call where it can (``z[y]``, ``ref``, the loss, the
        target and constant terms of ``grad_weight``), so a chunk costs a handful of launches."""
        n, vocab = x.shape[0], weight.shape[0]
        if n == 0:
            return
        if bias is not None or gb is not None or (scale is not None and scale.numel() != 1):
            raise ValueError("the scaled schedule takes no bias and one gradient scale per call")
        red = torch.zeros(n, self.layout.red_width, dtype=torch.float32, device=x.device)
        target_logits(x, weight, None, target, red[:, 0])
        live = (target != self.ignore_index) & (target >= 0) & (target < vocab)
        ref = self._values(self.values.ref, red[:, 0], vocab, red).contiguous()
        bm, bn = self.tiles.bm, self.tiles.bn
        rows = min(self.chunk, n)
        if self.tiles.tma:  # (its descriptor store is clipped at the last token and column)
            e_buf = logits_buffer(rows, vocab, x)
        else:  # (whole tiles stored)
            e_buf = logits_buffer(-(-rows // bm) * bm, -(-vocab // bn) * bn, x)
        tiles_n = -(-vocab // bn)
        width = self.values.part_width
        part_buf = torch.empty(tiles_n * rows * width, dtype=torch.float32, device=x.device)
        wsum = (
            weight.sum(0, dtype=torch.float32)
            if scale is not None and self.has_const and gx is not None
            else None
        )
        for s in range(0, n, self.chunk):
            e = min(s + self.chunk, n)
            part = part_buf[: tiles_n * (e - s) * width].view(tiles_n, e - s, width)
            self._forward(x[s:e], weight, target[s:e], red[s:e], ref[s:e], part, e_buf)
            if scale is not None:
                self._gradient(
                    s, e, x, weight, target, live[s:e], red[s:e], ref[s:e], e_buf, scale, gx, gw, wsum
                )
        del e_buf, part_buf  # (their memory serves the terms below)
        rest = (self.hyper, vocab, self.ignore_index, 0, red, red, 0, vocab)
        self.final((n,), x, 0, target, loss_tok, loss_tok, 0, *rest)
        if scale is None:
            return
        if gw is not None:
            self._weight_terms(x, target, live, red, scale, gw)
        spread = red[:, self.layout.red_cols[self.form.lse]] - ref
        out_of_range = (live & ~(spread <= MAX_SPREAD)).any()
        self._pending = (out_of_range, x, weight, target, scale, gx, gw)

    def resolve(self) -> None:
        """Check the range of the gradients computed in the last ``run`` (one host read, in
        backward, when the forward's work is queued or done): if a token was beyond
        ``MAX_SPREAD``, take them again with the row kernel. The loss is right either way."""
        if self._pending is None:
            return
        out_of_range, x, weight, target, scale, gx, gw = self._pending
        self._pending = None
        if bool(out_of_range):
            self._rerun(x, weight, target, scale, gx, gw)

    def _forward(self, xc, weight, y, red, ref, part, e_buf) -> None:
        """The chunk's ``E`` into ``e_buf`` and its reductions into ``red``."""
        m, vocab = xc.shape[0], weight.shape[0]
        grid = (-(-m // self.tiles.bm) * part.shape[0],)
        if self.tiles.tma:  # persistent programs, one per processor
            grid = (min(grid[0], self.processors),)
        self.kernel(
            grid, xc, weight, weight, y, red, ref, part, e_buf, e_buf.stride(0), self.hyper,
            m, xc.shape[1], vocab, 0, vocab, self.ignore_index,
        )  # fmt: skip
        for i, c in self.values.part_cols.items():
            col = self.layout.red_cols[i]
            if i == self.form.lse:  # the tiles' (sum of exp(a - m), m), combined exactly
                m = part[:, :, c + 1]
                top = m.max(0).values
                torch.add(top, torch.log((part[:, :, c] * torch.exp(m - top)).sum(0)), out=red[:, col])
            else:
                red[:, col] = part[:, :, c].sum(0)

    def _row_scale(self, red, ref, live, scale, vocab) -> torch.Tensor:
        """``s`` per token, times the call's gradient scale (0 where the target is out of range)."""
        r = red[:, self.layout.red_cols[self.form.lse]]
        return torch.where(
            live, self._values(self.values.a, red[:, 0], vocab, red) * torch.exp(ref - r) * scale, 0.0
        )

    def _term(self, fn, red, live, scale, vocab) -> torch.Tensor:
        return torch.where(live, self._values(fn, red[:, 0], vocab, red) * scale, 0.0)

    def _gradient(self, s, e, x, weight, target, live, red, ref, e_buf, scale, gx, gw, wsum) -> None:
        """The chunk's rows of ``grad_hidden`` (with its target and constant terms) and its
        softmax term of ``grad_weight``; ``live``: the rows with a target in range (the others'
        gradients are 0, their ``E`` rows zeros)."""
        vocab = weight.shape[0]
        g = self._row_scale(red, ref, live, scale, vocab)[:, None]
        E = e_buf[: e - s, :vocab]
        if gx is not None:
            out = torch.zeros(e - s, x.shape[1], dtype=torch.float32, device=x.device)
            accumulate_mm(out, E, weight)
            out.mul_(g)
            if self.has_const:
                out.addcmul_(self._term(self.values.c, red, live, scale, vocab)[:, None], wsum[None, :])
            if self.has_target:  # (the last term written straight into gx: one rounding)
                wy = weight.index_select(0, torch.where(live, target[s:e], 0))
                torch.addcmul(
                    out, self._term(self.values.b, red, live, scale, vocab)[:, None], wy, out=gx[s:e]
                )
            else:
                gx[s:e] = out
        if gw is not None:  # (s * x computed in fp32, rounded once to x's dtype)
            accumulate_weight_grad(gw, E, torch.mul(x[s:e], g, out=torch.empty_like(x[s:e])))

    def _weight_terms(self, x, target, live, red, scale, gw) -> None:
        """``grad_weight``'s target term (``B * x`` into row ``y``) and constant term (the sum
        of ``C * x`` into every row), in fp32, over pieces of ``TERM_ROWS`` tokens."""
        vocab = gw.shape[0]
        xsum = torch.zeros(x.shape[1], dtype=torch.float32, device=x.device) if self.has_const else None
        for s in range(0, x.shape[0], TERM_ROWS):
            e = min(s + TERM_ROWS, x.shape[0])
            xf, lv, rd = x[s:e].float(), live[s:e], red[s:e]
            if self.has_target:
                add_rows(
                    gw,
                    torch.where(lv, target[s:e], 0),
                    xf * self._term(self.values.b, rd, lv, scale, vocab)[:, None],
                )
            if xsum is not None:
                xsum.add_((xf * self._term(self.values.c, rd, lv, scale, vocab)[:, None]).sum(0))
        if xsum is not None:
            gw.add_(xsum)

    def _rerun(self, x, weight, target, scale, gx, gw) -> None:
        """The gradients again with the row kernel, ``gw`` cleared first."""
        if gw is not None:
            gw.zero_()
        loss = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        self.fallback.run(x, weight, None, target, loss, scale=scale, gx=gx, gw=gw)


def add_rows(out: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """``out[index[i]] += values[i]`` for every ``i``, in an order that does not depend on
    scheduling: the rows are sorted by index (stably), each run of equal indices summed as
    the difference of a running sum's ends, and each sum added once (the other rows add
    exact zeros). A plain ``index_add_`` sums repeated indices with atomics, in any order."""
    order = torch.argsort(index, stable=True)
    idx = index[order]
    # The running sum along the rows, taken on the transpose (a scan along the contiguous
    # dimension: torch's scan across rows is ~20x slower).
    running = values.t()[:, order].contiguous().cumsum(1)
    last = torch.ones_like(idx, dtype=torch.bool)
    last[:-1] = idx[1:] != idx[:-1]
    positions = torch.arange(idx.shape[0], device=idx.device)
    ends = torch.where(last, positions, -1)
    before = torch.cat([ends.new_full((1,), -1), ends[:-1]]).cummax(0).values  # the previous run's end
    base = torch.where(before >= 0, running[:, before.clamp(min=0)], 0.0)
    out.index_add_(0, idx, torch.where(last, running - base, 0.0).t())
