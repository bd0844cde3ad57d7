"""Functions and inputs of the optimizer rule language beyond arithmetic: conditions that
join per-step and per-element comparisons, against float64 references written here."""

import math

import pytest
import torch
from numerics import Tracked, U, assert_fp32_close, cos, sin

import fuser

# Sizes that cross a flat block (2048 elements) and its masked tail; a 2-D one for tiles.
SHAPES = [(7,), (2500,), (33, 5)]


def where(cond, a, b) -> Tracked:
    """``where`` of Tracked values: each element keeps the error of the branch it takes."""
    a, b = Tracked.of(a), Tracked.of(b)
    return Tracked(torch.where(cond, a.value, b.value), torch.where(cond, a.err, b.err))


def run(rule, params, grads, **hyper):
    opt = fuser.compile(rule)(params, **hyper)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    return opt


MIXED = """
    p = where((step >= k) and (g > 0), p - lr * g, p)
    m = where((step < k) or (g < 0), m + g, m - lr)
    v = where(not ((step >= k) or (abs(g) > 0.5)), v + g * g, v)
"""


@pytest.mark.parametrize("tiled", [False, True], ids=["flat", "tiled"])
def test_and_or_not_join_per_step_and_per_element_conditions(device, tiled):
    # `step >= k` flips between steps 2 and 3; every element condition is decided exactly
    # (g as stored), so only the arithmetic of the branches rounds. The tiled variant
    # (a row state) walks tiles of each tensor's 2-D view instead of flat blocks.
    text = MIXED + ("    r = 0.5 * r + rowmean(g)\n" if tiled else "")
    state = dict(m=0.0, v=0.0, **(dict(r=0.0) if tiled else {}))
    rule = fuser.rule(text, hyper=dict(lr=1e-2, k=2.5), state=state)
    shapes = [(7,), (19, 133)] if tiled else SHAPES  # (tiles under the interpreter are slow)
    params = [torch.randn(s, device=device) for s in shapes]
    start = [p.clone() for p in params]
    grads = [[torch.randn(s, device=device) for s in shapes] for _ in range(4)]
    opt = run(rule, params, grads, lr=0.05)
    for i, p in enumerate(params):
        want_p = Tracked.exact(start[i])
        want_m = want_v = Tracked.exact(torch.zeros(shapes[i]))
        for step, gs in enumerate(grads, 1):
            g = gs[i].double().cpu()
            late = step >= 2.5
            want_p = where(late & (g > 0), want_p - 0.05 * Tracked.exact(g), want_p)
            want_m = where((not late) | (g < 0), want_m + Tracked.exact(g), want_m - 0.05)
            want_v = where(~(late | (g.abs() > 0.5)), want_v + Tracked.exact(g) * Tracked.exact(g), want_v)
        assert_fp32_close(p, want_p, "p")
        assert_fp32_close(opt.state[p]["m"], want_m, "m")
        assert_fp32_close(opt.state[p]["v"], want_v, "v")


def test_cosine_schedule_and_every_k_are_per_step_values_in_fp64(device):
    # A cosine learning rate inside the rule (through step = total and past it), applied on
    # every third step only; mod(step, 2.5) as a per-step factor.
    rule = fuser.rule(
        """
        lr_t = lr * 0.5 * (1 + cos(pi * step / total))
        p = where(every(k), p - lr_t * g, p - lr * mod(step, 2.5) * g)
        """,
        hyper=dict(lr=1e-2, total=5.0, k=3.0),
    )
    params = [torch.randn(s, device=device) for s in SHAPES]
    start = [p.clone() for p in params]
    grads = [[torch.randn(s, device=device) for s in SHAPES] for _ in range(7)]
    run(rule, params, grads, lr=0.1)
    for i, p in enumerate(params):
        want = Tracked.exact(start[i])
        for step, gs in enumerate(grads, 1):
            g = Tracked.exact(gs[i])
            if step % 3 == 0:
                # the per-step factor is folded in fp64 and reaches the body rounded once
                want = want - Tracked.constant(0.1 * 0.5 * (1 + math.cos(math.pi * step / 5.0))) * g
            else:
                want = want - Tracked.constant(0.1 * math.fmod(step, 2.5)) * g
        assert_fp32_close(p, want, "p")


def test_sin_cos_and_mod_per_element(device):
    rule = fuser.rule(
        """
        m = sin(3 * g) - cos(p)
        r = mod(g, b)
        s = mod(g, -b)
        p = p - lr * m
        """,
        hyper=dict(lr=1e-2, b=0.3),
        state=dict(m=0.0, r=0.0, s=0.0),
    )
    params = [torch.randn(s, device=device) for s in SHAPES]
    start = [p.clone() for p in params]
    grads = [[torch.randn(s, device=device) for s in SHAPES]]
    opt = run(rule, params, grads)
    b = torch.tensor(0.3, dtype=torch.float32).item()  # the kernel's fp32 hyperparameter
    for i, p in enumerate(params):
        g, p0 = Tracked.exact(grads[0][i]), Tracked.exact(start[i])
        want_m = sin(3 * g) - cos(p0)
        assert_fp32_close(opt.state[p]["m"], want_m, "m")
        assert_fp32_close(p, p0 - 1e-2 * want_m, "p")
        x = grads[0][i].double().cpu()
        for name, d in (("r", b), ("s", -b)):
            got = opt.state[p][name].double().cpu()
            want = torch.remainder(x, d)  # Python's convention: the sign of the divisor
            lo, hi = min(0.0, d), max(0.0, d)
            assert bool(((got >= lo) & (got <= hi)).all()), name
            # a / b rounded to fp32 may land on the other side of a multiple of b: the
            # result then jumps by b; elsewhere it is within a few roundings of |a|
            edge = (want.abs() < 1e-5) | ((want - d).abs() < 1e-5)
            close = (got - want).abs() <= 4 * U * (x.abs() + abs(d))
            assert bool((close | edge).all()), name
            assert int(edge.sum()) <= 2
