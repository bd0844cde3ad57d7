"""Fused ``linear + loss``: the row kernel's chunked driver and the autograd ``Function``
(which also runs the staged schedules of ``fuser.runtime.loss.staged``).

For each chunk of tokens, the logits ``x_chunk @ W.T (+ b)`` are computed by torch (cuBLAS
on a GPU) into one reused fp32 buffer, from products of the inputs' dtype accumulated in
fp32 and never rounded (``fp32_logits``); the rule's generated row kernel, lowered for fp32
logits, then reduces each row, writes the per-token loss and overwrites the row with
``scale * d loss / d logits`` in fp32. For 16-bit inputs that gradient is rounded once, in
place, to the inputs' dtype (``rounded_gradient``, which keeps the target column's residue
aside); two more matmuls give the chunk's ``grad_hidden`` rows and add its share of
``grad_weight`` into an fp32 buffer. No ``[tokens, vocab]`` or ``[vocab, hidden]``
temporary exists besides the chunk's logits and the fp32 weight gradient itself.

Two schedules:

- *gradients in forward* (``reduction`` ``mean``/``sum``, bf16 and fp32 inputs): the
  forward pass already computes every gradient; backward multiplies them by the scalar
  ``grad_output``. One logits matmul per chunk.
- *gradients in backward* (``reduction="none"``, ``accumulate_into="main_grad"``, or fp16
  inputs: ``d loss / d logits`` is rounded to the inputs' dtype, and in fp16 a softmax
  term taken in forward, scaled by ``1 / T`` but not yet by a loss scale such as
  ``torch.amp.GradScaler``'s, rounds to 0 under 6e-8): the
  forward pass computes only the loss; backward recomputes each chunk's (fp32) logits and runs
  the kernel with the per-token ``grad_output`` as the row scale. ``grad_weight`` is
  ``sum_t g_t * dlogits_t (x) x_t``, which no scaling after the fact can produce, and
  ``main_grad`` must receive the gradient already scaled, with no ``[V, H]`` buffer on the
  side.
- ``main_grad`` *buffered* (``memory="fast"``): gradients in forward as for ``mean``/``sum``,
  the weight's into the fp32 ``[V, H]`` buffer; backward adds ``grad_output`` times it into
  ``weight.main_grad`` (one logits matmul per chunk, at the buffer's memory).

Vocabulary-parallel losses (``weight`` a rank's slice of the vocabulary) fit the same
driver: each reduction sweep of the plan becomes its own launch writing per-token
partials, combined across the group between sweeps.
"""

from __future__ import annotations

from functools import cache

import torch

from fuser.cache import load_kernel
from fuser.codegen.loss_matmul import GRAD_SCALE_BLOCK, render_grad_scale
from fuser.codegen.source import KernelSource

MIB = 1 << 20
# Bytes of a logit in every schedule's buffers: fp32, whatever the inputs' dtype.
LOGIT_SIZE = 4
# The fp32 block a 16-bit gradient passes through to take the target residue before its one
# rounding (cuBLAS may add C after rounding: benchmarks/results/cublas_c_probe_2026-11-27.txt).
BLOCK_BUDGET = 64 * MIB
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(
            f"fused linear + loss supports float32, bfloat16 and float16 inputs, not {dtype}"
        ) from None


def chunk_rows(
    n_tokens: int, hidden: int, vocab: int, element_size: int, logit_size: int = LOGIT_SIZE
) -> int:
    """Tokens per chunk: the chunk's logits (``logit_size`` bytes each: fp32, as every schedule
    keeps them, or the inputs' for the scaled schedule's ``E``) get what 1 GiB leaves after
    the fp32 ``[V, H]`` weight-gradient accumulator and ``grad_hidden``, but at least twice
    the weight's bytes, within [256 MiB, 1 GiB].

    The weight-gradient matmul ``dlogits.T @ x`` reads and writes the fp32 accumulator once
    per chunk, so a chunk must be long (its K dimension) for that traffic to hide behind the
    multiply; but the chunk's logits are the one large temporary. For V = 128256 in bf16:
    H = 768 and 32768 tokens give 1024 tokens of fp32 logits (525 MB), H = 4096 gives 2048
    (1.05 GB, under 1 GiB).
    """
    rest = 1024 * MIB - 4 * vocab * hidden - n_tokens * hidden * element_size
    budget = min(max(2 * vocab * hidden * element_size, rest, 256 * MIB), 1024 * MIB)
    rows = budget // max(vocab * logit_size, 1)
    if rows >= 256:
        rows = rows // 256 * 256
    return int(max(1, min(n_tokens, max(rows, 16))))


def processor_count(device: torch.device) -> int:
    """The programs that run at once on ``device``, for persistent grids: its streaming
    multiprocessors (4 in Triton's interpreter, so that tests cross several tiles each)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


class HostValue:
    """A one-element device tensor's value for the host, copied where the stream reaches it
    (into pinned memory, without waiting) so that ``read`` waits for that point of the
    stream only, not for the work queued after it."""

    def __init__(self, t: torch.Tensor):
        self.event = None
        if t.device.type == "cuda":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.value = host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(t.device))
        else:
            self.value = t

    def read(self):
        if self.event is not None:
            self.event.synchronize()
        return self.value.item()


def logits_buffer(rows: int, cols: int, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised ``[rows, cols]`` buffer of ``dtype`` (else ``like``'s) on ``like``'s
    device whose rows are a multiple of 8 elements apart, so that every row is 16-byte
    aligned (the loss kernels load and store full blocks 16 bytes at a time, and assume it).
    The padding is zeroed: a matmul may read a row's padding along with it (CPU bf16 GEMMs
    do), and uninitialised memory can hold NaN, which zeros elsewhere would not cancel."""
    width = -(-cols // 8) * 8
    buf = torch.empty(rows, width, dtype=dtype or like.dtype, device=like.device)
    if width != cols:
        buf[:, cols:].zero_()
    return buf[:, :cols]


_addmm_out_dtype_ok: dict[tuple[str, torch.dtype], bool] = {}


def accumulate_mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` with ``out`` fp32 and ``a``, ``b`` of the input dtype, with no
    temporary of ``out``'s size.

    fp16/bf16 on CUDA: ``addmm(..., out_dtype=float32, out=out)`` multiplies in the input
    dtype and accumulates into fp32. Elsewhere (CPU, older torch), the product is taken in
    fp32 over slices of ``out``'s rows, so temporaries stay slice-sized.
    """
    if a.dtype == out.dtype:
        out.addmm_(a, b)
        return
    key = (a.device.type, a.dtype)
    if a.is_cuda and _addmm_out_dtype_ok.get(key, True):
        try:
            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
            _addmm_out_dtype_ok[key] = True
            return
        except (RuntimeError, NotImplementedError, TypeError):
            _addmm_out_dtype_ok[key] = False
    bf = b.float()
    step = 8192
    for r0 in range(0, a.shape[0], step):
        out[r0 : r0 + step].addmm_(a[r0 : r0 + step].float(), bf)


def product_fp32(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out = a @ b`` with ``out`` fp32 (``accumulate_mm`` on a zeroed ``out`` where CUDA's
    ``addmm`` with ``beta=0`` cannot write fp32 from the inputs' dtype)."""
    key = (a.device.type, a.dtype)
    if a.is_cuda and a.dtype != out.dtype and _addmm_out_dtype_ok.get(key, True):
        try:
            torch.addmm(out, a, b, beta=0, out_dtype=out.dtype, out=out)
            return
        except (RuntimeError, NotImplementedError, TypeError):
            _addmm_out_dtype_ok[key] = False
    out.zero_()
    accumulate_mm(out, a, b)


def fp32_logits(logits, x, weight, bias) -> None:
    """``logits = x @ weight.T (+ bias)`` into the fp32 ``logits``, from products of the
    inputs' dtype accumulated in fp32 (``product_fp32``)."""
    product_fp32(logits, x, weight.t())
    if bias is not None:
        logits.add_(bias)


# Columns of a row that ``round_in_place`` copies aside before writing over them.
HEAD_COLS = 256


def round_in_place(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``z`` (fp32 ``[n, v]``, each row contiguous) rounded to the 16-bit ``dtype`` in its own
    memory: a ``[n, v]`` view of ``dtype`` whose rows start where ``z``'s do (so still 16-byte
    aligned), with no buffer of ``z``'s size besides. Columns ``[c, 2c)`` are written over the
    fp32 columns ``[c / 2, c)``, which the slices before read; the first ``HEAD_COLS`` pass
    through a copy of ``[n, HEAD_COLS]``."""
    n, v = z.shape
    if n == 0 or v == 0:
        return z.to(dtype)
    out = z.view(dtype)[:, :v]
    c = min(v, HEAD_COLS)
    head = z[:, :c].to(dtype)
    while c < v:
        e = min(2 * c, v)
        out[:, c:e].copy_(z[:, c:e])
        c = e
    out[:, : head.shape[1]].copy_(head)
    return out


def rounded_gradient(dz, dtype, resid=None, target=None, col_offset: int = 0) -> torch.Tensor:
    """``dz`` (fp32 ``scale * d loss / d logits`` of columns ``[col_offset, ...)`` of the
    vocabulary) for the gradient matmuls in the inputs' ``dtype``: ``dz`` itself for fp32,
    else rounded once, in place (``round_in_place``). With ``resid`` (fp32 ``[n]``) the target
    column's residue, ``dz[t, y_t]`` less its rounding, goes there for the tokens whose
    target these columns hold (``fuser.runtime.loss.residue`` adds it back in fp32)."""
    if dtype == torch.float32:
        return dz
    n, v = dz.shape
    if resid is None or n == 0 or v == 0:
        return round_in_place(dz, dtype)
    y = target - col_offset
    mine = (y >= 0) & (y < v)
    col = y.clamp(0, v - 1)[:, None]
    exact = dz.gather(1, col)[:, 0]
    low = round_in_place(dz, dtype)
    torch.where(mine, exact - low.gather(1, col)[:, 0].float(), resid, out=resid)
    return low


def accumulate_weight_grad(gw: torch.Tensor, dlogits: torch.Tensor, x: torch.Tensor) -> None:
    """``gw += dlogits.T @ x`` with ``gw`` fp32 (``accumulate_mm``)."""
    accumulate_mm(gw, dlogits.t(), x)


class Chunked:
    """Everything one call needs besides its tensors: the kernel, the hyperparameter row,
    the target's ignore index, the chunk length; ``residue``, a ``Residue`` where the kernel
    writes the target column's residue (16-bit logits)."""

    residue = None

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
        buf = logits_buffer(min(self.chunk, n_tokens), vocab, x, torch.float32)
        scale_stride = 0 if not grad or scale.numel() == 1 else 1
        residue = self.residue if grad else None
        resid = residue.buffer(n_tokens, x.device) if residue else loss_tok
        for s in range(0, n_tokens, self.chunk):
            e = min(s + self.chunk, n_tokens)
            xc, logits = x[s:e], buf[: e - s]
            fp32_logits(logits, xc, weight, bias)
            row_scale = (scale[s:e] if scale_stride else scale) if grad else loss_tok
            self.kernel(
                (e - s,), logits, logits.stride(0), target[s:e], loss_tok[s:e], resid[s:e], row_scale,
                scale_stride, self.hyper, vocab, self.ignore_index, int(grad),
            )  # fmt: skip
            if grad:
                chunk_grads(logits, xc, weight, target[s:e], 0, residue, resid[s:e], gx, gw, gb, s)
        if residue and gw is not None:
            residue_rows(residue, x, target, resid, 0, vocab, gw, None)


def chunk_grads(dz, xc, weight, target, col_offset: int, residue, resid, gx, gw, gb, start: int) -> None:
    """A chunk's shares of the gradients from its fp32 logit gradient ``dz`` (columns
    ``[col_offset, ...)``; overwritten): ``grad_bias`` summed from it in fp32, then the
    matmuls from it rounded to the inputs' dtype (``rounded_gradient``, the target column's
    residue into ``resid`` where ``residue`` adds it), ``gx``'s rows ``start`` on."""
    if gb is not None:
        gb.add_(dz.sum(0))
    dl = rounded_gradient(dz, xc.dtype, resid if residue else None, target, col_offset)
    if gx is not None:
        hidden_grad(gx[start : start + dz.shape[0]], dl, weight, residue, resid, target, col_offset)
    if gw is not None:
        accumulate_weight_grad(gw, dl, xc)


def hidden_grad(gx, dlogits, weight, residue, resid, target, col_offset: int) -> None:
    """``gx = dlogits @ weight`` (``gx`` of the inputs' dtype); with ``residue``, through
    fp32 blocks of rows that take the target column's term ``resid[t] * W[y_t]`` before
    their one rounding."""
    if residue is None:
        torch.mm(dlogits, weight, out=gx)
        return
    n, hid = gx.shape
    rows = max(1, BLOCK_BUDGET // max(4 * hid, 1))
    block = torch.empty(min(rows, n), hid, dtype=torch.float32, device=gx.device)
    for s in range(0, n, rows):
        e = min(s + rows, n)
        part = block[: e - s]
        product_fp32(part, dlogits[s:e], weight)
        residue.hidden(resid[s:e], weight, target[s:e], col_offset, part)
        gx[s:e].copy_(part)


def residue_rows(residue, x, target, resid, col_offset: int, n_cols: int, gw, gb) -> None:
    """The residue's terms of the fp32 ``gw`` (``[n_cols, H]``, or ``None``) and ``gb``."""
    runs = residue.runs(target, col_offset, n_cols)
    if gw is not None:
        residue.weight_rows(gw, x, resid, runs)
    if gb is not None:
        residue.bias_rows(gb, resid, runs, x.dtype)


def _reduce(loss_tok: torch.Tensor, reduction: str, count: int) -> torch.Tensor:
    if reduction == "mean":
        return loss_tok.sum() / max(count, 1)
    if reduction == "sum":
        return loss_tok.sum()
    return loss_tok


class LinearLoss(torch.autograd.Function):
    """``loss(x @ W.T + b, target)`` per token, reduced; gradients for x, W and b.

    ``x`` is ``[T, H]``, ``target`` ``[T]`` int64, ``count`` how many of its targets are not
    ``ignore_index`` (the mean's denominator, which the caller read on the host when it left
    the ignored rows out); ``in_forward``: the gradients are taken in forward (the schedule's
    plan, ``fuser.runtime.loss.choice.SchedulePlan``). Returns fp32: the per-token losses for
    ``reduction="none"``, else one number.
    """

    @staticmethod
    def forward(
        ctx, x, weight, bias, target, run: Chunked, reduction: str, main_grad: bool, want_grad: bool,
        in_forward: bool, count: int,
    ):  # fmt: skip
        n_tokens = x.shape[0]
        loss_tok = torch.empty(n_tokens, dtype=torch.float32, device=x.device)
        ctx.run, ctx.reduction, ctx.main_grad, ctx.count = run, reduction, main_grad, count
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        ctx.schedule = getattr(run, "schedule", "chunks")
        if not want_grad and ctx.schedule != "fused":
            ctx.schedule = "chunks"
        ctx.eager = in_forward
        if ctx.schedule == "fused":
            red = run.forward(x, weight, bias, target, loss_tok)
            if want_grad:
                ctx.save_for_backward(x, weight, bias, target, red)
        elif ctx.schedule == "whole":
            ctx.kept = run.forward_whole(x, weight, bias, target, loss_tok)
            ctx.save_for_backward(x, weight, bias, target)
        elif ctx.schedule == "vocab":
            red = run.forward_reductions(x, weight, bias, target, loss_tok)
            ctx.save_for_backward(x, weight, bias, target, red)
        elif ctx.eager:
            value = 1.0 / max(count, 1) if reduction == "mean" else 1.0
            scale = torch.full((1,), value, dtype=torch.float32, device=x.device)
            gx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_x else None
            gw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if need_w else None
            gb = torch.zeros(weight.shape[0], dtype=torch.float32, device=x.device) if need_b else None
            run.run(x, weight, bias, target, loss_tok, scale=scale, gx=gx, gw=gw, gb=gb)
            ctx.grads = (gx, gw, gb)
            if main_grad:  # (backward adds grad_output * gw into its main_grad)
                ctx.save_for_backward(weight)
        else:
            run.run(x, weight, bias, target, loss_tok)
            if want_grad:
                ctx.save_for_backward(x, weight, bias, target)
        return _reduce(loss_tok, reduction, count)

    @staticmethod
    def backward(ctx, grad_out):
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if ctx.eager:
            if ctx.grads is None:
                raise RuntimeError(BACKWARD_ONCE)
            grads, ctx.grads = ctx.grads, None
            resolve = getattr(ctx.run, "resolve", None)  # the scaled schedule's range check
            if resolve is not None and ctx.main_grad:
                resolve()  # (before anything is added into main_grad)
                resolve = None
            out = eager_grads(ctx, grads, grad_out)
            if resolve is not None and resolve():  # (read with the above queued: the GPU works on)
                out = eager_grads(ctx, grads, grad_out)  # (the rerun rewrote gx and gw)
            return *out, *_NO_GRADS
        run = ctx.run
        x, weight, bias, target, *red = ctx.saved_tensors
        scale = _grad_scale(grad_out, ctx.reduction, ctx.count)
        main_grad = ctx.main_grad and need_w
        if ctx.schedule in ("whole", "vocab", "fused"):
            flags = dict(need_x=need_x, need_w=need_w, need_b=need_b, main_grad=main_grad)
            if ctx.schedule == "fused":
                gx, gw, gb = run.backward(red[0], x, weight, bias, target, scale, **flags)
            elif ctx.schedule == "whole":
                if ctx.kept is None:
                    raise RuntimeError(BACKWARD_ONCE)
                (logits, kept_red), ctx.kept = ctx.kept, None
                gx, gw, gb = run.backward_whole(logits, kept_red, x, weight, target, scale, **flags)
            else:
                gx, gw, gb = run.backward_vocab(red[0], x, weight, bias, target, scale, run.cols, **flags)
        else:
            gx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_x else None
            if main_grad:
                gw = weight.main_grad
            else:
                gw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if need_w else None
            gb = torch.zeros(weight.shape[0], dtype=torch.float32, device=x.device) if need_b else None
            loss_tok = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
            run.run(x, weight, bias, target, loss_tok, scale=scale, gx=gx, gw=gw, gb=gb)
        if main_grad:
            gw = main_grad_return(weight)
        elif gw is not None:
            gw = _as(gw, weight.dtype)
        gb = _as(gb, bias.dtype) if gb is not None else None
        return gx, gw, gb, *_NO_GRADS


# The gradients of forward's arguments after x, weight and bias: none.
_NO_GRADS = (None,) * 7

BACKWARD_ONCE = (
    "the gradients of a fused linear + loss were computed in its forward pass, or its logits "
    "kept for one backward, and already used: backward can run through it once"
)


def eager_grads(ctx, grads, grad_out) -> tuple:
    """The gradients a forward computed, times ``grad_output``: ``grad_hidden`` in place,
    ``grad_weight`` rounded to the weight's dtype (or added into its ``main_grad``),
    ``grad_bias`` to the bias's."""
    gx, gw, gb = grads
    go = grad_out.float()
    if gx is not None:
        _scaled(gx, go, gx.dtype)
    if ctx.main_grad and gw is not None:
        (weight,) = ctx.saved_tensors
        weight.main_grad.addcmul_(gw, go)  # (one pass over the buffer and main_grad)
        gw = main_grad_return(weight)
    else:
        gw = _scaled(gw, go, ctx.weight_dtype)
    return gx, gw, _scaled(gb, go, ctx.bias_dtype)


def _grad_scale(grad_out: torch.Tensor, reduction: str, count: int) -> torch.Tensor:
    """fp32 factor of each token's ``d loss / d logits``: one value, or one per token."""
    go = grad_out.float()
    if reduction == "none":
        return go.reshape(-1).contiguous()
    if reduction == "mean":
        return (go / max(count, 1)).reshape(1)
    return go.reshape(1)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _scaled(g: torch.Tensor | None, go: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``g * go`` in ``dtype`` (``go``: one fp32 value on the device): in place for fp32, else
    by the ``grad_scale`` kernel, one pass reading ``g`` and writing ``dtype`` (in place where
    ``g`` has it already), rounded once. ``g`` is a gradient the forward allocated: whole,
    contiguous and 16-byte aligned, as the kernel takes it."""
    if g is None:
        return None
    if g.dtype == dtype == torch.float32:
        return g.mul_(go)
    out = g if g.dtype == dtype else torch.empty(g.shape, dtype=dtype, device=g.device)
    if g.numel():
        kernel = _grad_scale_kernel(dtype_name(g.dtype), dtype_name(dtype), g.device)
        kernel((-(-g.numel() // GRAD_SCALE_BLOCK),), g, go.reshape(1), out, g.numel())
    return out


@cache
def _grad_scale_kernel(src: str, dst: str, device: torch.device):
    return load_kernel(render_grad_scale(src, dst), device)


def main_grad_return(weight: torch.Tensor):
    """What autograd gets for a weight whose gradient went into ``weight.main_grad``
    (Megatron's contract): ``None``, unless the weight has ``grad_added_to_main_grad``: then
    that flag is set and a zero tensor is returned, so that hooks waiting for a gradient
    fire and nothing is counted twice."""
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        return torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
    return None
