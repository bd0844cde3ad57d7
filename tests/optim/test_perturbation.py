"""Each built-in's reference comparison rejects a rule with one coefficient moved by 1e-5:
the fp32 error bounds of tests/numerics.py are tight enough to see a wrong coefficient."""

import pytest
import torch
import torch_references
from numerics import assert_fp32_close
from test_builtins import lion_reference
from test_reductions import lamb_reference

import fuser

SHAPES = [(1,), (7,), (129,), (33, 5)]


def _fails(check) -> bool:
    try:
        check()
    except AssertionError:
        return True
    return False


@pytest.mark.parametrize("which", ["adam", "lamb", "lion"])
def test_built_in_references_reject_a_coefficient_off_by_1e5(device, which):
    """The same fuser run judged against the reference and against the reference with one
    coefficient moved by 1e-5: the first passes, the second fails."""
    params = [torch.randn(s, device=device) for s in SHAPES]
    start = [q.clone() for q in params]
    grads = [[torch.randn(s, device=device) for s in SHAPES] for _ in range(4)]
    opt, reference = {
        "adam": (
            fuser.optim.Adam(params, lr=1e-2),
            lambda b1, i: torch_references.adam(start[i], [gs[i] for gs in grads], 1e-2, betas=(b1, 0.999))[
                0
            ],
        ),
        "lamb": (
            fuser.optim.LAMB(params, lr=0.05, weight_decay=0.1),
            lambda b1, i: lamb_reference(start[i], [gs[i] for gs in grads], 0.05, b1, 0.999, 1e-6, 0.1),
        ),
        "lion": (
            fuser.optim.Lion(params, lr=1e-2),
            lambda b1, i: lion_reference(start[i], [gs[i] for gs in grads], 1e-2, (0.9, b1 + 0.09), 0.0)[1][
                "exp_avg"
            ],
        ),
    }[which]
    for gs in grads:
        for q, g in zip(params, gs):
            q.grad = g.clone()
        opt.step()
    got = params if which != "lion" else [opt.state[q]["exp_avg"] for q in params]
    for i, q in enumerate(got):
        assert_fp32_close(q, reference(0.9, i))
    assert any(
        _fails(lambda i=i, q=q: assert_fp32_close(q, reference(0.9 + 1e-5, i))) for i, q in enumerate(got)
    )
