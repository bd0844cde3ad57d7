"""Float64 references on materialised logits, written with torch alone (nothing from fuser)."""

from __future__ import annotations

import torch

T, H, V = 37, 24, 211
IGNORE = -100

LOW_PRECISION = {torch.bfloat16, torch.float16}


def make_inputs(dtype=torch.float32, *, bias=True, ignore="some", seed=None, shape=(T,), h=H, v=V, scale=1.0):
    """Fresh random hidden [*shape, h], weight [v, h], bias [v] and target [*shape]."""
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


def reference(
    per_token, hidden, weight, bias, target, *, reduction="mean", grad_out=None, round_logits_to=None
):
    """Loss and gradients of ``per_token(z, y)`` on ``z = hidden @ weight.T + bias`` in float64.

    ``per_token`` maps logits [N, V] and safe targets [N] to per-token losses [N].
    ``round_logits_to`` rounds the logits to the dtype the fused loss computes them in, so a
    comparison measures the epilogue rather than the matmul's rounding. Returns
    (loss, grad_hidden, grad_weight, grad_bias) in float64.
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
    return out.detach(), x.grad, w.grad, (b.grad if b is not None else None)


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
