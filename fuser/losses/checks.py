"""The checks of a fused linear + loss call's tensors and targets, before anything runs.

``check_tensors`` raises on shapes, dtypes, devices and ``main_grad``; ``live_rows`` is the
one host read a call makes (how many targets are ignored, which leaves their rows out of
every kernel), and in the same sum and the same device-to-host copy it counts the targets
outside the vocabulary, so the range check adds no synchronisation to a call that passes.
"""

from __future__ import annotations

import numbers

import torch

from fuser.runtime.loss.chunked import dtype_name

# What a call inside a CUDA graph capture is told: the ignored rows are left out by a
# data-dependent host read, which a capture cannot make (and a bad target could not be
# reported there except by a device-side assert, which kills the process).
CAPTURE = (
    "a fused linear + loss cannot be captured in a CUDA graph: each call reads on the host "
    "how many of its targets are ignore_index (to leave those rows out of every kernel) "
    "and checks that the others are inside the vocabulary; call it outside the capture"
)


def check_tensors(hidden, weight, target, bias, accumulate_into: str | None) -> str:
    """The inputs' dtype name, after raising the error of the first tensor of a call that is
    out of contract: shapes, dtypes, one device for all, and ``weight.main_grad`` (fp32, of
    the weight's shape, on its device, contiguous: kernels write its rows in place); then
    ``RuntimeError`` inside a CUDA graph capture (``CAPTURE``)."""
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be [T, H] or [B, S, H], not {list(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be [V, {hidden.shape[-1]}] (hidden's last size H = {hidden.shape[-1]}), "
            f"not {list(weight.shape)}"
        )
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise TypeError(
            f"hidden, weight and bias must share a dtype; got {hidden.dtype}, {weight.dtype}"
            + (f", {bias.dtype}" if bias is not None else "")
        )
    dtype = dtype_name(hidden.dtype)
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}] (weight's V), not {list(bias.shape)}")
    lead = hidden.shape[:-1]
    if target.shape != lead:
        raise ValueError(f"target must have hidden's leading shape {list(lead)}, not {list(target.shape)}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"target holds class indices (an integer tensor), not {target.dtype}")
    devices = {t.device for t in (hidden, weight, target, bias) if t is not None}
    if len(devices) != 1:
        raise ValueError(
            f"hidden, weight, target and bias must be on one device, got {sorted(map(str, devices))}"
        )
    if accumulate_into == "main_grad" and weight.requires_grad:
        _check_main_grad(weight)
    if hidden.is_cuda and torch.cuda.is_current_stream_capturing():  # (before any device work)
        raise RuntimeError(CAPTURE)
    return dtype


def _check_main_grad(weight) -> None:
    mg = getattr(weight, "main_grad", None)
    if not isinstance(mg, torch.Tensor) or mg.shape != weight.shape or mg.dtype != torch.float32:
        got = "none" if not isinstance(mg, torch.Tensor) else f"{mg.dtype} {list(mg.shape)}"
        raise ValueError(
            f"accumulate_into='main_grad' needs weight.main_grad, an fp32 tensor of weight's shape "
            f"{list(weight.shape)}; got {got}"
        )
    if mg.device != weight.device:
        raise ValueError(f"weight.main_grad must be on weight's device {weight.device}, not {mg.device}")
    if not (mg.is_contiguous() and weight.is_contiguous()):
        raise ValueError(
            "accumulate_into='main_grad' needs a contiguous weight and weight.main_grad: the gradient "
            "kernels write main_grad's rows in place"
        )


def live_rows(
    y: torch.Tensor, ignore_index, vocab: int, shape, slices=None
) -> tuple[torch.Tensor | None, int]:
    """The positions of ``y`` (flat int64 targets of a call whose ``target`` has ``shape``)
    that are not ``ignore_index`` (``None`` where that is all of them or none) and their
    count, read on the host once. Raises ``ValueError`` naming the first target outside
    ``[0, vocab)`` (``slices``: the process group's vocabulary slices, whose sum ``vocab``
    is) and nothing has run."""
    if not isinstance(ignore_index, numbers.Integral) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, not {ignore_index!r}")
    n = y.shape[0]
    if n == 0:
        return None, 0
    ignored = y == ignore_index
    out = y.clamp(0, vocab - 1) != y if vocab else torch.ones_like(ignored)
    # an ignored target counts n + 1, another one out of range 1: both counts in one sum
    packed = int(torch.where(ignored, n + 1, out).sum())  # (the call's one device-to-host copy)
    n_ignored, n_bad = divmod(packed, n + 1)
    if n_bad:  # (reads more, to say which: nothing runs after it)
        first = int((out & ~ignored).to(torch.uint8).argmax())  # (argmax: the first of the maxima)
        raise ValueError(_out_of_range(shape, first, int(y[first]), n_bad, vocab, ignore_index, slices))
    n_keep = n - n_ignored
    if 0 < n_keep < n:  # (the count is known: no second synchronisation for the positions)
        return torch.nonzero_static(~ignored, size=n_keep)[:, 0], n_keep
    return None, n_keep


def _out_of_range(shape, first: int, value: int, n_bad: int, vocab: int, ignore_index: int, slices) -> str:
    at = ", ".join(str(i) for i in _unravel(first, shape))
    where = f"the vocabulary of {vocab} classes"
    if slices is not None:
        where = (
            f"the global vocabulary of {vocab} classes (the process group's slices: "
            f"{' + '.join(map(str, slices))})"
        )
    more = f" ({n_bad} targets are out of range, this is the first)" if n_bad > 1 else ""
    return (
        f"target[{at}] = {value} is outside {where}: a target must be in [0, {vocab - 1}] "
        f"or ignore_index ({ignore_index}){more}; nothing was computed"
    )


def _unravel(flat: int, shape) -> list[int]:
    out = []
    for size in reversed(tuple(shape) or (1,)):
        out.append(flat % size)
        flat //= size
    return out[::-1]
