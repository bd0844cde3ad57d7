"""The fp32 error bounds of tests/numerics.py: they hold for real fp32 arithmetic on every
draw (cancellation included), and they are tight enough that a coefficient of a rule off by
1e-5 fails the comparison."""

import pytest
import torch
from numerics import Tracked, assert_fp32_close, norm, sign, sqrt

import fuser

ADAMW = """
    m = {b1} * m + (1 - {b1}) * g
    v = {b2} * v + (1 - {b2}) * g**2
    p = p - lr * weight_decay * p - lr * (m / (1 - beta1**step)) / (sqrt(v / (1 - beta2**step)) + eps)
"""
HYPER = dict(lr=3e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
SHAPES = [(1,), (7,), (129,), (33, 5)]


def adamw_tracked(p, grads, lr, beta1, beta2, eps, weight_decay):
    p, m, v = Tracked.exact(p), Tracked.exact(torch.zeros_like(p)), Tracked.exact(torch.zeros_like(p))
    for step, g in enumerate(grads, 1):
        g = Tracked.exact(g)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p = p - lr * weight_decay * p - lr * (m / (1 - beta1**step)) / (sqrt(v / (1 - beta2**step)) + eps)
    return p, m, v


def test_bounds_hold_for_torch_fp32_arithmetic_with_cancellation():
    """The same recurrences evaluated by torch in fp32, on gradients built to cancel the
    momentum (each g close to -beta1/(1-beta1) m) and on plain draws."""
    n, steps = 20000, 6
    p = torch.randn(n)
    grads = [torch.randn(n) for _ in range(steps)]
    m = torch.zeros(n)
    for k in range(1, steps):  # from the second step on, half the elements nearly cancel
        m = 0.9 * m + 0.1 * grads[k - 1]
        grads[k][: n // 2] = (-9.0 * m[: n // 2] * (1 + 1e-6 * torch.randn(n // 2))).float()
    want_p, want_m, want_v = adamw_tracked(p, grads, **HYPER)
    q, m, v = p.clone(), torch.zeros(n), torch.zeros(n)
    for step, g in enumerate(grads, 1):
        m = 0.9 * m + (1 - 0.9) * g
        v = 0.999 * v + (1 - 0.999) * g * g
        q = q - 3e-2 * 0.1 * q - 3e-2 * (m / (1 - 0.9**step)) / (torch.sqrt(v / (1 - 0.999**step)) + 1e-8)
    assert_fp32_close(m, want_m, "m")
    assert_fp32_close(v, want_v, "v")
    assert_fp32_close(q, want_p, "p")
    # The cancelled half is where a bound relative to |m| alone would fail.
    rel = ((m.double() - want_m.value).abs() / want_m.value.abs())[: n // 2]
    assert rel.nan_to_num(0.0).max() > 1e-5


def test_sign_of_an_undetermined_value_may_flip():
    x = Tracked(torch.tensor([1e-9, 1.0]), torch.tensor([1e-8, 1e-8]))
    s = sign(x)
    assert s.err.tolist() == [2.0, 0.0]
    assert_fp32_close(torch.tensor([-1.0, 1.0]), s)
    with pytest.raises(AssertionError, match="beyond fp32's bound"):
        assert_fp32_close(torch.tensor([1.0, -1.0]), s)


def test_norm_bound_holds_for_a_blocked_fp32_sum():
    x = torch.randn(4099)
    blocked = torch.stack([b.pow(2).sum() for b in x.split(256)]).sum().sqrt()
    assert_fp32_close(blocked, norm(Tracked.exact(x)), "norm")


def run_rule(text, device, params, grads):
    rule = fuser.rule(text, name="adamw", hyper=HYPER, state=dict(m=0.0, v=0.0))
    opt = fuser.compile(rule)(params)
    for gs in grads:
        for q, g in zip(params, gs):
            q.grad = g.clone()
        opt.step()
    return opt


@pytest.mark.parametrize(
    "b1, b2, fails",
    [
        ("beta1", "beta2", None),
        ("(beta1 + 1e-5)", "beta2", "m"),
        ("beta1", "(beta2 + 1e-5)", "v"),
    ],
    ids=["exact", "beta1+1e-5", "beta2+1e-5"],
)
def test_a_coefficient_off_by_1e5_fails_the_comparison(device, b1, b2, fails):
    params = [torch.randn(s, device=device) for s in SHAPES]
    start = [q.clone() for q in params]
    grads = [[torch.randn(s, device=device) for s in SHAPES] for _ in range(4)]
    opt = run_rule(ADAMW.format(b1=b1, b2=b2), device, params, grads)
    failed = set()
    for i, q in enumerate(params):
        want_p, want_m, want_v = adamw_tracked(start[i], [gs[i] for gs in grads], **HYPER)
        for name, got, want in (
            ("p", q, want_p),
            ("m", opt.state[q]["m"], want_m),
            ("v", opt.state[q]["v"], want_v),
        ):
            try:
                assert_fp32_close(got, want, name)
            except AssertionError:
                failed.add(name)
    if fails is None:
        assert not failed
    else:
        assert fails in failed
