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


@pytest.mark.parametrize("which", ["adam", "lamb", "lion"])
def test_built_in_references_reject_a_coefficient_off_by_1e5(device, which):
    """The same fuser run judged against its reference and against the reference with one
    coefficient moved by 1e-5 (beta1, or Lion's beta2): the first passes, the second fails
    on some element of the parameter or the states. (LAMB's trust ratio divides most of a
    change of its moment out of the parameter; the moment itself shows it.)"""
    params = [torch.randn(s, device=device) for s in SHAPES]
    start = [q.clone() for q in params]
    grads = [[torch.randn(s, device=device) for s in SHAPES] for _ in range(4)]

    def reference(beta, i):
        g = [gs[i] for gs in grads]
        if which == "adam":
            return torch_references.adam(start[i], g, 1e-2, betas=(beta, 0.999))
        if which == "lamb":
            return lamb_reference(start[i], g, 0.05, beta, 0.999, 1e-6, 0.1)
        return lion_reference(start[i], g, 1e-2, (0.9, beta + 0.09), 0.0)

    opt = {
        "adam": lambda: fuser.optim.Adam(params, lr=1e-2),
        "lamb": lambda: fuser.optim.LAMB(params, lr=0.05, weight_decay=0.1),
        "lion": lambda: fuser.optim.Lion(params, lr=1e-2),
    }[which]()
    for gs in grads:
        for q, g in zip(params, gs):
            q.grad = g.clone()
        opt.step()

    def compare(beta):
        for i, q in enumerate(params):
            want_p, want_state = reference(beta, i)
            assert_fp32_close(q, want_p, "parameter")
            for k, want in want_state.items():
                assert_fp32_close(opt.state[q][k], want, k)

    compare(0.9)
    with pytest.raises(AssertionError, match="beyond fp32's bound"):
        compare(0.9 + 1e-5)
