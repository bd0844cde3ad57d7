"""Token rules (per-token inputs, several per-token outputs): the chunked driver and the
autograd ``Function``.

For each chunk of tokens the logits ``x_chunk @ W.T (+ b)`` are taken into an fp32 buffer
(products of the inputs' dtype accumulated in fp32 and never rounded), and the rule's row
kernel, lowered for fp32 logits, writes every output of every token. Backward takes the
upstream gradient of each output (zero for one autograd gives none), recomputes each
chunk's logits and runs the same kernel with them as per-token inputs: it overwrites the
row with ``d (sum_i dout_i * output_i) / d logits`` in fp32, which gives the chunk's
``grad_hidden`` rows and its share of the fp32 ``grad_weight`` (through the inputs' dtype
for 16-bit inputs: the one rounding of the logit gradient, with the target column's
residue added back in fp32, as the ``chunks`` schedule's).

A rule that reads the teacher's logits (``t``) takes the teacher's hidden states, weight
and bias beside the student's: each chunk's teacher logits are taken into a second fp32
buffer beside the student's (in backward too, recomputed), read by the same kernel; they
take no gradient.

``ShardedTokens`` runs the same with ``weight`` a rank's slice of the vocabulary
(``process_group=``): the staged kernels of the rule's fp32 plan, their per-token partials
combined across the group between sweeps as ``ShardedChunked`` combines them.

``VocabTokens`` (``memory="lean"``) runs the same staged kernels as ``Staged``'s vocabulary
chunks: forward keeps each token's reductions and outputs, no logits; backward recomputes
the logits one slice of vocabulary rows at a time over every token, so no fp32 ``[V, H]``
buffer and no chunk of every column's logits is held (four products in all).
"""

from __future__ import annotations

import torch

from fuser.cache import load_kernel
from fuser.codegen.source import KernelSource
from fuser.runtime.loss.chunked import (
    BACKWARD_ONCE,
    BLOCK_BUDGET,
    accumulate_weight_grad,
    chunk_rows,
    eager_grads,
    fp32_logits,
    logits_buffer,
    main_grad_return,
    product_fp32,
    rounded_gradient,
)
from fuser.runtime.loss.staged import ShardedChunked, Staged


class TokenRun:
    """Everything a token rule's call needs besides its tensors: the row kernel (fp32
    logits), the hyperparameter row, the ignore index and the chunk length; ``keep``: a
    forward that backward follows keeps every token's logits (``memory="fast"``)."""

    def __init__(
        self,
        source: KernelSource,
        device: torch.device,
        hyper: torch.Tensor,
        ignore_index: int,
        chunk: int,
        keep: bool = False,
    ):
        self.kernel = load_kernel(source, device)
        self.hyper = hyper
        self.ignore_index = int(ignore_index)
        self.chunk = chunk
        self.keep = keep

    def kept_buffers(self, n_tokens: int, vocab: int, teacher: bool) -> tuple:
        """The fp32 ``[T, V]`` buffers a kept forward fills (the student's, and the teacher's
        or ``None``) for ``run``'s ``kept``."""
        student = logits_buffer(n_tokens, vocab, self.hyper)
        return student, logits_buffer(n_tokens, vocab, self.hyper) if teacher else None

    def run(
        self, x, weight, bias, target, inputs, out, *, gx=None, gw=None, gb=None, teacher=None, kept=None,
        filled=False,
    ) -> None:  # fmt: skip
        """Every output into ``out`` (fp32 ``[k, T]``); ``inputs`` (fp32 ``[m, T]``, or
        ``[m + k, T]`` with the upstream gradients after the rule's inputs). With any of
        ``gx`` (rows of the inputs' dtype), ``gw``, ``gb`` (fp32, added into) also the
        gradients of ``sum_i dout_i * output_i``. ``teacher``: the teacher's ``(hidden,
        weight, bias)`` for a kernel that reads its logits (``bias`` may be ``None``).
        ``kept`` (``kept_buffers``): every token's logits go there, chunk by chunk, or with
        ``filled`` are read from there, a forward's (no product): the gradient is written
        over them and its two products then run over every token at once."""
        n_tokens, vocab = x.shape[0], weight.shape[0]
        if n_tokens == 0:
            return
        grad = gx is not None or gw is not None or gb is not None
        if kept is None:
            buf = logits_buffer(min(self.chunk, n_tokens), vocab, self.hyper)  # (fp32, on the device)
            tbuf = None if teacher is None else logits_buffer(min(self.chunk, n_tokens), vocab, self.hyper)
        ones = torch.ones(1, dtype=torch.float32, device=x.device)
        flat_in = inputs.reshape(-1) if inputs.numel() else ones
        flat_out = out.reshape(-1)
        for s in range(0, n_tokens, self.chunk):
            e = min(s + self.chunk, n_tokens)
            xc = x[s:e]
            if kept is None:
                logits, tlogits = buf[: e - s], None if tbuf is None else tbuf[: e - s]
            else:
                logits, tlogits = kept[0][s:e], None if kept[1] is None else kept[1][s:e]
            if not filled:
                fp32_logits(logits, xc, weight, bias)
                if teacher is not None:  # (the same stride as the student's: one buffer shape)
                    fp32_logits(tlogits, teacher[0][s:e], teacher[1], teacher[2])
            extra = () if teacher is None else (tlogits,)
            self.kernel(
                (e - s,), logits, logits.stride(0), target[s:e], flat_out[s:], ones, ones, 0, self.hyper,
                vocab, self.ignore_index, int(grad), flat_in[s:] if inputs.numel() else ones, n_tokens,
                *extra,
            )  # fmt: skip
            if grad and kept is None:
                _chunk_grads(logits, xc, weight, target[s:e], 0, gx[s:e] if gx is not None else None, gw, gb)
        if grad and kept is not None:  # (both products over every token: K = T for grad_weight)
            _chunk_grads(kept[0], x, weight, target, 0, gx, gw, gb)


def _chunk_grads(logits, xc, weight, target, col_offset: int, gx, gw, gb) -> None:
    """A chunk's shares of the gradients from its fp32 logit gradient ``logits`` (columns
    ``[col_offset, ...)`` of the vocabulary; overwritten). 16-bit inputs take it rounded once,
    in place (``rounded_gradient``), for the products, and the target column's residue (its
    fp32 value less that rounding) in fp32:
    into ``gx`` before its one rounding and into ``gw``'s target rows, as the cross-entropy
    schedules add it (every token of one target would otherwise carry its rounding error
    into the same row). A 16-bit ``gw`` (the kept logits' one product over every token) is
    written, not added into, through fp32 blocks of its rows, each rounded once."""
    if xc.dtype == torch.float32:
        if gx is not None:
            torch.mm(logits, weight, out=gx)
        if gw is not None:
            accumulate_weight_grad(gw, logits, xc)
        if gb is not None:
            gb.add_(logits.sum(0))
        return
    if gb is not None:  # (from the fp32 values, before they are rounded in place)
        gb.add_(logits.sum(0))
    col = (target - col_offset).clamp(0, max(logits.shape[1] - 1, 0))[:, None]
    resid = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
    dl = rounded_gradient(logits, xc.dtype, resid, target, col_offset)  # (no copy of the chunk)
    if gx is not None:
        block = torch.empty(gx.shape, dtype=torch.float32, device=gx.device)
        product_fp32(block, dl, weight)
        if logits.shape[1]:
            block.addcmul_(resid[:, None], weight.index_select(0, col[:, 0]).float())
        gx.copy_(block)
    if gw is not None and gw.dtype != torch.float32:
        _weight_grad_rows(gw, dl, xc, resid, target)
    elif gw is not None:
        accumulate_weight_grad(gw, dl, xc)
        if logits.shape[1]:
            gw.index_add_(0, col[:, 0], resid[:, None] * xc.float())


def _weight_grad_rows(gw, dl, x, resid, target) -> None:
    """``gw = dl.T @ x`` plus each token's target-column residue in its target's row, ``gw``
    of the inputs' 16-bit dtype, through fp32 blocks of ``BLOCK_BUDGET`` bytes: a block of
    weight rows of the whole vocabulary's gradient in fp32 would be twice ``gw``'s size."""
    vocab, hid = gw.shape
    rows = max(1, BLOCK_BUDGET // max(4 * hid, 1))
    keys, order = target.sort()  # (ignored tokens' targets lie outside [0, vocab): no rows)
    edges = list(range(0, vocab, rows)) + [vocab]
    at = torch.searchsorted(keys, torch.tensor(edges, device=keys.device, dtype=keys.dtype)).tolist()
    block = torch.empty(min(rows, vocab), hid, dtype=torch.float32, device=gw.device)
    for j, a in enumerate(edges[:-1]):
        b = edges[j + 1]
        part = block[: b - a]
        product_fp32(part, dl[:, a:b].t(), x)
        mine = order[at[j] : at[j + 1]]
        if mine.numel():
            part.index_add_(0, target[mine] - a, resid[mine, None] * x[mine].float())
        gw[a:b].copy_(part)


class _WithInputs:
    """A staged kernel of a token rule called as ``ShardedChunked`` calls its kernels: the
    per-token inputs and their stride go in after ``compute_grad``."""

    def __init__(self, kernel):
        self.kernel, self.inputs, self.stride, self.teacher = kernel, None, 0, None

    def __call__(self, grid, *args):
        teacher = () if self.teacher is None else (self.teacher,)
        return self.kernel(grid, *args[:11], self.inputs, self.stride, *teacher, *args[11:])


class ShardedTokens(ShardedChunked):
    """``TokenRun``'s contract over this rank's vocabulary slice (``ShardedChunked``'s
    arguments; ``sources``: the staged kernels of the rule's fp32 plan): every rank gets
    every output; ``gx`` is summed across the group, ``gw`` and ``gb`` stay this rank's."""

    def __init__(
        self, sources, layout, zy_first, device, hyper, ignore_index, chunk, group, col_offset, total
    ):
        super().__init__(
            sources, layout, zy_first, device, hyper, ignore_index, chunk, group, col_offset, total
        )
        self.kernels = [_WithInputs(k) for k in self.kernels]

    def run(self, x, weight, bias, target, inputs, out, *, gx=None, gw=None, gb=None, teacher=None) -> None:
        n_tokens, vocab = x.shape[0], weight.shape[0]
        grad = gx is not None or gw is not None or gb is not None
        buf = logits_buffer(min(self.chunk, n_tokens), vocab, self.hyper)  # (fp32, on the device)
        tbuf = None if teacher is None else logits_buffer(min(self.chunk, n_tokens), vocab, self.hyper)
        red, parts = self._buffers(min(self.chunk, n_tokens), x.device)
        ones = torch.ones(1, dtype=torch.float32, device=x.device)
        flat_in, flat_out = (inputs.reshape(-1) if inputs.numel() else ones), out.reshape(-1)
        for s in range(0, n_tokens, self.chunk):  # (every rank runs the same chunks)
            e = min(s + self.chunk, n_tokens)
            xc, logits, r = x[s:e], buf[: e - s], red[: e - s]
            for k in self.kernels:
                k.inputs, k.stride = (flat_in[s:] if inputs.numel() else ones), n_tokens
            fp32_logits(logits, xc, weight, bias)
            if teacher is not None:  # (this rank's columns of the teacher's logits, the student's stride)
                fp32_logits(tbuf[: e - s], teacher[0][s:e], teacher[1], teacher[2])
                for k in self.kernels:
                    k.teacher = tbuf[: e - s]
            self._reduce(logits, target[s:e], flat_out[s:], r, parts)
            if grad:
                total = self._total(vocab)
                self._differentiate(logits, target[s:e], flat_out[s:], r, ones, self.col_offset, total, None)
                gxc = gx[s:e] if gx is not None else None
                _chunk_grads(logits, xc, weight, target[s:e], self.col_offset, gxc, gw, gb)
        if gx is not None:
            self._all_reduce(gx)


class VocabTokens(Staged):
    """A token rule in vocabulary chunks on one device (``Staged``'s arguments; ``sources``:
    the staged kernels of the rule's fp32 plan; ``k``: its outputs; ``cols``: vocabulary rows
    per backward slice). ``residue``: a ``Residue`` for 16-bit inputs (the target column's
    term in fp32, as the cross-entropy's ``vocab`` schedule adds it)."""

    schedule = "vocab"

    def __init__(self, sources, layout, zy_first, device, hyper, ignore_index, chunk, k: int, cols: int):
        super().__init__(sources, layout, zy_first, device, hyper, ignore_index, chunk)
        self.kernels = [_WithInputs(kernel) for kernel in self.kernels]
        self.k, self.cols = k, cols
        self._teacher = self._tbuf = None

    def _point(self, inputs: torch.Tensor, n_tokens: int, teacher_logits=None) -> None:
        for kernel in self.kernels:
            kernel.inputs, kernel.stride, kernel.teacher = inputs, n_tokens, teacher_logits

    def forward(self, x, weight, bias, target, inputs, out, teacher=None) -> torch.Tensor:
        """Every output into ``out`` (fp32 ``[k, T]``); returns the reductions ``red`` for
        ``backward``."""
        n_tokens, vocab = x.shape[0], weight.shape[0]
        red = torch.empty(n_tokens, self.layout.red_width, dtype=torch.float32, device=x.device)
        if n_tokens == 0:
            return red
        rows = min(self.chunk, n_tokens)
        buf = logits_buffer(rows, vocab, self.hyper)
        tbuf = None if teacher is None else logits_buffer(rows, vocab, self.hyper)
        _, parts = self._buffers(rows, x.device)
        ones = torch.ones(1, dtype=torch.float32, device=x.device)
        flat_in, flat_out = (inputs.reshape(-1) if inputs.numel() else ones), out.reshape(-1)
        for s in range(0, n_tokens, self.chunk):
            e = min(s + self.chunk, n_tokens)
            logits = buf[: e - s]
            fp32_logits(logits, x[s:e], weight, bias)
            t = None
            if teacher is not None:
                t = tbuf[: e - s]
                fp32_logits(t, teacher[0][s:e], teacher[1], teacher[2])
            self._point(flat_in[s:] if inputs.numel() else ones, n_tokens, t)
            self._reduce(logits, target[s:e], flat_out[s:], red[s:e], parts)
        return red

    def backward(self, red, x, weight, bias, target, inputs, teacher=None, **flags) -> tuple:
        """``(grad_hidden, grad_weight, grad_bias)`` of ``sum_i dout_i * output_i``, the
        upstream gradients after the rule's inputs in ``inputs`` (fp32 ``[m + k, T]``), as
        ``Staged.backward_vocab`` returns them (``flags``: its keywords)."""
        n_tokens = x.shape[0]
        ones = torch.ones(1, dtype=torch.float32, device=x.device)
        self._point(inputs.reshape(-1), n_tokens)
        self._teacher = teacher
        try:
            return self.backward_vocab(red, x, weight, bias, target, ones, self.cols, **flags)
        finally:
            self._teacher = self._tbuf = None

    def _slice_logits(self, x, weight, bias, v0: int, v1: int, out) -> None:
        super()._slice_logits(x, weight, bias, v0, v1, out)
        if self._teacher is not None:  # (the teacher's same columns, at the student's stride)
            tx, tw, tb = self._teacher
            if self._tbuf is None:  # (the first slice is the widest: backward_vocab's buffer's shape)
                self._tbuf = logits_buffer(out.shape[0], out.shape[1], out)
            t = self._tbuf[:, : v1 - v0]
            fp32_logits(t, tx, tw[v0:v1], tb[v0:v1] if tb is not None else None)
            for kernel in self.kernels:
                kernel.teacher = t

    def _outputs_buffer(self, n_tokens: int, device) -> torch.Tensor:
        return torch.empty(self.k * n_tokens, dtype=torch.float32, device=device)


def new_outputs(k: int, n: int, device) -> torch.Tensor:
    """The fp32 ``[k, n]`` buffer a forward's kernels write every output of every row into
    (uninitialised: tests fill it with NaN to see that each element is written)."""
    return torch.empty(k, n, dtype=torch.float32, device=device)


class TokenLoss(torch.autograd.Function):
    """A token rule's outputs of ``x @ W.T + b`` per token, each differentiable with respect
    to ``x``, ``W`` and ``b``; ``inputs`` (fp32 ``[m, T]``) take no gradient, nor do the
    teacher's ``tx``, ``tw``, ``tb`` (``None`` for a rule that reads no teacher; given
    detached). Returns the ``k`` outputs, fp32 ``[T]`` each."""

    @staticmethod
    def forward(
        ctx, x, weight, bias, target, inputs, run: TokenRun, k: int, main_grad: bool, want_grad: bool,
        tx=None, tw=None, tb=None,
    ):  # fmt: skip
        out = new_outputs(k, x.shape[0], x.device)
        teacher = None if tx is None else (tx, tw, tb)
        red = ctx.kept = None
        if isinstance(run, VocabTokens):
            red = run.forward(x, weight, bias, target, inputs, out, teacher)
        else:
            if want_grad and getattr(run, "keep", False):  # (TokenRun on one device)
                ctx.kept = run.kept_buffers(x.shape[0], weight.shape[0], tx is not None)
            keep = {} if ctx.kept is None else dict(kept=ctx.kept)  # (TokenRun's alone)
            run.run(x, weight, bias, target, inputs, out, teacher=teacher, **keep)
        ctx.run, ctx.main_grad, ctx.k, ctx.teacher = run, main_grad, k, tx is not None
        if want_grad:
            ctx.save_for_backward(x, weight, bias, target, inputs, tx, tw, tb, red)
        return tuple(out.unbind(0))

    @staticmethod
    def backward(ctx, *grads):
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        x, weight, bias, target, inputs, tx, tw, tb, red = ctx.saved_tensors
        n = x.shape[0]
        if all(g is None for g in grads) or not (need_x or need_w or need_b):
            return None, None, None, *_NO_GRADS
        dout = torch.stack(
            [
                torch.zeros(n, dtype=torch.float32, device=x.device) if g is None else g.reshape(n).float()
                for g in grads
            ]
        )
        full = torch.cat([inputs.reshape(-1, n), dout]).contiguous()
        main_grad = ctx.main_grad and need_w
        teacher = (tx, tw, tb) if ctx.teacher else None
        if red is not None:  # (vocabulary chunks: grad_weight comes slice by slice, in its dtype)
            flags = dict(need_x=need_x, need_w=need_w, need_b=need_b, main_grad=main_grad)
            gx, gw, gb = ctx.run.backward(red, x, weight, bias, target, full, teacher, **flags)
            gw = main_grad_return(weight) if main_grad else gw
            gb = gb.to(bias.dtype) if gb is not None and gb.dtype != bias.dtype else gb
            return gx, gw, gb, *_NO_GRADS
        gx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_x else None
        kept, ctx.kept = ctx.kept, None  # (a second backward, retain_graph=True, recomputes them)
        if main_grad:
            gw = weight.main_grad
        elif need_w and kept is not None and x.dtype == weight.dtype != torch.float32:
            gw = torch.empty(weight.shape, dtype=weight.dtype, device=x.device)  # (one product: written)
        else:
            gw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if need_w else None
        gb = torch.zeros(weight.shape[0], dtype=torch.float32, device=x.device) if need_b else None
        out = torch.empty(ctx.k, n, dtype=torch.float32, device=x.device)
        flags = dict(gx=gx, gw=gw, gb=gb, teacher=teacher)
        if kept is not None:
            flags.update(kept=kept, filled=True)
        ctx.run.run(x, weight, bias, target, full, out, **flags)
        if main_grad:
            gw = main_grad_return(weight)
        elif gw is not None and gw.dtype != weight.dtype:
            gw = gw.to(weight.dtype)
        if gb is not None and gb.dtype != bias.dtype:
            gb = gb.to(bias.dtype)
        return gx, gw, gb, *_NO_GRADS


class ReducedTokenLoss(torch.autograd.Function):
    """A token rule whose one output is ``loss``, reduced (``"mean"`` over ``count`` rows,
    or ``"sum"``), with ``TokenLoss``'s arguments: the gradients are taken in forward, in
    the sweep that computes the loss (one logits product a chunk fewer than forward, then
    backward, as the cross-entropy's eager schedules), and scaled by ``grad_output`` in
    backward. Holds ``grad_hidden`` and the fp32 ``grad_weight`` from forward to backward."""

    @staticmethod
    def forward(
        ctx, x, weight, bias, target, inputs, run: TokenRun, reduction: str, count: int, main_grad: bool,
        tx=None, tw=None, tb=None,
    ):  # fmt: skip
        n = x.shape[0]
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        scale = 1.0 / max(count, 1) if reduction == "mean" else 1.0
        dout = torch.full((1, n), scale, dtype=torch.float32, device=x.device)
        full = torch.cat([inputs.reshape(-1, n), dout]).contiguous()
        gx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_x else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if need_w else None
        gb = torch.zeros(weight.shape[0], dtype=torch.float32, device=x.device) if need_b else None
        out = new_outputs(1, n, x.device)
        teacher = None if tx is None else (tx, tw, tb)
        run.run(x, weight, bias, target, full, out, gx=gx, gw=gw, gb=gb, teacher=teacher)
        ctx.grads, ctx.main_grad = (gx, gw, gb), main_grad and need_w
        ctx.weight_dtype, ctx.bias_dtype = weight.dtype, None if bias is None else bias.dtype
        if ctx.main_grad:
            ctx.save_for_backward(weight)
        return out[0].sum() / max(count, 1) if reduction == "mean" else out[0].sum()

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.grads is None:
            raise RuntimeError(BACKWARD_ONCE)
        grads, ctx.grads = ctx.grads, None
        return *eager_grads(ctx, grads, grad_out), *_NO_GRADS


# The gradients of forward's arguments after x, weight and bias: none.
_NO_GRADS = (None,) * 9


def token_chunk(n_tokens: int, hidden: int, vocab: int, chunk_size: int | None) -> int:
    """Tokens per chunk of fp32 logits (``chunk_rows`` at 4 bytes a logit), or
    ``chunk_size``."""
    return chunk_size or chunk_rows(n_tokens, hidden, vocab, 4)
