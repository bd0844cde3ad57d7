"""States of one number per tensor, row or column beside matrix states (a running bound of
PSGD's kind, a row statistic): kept by the matrix phase, read by the update as values per
element. Against float64 written from the rule."""

from __future__ import annotations

import torch

import fuser

RULE = fuser.rule(
    """
    L = L + g @ transpose(g)
    bound = maximum(beta * bound, norm(L))
    r = r + rowmean(g**2)
    u = L @ g / bound
    p = p - lr * u / sqrt(r + eps) - lr * 0.1 * bound / (1 + bound)
    """,
    name="bounded",
    hyper=dict(lr=0.05, beta=0.9, eps=1e-3),
    state=dict(L="zeros(rows, rows)", bound=0.0, r=0.0),
)


def reference(p, grads):
    p = p.double().clone()
    rows = p.shape[0]
    L = torch.zeros(rows, rows, dtype=torch.float64)
    bound = torch.zeros((), dtype=torch.float64)
    r = torch.zeros(rows, 1, dtype=torch.float64)
    for g in grads:
        g = g.double().reshape(rows, -1)
        L = L + g @ g.T
        bound = torch.maximum(0.9 * bound, L.norm())
        r = r + g.square().mean(1, keepdim=True)
        u = L @ g / bound
        p = p - (0.05 * u / (r + 1e-3).sqrt()).reshape(p.shape) - 0.05 * 0.1 * bound / (1 + bound)
    return p, bound, r.flatten()


def test_scalar_and_row_states_follow_float64(device):
    shapes = [(5, 3), (5, 3), (4, 6)]
    start = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(3)]
    ps = [x.clone().to(device) for x in start]
    opt = fuser.compile(RULE)(ps)
    for gs in grads:
        for p, g in zip(ps, gs):
            p.grad = g.to(device)
        opt.step()
    for k, p in enumerate(ps):
        want, bound, r = reference(start[k], [gs[k] for gs in grads])
        st = opt.state[p]
        assert st["bound"].shape == () and st["r"].shape == (shapes[k][0],)
        assert st["bound"].dtype == torch.float32
        # (fp32 sums of 15-24 products over 3 steps: a few 1e-7 relative)
        assert abs(st["bound"].double().cpu() - bound) / bound < 1e-6
        assert (st["r"].double().cpu() - r).norm() / r.norm() < 1e-6
        err = (p.double().cpu() - want).norm() / (want - start[k].double()).norm()
        assert err < 1e-5, (k, err.item())


def test_state_dict_keeps_the_phase_states(device):
    p = torch.randn(4, 3).to(device)
    opt = fuser.compile(RULE)([p])
    p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    assert set(sd["state"][0]) == {"step", "L", "bound", "r"}
    q = p.clone()
    again = fuser.compile(RULE)([q])
    again.load_state_dict(sd)
    g = torch.randn_like(p)
    p.grad, q.grad = g, g.clone()
    opt.step()
    again.step()
    assert torch.equal(p, q) and torch.equal(opt.state[p]["bound"], again.state[q]["bound"])


def test_a_side_without_a_factor_stays_the_identity_under_a_per_tensor_gate(device):
    # The gate reads a state of one number per tensor, so both branches are values of the
    # stack; a side over max_matrix_dim (rows 7 and 9 > 4) must still be the identity.
    rule = fuser.rule(
        """
        c = c + 1
        L = where(c > 1.5, L + g @ transpose(g), L * 2)
        p = p - lr * L @ g
        """,
        name="gated",
        hyper=dict(lr=0.1),
        state=dict(c=0.0, L="eye(rows)"),
    )
    shapes = [(7, 3), (9, 2), (3, 5)]
    start = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(3)]
    ps = [x.clone().to(device) for x in start]
    opt = fuser.compile(rule)(ps, max_matrix_dim=4)
    for gs in grads:
        for p, g in zip(ps, gs):
            p.grad = g.to(device)
        opt.step()
    for k in (0, 1):  # (no factor: the identity, times the 2 of the first step's branch)
        want = start[k].double() - 0.1 * sum(
            (2 if i == 0 else 1) * gs[k].double() for i, gs in enumerate(grads)
        )
        assert opt.state[ps[k]]["L"].numel() == 0
        assert (ps[k].double().cpu() - want).norm() / want.norm() < 1e-6
    L = torch.eye(3, dtype=torch.float64)
    want = start[2].double()
    for i, gs in enumerate(grads):
        g = gs[2].double()
        L = L * 2 if i == 0 else L + g @ g.T
        want = want - 0.1 * L @ g
    assert (ps[2].double().cpu() - want).norm() / want.norm() < 1e-5
    assert (opt.state[ps[2]]["L"].double().cpu() - L).norm() / L.norm() < 1e-6


def test_states_of_the_wrong_shape_or_dtype_given_by_hand(device):
    """A state assigned of another shape (or missing) is a ValueError before anything moves,
    on whichever parameter it is; one of another dtype is stored as fp32 as made."""
    import copy

    import pytest

    rule = fuser.rule(
        "m = 0.5 * m + g\n" + RULE.text,
        name="bounded_m",
        hyper=dict(RULE.hyper),
        state=dict(RULE.state, m=0.0),
    )
    ps = [torch.randn(5, 3, device=device), torch.randn(4, 6, device=device)]
    opt = fuser.compile(rule)(ps)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    bad = {"L": torch.zeros(6, 6), "bound": torch.zeros(1), "r": torch.zeros(6), "m": torch.zeros(4, 5)}
    for key, value in bad.items():
        kept = [p.clone() for p in ps], [copy.deepcopy(opt.state[p]) for p in ps]
        opt.state[ps[1]][key] = value.to(device)
        with pytest.raises(ValueError, match=rf"state '{key}' .* shape \(4, 6\) is of shape"):
            opt.step()
        assert all(torch.equal(p, q) for p, q in zip(ps, kept[0]))
        assert all(
            torch.equal(opt.state[p][k], v) for p, st in zip(ps, kept[1]) for k, v in st.items() if k != key
        )
        opt.state[ps[1]][key] = kept[1][1][key]
    del opt.state[ps[0]]["r"]
    with pytest.raises(ValueError, match=r"state 'r' .* is missing"):
        opt.step()
    opt.state[ps[0]]["r"] = torch.ones(5, device=device)
    opt.state[ps[1]]["L"] = opt.state[ps[1]]["L"].to(torch.bfloat16)
    opt.step()
    assert opt.state[ps[1]]["L"].dtype == torch.float32 and float(opt.state[ps[0]]["step"]) == 2
