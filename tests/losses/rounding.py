"""The epilogue's own fp32 rounding, estimated by Monte Carlo arithmetic (Parker, 1997).

A loss's gradient often cancels: ``d_y = p_y - 1`` of a confident token is ~1e-6 while
``p_y`` and ``1`` are ~1, and ``p_y = exp(z_y - lse)`` carries the rounding of ``lse``,
about ``U * |lse|``. The error of ``d_y`` is then a fraction of its terms' magnitude, not
of ``|d_y|`` itself, and which terms cancel depends on the rule. So the rule runs in float64
under ``Rounding``, which moves every floating-point result, forward and backward, by the
largest error fp32 could make there, with a random sign:

    elementwise      U |result|
    sum, mean of n   U (|result| + depth(n) sum |terms|)          (/ n for the mean)
    logsumexp of n   U (|result| + depth(n) + sum_v p_v |x_v - result|)

``depth(n)`` is a sweep's summation depth (``reference.epilogue_depth`` without its 16
elementwise operations). Selections (views, gathers, where, clamp, abs, max) are exact.
To first order, the result of one run moves by ``sum_k J_k s_k e_k`` (sensitivity ``J_k``
of the output to the k-th rounding, its size ``e_k``, a random sign ``s_k``): the root mean
square over runs estimates ``sqrt(sum (J_k e_k)**2)``. fp32's own roundings are errors of
at most ``e_k`` each, spread over ``[-e_k, e_k]``: their sum's standard deviation is at most
that root mean square over sqrt(3). ``FACTOR`` root mean squares is therefore more than
5 standard deviations of the kernel's error; ``SLACK`` (tests/numerics.py) more covers a
kernel that orders the same operations differently.
"""

from __future__ import annotations

import math

import torch
from numerics import U
from torch.utils._python_dispatch import TorchDispatchMode

SAMPLES = 16
FACTOR = 3.0

aten = torch.ops.aten

# Operations whose fp32 result is exact: data movement, selection, sign changes.
EXACT = {
    aten.abs,
    aten.alias,
    aten.amax,
    aten.amin,
    aten.argmax,
    aten.as_strided,
    aten.clamp,
    aten.clamp_max,
    aten.clamp_min,
    aten.clone,
    aten.copy_,
    aten.detach,
    aten.empty,
    aten.empty_like,
    aten.eq,
    aten.expand,
    aten.fill_,
    aten.full,
    aten.full_like,
    aten.gather,
    aten.ge,
    aten.gt,
    aten.index,
    aten.index_select,
    aten.le,
    aten.lift_fresh,
    aten.lift_fresh_copy,
    aten.lt,
    aten.masked_fill,
    aten.max,
    aten.maximum,
    aten.min,
    aten.minimum,
    aten.ne,
    aten.neg,
    aten.new_empty,
    aten.new_empty_strided,
    aten.new_zeros,
    aten.ones,
    aten.ones_like,
    aten.permute,
    aten.reshape,
    aten.scalar_tensor,
    aten.scatter,
    aten.select,
    aten.select_backward,
    aten.sgn,
    aten.sign,
    aten.slice,
    aten.slice_backward,
    aten.squeeze,
    aten.t,
    aten.transpose,
    aten.unsqueeze,
    aten.view,
    aten._to_copy,
    aten._unsafe_view,
    aten.where,
    aten.zeros,
    aten.zeros_like,
}


def depth(n: int) -> int:
    """Summation depth of a sweep over n values: a tree per block, the blocks chained."""
    return math.ceil(math.log2(max(n, 2))) + 8 + math.ceil(n / 64)


def _reduced(x: torch.Tensor, dims) -> tuple[list[int], int]:
    if dims is None or (not isinstance(dims, int) and len(dims) == 0):
        dims = list(range(x.dim()))
    dims = [dims] if isinstance(dims, int) else [d % x.dim() for d in dims]
    return dims, math.prod(x.shape[d] for d in dims)


def _arg(args, kwargs, i, name, default):
    return args[i] if len(args) > i else kwargs.get(name, default)


def rounding_error(func, args, kwargs, out: torch.Tensor) -> torch.Tensor:
    """The largest error fp32 can make in computing ``out = func(*args, **kwargs)``."""
    op = func.overloadpacket
    x = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if op in (aten.sum, aten.mean) and x is not None and x.dim() > 0:
        dims, n = _reduced(x, _arg(args, kwargs, 1, "dim", None))
        terms = x.abs().sum(dims, keepdim=bool(_arg(args, kwargs, 2, "keepdim", False)))
        terms = terms / n if op is aten.mean else terms
        return U * (out.abs() + depth(n) * terms.reshape(out.shape))
    if op is aten.logsumexp:
        dims, n = _reduced(x, _arg(args, kwargs, 1, "dim", None))
        keep = bool(_arg(args, kwargs, 2, "keepdim", False))
        lse = out if keep else out.reshape([1 if d in dims else s for d, s in enumerate(x.shape)])
        spread = (torch.exp(x - lse) * (x - lse).abs()).sum(dims, keepdim=keep)
        return U * (out.abs() + depth(n) + spread)
    return U * out.abs()


class Rounding(TorchDispatchMode):
    """Moves every floating-point result by its ``rounding_error``, with random signs."""

    def __init__(self, generator: torch.Generator):
        super().__init__()
        self.generator = generator

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.overloadpacket in EXACT or not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return out
        signs = torch.randint(0, 2, out.shape, generator=self.generator, dtype=out.dtype) * 2 - 1
        noise = signs * rounding_error(func, args, kwargs, out)
        if func._schema.is_mutable:
            return out.add_(noise)
        return out + noise


def _loss_and_gradient(per_token, z, y):
    z = z.detach().clone().requires_grad_()
    loss = per_token(z, y)
    (grad,) = torch.autograd.grad(loss.sum(), z)
    return loss.detach(), grad


def own_rounding(per_token, z, y, samples: int = SAMPLES) -> tuple[torch.Tensor, torch.Tensor]:
    """``FACTOR`` root mean squares of how far fp32's rounding moves the per-token loss [N]
    and its gradient [N, V] of ``per_token`` at float64 logits ``z`` (rows independent)."""
    loss, grad = _loss_and_gradient(per_token, z, y)
    generator = torch.Generator().manual_seed(0)
    dl = torch.zeros_like(loss)
    dg = torch.zeros_like(grad)
    for _ in range(samples):
        with Rounding(generator):
            moved_loss, moved_grad = _loss_and_gradient(per_token, z, y)
        dl += (moved_loss - loss) ** 2
        dg += (moved_grad - grad) ** 2

    def spread(sq):
        # A rounding that overflows where float64 does not adds nothing: the other terms stay.
        return FACTOR * torch.nan_to_num((sq / samples).sqrt(), nan=0.0, posinf=0.0)

    return spread(dl), spread(dg)
