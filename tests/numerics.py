"""What fp32 arithmetic can guarantee: error bounds for comparing fp32 kernels with float64.

A reference is written with ``Tracked`` values. Each holds the float64 value of a formula
and a bound on the absolute error that evaluating the same formula in fp32 can make
(running error analysis: Wilkinson 1986; Higham, *Accuracy and Stability of Numerical
Algorithms*, 2nd ed., section 3.3). Every rounded operation adds ``U * |result|`` (``U =
2**-24``, fp32's unit roundoff) and propagates the errors of its operands to first order:

    a +- b   e_a + e_b
    a * b    |a| e_b + |b| e_a + e_a e_b
    a / b    (e_a + |a / b| e_b) / (|b| - e_b)          b must exceed its own error
    sqrt(a)  e_a / (sqrt(a) + sqrt(max(a - e_a, 0)))    exact for the worst case
    f(a)     max |f'| on [a - e_a, a + e_a] * e_a       exp, log, tanh, ...
    sign(a)  0, or 2 where |a| <= e_a: the sign itself is not determined by fp32

So a value that cancels (``m = beta1 * m + (1 - beta1) * g`` with terms of opposite sign)
keeps the error of its terms: the comparison is relative to the magnitude of what was
summed, ``sum |term|``, never to the small result alone, and it holds for every draw.
Python numbers enter as fp32 constants (one rounding, ``U * |c|``), as the kernel's
hyperparameters and its per-step scalars folded in fp64 do.

The kernel evaluates the same operations in another order (sympy regroups sums and
products; per-step scalars are folded in fp64 and rounded once). Each such regrouping of a
formula without new cancellation has a bound of the same form with at most a few more
rounded operations, each worth ``U * |value|``; ``assert_fp32_close`` therefore allows
``SLACK = 4`` times the reference's bound. A coefficient off by 1e-5 moves a result by
~1e-5 of its terms' magnitude, ~20-100x over the bound of a few-step recurrence
(``tests/test_numerics.py`` checks that such perturbations fail).
"""

from __future__ import annotations

import math

import torch

U = 2.0**-24
SLACK = 4.0
# Below fp32's smallest normal number rounding is absolute, not relative.
TINY = 2.0**-126

# Relative spacing of each storage dtype (one ulp at 1): a rounded store lands on one of the
# two neighbours of the exact value, so it can move a value by up to one spacing.
SPACING = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _t(x) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.tensor(float(x), dtype=torch.float64)


class Tracked:
    """A float64 value and the bound ``err`` of fp32's absolute error in computing it."""

    __slots__ = ("value", "err")

    def __init__(self, value, err=None):
        self.value = _t(value).double()
        self.err = torch.zeros_like(self.value) if err is None else _t(err).double()

    @classmethod
    def exact(cls, x) -> Tracked:
        """An input the kernel reads as stored (a parameter, a gradient): no error."""
        return cls(x.detach().double().cpu() if isinstance(x, torch.Tensor) else x)

    @classmethod
    def constant(cls, c) -> Tracked:
        """A scalar that reaches the kernel rounded to fp32 once."""
        c = _t(c).double()
        return cls(c, U * c.abs())

    @staticmethod
    def of(x) -> Tracked:
        return x if isinstance(x, Tracked) else Tracked.constant(x)

    def _rounded(self, value, err) -> Tracked:
        return Tracked(value, err + U * value.abs() + TINY)

    # arithmetic -------------------------------------------------------------------------
    def __add__(self, other):
        o = Tracked.of(other)
        return self._rounded(self.value + o.value, self.err + o.err)

    __radd__ = __add__

    def __sub__(self, other):
        o = Tracked.of(other)
        return self._rounded(self.value - o.value, self.err + o.err)

    def __rsub__(self, other):
        return Tracked.of(other) - self

    def __neg__(self):
        return Tracked(-self.value, self.err)

    def __mul__(self, other):
        o = Tracked.of(other)
        err = self.value.abs() * o.err + o.value.abs() * self.err + self.err * o.err
        return self._rounded(self.value * o.value, err)

    __rmul__ = __mul__

    def __truediv__(self, other):
        o = Tracked.of(other)
        margin = o.value.abs() - o.err
        if bool((margin <= 0).any()):
            raise ValueError("a divisor is within its own fp32 error of zero: no bound exists")
        q = self.value / o.value
        return self._rounded(q, (self.err + q.abs() * o.err) / margin)

    def __rtruediv__(self, other):
        return Tracked.of(other) / self

    def __pow__(self, k):
        if k == 2:
            return self * self
        if k == 0.5:
            return sqrt(self)
        raise NotImplementedError(f"power {k}: write it as products")

    def __abs__(self):
        return Tracked(self.value.abs(), self.err)

    def round_to(self, dtype) -> Tracked:
        """The value stored in ``dtype`` (round to nearest even, as the kernel stores)."""
        stored = self.value.to(dtype).double()
        return Tracked(stored, self.err + SPACING[dtype] * self.value.abs() + TINY)

    def __repr__(self):
        return f"Tracked({self.value!r}, err={self.err!r})"


def sqrt(a: Tracked) -> Tracked:
    root = a.value.clamp_min(0).sqrt()
    low = (a.value - a.err).clamp_min(0).sqrt()
    return a._rounded(root, a.err / (root + low).clamp_min(TINY))


def _unary(a: Tracked, fn, slope_bound) -> Tracked:
    out = fn(a.value)
    return a._rounded(out, slope_bound(a.value, a.err) * a.err)


def exp(a: Tracked) -> Tracked:
    # exp' = exp, largest at the top of the interval.
    return _unary(a, torch.exp, lambda v, e: torch.exp(v + e))


def tanh(a: Tracked) -> Tracked:
    # tanh' = 1 - tanh^2 <= 1.
    return _unary(a, torch.tanh, lambda v, e: torch.ones_like(v))


def _trig(a: Tracked, fn) -> Tracked:
    # |cos'|, |sin'| <= 1. libdevice's cosf and sinf are within 2 ulp, numpy's float32 ones
    # within 1.5: three roundings' worth beside the one _rounded counts.
    out = _unary(a, fn, lambda v, e: torch.ones_like(v))
    return Tracked(out.value, out.err + 3 * U * out.value.abs())


def cos(a: Tracked) -> Tracked:
    return _trig(a, torch.cos)


def sin(a: Tracked) -> Tracked:
    return _trig(a, torch.sin)


def sign(a: Tracked) -> Tracked:
    undecided = a.value.abs() <= a.err
    return Tracked(torch.sign(a.value), torch.where(undecided, 2.0, 0.0).double())


def maximum(a, b) -> Tracked:
    a, b = Tracked.of(a), Tracked.of(b)
    return Tracked(torch.maximum(a.value, b.value), torch.maximum(a.err, b.err))


def minimum(a, b) -> Tracked:
    a, b = Tracked.of(a), Tracked.of(b)
    return Tracked(torch.minimum(a.value, b.value), torch.maximum(a.err, b.err))


def total(a: Tracked) -> Tracked:
    """Sum of every element. A summation whose dependency tree has depth ``d`` errs by at
    most ``d U sum |x|`` (Higham, section 4.2). Kernels sum a block as a tree (``tl.sum``;
    numpy's pairwise sum under the interpreter, sequential below 8 terms) and chain the
    partials of its passes of at least 128 elements (a block's passes, then the blocks, in
    order): ``d <= log2(n) + 8 + n / 128``, and never more than ``n``, the depth of a plain
    loop."""
    n = a.value.numel()
    depth = min(n, math.ceil(math.log2(max(n, 2))) + 8 + math.ceil(n / 128))
    return Tracked(a.value.sum(), a.err.sum() + depth * U * a.value.abs().sum() + TINY)


def cat(parts) -> Tracked:
    """Every element of ``parts`` in one flat value, as a global reduction reads them."""
    return Tracked(
        torch.cat([x.value.reshape(-1) for x in parts]), torch.cat([x.err.reshape(-1) for x in parts])
    )


def mean(a: Tracked) -> Tracked:
    return total(a) / a.value.numel()


def amax(a: Tracked) -> Tracked:
    """The largest element: exact, up to the errors of the elements."""
    return Tracked(a.value.max(), a.err.max())


def norm(a: Tracked) -> Tracked:
    """L2 norm of every element: the sum of squares, then its square root."""
    return sqrt(total(a * a))


def fp32_close(actual: torch.Tensor, expected: Tracked) -> bool:
    """Whether ``|actual - expected| <= SLACK * bound`` holds for every element."""
    got = actual.detach().double().cpu().reshape(expected.value.shape)
    return bool(((got - expected.value).abs() <= SLACK * expected.err).all())


def assert_fp32_close(actual: torch.Tensor, expected: Tracked, what: str = "") -> None:
    """``|actual - expected| <= SLACK * bound`` elementwise, with the worst element named."""
    got = actual.detach().double().cpu().reshape(expected.value.shape)
    diff = (got - expected.value).abs()
    bound = SLACK * expected.err
    bad = ~(diff <= bound)  # NaN in either fails
    if bool(bad.any()):
        ratio = torch.where(bad, diff / bound.clamp_min(TINY), torch.zeros_like(diff))
        i = int(ratio.reshape(-1).nan_to_num(float("inf")).argmax())
        raise AssertionError(
            f"{what or 'value'}: {int(bad.sum())} of {diff.numel()} elements beyond fp32's bound; "
            f"worst at flat index {i}: got {got.reshape(-1)[i].item()!r}, "
            f"float64 {expected.value.reshape(-1)[i].item()!r}, |error| {diff.reshape(-1)[i].item():.3e} "
            f"> {SLACK:g} x bound {expected.err.reshape(-1)[i].item():.3e}"
        )
