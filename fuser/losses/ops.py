"""Fused ``linear + loss``: the chunked driver and its autograd ``Function``.

For each chunk of tokens, the logits ``x_chunk @ W.T (+ b)`` are computed by torch (cuBLAS
on a GPU) in the input dtype into one reused buffer; the rule's generated row kernel then
reduces each row in fp32, writes the per-token loss and overwrites the row with
``scale * d loss / d logits``; two more matmuls give the chunk's ``grad_hidden`` rows and add
its share of ``grad_weight`` into an fp32 buffer. No ``[tokens, vocab]`` or ``[vocab,
hidden]`` temporary exists besides the chunk's logits and the fp32 weight gradient itself.

Two schedules:

- *gradients in forward* (``reduction`` ``mean``/``sum``): the forward pass already
  computes every gradient; backward multiplies them by the scalar ``grad_output``. One
  logits matmul per chunk.
- *gradients in backward* (``reduction="none"``, or ``accumulate_into="main_grad"``): the
  forward pass computes only the loss; backward recomputes each chunk's logits and runs
  the kernel with the per-token ``grad_output`` as the row scale. ``grad_weight`` is
  ``sum_t g_t * dlogits_t (x) x_t``, which no scaling after the fact can produce, and
  ``main_grad`` must receive the gradient already scaled, with no ``[V, H]`` buffer on the
  side.

Vocabulary-parallel losses (``weight`` a rank's slice of the vocabulary) fit the same
driver: each reduction sweep of the plan becomes its own launch writing per-token
partials, combined across the group between sweeps.
"""

from __future__ import annotations

import torch

from fuser.cache import load_kernel
from fuser.codegen.source import KernelSource

MIB = 1 << 20
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(
            f"fused linear + loss supports float32, bfloat16 and float16 inputs, not {dtype}"
        ) from None


def chunk_rows(n_tokens: int, hidden: int, vocab: int, element_size: int) -> int:
    """Tokens per chunk: the chunk's logits get about twice the weight's bytes, within
    [256 MiB, 1 GiB].

    The weight-gradient matmul ``dlogits.T @ x`` reads and writes the fp32 ``[V, H]``
    accumulator once per chunk, so a chunk must be long (its K dimension) for that traffic
    to hide behind the multiply; but the chunk's logits are the one large temporary. For
    V = 128256 in bf16: H = 768 gives 1536 tokens (394 MB), H = 4096 gives 4096 (1 GiB).
    """
    budget = min(max(2 * vocab * hidden * element_size, 256 * MIB), 1024 * MIB)
    rows = budget // max(vocab * element_size, 1)
    if rows >= 256:
        rows = rows // 256 * 256
    return int(max(1, min(n_tokens, max(rows, 16))))


_addmm_out_dtype_ok: dict[tuple[str, torch.dtype], bool] = {}


def accumulate_weight_grad(gw: torch.Tensor, dlogits: torch.Tensor, x: torch.Tensor) -> None:
    """``gw += dlogits.T @ x`` with ``gw`` fp32, with no ``[V, H]`` temporary.

    fp16/bf16 on CUDA: ``addmm(..., out_dtype=float32, out=gw)`` multiplies in the input
    dtype and accumulates into fp32. Elsewhere (CPU, older torch), the product is taken in
    fp32 over vocabulary slices, so temporaries stay chunk-sized.
    """
    if dlogits.dtype == gw.dtype:
        gw.addmm_(dlogits.t(), x)
        return
    key = (dlogits.device.type, dlogits.dtype)
    if dlogits.is_cuda and _addmm_out_dtype_ok.get(key, True):
        try:
            torch.addmm(gw, dlogits.t(), x, out_dtype=gw.dtype, out=gw)
            _addmm_out_dtype_ok[key] = True
            return
        except (RuntimeError, NotImplementedError, TypeError):
            _addmm_out_dtype_ok[key] = False
    xf = x.float()
    step = 8192
    for v0 in range(0, dlogits.shape[1], step):
        gw[v0 : v0 + step].addmm_(dlogits[:, v0 : v0 + step].t().float(), xf)


class Chunked:
    """Everything one call needs besides its tensors: the kernel, the hyperparameter row,
    the target's ignore index, the chunk length."""

    def __init__(
        self, source: KernelSource, device: torch.device, hyper: torch.Tensor, ignore_index: int, chunk: int
    ):
        self.kernel = load_kernel(source, device)
        self.hyper = hyper
        self.ignore_index = int(ignore_index)
        self.chunk = chunk

    def run(self, x, weight, bias, target, loss_tok, *, scale=None, gx=None, gw=None, gb=None) -> None:
        """Per-token losses into ``loss_tok``; with ``scale`` (fp32, one value or one per
        token) also ``scale * dloss`` into ``gx`` (rows), ``gw`` and ``gb`` (fp32, added)."""
        n_tokens, vocab = x.shape[0], weight.shape[0]
        if n_tokens == 0:
            return
        grad = scale is not None
        buf = torch.empty(min(self.chunk, n_tokens), vocab, dtype=x.dtype, device=x.device)
        scale_stride = 0 if not grad or scale.numel() == 1 else 1
        for s in range(0, n_tokens, self.chunk):
            e = min(s + self.chunk, n_tokens)
            xc, logits = x[s:e], buf[: e - s]
            if bias is not None:
                torch.addmm(bias, xc, weight.t(), out=logits)
            else:
                torch.mm(xc, weight.t(), out=logits)
            row_scale = (scale[s:e] if scale_stride else scale) if grad else loss_tok
            self.kernel(
                (e - s,),
                logits,
                vocab,
                target[s:e],
                loss_tok[s:e],
                row_scale,
                scale_stride,
                self.hyper,
                vocab,
                self.ignore_index,
                int(grad),
            )
            if not grad:
                continue
            if gx is not None:
                torch.mm(logits, weight, out=gx[s:e])
            if gw is not None:
                accumulate_weight_grad(gw, logits, xc)
            if gb is not None:
                gb.add_(logits.sum(0, dtype=torch.float32))


class ShardedChunked(Chunked):
    """``Chunked`` for a vocabulary-parallel loss: ``weight`` (and ``bias``) hold this rank's
    contiguous slice ``[col_offset, col_offset + V_r)`` of a vocabulary of ``vocab_total``
    columns, split over ``group`` in rank order; every rank passes the same ``x`` and targets.

    Each chunk runs one launch per reduction pass of the plan; after each, the per-token
    partials of every rank are gathered with ONE collective and combined (sum: added;
    logsumexp: logsumexp of the ranks' values; max: the largest, its argmax kept by the
    first rank holding it, as the unsharded kernel keeps the first column). ``z[y]`` is read
    by the target's owner and summed across the group, in the first collective when no
    sweep needs it before. The last launch computes the same per-token loss on every rank and
    this rank's columns of the logit gradient. ``grad_weight``/``grad_bias`` stay local;
    ``grad_hidden`` is summed across the group (Megatron's backward of the column-parallel
    head).
    """

    def __init__(
        self,
        sources,
        layout,
        zy_first: bool,
        device,
        hyper,
        ignore_index,
        chunk,
        group,
        col_offset: int,
        vocab_total: int,
    ):
        import torch.distributed as dist

        self.kernels = [load_kernel(s, device) for s in sources]
        self.layout = layout
        self.zy_first = zy_first  # a sweep reads z[y]: combine it before the first launch
        self.hyper = hyper
        self.ignore_index = int(ignore_index)
        self.chunk = chunk
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.col_offset = int(col_offset)
        self.vocab_total = int(vocab_total)

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        out = torch.empty((self.world,) + tuple(t.shape), dtype=t.dtype, device=t.device)
        dist.all_gather(list(out.unbind(0)), t.contiguous(), group=self.group)
        return out

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

    def run(self, x, weight, bias, target, loss_tok, *, scale=None, gx=None, gw=None, gb=None) -> None:
        import torch.distributed as dist

        n_tokens, vocab = x.shape[0], weight.shape[0]
        if n_tokens == 0:
            return
        grad = scale is not None
        rows = min(self.chunk, n_tokens)
        buf = torch.empty(rows, vocab, dtype=x.dtype, device=x.device)
        red = torch.empty(rows, self.layout.red_width, dtype=torch.float32, device=x.device)
        n_passes = len(self.layout.part_cols)
        parts = [torch.empty(rows, w, dtype=torch.float32, device=x.device) for w in self.layout.part_widths]
        scale_stride = 0 if not grad or scale.numel() == 1 else 1
        for s in range(0, n_tokens, self.chunk):
            e = min(s + self.chunk, n_tokens)
            n = e - s
            xc, logits, r = x[s:e], buf[:n], red[:n]
            if bias is not None:
                torch.addmm(bias, xc, weight.t(), out=logits)
            else:
                torch.mm(xc, weight.t(), out=logits)
            # z[y] where this rank holds the target's column, 0 elsewhere.
            yl = target[s:e] - self.col_offset
            mine = (yl >= 0) & (yl < vocab) & (target[s:e] != self.ignore_index)
            zy = torch.where(
                mine,
                logits.gather(1, yl.clamp(0, max(vocab - 1, 0))[:, None])[:, 0].float()
                if vocab
                else torch.zeros(n, device=x.device),
                0.0,
            )
            if self.zy_first:
                dist.all_reduce(zy, group=self.group)
                r[:, 0] = zy
            row_scale = (scale[s:e] if scale_stride else scale) if grad else loss_tok
            args = (
                logits,
                vocab,
                target[s:e],
                loss_tok[s:e],
                row_scale,
                scale_stride,
                self.hyper,
                vocab,
                self.ignore_index,
            )
            for k in range(n_passes):
                part = parts[k][:n]
                self.kernels[k]((n,), *args, 0, r, part, self.col_offset, self.vocab_total)
                if k == 0 and not self.zy_first:
                    part[:, -1] = zy
                gathered = self._gather(part)
                if k == 0 and not self.zy_first:
                    r[:, 0] = gathered[:, :, -1].sum(0)
                self._combine(k, gathered, r)
            self.kernels[n_passes]((n,), *args, int(grad), r, r, self.col_offset, self.vocab_total)
            if not grad:
                continue
            if gx is not None:
                torch.mm(logits, weight, out=gx[s:e])
            if gw is not None:
                accumulate_weight_grad(gw, logits, xc)
            if gb is not None:
                gb.add_(logits.sum(0, dtype=torch.float32))
        if grad and gx is not None:
            dist.all_reduce(gx, group=self.group)


def _reduce(loss_tok: torch.Tensor, reduction: str, count: torch.Tensor) -> torch.Tensor:
    if reduction == "mean":
        return loss_tok.sum() / count.clamp(min=1)
    if reduction == "sum":
        return loss_tok.sum()
    return loss_tok


class LinearLoss(torch.autograd.Function):
    """``loss(x @ W.T + b, target)`` per token, reduced; gradients for x, W and b.

    ``x`` is ``[T, H]``, ``target`` ``[T]`` int64. Returns fp32: the per-token losses for
    ``reduction="none"``, else one number.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, target, run: Chunked, reduction: str, main_grad: bool, want_grad: bool):
        n_tokens = x.shape[0]
        count = (target != run.ignore_index).sum()  # on the device: no sync, whole batch
        loss_tok = torch.empty(n_tokens, dtype=torch.float32, device=x.device)
        ctx.run, ctx.reduction, ctx.main_grad = run, reduction, main_grad
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        ctx.eager = want_grad and reduction != "none" and not main_grad
        if ctx.eager:
            scale = (
                1.0 / count.clamp(min=1).float() if reduction == "mean" else torch.ones((), device=x.device)
            ).reshape(1)
            gx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_x else None
            gw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if need_w else None
            gb = torch.zeros(weight.shape[0], dtype=torch.float32, device=x.device) if need_b else None
            run.run(x, weight, bias, target, loss_tok, scale=scale, gx=gx, gw=gw, gb=gb)
            ctx.grads = (gx, gw, gb)
        else:
            run.run(x, weight, bias, target, loss_tok)
            if want_grad:
                ctx.save_for_backward(x, weight, bias, target, count)
        return _reduce(loss_tok, reduction, count)

    @staticmethod
    def backward(ctx, grad_out):
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if ctx.eager:
            if ctx.grads is None:
                raise RuntimeError(
                    "the gradients of a fused linear + loss were computed in its forward pass "
                    "and already handed out: backward can run through it once"
                )
            gx, gw, gb = ctx.grads
            ctx.grads = None
            go = grad_out.float()
            if gx is not None:
                gx.mul_(go)
            return (
                gx,
                _scaled(gw, go, ctx.weight_dtype),
                _scaled(gb, go, ctx.bias_dtype),
                None,
                None,
                None,
                None,
                None,
            )
        x, weight, bias, target, count = ctx.saved_tensors
        run = ctx.run
        go = grad_out.float()
        if ctx.reduction == "none":
            scale = go.reshape(-1).contiguous()
        elif ctx.reduction == "mean":
            scale = (go / count.clamp(min=1)).reshape(1)
        else:
            scale = go.reshape(1)
        gx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_x else None
        if ctx.main_grad and need_w:
            gw = weight.main_grad
        else:
            gw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if need_w else None
        gb = torch.zeros(weight.shape[0], dtype=torch.float32, device=x.device) if need_b else None
        loss_tok = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        run.run(x, weight, bias, target, loss_tok, scale=scale, gx=gx, gw=gw, gb=gb)
        if ctx.main_grad and need_w:
            gw = main_grad_return(weight)
        elif gw is not None:
            gw = _as(gw, weight.dtype)
        gb = _as(gb, bias.dtype) if gb is not None else None
        return gx, gw, gb, None, None, None, None, None


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _scaled(g: torch.Tensor | None, go: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``g * go`` in ``dtype``: in place for fp32, else one pass reading fp32, writing ``dtype``."""
    if g is None:
        return None
    if g.dtype == dtype:
        return g.mul_(go)
    return torch.mul(g, go, out=torch.empty(g.shape, dtype=dtype, device=g.device))


def main_grad_return(weight: torch.Tensor):
    """What autograd gets for a weight whose gradient went into ``weight.main_grad``
    (Megatron's contract): ``None``, unless the weight has ``grad_added_to_main_grad``: then
    that flag is set and a zero tensor is returned, so that hooks waiting for a gradient
    fire and nothing is counted twice."""
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        return torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
    return None
