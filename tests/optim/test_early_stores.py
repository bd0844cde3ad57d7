"""States stored by the phase that computes them (``fuser.ir.stores``): which rules move a
store, what the last phase then reads, and that the step is the rule's, in float64, with
AMP skips leaving every tensor as it was."""

import re

import pytest
import torch
from numerics import Tracked, assert_fp32_close, norm, sqrt

import fuser
from fuser.codegen.render import render_phase
from fuser.ir.optim import lower_optim
from fuser.optim.builtins import came, lamb

SHAPES = [(7,), (129,), (33, 5), (3, 4, 5)]


def element_reads(phase) -> set[str]:
    """The names every value of a phase reads (slots among them)."""
    values = (*phase.body, *phase.stores, *phase.reduce, *phase.axis_reduce, *phase.matrix_stores)
    return {s.name for _, e in values for s in e.free_symbols}


def stored(plan) -> list[tuple[int, list[str]]]:
    return [(ph.index, [n for n, _ in ph.stores]) for ph in plan.phases]


def test_came_stores_its_momentum_where_it_computes_it_and_then_skips_the_gradient():
    plan = lower_optim(came)
    assert stored(plan) == [(0, []), (1, []), (2, ["exp_avg"]), (3, ["p"])]
    assert "g" in element_reads(plan.phases[2]) and "exp_avg" in element_reads(plan.phases[2])
    assert "g" not in element_reads(plan.phases[3])
    source = render_phase(plan, plan.phases[3]).text
    assert re.search(r"\bg_ptr", source) is None and "x_exp_avg = tl.load(exp_avg_ptr + offs" in source
    # the third phase still accumulates the residual's row and column sums
    assert len(plan.phases[2].axis_reduce) == 2


def test_lamb_moves_both_moments_only_together():
    # Moving one moment alone would leave the gradient in the last phase: no fewer bytes.
    plan = lower_optim(lamb)
    assert stored(plan) == [(0, ["exp_avg", "exp_avg_sq"]), (1, ["p"])]
    assert element_reads(plan.phases[1]) & {"g", "p", "exp_avg", "exp_avg_sq"} == {
        "p",
        "exp_avg",
        "exp_avg_sq",
    }


def test_states_stay_in_the_last_phase_where_it_reads_their_old_value_or_they_round():
    keeps_old = fuser.rule(
        """
        m0 = m
        m = beta * m + g
        p = p - lr * m / norm(m) - lr * c * m0
        """,
        name="keeps_old",
        hyper=dict(lr=0.1, beta=0.9, c=0.5),
        state=dict(m=0.0),
    )
    assert stored(lower_optim(keeps_old)) == [(0, []), (1, ["p", "m"])]
    # a bf16 state would hand the last phase its rounded value, not the one it computes
    assert stored(lower_optim(lamb, dict(exp_avg="bf16", exp_avg_sq="bf16")))[-1][1] == [
        "p",
        "exp_avg",
        "exp_avg_sq",
    ]


CHAINED = fuser.rule(
    """
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * (g - m)**2
    u = m / (sqrt(v) + eps)
    p = p - lr * norm(p) / norm(u) * u
    """,
    name="chained",
    hyper=dict(lr=0.05, beta1=0.8, beta2=0.9, eps=1e-3),
    state=dict(m=0.0, v=0.0),
)


def chained_reference(p, grads, lr=0.05, beta1=0.8, beta2=0.9, eps=1e-3):
    p = Tracked.exact(p)
    m = Tracked.exact(torch.zeros(p.value.shape))
    v = Tracked.exact(torch.zeros(p.value.shape))
    for g in grads:
        g = Tracked.exact(g)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * (g - m) * (g - m)
        u = m / (sqrt(v) + eps)
        p = p - lr * norm(p) / norm(u) * u
    return p, dict(m=m, v=v)


def test_a_state_whose_new_value_reads_another_s_new_value(device):
    # v's new value contains m's: both move to the first phase (m alone would leave the
    # gradient to v's update in the last phase), and the last reads both.
    plan = lower_optim(CHAINED)
    assert stored(plan) == [(0, ["m", "v"]), (1, ["p"])]
    assert "g" not in element_reads(plan.phases[1])
    params = [torch.randn(s, device=device) for s in SHAPES]
    start = [p.clone() for p in params]
    opt = fuser.compile(CHAINED)(params)
    grads = [[torch.randn(s, device=device) for s in SHAPES] for _ in range(3)]
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    for i, p in enumerate(params):
        want, states = chained_reference(start[i], [gs[i] for gs in grads])
        assert_fp32_close(p, want, "p")
        for k, v in states.items():
            assert_fp32_close(opt.state[p][k], v, k)


@pytest.mark.parametrize("make", [fuser.optim.LAMB, fuser.optim.CAME, fuser.compile(CHAINED)])
def test_a_skipped_amp_step_leaves_early_stored_states_as_they_were(device, make):
    params = [torch.randn(s, device=device) for s in SHAPES]
    opt = make(params)
    for p in params:
        p.grad = torch.randn(p.shape, device=device)
    opt.step()
    kept = [p.clone() for p in params]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    for p in params:
        p.grad = torch.randn(p.shape, device=device)
    opt.found_inf = torch.ones((), device=device)
    opt.step()
    for p, k, st in zip(params, kept, states):
        assert torch.equal(p, k)
        for key, v in st.items():
            assert torch.equal(opt.state[p][key], v), key
