"""Float64 references on materialised logits, written with torch alone (nothing from fuser),
with the error that fp32 arithmetic can make in the fused computation of each output."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from numerics import SLACK, U

from .rounding import own_rounding

T, H, V = 37, 24, 211
IGNORE = -100

LOW_PRECISION = {torch.bfloat16, torch.float16}


def make_inputs(
    dtype=torch.float32, *, bias=True, ignore="some", seed=None, shape=(T,), h=H, v=V, scale=1.0, rule=None
):
    """Fresh random hidden [*shape, h], weight [v, h], bias [v] and target [*shape].

    With ``rule`` (a per-token loss, as ``reference`` takes), draws again while some logit
    sits within fp32's error of one of the rule's branch points (see ``decidable``)."""
    return decidable_draw(lambda: _draw(dtype, bias, ignore, seed, shape, h, v, scale), rule)


def decidable_draw(draw, rule=None):
    """``draw()`` -> (hidden, weight, bias, target), drawn again while ``rule`` is not
    ``decidable`` there (20 tries)."""
    for _ in range(20):
        drawn = draw()
        if rule is None or decidable(rule, *drawn):
            return drawn
    raise AssertionError("20 draws in a row within fp32's error of a branch of the rule")


def _draw(dtype, bias, ignore, seed, shape, h, v, scale):
    g = torch.Generator().manual_seed(torch.randint(2**62, ()).item() if seed is None else seed)
    hidden = torch.randn(*shape, h, generator=g) * scale
    weight = torch.randn(v, h, generator=g) * (1.5 / h**0.5)
    b = torch.randn(v, generator=g) * 0.5 if bias else None
    target = torch.randint(0, v, shape, generator=g)
    flat = target.view(-1)
    if ignore == "some":
        flat[torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 4)]] = IGNORE
    elif ignore == "all":
        flat[:] = IGNORE
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    b = b.to(dtype) if b is not None else None
    return hidden, weight, b, target


class Reference(NamedTuple):
    """Loss and gradients in float64, and fp32's error bound of each (None where the inputs
    are not fp32): ``ref[0]`` .. ``ref[3]`` as before. ``loss_bound``: fp32's bound of the
    loss for inputs of every dtype (a 16-bit call's logits are accumulated and kept in
    fp32), None where the reference rounded its logits (``round_logits_to``)."""

    loss: torch.Tensor
    grad_hidden: torch.Tensor
    grad_weight: torch.Tensor
    grad_bias: torch.Tensor | None
    bounds: tuple | None
    loss_bound: torch.Tensor | None = None


def reference(
    per_token, hidden, weight, bias, target, *, reduction="mean", grad_out=None, round_logits_to=None
):
    """Loss and gradients of ``per_token(z, y)`` on ``z = hidden @ weight.T + bias`` in float64.

    ``per_token`` maps logits [N, V] and safe targets [N] to per-token losses [N].
    ``round_logits_to`` rounds the logits to the dtype the fused loss computes them in, so a
    comparison measures the epilogue rather than the matmul's rounding. Returns
    (loss, grad_hidden, grad_weight, grad_bias) in float64, for fp32 inputs the bounds of
    ``fp32_bounds``, and for inputs of every dtype the loss's (``fp32_loss_bound``).
    """
    x = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    b = bias.detach().double().requires_grad_() if bias is not None else None
    z = x.reshape(-1, x.shape[-1]) @ w.T
    if b is not None:
        z = z + b
    if round_logits_to is not None:
        z = z + (z.detach().to(round_logits_to).double() - z.detach())
    y = target.reshape(-1)
    valid = y != IGNORE
    per = per_token(z, torch.where(valid, y, 0)) * valid
    if reduction == "mean":
        out = per.sum() / valid.sum().clamp(min=1)
    elif reduction == "sum":
        out = per.sum()
    else:
        out = per.reshape(target.shape)
    go = torch.ones_like(out) if grad_out is None else grad_out.double()
    (out * go).sum().backward()
    fp32 = hidden.dtype == weight.dtype == torch.float32 and round_logits_to is None
    bounds = fp32_bounds(per_token, hidden, weight, bias, target, reduction, grad_out) if fp32 else None
    loss_bound = bounds[0] if bounds is not None else None
    if loss_bound is None and round_logits_to is None:
        loss_bound = fp32_loss_bound(per_token, hidden, weight, bias, target, reduction)
    return Reference(out.detach(), x.grad, w.grad, (b.grad if b is not None else None), bounds, loss_bound)


# --- what fp32 can err --------------------------------------------------------------------------
#
# The fused loss of fp32 inputs computes, in fp32:
#   1. the logits z = x @ w.T + b, a matmul of depth H: |dz| <= (H + 2) U (|x| @ |w|.T + |b|)
#      (Higham, Accuracy and Stability, (3.13), and one rounding for the bias);
#   2. per token, the loss l(z) and its gradient d = dl/dz: the logits' error reaches them
#      through the rule's derivatives (first order: |grad l| . dz and |hess l| @ dz, from
#      autograd), and the epilogue's own arithmetic adds at most E U (|l| + max |z| + 1) to l
#      and E U (|d_v| + max |d|) to each d_v. E = (depth of a sweep over the V logits) + 16
#      operations per element on values no larger than the row's: a sweep sums each block
#      as a tree (tl.sum; numpy's pairwise sum under the interpreter: depth <= log2 + 8) and
#      chains the blocks (64 columns or more), so its depth is <= log2(V) + 8 + V / 64.
#      Where l or d cancels (d_y = p_y - 1 of a confident token; an adjoint summing terms
#      of both signs) their error is a fraction of the cancelling terms, not of |d|: the
#      rule's own rounding, propagated by Monte Carlo arithmetic (tests/losses/rounding.py),
#      is added;
#   3. the gradients from D = d * grad_out (per token, / count for "mean"): matmuls of depth
#      V (grad_hidden = D @ w), N (grad_weight = D.T @ x, accumulated over chunks) and a sum
#      of N (grad_bias), each |dD| @ |.| + (depth + 2) U |D| @ |.|.
# assert_within allows SLACK (tests/numerics.py) times these bounds, for reorderings.


def epilogue_depth(v: int) -> int:
    return math.ceil(math.log2(v)) + 8 + math.ceil(v / 64) + 16


def _per_row(per_token):
    def f(zr, yr):
        return per_token(zr[None], yr[None])[0]

    return f


def _derivatives(per_token, z, y):
    f = _per_row(per_token)
    grads = torch.func.vmap(torch.func.grad(f))(z, y)
    hess = torch.func.vmap(torch.func.hessian(f))(z, y)
    return grads, hess


def _logits(hidden, weight, bias):
    x = hidden.detach().double().reshape(-1, hidden.shape[-1])
    w = weight.detach().double()
    z = x @ w.T
    mag = x.abs() @ w.abs().T
    if bias is not None:
        z, mag = z + bias.double(), mag + bias.double().abs()
    return x, w, z, (x.shape[-1] + 2) * U * mag


def fp32_bounds(per_token, hidden, weight, bias, target, reduction="mean", grad_out=None):
    """Bounds of fp32's error in (loss, grad_hidden, grad_weight, grad_bias), elementwise."""
    x, w, z, dz = _logits(hidden, weight, bias)
    n, v = z.shape
    y = target.reshape(-1)
    valid = y != IGNORE
    ys = torch.where(valid, y, 0)
    grads, hess = _derivatives(per_token, z, ys)
    losses = per_token(z, ys).detach()
    own = epilogue_depth(v) * U
    rounding_l, rounding_d = own_rounding(per_token, z, ys)
    err_loss = _loss_error(losses, grads, z, dz, rounding_l, valid, target, reduction)
    err_d = (
        (hess.abs() @ dz[..., None])[..., 0]
        + own * (grads.abs() + grads.abs().amax(1, keepdim=True))
        + rounding_d
    )
    go = torch.ones(n, dtype=torch.float64) if grad_out is None else grad_out.double().expand(target.shape)
    scale = go.reshape(-1) * valid
    if reduction == "mean":
        scale = scale / valid.sum().clamp(min=1)
    big_d = grads * scale[:, None]
    err_big_d = err_d * scale.abs()[:, None] + 2 * U * big_d.abs()
    err_gx = err_big_d @ w.abs() + (v + 2) * U * (big_d.abs() @ w.abs())
    err_gw = err_big_d.T @ x.abs() + (n + 2) * U * (big_d.abs().T @ x.abs())
    err_gb = err_big_d.sum(0) + (n + 2) * U * big_d.abs().sum(0)
    return err_loss, err_gx.reshape(hidden.shape), err_gw, (err_gb if bias is not None else None)


def fp32_loss_bound(per_token, hidden, weight, bias, target, reduction="mean"):
    """``fp32_bounds``' bound of the loss alone, without the second derivatives that the
    gradients' bounds take (so it stays cheap at any size). For 16-bit inputs too: their
    products are exact in fp32, so logits accumulated in fp32 carry fp32's error only."""
    _, _, z, dz = _logits(hidden, weight, bias)
    y = target.reshape(-1)
    valid = y != IGNORE
    ys = torch.where(valid, y, 0)
    zg = z.clone().requires_grad_()
    losses = per_token(zg, ys)
    (grads,) = torch.autograd.grad(losses.sum(), zg)  # (rows are independent)
    rounding_l, _ = own_rounding(per_token, z, ys)
    return _loss_error(losses.detach(), grads, z, dz, rounding_l, valid, target, reduction)


def _loss_error(losses, grads, z, dz, rounding_l, valid, target, reduction):
    """The loss's bound from the per-token losses, their gradients, the logits' bound ``dz``
    and the epilogue's own rounding (item 2 above), reduced as ``reduction`` (item 3)."""
    n, v = z.shape
    own = epilogue_depth(v) * U
    err_l = ((grads.abs() * dz).sum(1) + own * (losses.abs() + z.abs().amax(1) + 1) + rounding_l) * valid
    if reduction == "none":
        return err_l.reshape(target.shape)
    err_loss = err_l.sum() + (n + 2) * U * (losses * valid).abs().sum()
    return err_loss / valid.sum().clamp(min=1) if reduction == "mean" else err_loss


def decidable(per_token, hidden, weight, bias, target) -> bool:
    """Whether fp32 and float64 take the same branches of the rule at these logits: moving
    the logits by their error bound (random signs, 16 times) changes the gradient only as
    the rule's second derivatives predict. A branch point (a max's tie, the kink of abs,
    where or clamp) within the logits' error fails it; a comparison there measures which
    side fp32 fell on, not the kernel."""
    _, _, z, dz = _logits(hidden, weight, bias)
    y = target.reshape(-1)
    ys = torch.where(y != IGNORE, y, 0)
    grads, hess = _derivatives(per_token, z, ys)
    # Jumps at branch points are >= 1e-4 in these rules; smooth changes are ~ |hess| dz.
    predicted = 2 * (hess.abs() @ dz[..., None])[..., 0] + 1e-8
    step = torch.func.vmap(torch.func.grad(_per_row(per_token)))
    for _ in range(16):
        signs = torch.randint(0, 2, z.shape, dtype=torch.float64) * 2 - 1
        moved = step(z + signs * dz, ys)
        if bool(((moved - grads).abs() > predicted)[y != IGNORE].any()):
            return False
    return True


def assert_within(actual, expected, bound, what=""):
    """|actual - expected| <= SLACK * bound elementwise (tests/numerics.py), NaN failing."""
    got = actual.detach().double()
    assert got.shape == expected.shape, f"{what}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    diff = (got - expected).abs()
    bad = ~(diff <= SLACK * bound)
    if bool(bad.any()):
        i = int((diff / bound.clamp(min=1e-300)).nan_to_num(float("inf")).reshape(-1).argmax())
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {diff.numel()} elements beyond fp32's bound; worst at flat index "
            f"{i}: got {got.reshape(-1)[i].item()!r}, float64 {expected.reshape(-1)[i].item()!r}, "
            f"|error| {diff.reshape(-1)[i].item():.3e} > {SLACK:g} x bound {bound.reshape(-1)[i].item():.3e}"
        )


def cross_entropy(z, y):
    return torch.logsumexp(z, 1) - z.gather(1, y[:, None])[:, 0]


def assert_close(actual, expected, tol, what=""):
    """max |actual - expected| <= tol * max(|expected|, tiny): a scale-aware check that
    fails on NaN."""
    actual = actual.detach().double()
    scale = expected.abs().max().clamp(min=1e-6) if expected.numel() else torch.tensor(1.0)
    err = (actual - expected).abs().max() if expected.numel() else torch.tensor(0.0)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    assert err <= tol * scale, f"{what}: max error {err:.3e} > {tol:.1e} * {scale:.3e}"


def assert_norm_close(actual, expected, tol, what=""):
    """||actual - expected|| <= tol * ||expected|| (Frobenius): the relative error of a
    whole gradient, as the benchmarks report it; fails on NaN."""
    actual = actual.detach().double()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = ((actual - expected).norm() / expected.norm()).item()
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def assert_rounding_close(actual, expected, extra, what=""):
    """||actual - expected|| <= ||rounded - expected|| + extra * ||expected||, ``rounded`` being
    ``expected`` stored in ``actual``'s dtype: a 16-bit result's error beyond what storing the
    exact answer costs, which a fixed bound cannot tell apart on small tensors. Rounding alone
    costs ~1.6e-3 of a bf16 gradient's norm on average, but from 1.3e-3 to 2.0e-3 of one whose
    norm a single 40-element row holds (the long run of one target); ``extra`` is left to the
    computation (fp32 sums, logit gradients rounded before a matmul). Fails on NaN."""
    got = actual.detach().double()
    assert got.shape == expected.shape, f"{what}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    norm = expected.norm().item()
    err = (got - expected).norm().item() / norm
    floor = (expected.to(actual.dtype).double() - expected).norm().item() / norm
    assert err <= floor + extra, (
        f"{what}: relative error {err:.3e} > {floor:.3e} (the exact answer rounded to "
        f"{actual.dtype}) + {extra:.1e}"
    )
