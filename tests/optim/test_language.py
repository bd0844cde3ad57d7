"""Functions and inputs of the optimizer rule language beyond arithmetic: conditions that
join per-step and per-element comparisons, against float64 references written here."""

import pytest
import torch
from numerics import Tracked, assert_fp32_close

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
    params = [torch.randn(s, device=device) for s in SHAPES]
    start = [p.clone() for p in params]
    grads = [[torch.randn(s, device=device) for s in SHAPES] for _ in range(4)]
    opt = run(rule, params, grads, lr=0.05)
    for i, p in enumerate(params):
        want_p = Tracked.exact(start[i])
        want_m = want_v = Tracked.exact(torch.zeros(SHAPES[i]))
        for step, gs in enumerate(grads, 1):
            g = gs[i].double().cpu()
            late = step >= 2.5
            want_p = where(late & (g > 0), want_p - 0.05 * Tracked.exact(g), want_p)
            want_m = where((not late) | (g < 0), want_m + Tracked.exact(g), want_m - 0.05)
            want_v = where(~(late | (g.abs() > 0.5)), want_v + Tracked.exact(g) * Tracked.exact(g), want_v)
        assert_fp32_close(p, want_p, "p")
        assert_fp32_close(opt.state[p]["m"], want_m, "m")
        assert_fp32_close(opt.state[p]["v"], want_v, "v")
