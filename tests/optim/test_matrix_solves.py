"""Triangular solves of matrix rules (``solve_upper``, ``solve_lower``, docs/rules.md)
against float64 ``torch.linalg.solve_triangular``: left solves with a ``[rows, rows]``
factor, the right solve ``B A⁻¹`` written with transposes, a singular factor."""

from __future__ import annotations

import warnings

import pytest
import torch

import fuser

SOLVES = fuser.rule(
    """
    a = solve_upper(Q, g)
    b = transpose(solve_lower(transpose(P), transpose(g)))
    p = p - lr * (a + b)
    """,
    name="solves",
    hyper=dict(lr=0.1),
    state=dict(Q="eye(rows)", P="eye(cols)"),
)


def triangular(n: int) -> torch.Tensor:
    """Upper triangular, well conditioned, with entries below the diagonal the solves must
    not read."""
    return torch.triu(torch.randn(n, n)) + 3 * torch.eye(n) + 5 * torch.tril(torch.ones(n, n), -1)


def test_solves_follow_float64(device):
    ps = [torch.randn(5, 3).to(device), torch.randn(5, 3).to(device), torch.randn(4, 6).to(device)]
    opt = fuser.compile(SOLVES)(ps)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()  # (makes the states: identities)
    factors = {}
    for p in ps:
        q, r = triangular(p.shape[0]), triangular(p.shape[1])
        opt.state[p]["Q"].copy_(q)
        opt.state[p]["P"].copy_(r)
        factors[p] = (q.double(), r.double())
    before = [p.detach().double().cpu().clone() for p in ps]
    grads = [torch.randn(p.shape) for p in ps]
    for p, g in zip(ps, grads):
        p.grad = g.to(device)
    opt.step()
    for p, p0, g in zip(ps, before, grads):
        q, r = (torch.triu(x) for x in factors[p])
        g = g.double()
        a = torch.linalg.solve_triangular(q, g, upper=True)
        b = torch.linalg.solve_triangular(r, g, upper=True, left=False)
        want = p0 - 0.1 * (a + b)
        step = (want - p0).norm()
        err = (p.double().cpu() - want).norm() / step
        # (fp32 solves of 3-6 sided factors with condition ~10: a few 1e-7 of the step)
        assert err < 1e-5, err.item()


def test_a_singular_factor_gives_zero_with_a_warning_and_no_nan(device):
    ps = [torch.randn(4, 2).to(device), torch.randn(4, 2).to(device)]
    opt = fuser.compile(SOLVES)(ps)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    q = triangular(4)
    q[2, 2] = 0.0  # singular
    opt.state[ps[0]]["Q"].copy_(q)
    before = [p.detach().clone() for p in ps]
    for p in ps:
        p.grad = torch.randn_like(p)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt.step()
    assert [str(w.message) for w in seen if "singular" in str(w.message)], [str(w.message) for w in seen]
    assert all(bool(torch.isfinite(p).all()) for p in ps)
    # The singular tensor's left solve is zero: only the right solve (the identity) moved it.
    assert torch.allclose(ps[0], before[0] - 0.1 * ps[0].grad, rtol=0, atol=1e-6)
    assert not torch.allclose(ps[1], before[1] - 0.1 * ps[1].grad, rtol=0, atol=1e-6)


def test_a_solve_of_unmatched_sides_is_a_rule_error():
    with pytest.raises(fuser.RuleError, match=r"solve_upper\(A, B\) takes A a \[rows, rows\]"):
        fuser.rule(
            "p = p - lr * solve_upper(P, g)", name="bad", hyper=dict(lr=0.1), state=dict(P="eye(cols)")
        )


PERMUTED = fuser.rule(
    """
    P = sort_perm(rowsum(g))
    C = sort_perm(colsum(g * g) - colsum(g))
    p = transpose(P) @ g @ C + 2 * P @ g @ transpose(C) + 3 * diag(transpose(P) @ (g @ transpose(g)) @ P)
    """,
    name="permuted",
    hyper=dict(),
)


def test_sort_perm_products_follow_explicit_permutation_matrices(device):
    g = torch.randn(5, 4)
    p = torch.zeros(5, 4).to(device)
    p.grad = g.to(device)
    fuser.compile(PERMUTED)([p]).step()
    gd = g.double()

    def perm(d):  # P[:, j] = e[idx[j]], idx sorting d from largest to smallest
        idx = torch.argsort(d, descending=True, stable=True)
        return torch.nn.functional.one_hot(idx, len(d)).double().T

    P, C = perm(gd.sum(1)), perm((gd * gd).sum(0) - gd.sum(0))
    assert not torch.equal(P, torch.eye(5, dtype=torch.float64))  # (a permutation that moves rows)
    want = P.T @ gd @ C + 2 * P @ gd @ C.T + 3 * torch.diag(P.T @ gd @ gd.T @ P).unsqueeze(1)
    assert (p.double().cpu() - want).norm() / want.norm() < 1e-6


ARGMAX = fuser.rule(
    """
    L = g @ transpose(g)
    R = transpose(g) @ g
    p = L @ argmax_onehot(rowsum(g)) + 2 * (R @ argmax_onehot(diag(R)))
    """,
    name="argmax",
    hyper=dict(),
)


def test_argmax_onehot_picks_the_first_largest_row_and_column(device):
    # Rows 1 and 3 have the largest sum, 8 exactly in fp32, and differ: the first of them is
    # picked; the column of R = GᵀG of largest diagonal is G's column of largest norm.
    g = torch.rand(5, 4)
    g[1], g[3] = torch.tensor([3.0, 1.0, 2.0, 2.0]), torch.tensor([2.0, 2.0, 1.0, 3.0])
    p = torch.zeros(5, 4).to(device)
    p.grad = g.to(device)
    fuser.compile(ARGMAX)([p]).step()
    gd = g.double()
    L, R = gd @ gd.T, gd.T @ gd
    j = int(torch.diag(R).argmax())
    want = L[:, 1].unsqueeze(1) + 2 * R[:, j].unsqueeze(0)
    assert (p.double().cpu() - want).norm() / want.norm() < 1e-6


def test_argmax_onehot_of_a_value_per_element_is_a_rule_error():
    with pytest.raises(fuser.RuleError, match=r"line 1, column 14: argmax_onehot\(\) takes a value per row"):
        fuser.rule("p = p - lr * argmax_onehot(g)", name="bad", hyper=dict(lr=0.1))
