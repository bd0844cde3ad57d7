"""Diagonal per-dimension factors: a dimension a matrix rule's ``diagonal_dims`` marks keeps
each of its per-dimension factors (``"eye(dims)"``) as the ``d`` numbers of a diagonal
matrix, and every per-dimension value of that dimension is the diagonal matrix those numbers
make, as PSGD Kron keeps a side of size 1, one over ``max_size_triangular`` or the largest
one under ``memory_save_mode`` (Li 2015-2024). The rule is written once: ``@``, ``transpose``,
``triu``, ``diag``, ``trace``, reductions, ``inv_root``, solves, ``gram`` and ``modes`` take
their diagonal-matrix meaning (``gram(x)`` the sums of squares over the other dimensions,
``modes(x, D)`` a scale along the dimension), so a triangular factor's step is a diagonal
one's. Elementwise work must keep the zeros off the diagonal (``D + eps * eye_dims()``, ``D *
s``, ``abs(D)``, but not ``D + 1`` or ``exp(D)``); ``eigh``, ``qr`` and a product with a
permutation make a full matrix and are refused with a ``ValueError`` at the step.
"""

from __future__ import annotations

import warnings

import torch


class Diagonal:
    """A diagonal matrix per matrix of a stack: its diagonal ``v`` (``[n, d, 1]`` or ``[1, d, 1]``)."""

    def __init__(self, v: torch.Tensor):
        self.v = v

    @property
    def d(self) -> int:
        return self.v.shape[-2]


def diagonal_marks(fn, shape: tuple, who: str) -> tuple[bool, ...]:
    """``fn(shape)`` (a ``diagonal_dims`` keyword) checked: one bool per dimension."""
    if fn is None:
        return (False,) * len(shape)
    marks = fn(tuple(shape))
    try:
        marks = tuple(marks)
    except TypeError:
        marks = None
    if marks is None or len(marks) != len(shape) or not all(isinstance(m, bool) for m in marks):
        raise ValueError(
            f"{who}: diagonal_dims({tuple(shape)}) gave {marks!r}; it must give one bool per dimension "
            f"of the tensor ({len(shape)})"
        )
    return marks


def full_message(what: str) -> str:
    return (
        f"{what} at a dimension diagonal_dims marks diagonal: that dimension's factors are "
        "diagonal matrices; eigh, qr, sort_perm and permutations make full ones (leave the "
        "dimension full for such a rule)"
    )


def product(a, b):
    """``a @ b`` where one is diagonal: a diagonal (two diagonals) or a vector (``D @ v``)."""
    if not isinstance(a, Diagonal):
        raise ValueError(full_message("a full matrix times a diagonal factor"))
    if isinstance(b, Diagonal):
        return Diagonal(a.v * b.v)
    if not (torch.is_tensor(b) and b.dim() == 3 and b.shape[-1] == 1):
        raise ValueError(full_message(f"a diagonal factor times a {type(b).__name__} value"))
    return a.v * b


def solve(a, b, warn: str):
    """``a⁻¹ b`` of a diagonal ``a``: ``b / a`` per matrix, zero (with a warning) where not finite."""
    if not isinstance(a, Diagonal):
        raise ValueError(full_message("a full factor solved against a diagonal one"))
    rhs = b.v if isinstance(b, Diagonal) else b
    out = finite_or_zero(rhs / a.v, warn)
    return Diagonal(out) if isinstance(b, Diagonal) else out


def finite_or_zero(out: torch.Tensor, warn: str) -> torch.Tensor:
    """``out`` (``[n, ...]``) with each matrix that is not finite set to zero, with a warning."""
    bad = (~torch.isfinite(out)).flatten(1).any(1)
    if bool(bad.any()):
        out = torch.where(bad.reshape(-1, *[1] * (out.dim() - 1)), torch.zeros_like(out), out)
        warnings.warn(warn, RuntimeWarning, stacklevel=6)
    return out


def elementwise(fn, args: list, what: str):
    """``fn`` of operands at a diagonal dimension: of the diagonals, where it keeps the zeros
    off the diagonal (checked by evaluating it there); a vector or a number otherwise."""
    if not any(isinstance(a, Diagonal) for a in args):
        return fn(*args)
    off = fn(*[torch.zeros_like(a.v) if isinstance(a, Diagonal) else a for a in args])
    if not bool(torch.all(torch.as_tensor(off) == 0)):
        raise ValueError(
            f"{what} of a diagonal factor (diagonal_dims) is not zero off the diagonal, so not a "
            "diagonal matrix: write it with the factors' own terms (D + eps * eye_dims(), D * s), or "
            "leave the dimension full"
        )
    return Diagonal(fn(*[a.v if isinstance(a, Diagonal) else a for a in args]))


def where(c, a, b):
    """``where(c, a, b)`` at a diagonal dimension, ``c`` one condition per matrix or step, or a
    diagonal's (a comparison of diagonals, false off the diagonal): of the diagonals, where the
    value off the diagonal is zero (each branch a diagonal, or the number 0)."""
    branches = [x if isinstance(x, Diagonal) else torch.as_tensor(x, dtype=torch.float32) for x in (a, b)]
    off = [torch.zeros(()) if isinstance(x, Diagonal) else x for x in branches]
    full = any(x.dim() == 3 and x.shape[-1] != 1 for x in off)
    zero = off[1] if isinstance(c, Diagonal) else torch.where(torch.as_tensor(c), off[0], off[1])
    if full or not bool(torch.all(zero == 0)):
        raise ValueError(full_message("a where() of a diagonal factor and a value not zero off the diagonal"))
    cond = c.v if isinstance(c, Diagonal) else torch.as_tensor(c)
    return Diagonal(torch.where(cond, *(x.v if isinstance(x, Diagonal) else x for x in branches)))


def reduced(kind: str, x: Diagonal) -> torch.Tensor:
    """``norm``, ``sum``, ``mean``, ``amax`` or ``trace`` of each diagonal matrix, ``[n, 1, 1]``
    (its zeros off the diagonal counted: ``mean`` over ``d²`` entries, ``amax`` at least 0)."""
    v, d = x.v, x.d
    if kind == "norm":
        return v.square().sum(-2, keepdim=True).sqrt()
    if kind in ("sum", "trace"):
        return v.sum(-2, keepdim=True)
    if kind == "mean":
        return v.sum(-2, keepdim=True) / (d * d)
    top = v.amax(-2, keepdim=True)
    return top if d == 1 else top.clamp_min(0.0)


def inv_root(x: Diagonal, k: int, old, warn: str) -> Diagonal:
    """``x^(-1/k)`` of each diagonal; a matrix with an entry not positive or not finite keeps
    ``old`` (its state's previous diagonal), with a warning, as a failed root does."""
    v = x.v.double()
    root = torch.where(v > 0, v.clamp_min(torch.finfo(torch.float64).tiny) ** (-1.0 / k), float("nan"))
    root = root.float()
    ok = torch.isfinite(root).flatten(1).all(1)
    if bool(ok.all()):
        return Diagonal(root)
    warnings.warn(warn, RuntimeWarning, stacklevel=6)
    keep = old.v.expand_as(root)
    return Diagonal(torch.where(ok.reshape(-1, 1, 1), root, keep))


def along(v: torch.Tensor, i: int, ndim: int) -> torch.Tensor:
    """A diagonal ``[n, d, 1]`` shaped to scale dimension ``i`` of a stack ``[n, *shape]``."""
    shape = [v.shape[0]] + [1] * ndim
    shape[i + 1] = v.shape[-2]
    return v.reshape(shape)
