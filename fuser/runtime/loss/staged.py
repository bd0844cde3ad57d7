"""The staged launch sequence of a loss: one launch per reduction sweep, then the loss and
gradient launch, with the per-token reductions kept between them.

The row kernel (``Chunked``) reduces, scores and differentiates a row in one launch, so its
gradient must be taken while the row's logits are at hand. The staged sequence writes each
sweep's per-token partials, combines them into ``red`` (``[T, red_width]`` fp32: ``z[y]``,
then each reduction), and its last kernel computes the loss and ``d loss / d logits`` of any
slice of vocabulary columns from ``red`` alone. That allows three schedules besides the
row kernel's:

- ``ShardedChunked``: a vocabulary-parallel loss, the partials combined across ranks.
- *whole* (``Staged.forward_whole`` / ``backward_whole``): all ``[T, V]`` fp32 logits in one
  buffer from forward to backward, which then scales them into the gradient in place and
  takes the two gradient matmuls over every token at once: ``grad_weight`` comes out of
  one matmul with fp32 accumulation, rounded once, with no fp32 ``[V, H]`` buffer (16-bit
  weights: fp32 blocks that take the target column's residue, ``residue.SliceTerms``). Chosen
  when the logits take no more memory than the chunked schedule's buffers would.
- *vocabulary chunks* (``forward_reductions`` / ``backward_vocab``): forward keeps only
  ``red``; backward recomputes the logits one slice of vocabulary rows at a time over every
  token, so each slice of ``grad_weight`` (or ``main_grad``) is written once, and
  ``grad_hidden`` is summed in fp32 over the slices. Its memory is one ``[T, slice]`` buffer
  and the fp32 ``grad_hidden``: the schedule for ``main_grad``, whose memory goal leaves no
  room for an fp32 ``[V, H]`` buffer or a full chunk of logits.
"""

from __future__ import annotations

import torch

from fuser.cache import load_kernel
from fuser.runtime.loss.chunked import (
    MIB,
    Chunked,
    accumulate_mm,
    accumulate_weight_grad,
    chunk_grads,
    fp32_logits,
    hidden_grad,
    logits_buffer,
    residue_rows,
    rounded_gradient,
)
from fuser.runtime.loss.residue import SliceTerms


class Staged(Chunked):
    """The staged sequence on one device (``weight`` the whole vocabulary, or a rank's slice
    ``[col_offset, col_offset + V_r)`` of ``vocab_total`` columns in ``ShardedChunked``)."""

    rank, world = 0, 1

    def __init__(
        self,
        sources,
        layout,
        zy_first: bool,
        device,
        hyper,
        ignore_index,
        chunk,
        *,
        col_offset=0,
        vocab_total=None,
    ):
        self.kernels = [load_kernel(s, device) for s in sources]
        self.layout = layout
        self.zy_first = zy_first  # a sweep reads z[y]: combine it before the first launch
        self.hyper = hyper
        self.ignore_index = int(ignore_index)
        self.chunk = chunk
        self.col_offset = int(col_offset)
        self.vocab_total = vocab_total

    # -- across ranks (nothing to do on one device) ---------------------------------------
    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        return t.unsqueeze(0)

    def _all_reduce(self, t: torch.Tensor) -> None:
        pass

    def _combine(self, stage: int, gathered: torch.Tensor, red: torch.Tensor) -> None:
        for i, op, c in self.layout.part_cols[stage]:
            rc = self.layout.red_cols[i]
            vals = gathered[:, :, c]
            if op == "sum":
                red[:, rc] = vals.sum(0)
            elif op == "logsumexp":
                red[:, rc] = torch.logsumexp(vals, 0)
            else:
                best, owner = vals.max(0)  # the first rank holding the maximum
                red[:, rc] = best
                red[:, rc + 1] = torch.where(owner == self.rank, gathered[self.rank, :, c + 1], -1.0)

    # -- one block of rows ----------------------------------------------------------------
    def _logits(self, xc, weight, bias, out) -> None:
        fp32_logits(out, xc, weight, bias)

    def _reduce(self, logits, target, loss, r, parts) -> None:
        """Every sweep over ``logits`` (this rank's columns of ``target``'s rows) into ``r``,
        then the loss into ``loss``."""
        n, vocab = logits.shape
        if self.world == 1 and self.col_offset == 0:
            self._reduce_alone(logits, target, loss, r, parts)
            return
        yl = target - self.col_offset
        mine = (yl >= 0) & (yl < vocab) & (target != self.ignore_index)
        # z[y] where this rank holds the target's column, 0 elsewhere.
        zy = torch.where(
            mine,
            logits.gather(1, yl.clamp(0, max(vocab - 1, 0))[:, None])[:, 0].float()
            if vocab
            else torch.zeros(n, device=logits.device),
            0.0,
        )
        if self.zy_first:
            self._all_reduce(zy)
            r[:, 0] = zy
        args = self._args(logits, target, loss, loss, 0)
        for k in range(len(self.layout.part_cols)):
            part = parts[k][:n]
            self.kernels[k]((n,), *args, 0, r, part, self.col_offset, self._total(vocab))
            if k == 0 and not self.zy_first:
                part[:, -1] = zy
            gathered = self._gather(part)
            if k == 0 and not self.zy_first:
                r[:, 0] = gathered[:, :, -1].sum(0)
            self._combine(k, gathered, r)
        self.kernels[-1]((n,), *args, 0, r, r, self.col_offset, self._total(vocab))

    def _reduce_alone(self, logits, target, loss, r, parts) -> None:
        """``_reduce`` on one device, in a few launches: each sweep's values are already the
        row's, so they are copied into ``r`` rather than combined, and ``z[y]`` is read for
        every row (the kernels ignore it where the target is ignored or out of range)."""
        n, vocab = logits.shape
        if vocab:
            r[:, 0] = logits.gather(1, target.clamp(0, vocab - 1)[:, None])[:, 0]
        else:
            r[:, 0] = 0.0
        args = self._args(logits, target, loss, loss, 0)
        for k, cols in enumerate(self.layout.part_cols):
            part = parts[k][:n]
            self.kernels[k]((n,), *args, 0, r, part, 0, vocab)
            for i, op, c in cols:  # a max's argmax column follows its value
                rc, width = self.layout.red_cols[i], 2 if op == "max" else 1
                r[:, rc : rc + width] = part[:, c : c + width]
        self.kernels[-1]((n,), *args, 0, r, r, 0, vocab)

    def _differentiate(self, logits, target, loss, r, scale, col_offset: int, total: int, resid) -> None:
        """Overwrite ``logits`` (columns ``[col_offset, ...)`` of the vocabulary) with
        ``scale * d loss / d logits`` from the combined values ``r``; ``resid``: the target
        column's residue out, where these columns hold it (with ``residue``; else unused)."""
        n = logits.shape[0]
        scale_stride = 0 if scale.numel() == 1 else 1
        args = self._args(logits, target, loss, scale, scale_stride, resid)
        self.kernels[-1]((n,), *args, 1, r, r, col_offset, total)

    def _args(self, logits, target, loss, scale, scale_stride, resid=None):
        vocab = logits.shape[1]
        stride = logits.stride(0)
        resid = loss if resid is None else resid
        return (
            logits,
            stride,
            target,
            loss,
            resid,
            scale,
            scale_stride,
            self.hyper,
            vocab,
            self.ignore_index,
        )

    def _total(self, vocab: int) -> int:
        return vocab if self.vocab_total is None else self.vocab_total

    def _buffers(self, rows: int, device):
        red = torch.empty(rows, self.layout.red_width, dtype=torch.float32, device=device)
        parts = [torch.empty(rows, w, dtype=torch.float32, device=device) for w in self.layout.part_widths]
        return red, parts

    # -- the row kernel's contract: gradients taken chunk by chunk ------------------------
    def run(self, x, weight, bias, target, loss_tok, *, scale=None, gx=None, gw=None, gb=None) -> None:
        n_tokens, vocab = x.shape[0], weight.shape[0]
        if n_tokens == 0:
            return
        grad = scale is not None
        rows = min(self.chunk, n_tokens)
        buf = logits_buffer(rows, vocab, x, torch.float32)
        red, parts = self._buffers(rows, x.device)
        per_token = grad and scale.numel() > 1
        residue = self.residue if grad else None
        resid = residue.buffer(n_tokens, x.device) if residue else loss_tok
        for s in range(0, n_tokens, self.chunk):
            e = min(s + self.chunk, n_tokens)
            xc, logits, r = x[s:e], buf[: e - s], red[: e - s]
            self._logits(xc, weight, bias, logits)
            self._reduce(logits, target[s:e], loss_tok[s:e], r, parts)
            if not grad:
                continue
            total = self._total(vocab)
            self._differentiate(
                logits,
                target[s:e],
                loss_tok[s:e],
                r,
                scale[s:e] if per_token else scale,
                self.col_offset,
                total,
                resid[s:e],
            )
            chunk_grads(logits, xc, weight, target[s:e], self.col_offset, residue, resid[s:e], gx, gw, gb, s)
        if residue and gw is not None:
            residue_rows(residue, x, target, resid, self.col_offset, vocab, gw, None)
        if grad and gx is not None:
            self._all_reduce(gx)

    # -- whole: every token's logits kept from forward to backward ------------------------
    def forward_whole(self, x, weight, bias, target, loss_tok):
        """The loss into ``loss_tok``; returns ``(logits, red)`` for ``backward_whole``."""
        n_tokens, vocab = x.shape[0], weight.shape[0]
        logits = logits_buffer(n_tokens, vocab, x, torch.float32)
        red, parts = self._buffers(n_tokens, x.device)
        if n_tokens:
            self._logits(x, weight, bias, logits)
            self._reduce(logits, target, loss_tok, red, parts)
        return logits, red

    def backward_whole(self, logits, red, x, weight, target, scale, *, need_x, need_w, need_b, main_grad):
        """``(grad_hidden, grad_weight, grad_bias)`` from the kept logits (overwritten with
        the scaled logit gradient). ``grad_weight`` in the weight's dtype, or added into
        ``weight.main_grad`` (then ``None``); ``grad_bias`` fp32."""
        gx = gw = gb = None
        n, vocab = logits.shape
        loss = torch.empty(n, dtype=torch.float32, device=x.device)
        residue = self.residue if n and vocab else None
        terms = residue and SliceTerms(residue, x, target, self.col_offset, vocab, vocab)
        if n:
            resid = terms.resid if terms else None
            self._differentiate(logits, target, loss, red, scale, self.col_offset, self._total(vocab), resid)
        if need_b:
            gb = logits.sum(0)
        dl = rounded_gradient(logits, x.dtype, terms and terms.resid, target, self.col_offset)
        if need_x:
            gx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            hidden_grad(gx, dl, weight, residue, terms and terms.resid, target, self.col_offset)
            self._all_reduce(gx)
        if need_w and main_grad:
            accumulate_weight_grad(weight.main_grad, dl, x)
        elif need_w and terms:
            gw = torch.empty(weight.shape, dtype=weight.dtype, device=x.device)
            terms.weight_slice(gw, 0, vocab, dl, x)
        elif need_w:
            gw = torch.mm(dl.t(), x)
        if terms:
            terms.finish(x, weight, None, weight.main_grad if need_w and main_grad else None, None)
        return gx, gw, gb

    # -- vocabulary chunks: forward keeps the reductions, backward recomputes by slices ---
    def forward_reductions(self, x, weight, bias, target, loss_tok) -> torch.Tensor:
        """The loss into ``loss_tok``; returns ``red`` for ``backward_vocab``."""
        n_tokens, vocab = x.shape[0], weight.shape[0]
        red = torch.empty(n_tokens, self.layout.red_width, dtype=torch.float32, device=x.device)
        if n_tokens == 0:
            return red
        rows = min(self.chunk, n_tokens)
        buf = logits_buffer(rows, vocab, x, torch.float32)
        _, parts = self._buffers(rows, x.device)
        for s in range(0, n_tokens, self.chunk):
            e = min(s + self.chunk, n_tokens)
            logits = buf[: e - s]
            self._logits(x[s:e], weight, bias, logits)
            self._reduce(logits, target[s:e], loss_tok[s:e], red[s:e], parts)
        return red

    def backward_vocab(
        self, red, x, weight, bias, target, scale, cols: int, *, need_x, need_w, need_b, main_grad
    ):
        """``(grad_hidden, grad_weight, grad_bias)``, recomputing the logits ``cols``
        vocabulary rows at a time; as ``backward_whole`` returns them."""
        n_tokens, vocab = x.shape[0], weight.shape[0]
        gx = gw = gb = None
        if need_x:
            gx = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        residue = self.residue if n_tokens and vocab else None
        if need_w and not main_grad:
            gw = torch.empty(weight.shape, dtype=weight.dtype, device=x.device)
        if need_b:
            gb = torch.empty(vocab, dtype=torch.float32, device=x.device)
        if n_tokens == 0 or vocab == 0:
            return self._finish_x(gx, x), gw, gb.zero_() if gb is not None else None
        terms = residue and SliceTerms(residue, x, target, self.col_offset, vocab, cols)
        buf = logits_buffer(n_tokens, min(cols, vocab), x, torch.float32)
        loss = self._outputs_buffer(n_tokens, x.device)
        layout = self.layout
        argmax_cols = [layout.red_cols[i] + 1 for p in layout.part_cols for i, op, _ in p if op == "max"]
        r = red.clone() if argmax_cols else red
        total = self._total(vocab)
        for v0 in range(0, vocab, cols):
            v1 = min(v0 + cols, vocab)
            logits = buf[:, : v1 - v0]
            self._slice_logits(x, weight, bias, v0, v1, logits)
            for c in argmax_cols:  # argmax columns are local to the columns swept
                am = red[:, c]
                r[:, c] = torch.where((am >= v0) & (am < v1), am - v0, -1.0)
            resid = terms.resid if terms else None
            self._differentiate(logits, target, loss, r, scale, self.col_offset + v0, total, resid)
            if need_b:
                torch.sum(logits, 0, out=gb[v0:v1])
            dl = rounded_gradient(logits, x.dtype, resid, target, self.col_offset + v0)
            if need_x:
                accumulate_mm(gx, dl, weight[v0:v1])
            if need_w and main_grad:
                accumulate_weight_grad(weight.main_grad[v0:v1], dl, x)
            elif need_w and terms:
                terms.weight_slice(gw, v0, v1, dl, x)
            elif need_w:
                torch.mm(dl.t(), x, out=gw[v0:v1])
        del buf, logits, dl  # before grad_hidden takes the input dtype
        if terms:
            terms.finish(x, weight, gx, weight.main_grad if need_w and main_grad else None, None)
        if gx is not None:
            self._all_reduce(gx)
        return self._finish_x(gx, x), gw, gb

    def _slice_logits(self, x, weight, bias, v0: int, v1: int, out) -> None:
        """The logits of vocabulary rows ``[v0, v1)`` over every token, for ``backward_vocab``."""
        self._logits(x, weight[v0:v1], bias[v0:v1] if bias is not None else None, out)

    @staticmethod
    def _outputs_buffer(n_tokens: int, device) -> torch.Tensor:
        """Where ``backward_vocab``'s gradient launches write the per-token loss (unread)."""
        return torch.empty(n_tokens, dtype=torch.float32, device=device)

    @staticmethod
    def _finish_x(gx, x):
        return gx if gx is None or gx.dtype == x.dtype else gx.to(x.dtype)


# Memory of the schedule for ``main_grad`` (besides ``red`` and a few per-token vectors).
MAIN_GRAD_BUDGET = 240 * MIB


def forward_rows(vocab: int, element_size: int, budget: int = MAIN_GRAD_BUDGET) -> int:
    """Tokens per forward chunk of the vocabulary-chunk schedule: their logits within
    ``budget``; a multiple of 64, at least 64."""
    rows = budget // max(vocab * element_size, 1)
    return int(max(64, rows // 64 * 64))


def vocab_cols(
    n_tokens: int, hidden: int, element_size: int, block: int, budget: int = MAIN_GRAD_BUDGET
) -> int:
    """Vocabulary rows per slice of ``backward_vocab``: the ``[T, slice]`` logits and the fp32
    ``[T, H]`` hidden gradient within ``budget``; a multiple of the kernel's ``block`` (the
    kernel's full blocks take its fast path) where that fits, else of 256, at least 256."""
    room = budget - 4 * n_tokens * hidden
    cols = room // max(n_tokens * element_size, 1)
    step = block if cols >= block else 256
    return int(max(256, cols // step * step))


class ShardedChunked(Staged):
    """The staged sequence of a vocabulary-parallel loss: ``weight`` (and ``bias``) hold this
    rank's contiguous slice ``[col_offset, col_offset + V_r)`` of a vocabulary of
    ``vocab_total`` columns, split over ``group`` in rank order; every rank passes the same
    ``x`` and targets.

    After each sweep, the per-token partials of every rank are gathered with ONE collective
    and combined (sum: added; logsumexp: logsumexp of the ranks' values; max: the largest,
    its argmax kept by the first rank holding it, as the unsharded kernel keeps the first
    column). ``z[y]`` is read by the target's owner and summed across the group, in the
    first collective when no sweep needs it before. The last launch computes the same
    per-token loss on every rank and this rank's columns of the logit gradient.
    ``grad_weight``/``grad_bias`` stay local; ``grad_hidden`` is summed across the group
    (Megatron's backward of the column-parallel head).
    """

    def __init__(
        self,
        sources,
        layout,
        zy_first,
        device,
        hyper,
        ignore_index,
        chunk,
        group,
        col_offset: int,
        vocab_total: int,
    ):
        import torch.distributed as dist

        super().__init__(
            sources,
            layout,
            zy_first,
            device,
            hyper,
            ignore_index,
            chunk,
            col_offset=col_offset,
            vocab_total=int(vocab_total),
        )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        out = torch.empty((self.world,) + tuple(t.shape), dtype=t.dtype, device=t.device)
        dist.all_gather(list(out.unbind(0)), t.contiguous(), group=self.group)
        return out

    def _all_reduce(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.all_reduce(t, group=self.group)
