"""Per-dimension factors of a matrix rule ("zeros(dims)", ``gram``, ``modes``, ``eye_dims``):
one ``[d, d]`` factor per dimension of a tensor of any order, as Shampoo keeps them (Gupta et
al. 2018, Algorithm 2). The reference is that algorithm in float64 with ``torch.tensordot``,
written from the paper, not from the rule."""

from __future__ import annotations

import warnings

import pytest
import torch

import fuser
from fuser.errors import RuleError

TEXT = """
    F = beta * F + gram(g)
    P = where(every(k), inv_root(F + eps * eye_dims(), 2 * ndim), P)
    p = p - lr * modes(g, P)
"""
HYPER = dict(lr=0.05, beta=0.9, eps=0.1, k=2.0)
STATE = dict(F="zeros(dims)", P="eye(dims)")
SHAMPOO = fuser.rule(TEXT, name="dims_shampoo", hyper=HYPER, state=STATE)
# Tensors of orders 0 to 4, two of one shape (one stack), and a dimension of 40 over the limit.
SHAPES = [(5, 3, 4), (7,), (6, 5), (5, 3, 4), (3, 40, 2), (2, 3, 2, 3), ()]
LIMIT = 30
# fp32 eigendecompositions of factors of condition number up to ~1e3 (eps 0.1) against float64.
TOL = 1e-5


def papers_shampoo(p: torch.Tensor, grads: list, limit: int = LIMIT, diagonal=None) -> torch.Tensor:
    """Shampoo for an order-k tensor in float64: per dimension i the statistic of ``g``
    unfolded along i, every ``k`` steps its inverse ``2k``-th root, and the update ``g ×₁ P₁
    … ×ₖ Pₖ``; a dimension over ``limit`` without a factor, unless ``diagonal`` marks it:
    a marked dimension's statistic is cut to its diagonal."""
    p = p.double().clone()
    order = p.dim()
    diagonal = diagonal or (False,) * order
    stats = [torch.zeros(d, d, dtype=torch.float64) for d in p.shape]
    roots = [torch.eye(d, dtype=torch.float64) for d in p.shape]
    for step, g in enumerate(grads, 1):
        g = g.double()
        u = g
        for i, d in enumerate(p.shape):
            if d > limit and not diagonal[i]:
                continue
            other = [j for j in range(order) if j != i]
            s = torch.tensordot(g, g, dims=(other, other))
            stats[i] = HYPER["beta"] * stats[i] + (torch.diag(s.diagonal()) if diagonal[i] else s)
            if step % int(HYPER["k"]) == 0:
                lam, vec = torch.linalg.eigh(stats[i] + HYPER["eps"] * torch.eye(d, dtype=torch.float64))
                roots[i] = (vec * lam ** (-1.0 / (2 * order))) @ vec.T
            u = torch.movedim(torch.tensordot(roots[i], u, dims=([1], [i])), 0, i)
        p = p - HYPER["lr"] * u
    return p


def _grads(shapes, steps: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]


def _run(opt, ps, grads) -> None:
    for gs in grads:
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


def test_per_dimension_shampoo_is_the_papers_algorithm_for_tensors_of_every_order():
    torch.manual_seed(0)
    ps = [torch.randn(s, requires_grad=True) for s in SHAPES]
    start = [p.detach().clone() for p in ps]
    grads = _grads(SHAPES, 4, seed=1)  # (two refreshes of the roots)
    opt = fuser.compile(SHAMPOO)(ps, max_matrix_dim=LIMIT)
    _run(opt, ps, grads)
    for j, (p, p0) in enumerate(zip(ps, start)):
        want = papers_shampoo(p0, [gs[j] for gs in grads])
        assert _rel(p.detach(), want) < TOL, (p.shape, _rel(p.detach(), want))
    st = opt.state[ps[4]]  # (3, 40, 2): the 40 over the limit has no factor
    assert st["F[1]"].numel() == 0 and st["P[1]"].numel() == 0
    assert st["F[0]"].shape == (3, 3) and st["P[2]"].shape == (2, 2)
    want_f = sum(
        0.9 ** (3 - s) * torch.tensordot(gs[0].double(), gs[0].double(), dims=([1, 2], [1, 2]))
        for s, gs in enumerate(grads)
    )
    assert _rel(opt.state[ps[0]]["F[0]"], want_f) < TOL


def test_a_traced_rule_writes_the_same_factors_with_fuser_gram_and_modes():
    @fuser.rule(name="dims_shampoo_traced", hyper=HYPER, state=STATE)
    def traced(p, g, F, P, *, lr, beta, eps, k, ndim):
        F = beta * F + fuser.gram(g)
        P = fuser.where(fuser.every(k), fuser.inv_root(F + eps * fuser.eye_dims(), 2 * ndim), P)
        return dict(p=p - lr * fuser.modes(g, P), F=F, P=P)

    shapes = [(4, 3, 5), (6,)]
    grads = _grads(shapes, 2, seed=2)
    out = []
    for rule in (SHAMPOO, traced):
        torch.manual_seed(3)
        ps = [torch.randn(s, requires_grad=True) for s in shapes]
        _run(fuser.compile(rule)(ps), ps, grads)
        out.append(ps)
    for a, b in zip(*out):
        assert torch.equal(a, b)
    latex = SHAMPOO._repr_latex_()
    assert r"\operatorname{gram}\left(g\right)" in latex and r"\operatorname{modes}\left(g, P\right)" in latex


def test_state_dict_round_trip_of_per_dimension_factors_continues_the_same_steps():
    shapes = [(4, 3, 5), (6, 2)]
    grads = _grads(shapes, 4, seed=4)
    torch.manual_seed(5)
    ps = [torch.randn(s, requires_grad=True) for s in shapes]
    qs = [p.detach().clone().requires_grad_() for p in ps]
    Opt = fuser.compile(SHAMPOO)
    whole = Opt(ps)
    _run(whole, ps, grads)
    first = Opt(qs)
    _run(first, qs, grads[:2])
    saved = first.state_dict()
    assert saved["state"][0]["F[2]"].shape == (5, 5)
    second = Opt(qs)
    second.load_state_dict(saved)
    _run(second, qs, grads[2:])
    for a, b in zip(ps, qs):
        assert torch.equal(a, b)
    second.state[qs[0]]["P[1]"] = torch.eye(4)
    before = qs[0].detach().clone()
    with pytest.raises(ValueError, match=r"state 'P\[1\]' .* shape \(3, 3\)"):
        _run(second, qs, grads[:1])
    assert torch.equal(qs[0], before)  # (nothing of the failed step applied)


def test_a_factor_whose_root_fails_keeps_its_previous_value_with_a_warning():
    rule = fuser.rule(
        """
        F = gram(g)
        P = inv_root(-F, 2)
        p = p - lr * modes(g, P)
        """,
        name="negative",
        hyper=dict(lr=0.1),
        state=STATE,
    )
    p = torch.randn(3, 4, requires_grad=True)
    p.grad = torch.randn(3, 4)  # (-F has negative eigenvalues in both dimensions: both roots fail)
    opt = fuser.compile(rule)([p])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert any("keeps its previous value" in str(w.message) for w in caught)
    assert torch.equal(opt.state[p]["P[0]"], torch.eye(3)) and torch.equal(opt.state[p]["P[1]"], torch.eye(4))
    assert torch.isfinite(p).all()


def test_triangles_solves_traces_and_their_product_over_dimensions_per_factor():
    rule = fuser.rule(
        """
        F = gram(g)
        p = p - lr * modes(g, solve_upper(triu(F + eye_dims()), tril(F))) / prod_dims(trace(F + eye_dims()))
        """,
        name="per_factor",
        hyper=dict(lr=5000.0),  # (a step of about 0.1: the product of traces is some 1e4)
        state=dict(F="zeros(dims)"),
    )
    shapes = [(3, 4, 2), (5, 3)]
    grads = _grads(shapes, 1, seed=6)[0]
    torch.manual_seed(7)
    ps = [torch.randn(s, requires_grad=True) for s in shapes]
    want = []
    for g in grads:  # (float64, from the definitions)
        u, scale, g = g.double(), 1.0, g.double()
        for i, d in enumerate(g.shape):
            other = [j for j in range(g.dim()) if j != i]
            f = torch.tensordot(g, g, dims=(other, other))
            t = torch.linalg.solve_triangular(
                torch.triu(f + torch.eye(d, dtype=torch.float64)), torch.tril(f), upper=True
            )
            u = torch.movedim(torch.tensordot(t, u, dims=([1], [i])), 0, i)
            scale *= float(torch.trace(f)) + d
        want.append(5000.0 * u / scale)
    start = [p.detach().clone() for p in ps]
    _run(fuser.compile(rule)(ps), ps, [grads])
    for p, p0, w in zip(ps, start, want):  # (the step itself)
        assert _rel(p0 - p.detach(), w) < TOL, _rel(p0 - p.detach(), w)


@pytest.mark.parametrize(
    "text, state, match",
    [
        ("F = gram(F)\np = p - lr * g", STATE, r"gram\(\) takes a value per element"),
        ("L = L\np = p - lr * modes(g, L)", dict(L="zeros(rows, rows)"), r"modes\(x, F\) takes x"),
        ("F = F + gram(g)\np = p - lr * F @ g", STATE, r"modes\(x, F\)"),
        (
            "F = F + gram(g)\np = p - lr * g * trace(F)",
            STATE,
            r"a number per dimension .* cannot be combined",
        ),
        ("F = F + gram(g)\np = p - lr * solve_upper(F, g)", STATE, r"solve_upper\(A, B\) of per-dimension"),
        ("F = F + gram(g)\np = p - lr * g * norm(F)", STATE, r"a number per dimension .* cannot be combined"),
        ("F = F + gram(g)\np = p - lr * g * norm(amax(F))", STATE, r"norm\(\) does not take a number per"),
        (
            "F = F + gram(g)\np = p - lr * g * prod_dims(F)",
            STATE,
            r"prod_dims\(\) takes a number per dimension",
        ),
        (
            "F = F + gram(g)\np = p - lr * solve_modes_lower(g, F)",
            STATE,
            r"solve_modes_lower\(A, x\) takes A",
        ),
        ("F = F + gram(g)\np = p - lr * g * sum(diag(F) @ F)", STATE, r"`@` does not take a \[d\] vector"),
        ("F = F + gram(g)\np = p + F", STATE, r"cannot be combined elementwise"),
        ("L = inv_root(L, 2 * ndim)\np = p - lr * L @ g", dict(L="zeros(rows, rows)"), "function of ndim"),
        ("F = inv_root(F, ndim + 0.5)\np = p - lr * g", STATE, None),
        ("G = gram(g)\np = p - lr * g", dict(G=0.0), r"declare it as .*'zeros\(dims\)'"),
    ],
)
def test_misuse_of_per_dimension_factors_is_a_rule_error_at_its_line(text, state, match):
    if match is None:  # (k a function of ndim that is no whole number: refused at the step)
        opt = fuser.compile(fuser.rule(text, name="bad", hyper=dict(lr=0.1), state=state))
        p = torch.randn(3, 2, requires_grad=True)
        p.grad = torch.randn(3, 2)
        opt_ = opt([p])
        before = p.detach().clone()
        with pytest.raises(ValueError, match="k must be a whole number from 1 to 16"):
            opt_.step()
        assert torch.equal(p, before) and torch.equal(opt_.state[p]["F[0]"], torch.zeros(3, 3))
        return
    with pytest.raises(RuleError, match=match) as err:
        fuser.rule(text, name="bad", hyper=dict(lr=0.1), state=state)
    assert err.value.line is not None


def test_a_batched_view_gives_each_matrix_its_own_factors():
    # Expert weights [E, m, n] under view="batched": each [m, n] matrix is Shampoo's 2-D
    # tensor (ndim 2, roots 1/4), its factors stacked as F[0] [E, m, m] and F[1] [E, n, n];
    # a 2-D and a 1-D tensor beside them are factored whole.
    shapes = [(3, 5, 4), (2, 2, 3, 6), (5, 4), (7,)]
    torch.manual_seed(6)
    ps = [torch.randn(s, requires_grad=True) for s in shapes]
    start = [p.detach().clone() for p in ps]
    grads = _grads(shapes, 4, seed=7)
    opt = fuser.compile(SHAMPOO, view="batched")(ps)
    _run(opt, ps, grads)
    for j, (p, p0) in enumerate(zip(ps, start)):
        mats = p0.reshape(-1, *p0.shape[-2:]) if p0.dim() > 2 else p0[None]
        steps = [gs[j].reshape(mats.shape) for gs in grads]
        want = torch.stack([papers_shampoo(m, [g[k] for g in steps]) for k, m in enumerate(mats)])
        assert _rel(p.detach(), want.reshape(p.shape)) < TOL, (
            p.shape,
            _rel(p.detach(), want.reshape(p.shape)),
        )
    assert opt.state[ps[0]]["F[0]"].shape == (3, 5, 5) and opt.state[ps[0]]["P[1]"].shape == (3, 4, 4)
    assert opt.state[ps[1]]["F[1]"].shape == (2, 2, 6, 6) and "F[2]" not in opt.state[ps[1]]
    assert opt.state[ps[3]]["F[0]"].shape == (7, 7)
    saved = opt.state_dict()  # (the stacked factors load back and continue the same steps)
    again = fuser.compile(SHAMPOO, view="batched")([p.detach().clone().requires_grad_() for p in ps])
    again.load_state_dict(saved)
    again.state[again.param_groups[0]["params"][0]]["F[0]"] = torch.zeros(5, 5)
    with pytest.raises(ValueError, match=r"state 'F\[0\]' .* shape \(3, 5, 5\)"):
        _run(again, again.param_groups[0]["params"], grads[:1])
