"""Token rules (per-token inputs, several per-token outputs): the chunked driver and the
autograd ``Function``.

For each chunk of tokens the logits ``x_chunk @ W.T (+ b)`` are taken into an fp32 buffer
(products of the inputs' dtype accumulated in fp32 and never rounded), and the rule's row
kernel, lowered for fp32 logits, writes every output of every token. Backward takes the
upstream gradient of each output (zero for one autograd gives none), recomputes each
chunk's logits and runs the same kernel with them as per-token inputs: it overwrites the
row with ``d (sum_i dout_i * output_i) / d logits`` in fp32, which gives the chunk's
``grad_hidden`` rows and its share of the fp32 ``grad_weight`` (through the inputs' dtype
for 16-bit inputs: the one rounding of the logit gradient, as the ``chunks`` schedule's).
"""

from __future__ import annotations

import torch

from fuser.cache import load_kernel
from fuser.codegen.source import KernelSource
from fuser.runtime.loss.chunked import (
    accumulate_weight_grad,
    chunk_rows,
    logits_buffer,
    main_grad_return,
    product_fp32,
)


class TokenRun:
    """Everything a token rule's call needs besides its tensors: the row kernel (fp32
    logits), the hyperparameter row, the ignore index and the chunk length."""

    def __init__(
        self, source: KernelSource, device: torch.device, hyper: torch.Tensor, ignore_index: int, chunk: int
    ):
        self.kernel = load_kernel(source, device)
        self.hyper = hyper
        self.ignore_index = int(ignore_index)
        self.chunk = chunk

    def run(self, x, weight, bias, target, inputs, out, *, gx=None, gw=None, gb=None) -> None:
        """Every output into ``out`` (fp32 ``[k, T]``); ``inputs`` (fp32 ``[m, T]``, or
        ``[m + k, T]`` with the upstream gradients after the rule's inputs). With any of
        ``gx`` (rows of the inputs' dtype), ``gw``, ``gb`` (fp32, added into) also the
        gradients of ``sum_i dout_i * output_i``."""
        n_tokens, vocab = x.shape[0], weight.shape[0]
        if n_tokens == 0:
            return
        grad = gx is not None or gw is not None or gb is not None
        buf = logits_buffer(min(self.chunk, n_tokens), vocab, self.hyper)  # (fp32, on the device)
        ones = torch.ones(1, dtype=torch.float32, device=x.device)
        flat_in = inputs.reshape(-1) if inputs.numel() else ones
        flat_out = out.reshape(-1)
        wt = weight.t()
        for s in range(0, n_tokens, self.chunk):
            e = min(s + self.chunk, n_tokens)
            xc, logits = x[s:e], buf[: e - s]
            product_fp32(logits, xc, wt)
            if bias is not None:
                logits.add_(bias.float())
            self.kernel(
                (e - s,), logits, logits.stride(0), target[s:e], flat_out[s:], ones, ones, 0, self.hyper,
                vocab, self.ignore_index, int(grad), flat_in[s:] if inputs.numel() else ones, n_tokens,
            )  # fmt: skip
            if not grad:
                continue
            dl = logits if x.dtype == torch.float32 else logits.to(x.dtype)
            if gx is not None:
                torch.mm(dl, weight, out=gx[s:e])
            if gw is not None:
                accumulate_weight_grad(gw, dl, xc)
            if gb is not None:
                gb.add_(logits.sum(0))


class TokenLoss(torch.autograd.Function):
    """A token rule's outputs of ``x @ W.T + b`` per token, each differentiable with respect
    to ``x``, ``W`` and ``b``; ``inputs`` (fp32 ``[m, T]``) take no gradient. Returns the
    ``k`` outputs, fp32 ``[T]`` each."""

    @staticmethod
    def forward(
        ctx, x, weight, bias, target, inputs, run: TokenRun, k: int, main_grad: bool, want_grad: bool
    ):
        out = torch.empty(k, x.shape[0], dtype=torch.float32, device=x.device)
        run.run(x, weight, bias, target, inputs, out)
        ctx.run, ctx.main_grad, ctx.k = run, main_grad, k
        if want_grad:
            ctx.save_for_backward(x, weight, bias, target, inputs)
        return tuple(out.unbind(0))

    @staticmethod
    def backward(ctx, *grads):
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        x, weight, bias, target, inputs = ctx.saved_tensors
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
        gx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_x else None
        if main_grad:
            gw = weight.main_grad
        else:
            gw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if need_w else None
        gb = torch.zeros(weight.shape[0], dtype=torch.float32, device=x.device) if need_b else None
        out = torch.empty(ctx.k, n, dtype=torch.float32, device=x.device)
        ctx.run.run(x, weight, bias, target, full, out, gx=gx, gw=gw, gb=gb)
        if main_grad:
            gw = main_grad_return(weight)
        elif gw is not None and gw.dtype != weight.dtype:
            gw = gw.to(weight.dtype)
        if gb is not None and gb.dtype != bias.dtype:
            gb = gb.to(bias.dtype)
        return gx, gw, gb, *_NO_GRADS


# The gradients of forward's arguments after x, weight and bias: none.
_NO_GRADS = (None,) * 6


def token_chunk(n_tokens: int, hidden: int, vocab: int, chunk_size: int | None) -> int:
    """Tokens per chunk of fp32 logits (``chunk_rows`` at 4 bytes a logit), or
    ``chunk_size``."""
    return chunk_size or chunk_rows(n_tokens, hidden, vocab, 4)
