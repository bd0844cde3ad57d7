"""Diagonal per-dimension factors (a matrix rule's ``diagonal_dims``): a marked dimension keeps
its factors as diagonals, and every value of it is that diagonal matrix. References: Shampoo
in float64 with each marked dimension's statistic cut to its diagonal (test_matrix_dims.py's
Gupta et al. 2018), and the same rule on full factors started diagonal (fuser's full path,
itself checked against float64 in test_matrix_dims.py), which must then stay diagonal.
PSGD Kron with diagonal factors against pytorch-optimizer's is in test_zoo.py."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

import fuser

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_matrix_dims import LIMIT, SHAMPOO, _grads, _rel, _run, papers_shampoo  # noqa: E402

SHAPES = [(5, 3, 4), (7,), (6, 1), (5, 3, 4), (3, 40, 2), ()]
ODD = lambda shape: tuple(d % 2 == 1 for d in shape)  # noqa: E731  (5, 3, 7, 1 and 3 diagonal)


def test_diagonal_dimensions_are_shampoo_with_diagonal_statistics():
    torch.manual_seed(0)
    ps = [torch.randn(s, requires_grad=True) for s in SHAPES]
    start = [p.detach().clone() for p in ps]
    grads = _grads(SHAPES, 4, seed=1)
    opt = fuser.compile(SHAMPOO)(ps, max_matrix_dim=LIMIT, diagonal_dims=ODD)
    _run(opt, ps, grads)
    for j, (p, p0) in enumerate(zip(ps, start)):
        want = papers_shampoo(p0, [gs[j] for gs in grads], diagonal=ODD(p.shape))
        assert _rel(p.detach(), want) < 1e-5, (p.shape, _rel(p.detach(), want))
        moved = _rel(p.detach(), p0.double()) if p0.norm() > 0 else 1.0
        assert moved > 1e-2, (p.shape, moved)
    st = opt.state[ps[0]]  # (5, 3, 4): 5 and 3 diagonal, 4 full
    assert st["F[0]"].shape == (5,) and st["P[1]"].shape == (3,) and st["F[2]"].shape == (4, 4)
    assert opt.state[ps[4]]["F[1]"].numel() == 0  # (40: over the limit, unmarked: no factor)
    want = sum(0.9 ** (3 - s) * gs[0].double().square().sum((1, 2)) for s, gs in enumerate(grads))
    assert _rel(st["F[0]"], want) < 1e-6


# Every per-dimension operation on factors that stay diagonal: reductions (the off-diagonal
# zeros counted: amax of -D is 0, the mean over d² entries), transpose, triu, diag, traces,
# F @ v, diag(QᵀFQ), solves, roots, modes and their solves, where (per step and per entry)
# and prod_dims.
EVERYTHING = fuser.rule(
    """
    E = E + D * D * (1 + abs(sum(D))) + gram(g) * 0
    s = amax(-D) + amax(D) + mean(D) * 3 + norm(D) + trace(D) / 4
    x = D @ argmax_onehot(diag(E))
    R = inv_root(where(E > 1, E, 2 * E) + eps * eye_dims(), 2)
    T = solve_upper(triu(D), transpose(R))
    q = diag(transpose(D) @ E @ D)
    D = where(every(2), (D - 0.3 * T @ D) * (1 + sum(q) / (1 + sum(q)) + norm(x)) / (1 + s), D)
    p = p - lr * modes(solve_modes_lower(transpose(D), g), R) * prod_dims(1 + amax(-D)) ** 0.5
    """,
    name="diag_everything",
    hyper=dict(lr=0.05, eps=0.1),
    state=dict(D="eye(dims)", E="zeros(dims)", R="eye(dims)"),
)


def test_every_operation_of_diagonal_factors_is_the_full_factors_started_diagonal():
    # gram(g) * 0 keeps E diagonal on full dimensions too (gram's diagonal meaning is checked
    # above); both runs start from the same diagonals (D's of both signs), as vectors or as
    # diagonal matrices, so every value of the full run stays diagonal.
    shapes = [(4, 3, 2), (5,), (3, 3)]
    grads = _grads(shapes, 4, seed=2)
    g = torch.Generator().manual_seed(4)
    starts = [[(torch.randn(d, generator=g), torch.rand(d, generator=g) + 0.5) for d in s] for s in shapes]
    runs = []
    for diagonal in (True, False):
        torch.manual_seed(3)
        ps = [torch.randn(s, requires_grad=True) for s in shapes]
        marks = (lambda s: (True,) * len(s)) if diagonal else None
        opt = fuser.compile(EVERYTHING)(ps, diagonal_dims=marks)
        for p, start in zip(ps, starts):
            opt.state[p]["step"] = torch.tensor(0.0)
            for k, (dv, ev) in enumerate(start):
                as_factor = (lambda v: v.clone()) if diagonal else torch.diag
                opt.state[p][f"D[{k}]"], opt.state[p][f"E[{k}]"] = as_factor(dv), as_factor(ev)
                opt.state[p][f"R[{k}]"] = as_factor(torch.ones(len(dv)))
        _run(opt, ps, grads)
        runs.append((ps, opt))
    (ours, diag_opt), (full, full_opt) = runs
    for a, b in zip(ours, full):
        # (the full run's roots by fp32 eigh, within 1e-5 of the diagonal's fp64 powers)
        assert _rel(a.detach(), b.detach().double()) < 1e-5
        for k in range(a.dim()):
            for s in ("D", "E"):
                v, m = diag_opt.state[a][f"{s}[{k}]"], full_opt.state[b][f"{s}[{k}]"]
                assert torch.equal(m, torch.diag(m.diagonal()))  # (the full run stayed diagonal)
                assert _rel(v, m.diagonal().double()) < 1e-5, (s, k)
    moved = [
        float((diag_opt.state[a]["D[0]"] - start[0][0]).norm() / start[0][0].norm())
        for a, start in zip(ours, starts)
    ]
    assert min(moved) > 1e-2, moved


def test_a_diagonal_root_that_fails_keeps_its_previous_value_with_a_warning():
    rule = fuser.rule(
        "F = gram(g)\nP = inv_root(-F, 2)\np = p - lr * modes(g, P)",
        name="diag_negative",
        hyper=dict(lr=0.1),
        state=dict(F="zeros(dims)", P="eye(dims)"),
    )
    p = torch.randn(3, 4, requires_grad=True)
    p.grad = torch.randn(3, 4)
    opt = fuser.compile(rule)([p], diagonal_dims=lambda s: (True, False))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert any("diagonal 3x3 factor" in str(w.message) for w in caught)
    assert torch.equal(opt.state[p]["P[0]"], torch.ones(3)) and torch.isfinite(p).all()


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("P = exp(F)", "not zero off the diagonal"),
        ("P = F + 1", "not zero off the diagonal"),
        ("P = where(F > 1, F, 1)", "not zero off the diagonal"),
        ("P = eigh(F)", "diagonal_dims marks diagonal"),
        ("P = F @ sort_perm(diag(F))", "diagonal_dims marks diagonal"),
    ],
)
def test_values_that_are_not_diagonal_are_refused_before_anything_changes(line, match):
    rule = fuser.rule(
        f"F = F + gram(g)\n{line}\np = p - lr * modes(g, P)",
        name="diag_refused",
        hyper=dict(lr=0.1),
        state=dict(F="zeros(dims)", P="eye(dims)"),
    )
    p = torch.randn(3, 4, requires_grad=True)
    p.grad = torch.randn(3, 4)
    before = p.detach().clone()
    opt = fuser.compile(rule)([p], diagonal_dims=lambda s: (True, True))
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert torch.equal(p.detach(), before) and float(opt.state[p]["step"]) == 0
    assert torch.equal(opt.state[p]["F[0]"], torch.zeros(3))


def test_diagonal_dims_is_checked_and_its_states_keep_their_shapes():
    p = torch.randn(3, 4, requires_grad=True)
    Opt = fuser.compile(SHAMPOO)
    with pytest.raises(TypeError, match="diagonal_dims must be a function"):
        Opt([p], diagonal_dims=(True, False))
    two_sided = fuser.rule(
        "L = L + g @ transpose(g)\np = p - lr * L @ g",
        name="two_sided",
        hyper=dict(lr=0.1),
        state=dict(L="zeros(rows, rows)"),
    )
    with pytest.raises(TypeError, match="this rule has none"):
        fuser.compile(two_sided)([p], diagonal_dims=ODD)
    p.grad = torch.randn(3, 4)
    bad = Opt([p], diagonal_dims=lambda s: (True,))
    with pytest.raises(ValueError, match=r"diagonal_dims\(\(3, 4\)\) gave \(True,\)"):
        bad.step()
    assert not bad.state[p]  # (nothing began)
    opt = Opt([p], diagonal_dims=ODD)
    opt.step()
    saved = opt.state_dict()
    assert saved["state"][0]["F[0]"].shape == (3,) and saved["state"][0]["F[1]"].shape == (4, 4)
    again = Opt([p], diagonal_dims=ODD)
    again.load_state_dict(saved)
    again.state[p]["P[0]"] = torch.eye(3)
    with pytest.raises(ValueError, match=r"state 'P\[0\]' .* shape \(3,\)"):
        again.step()


def test_a_batched_view_marks_each_matrix_dimensions():
    # view="batched": diagonal_dims sees each matrix's (rows, cols), its diagonals stacked.
    shapes = [(2, 5, 4), (3, 6)]
    torch.manual_seed(8)
    ps = [torch.randn(s, requires_grad=True) for s in shapes]
    start = [p.detach().clone() for p in ps]
    grads = _grads(shapes, 4, seed=9)
    seen = set()
    marks = lambda shape: seen.add(shape) or ODD(shape)  # noqa: E731
    opt = fuser.compile(SHAMPOO, view="batched")(ps, diagonal_dims=marks)
    _run(opt, ps, grads)
    assert seen == {(5, 4), (3, 6)}
    for j, (p, p0) in enumerate(zip(ps, start)):
        mats = p0.reshape(-1, *p0.shape[-2:])
        steps = [gs[j].reshape(mats.shape) for gs in grads]
        want = [papers_shampoo(m, [g[k] for g in steps], diagonal=ODD(m.shape)) for k, m in enumerate(mats)]
        assert _rel(p.detach(), torch.stack(want).reshape(p.shape)) < 1e-5
    assert opt.state[ps[0]]["F[0]"].shape == (2, 5) and opt.state[ps[0]]["F[1]"].shape == (2, 4, 4)
