"""Per-tensor scalar states (a state whose update reads no per-element value) with many
tensors in one launch, through steps, table rebuilds and state_dict loads."""

import copy

import pytest
import torch
from numerics import Tracked, assert_fp32_close

import fuser

SHAPES = [(1,), (7,), (129,), (33, 5)]

DECAYED_MOMENTUM = """
    scale = scale * decay
    m = beta * m + (1 - beta) * g
    p = p - lr * scale * m
"""


def decayed_momentum():
    rule = fuser.rule(
        DECAYED_MOMENTUM,
        name="decayed_momentum",
        hyper=dict(lr=0.1, decay=0.5, beta=0.9),
        state=dict(scale=1.0, m=0.0),
    )
    return fuser.compile(rule)


def reference(p, grads, lr=0.1, decay=0.5, beta=0.9):
    """The rule in float64 with fp32's error bound (tests/numerics.py); ``scale`` is a power
    of two, exact in both."""
    p, m, scale = Tracked.exact(p), Tracked.exact(torch.zeros(p.shape)), 1.0
    for g in grads:
        scale *= decay
        m = beta * m + (1 - beta) * Tracked.exact(g)
        p = p - lr * scale * m
    return p, m, scale


def run(opt, params, grads_per_step):
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.clone().to(p.dtype)
        opt.step()


def grads_for(params, steps):
    return [[torch.randn(p.shape, device=p.device) + 0.1 for p in params] for _ in range(steps)]


def test_every_tensor_keeps_its_own_scalar_state_across_rebuilds(device):
    params = [torch.randn(s, device=device) for s in SHAPES]
    start = [p.clone() for p in params]
    opt = decayed_momentum()(params)
    grads = grads_for(params, 4)  # new gradient tensors each step
    run(opt, params, grads)
    for i, p in enumerate(params):
        want_p, want_m, want_scale = reference(start[i], [gs[i] for gs in grads])
        assert_fp32_close(p, want_p, "p")
        assert_fp32_close(opt.state[p]["m"], want_m, "m")
        assert opt.state[p]["scale"].shape == ()
        assert opt.state[p]["scale"].item() == want_scale
        assert opt.state[p]["step"].item() == 4


def test_scalar_state_of_a_different_shape_is_refused(device):
    params = [torch.randn(7, device=device)]
    opt = decayed_momentum()(params)
    run(opt, params, grads_for(params, 1))
    opt.state[params[0]]["scale"] = torch.ones(7, device=device)
    opt._fuser.signature = []
    with pytest.raises(RuntimeError, match="one number"):
        run(opt, params, grads_for(params, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_state_dict_keeps_scalar_and_element_states_at_full_precision(device, dtype):
    # torch's load casts every floating state to its parameter's dtype; fuser restores the
    # saved fp32 values, for one-element parameters too.
    params = [torch.randn(s, device=device).to(dtype) for s in SHAPES]
    opt = decayed_momentum()(params)
    grads = grads_for(params, 3)
    run(opt, params, grads[:2])
    checkpoint = copy.deepcopy(opt.state_dict())
    again = [p.clone() for p in params]
    opt2 = decayed_momentum()(again)
    opt2.load_state_dict(checkpoint)
    for p, q in zip(params, again):
        for k in ("m", "scale", "step"):
            assert opt2.state[q][k].dtype == torch.float32
            assert torch.equal(opt2.state[q][k], opt.state[p][k]), k
    run(opt, params, grads[2:])
    run(opt2, again, grads[2:])
    for p, q in zip(params, again):
        assert torch.equal(p, q)
        assert opt2.state[q]["scale"].item() == 0.125
