"""``inv_root_newton(M, k)`` (docs/rules.md, "Matrix values of an optimizer rule";
``fuser.runtime.matrix.inv_root_newton``): a Shampoo-like rule against float64 roots
by eigendecomposition written here, over steps with refreshes; matrices that fail (a zero
factor, one that is singular but finite) and keep their old value while the rest of their
stack converges and stops; the errors of a bad ``k``; the traced form and the displays.

Error bound of a root (fp32 against float64, relative, spectral norm, ``d`` the side): the
iteration stops once every entry of ``Y - I`` is within ``TOL`` (``Y = X^k M`` in exact
arithmetic), so ``||Y - I|| <= d TOL`` and ``X = M^(-1/k) Y^(1/k)`` is off by ``d TOL / k``;
fp32's rounding in the iteration acts as a backward error of ``d U ||M||`` a product (the
coupled iteration is stable: Higham, *Functions of Matrices*, 2008, sec. 7.3), which moves
``M^(-1/k)`` by ``kappa(M) d U / k``; the bound allows ``k`` such products a step, ``kappa d
U``. Each comparison allows ``SLACK`` times that, and checks the bound is small beside
what it bounds."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from numerics import SLACK, U

import fuser
from fuser.runtime.matrix import NEWTON_MAX_ITERATIONS, NEWTON_TOLERANCE

F64 = torch.float64
STATE = dict(L="zeros(rows, rows)", R="zeros(cols, cols)", PL="eye(rows)", PR="eye(cols)")
# eps beside the factors of gradients at this scale keeps their condition numbers in the
# tens to hundreds: the bound stays under 1e-3 of the root, while a wrong iteration moves it by far more.
EPS, GSCALE = 0.1, 0.5


def shampoo_text(root: int) -> str:
    return "\n".join(
        [
            "L = L + g @ transpose(g)",
            "R = R + transpose(g) @ g",
            f"PL = where(every(k), inv_root_newton(L + eps * eye(rows), {root}), PL)",
            f"PR = where(every(k), inv_root_newton(R + eps * eye(cols), {root}), PR)",
            "p = p - lr * PL @ g @ PR",
        ]
    )


def d64(x: torch.Tensor) -> torch.Tensor:
    return x.detach().cpu().double()


def spectral(m: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(m, 2))


def inv_root64(m: torch.Tensor, k: int) -> torch.Tensor:
    lam, vec = torch.linalg.eigh(m)
    return (vec * lam ** (-1.0 / k)) @ vec.T


def root_rtol(m: torch.Tensor, k: int) -> float:
    """The module docstring's bound on the fp32 root of ``m``, relative to its norm."""
    lam = torch.linalg.eigvalsh(m)
    d = m.shape[-1]
    return d * NEWTON_TOLERANCE / k + float(lam[-1] / lam[0]) * d * U


@pytest.mark.parametrize("root", [2, 4])
def test_newton_roots_follow_float64_over_gated_refreshes(root, device):
    """Four steps with every(2): the roots on steps 2 and 4 against float64's of the
    optimizer's own factors plus eps (test_matrix_rules.py checks the factors themselves),
    the gated steps keep the last root bit for bit, and each step's ``p`` is fuser's old
    ``p`` minus the float64 update with the float64 roots. Two 5x7 tensors (one stack, each
    its own factors) and a 13x3 one."""
    opt_cls = fuser.compile(
        fuser.rule(shampoo_text(root), name="newton", hyper=dict(lr=1e-2, eps=1e-6, k=1.0), state=STATE)
    )
    params = [torch.randn(s).to(device) for s in ((5, 7), (5, 7), (13, 3))]
    opt = opt_cls(params, lr=0.05, eps=EPS, k=2.0)
    roots = {id(p): {s: torch.eye(p.shape[i], dtype=F64) for s, i in (("L", 0), ("R", 1))} for p in params}
    rtols = {id(p): dict(L=0.0, R=0.0) for p in params}
    for step in range(1, 5):
        olds = [d64(p) for p in params]
        kept = [{s: opt.state[p][s].clone() for s in ("PL", "PR")} for p in params if opt.state[p]]
        for p in params:
            p.grad = (torch.randn(p.shape) * GSCALE).to(device)
        opt.step()
        for i, (p, old) in enumerate(zip(params, olds)):
            st, ref, rtol = opt.state[p], roots[id(p)], rtols[id(p)]
            for s in ("L", "R"):
                if step % 2:  # gated: the last refresh's root (the identity on step 1), exactly
                    before = kept[i]["P" + s] if kept else torch.eye(st[s].shape[0], device=device)
                    assert torch.equal(st["P" + s], before)
                    continue
                m = d64(st[s]) + EPS * torch.eye(st[s].shape[0], dtype=F64)
                ref[s], rtol[s] = inv_root64(m, root), root_rtol(m, root)
                assert rtol[s] < 1e-3  # beside an O(1) root: a wrong iteration would show
                err = spectral(d64(st["P" + s]) - ref[s])
                assert err <= SLACK * rtol[s] * spectral(ref[s]), (tuple(p.shape), s, err, rtol[s])
            G = d64(p.grad)
            expected = old - 0.05 * ref["L"] @ G @ ref["R"]
            rel = rtol["L"] + rtol["R"] + 2 * (sum(p.shape) + 2) * U
            bound = rel * 0.05 * spectral(ref["L"]) * float(G.norm()) * spectral(ref["R"])
            bound += U * float(expected.norm())
            err = float((d64(p) - expected).norm())
            assert err <= SLACK * bound, (step, tuple(p.shape), err, bound)
    a, b = (opt.state[params[i]]["PL"] for i in (0, 1))
    assert float((a - b).abs().max()) > 1e-2  # one stack, each matrix its own root


LEFT = "\n".join(
    [
        "L = L + g @ transpose(g)",
        "PL = where(every(k), inv_root_newton(L + eps * eye(rows), 2), PL)",
        "p = p - lr * PL @ g",
    ]
)


def test_newton_roots_that_fail_keep_the_old_value_while_the_rest_stop(device, monkeypatch):
    """eps = 0, one stack of three 5x7 tensors: a random gradient (its factor converges), a
    zero one (the zero factor: not finite from the first step) and one with a zero row (the
    factor's zero row stays zero in every iterate, so Y never nears I: finite, but not
    within the tolerance after NEWTON_MAX_ITERATIONS). The two failures warn, naming the
    state, in fp32 and again in fp64; their PL keeps its identity and no NaN reaches a
    parameter. The converged matrix stops being iterated while the singular one runs to
    the limit (the products' batch sizes show it). Next step both factors are positive
    definite and refresh silently."""
    opt_cls = fuser.compile(
        fuser.rule(
            LEFT,
            name="left",
            hyper=dict(lr=0.1, eps=0.0, k=1.0),
            state=dict(L="zeros(rows, rows)", PL="eye(rows)"),
        )
    )
    params = [torch.randn(5, 7).to(device) for _ in range(3)]
    good, zero, row = params
    opt = opt_cls(params, lr=0.1)
    good.grad, zero.grad = torch.randn(5, 7).to(device), torch.zeros(5, 7, device=device)
    row.grad = torch.randn(5, 7).to(device)
    row.grad[2] = 0.0
    zero0, row0 = zero.clone(), row.clone()
    powers = []  # (matrices, dtype) of each T^k the iteration asks for
    matrix_power = torch.linalg.matrix_power

    def counted(t, n):
        powers.append((t.shape[0], t.dtype))
        return matrix_power(t, n)

    monkeypatch.setattr(torch.linalg, "matrix_power", counted)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    found = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(found) == 2 and all("inv_root_newton()" in w and "'PL'" in w for w in found), found
    for p in (zero, row):
        assert torch.equal(opt.state[p]["PL"], torch.eye(5, device=device))
    assert torch.equal(zero, zero0)
    moved = 0.1 * d64(row.grad)  # (by the identity it kept: two roundings an entry)
    assert bool(((d64(row) - (d64(row0) - moved)).abs() <= 2 * U * (d64(row0).abs() + moved.abs())).all())
    assert all(bool(torch.isfinite(t).all()) for p in params for t in (p, opt.state[p]["PL"]))
    m = d64(opt.state[good]["L"])
    err = spectral(d64(opt.state[good]["PL"]) - inv_root64(m, 2))
    assert err <= SLACK * root_rtol(m, 2) * spectral(inv_root64(m, 2))
    # fp32: the zero factor is never iterated, the good one stops within 30 steps and the
    # singular one runs on alone to the limit, then X^k M is checked over the whole stack;
    # fp64 retries each failure alone: the zero one only checked, the singular one to the
    # limit and checked.
    fp32 = [n for n, dtype in powers if dtype == torch.float32]
    assert fp32[-1] == 3, fp32
    fp32 = fp32[:-1]
    assert len(fp32) == NEWTON_MAX_ITERATIONS and set(fp32) == {1, 2}, fp32
    assert fp32.count(2) < 30 and fp32 == sorted(fp32, reverse=True), fp32
    assert [n for n, dtype in powers if dtype == F64] == [1] * (NEWTON_MAX_ITERATIONS + 2)
    monkeypatch.undo()
    # Next step both factors are positive definite: they refresh, silently.
    for p in params:
        p.grad = torch.randn(5, 7).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        opt.step()
    for p in (zero, row):
        m = d64(opt.state[p]["L"])
        err = spectral(d64(opt.state[p]["PL"]) - inv_root64(m, 2))
        assert err <= SLACK * root_rtol(m, 2) * spectral(inv_root64(m, 2))


WHOLE = "needs k a whole number from 1 to 8 written in the rule"


def _error(text: str) -> fuser.RuleError:
    with pytest.raises(fuser.RuleError) as info:
        fuser.rule(
            text, name="r", hyper=dict(lr=0.1, k=2.0), state=dict(L="zeros(rows, rows)", PL="eye(rows)")
        )
    return info.value


@pytest.mark.parametrize(
    "call, fragment",
    [
        ("inv_root_newton(L, 9)", f"inv_root_newton(M, k) {WHOLE}, not 9"),
        ("inv_root_newton(L, 0)", f"{WHOLE}, not 0"),
        ("inv_root_newton(L, 2.5)", f"{WHOLE}, not 2.5"),
        ("inv_root_newton(L, k)", f"{WHOLE}, not k"),
        (
            "inv_root_newton(g, 2)",
            "inv_root_newton() takes a [rows, rows] or [cols, cols] matrix, not a value per",
        ),
        ("inv_root_newton(L)", "inv_root_newton() takes 2 arguments, got 1"),
    ],
    ids=["k-9", "k-0", "k-fraction", "k-hyperparameter", "kind", "arity"],
)
def test_newton_misuse_names_line_and_column(call, fragment):
    text = f"L = L + g @ transpose(g)\nPL = where(every(2), {call}, PL)\np = p - lr * PL @ g"
    err = _error(text)
    col = text.splitlines()[1].index("inv_root_newton") + 1
    first = str(err).splitlines()[0]
    assert (err.line, err.col) == (2, col) and first.startswith(f"rule 'r', line 2, column {col}: "), first
    assert fragment in first, first


def test_newton_that_no_state_keeps_is_refused():
    text = "L = L + g @ transpose(g)\np = p - lr * inv_root_newton(L, 2) @ g"
    rule = fuser.rule(text, name="r", hyper=dict(lr=0.1), state=dict(L="zeros(rows, rows)"))
    with pytest.raises(fuser.RuleError) as info:
        fuser.compile(rule)
    assert str(info.value).splitlines()[0] == (
        "rule 'r', line 2, column 1: inv_root_newton() must be the value of a matrix state (directly, "
        "or a branch of where(...)): where it fails that state keeps its previous value"
    )


def test_traced_newton_steps_as_the_text_rule_and_displays(device):
    """``fuser.inv_root_newton`` in a traced rule: the same step, bit for bit, as the rule
    text; the LaTeX and ``fuser.explain`` name the function and the state that keeps it."""

    @fuser.rule(hyper=dict(lr=0.1, eps=0.5), state=dict(L="zeros(rows, rows)", PL="eye(rows)"))
    def left(p, g, L, PL, *, lr, eps, rows):
        L = L + fuser.matmul(g, fuser.transpose(g))
        PL = fuser.inv_root_newton(L + eps * fuser.eye(rows), 4)
        return dict(p=p - lr * fuser.matmul(PL, g), L=L, PL=PL)

    text = fuser.rule(
        "L = L + g @ transpose(g)\nPL = inv_root_newton(L + eps * eye(rows), 4)\np = p - lr * (PL @ g)",
        name="left",
        hyper=dict(lr=0.1, eps=0.5),
        state=dict(L="zeros(rows, rows)", PL="eye(rows)"),
    )
    a = torch.randn(7, 5).to(device)
    b = a.clone()
    grads = [torch.randn(7, 5).to(device) for _ in range(2)]
    opts = [fuser.compile(r)([p]) for r, p in ((left, a), (text, b))]
    for g in grads:
        for opt, p in zip(opts, (a, b)):
            p.grad = g.clone()
            opt.step()
    assert torch.equal(a, b) and torch.equal(opts[0].state[a]["PL"], opts[1].state[b]["PL"])
    latex = r"\mathit{PL}' &= \operatorname{inv\_root\_newton}\left(L + \epsilon I + g \, g^{\top}, 4\right)"
    assert latex in left._repr_latex_()
    buf = io.StringIO()
    fuser.explain(text, file=buf)
    assert "inv_root_newton: kept by PL" in buf.getvalue()


def test_a_singular_factor_whose_iteration_drifts_to_the_identity_is_a_failure(device):
    """L = g gᵀ of rank 3 of 6: in fp32 the coupled iterate Y can reach I while X grows
    without bound (Y drifts from X^k M in rounding), for this seed at k = 1. X^k M, checked,
    is far from I: the root fails, warns, keeps its identity, and p moves by g alone."""
    torch.manual_seed(2)
    rule = fuser.rule(
        "L = L + g @ transpose(g)\nPL = inv_root_newton(L, 1)\np = p - lr * PL @ g",
        name="drift",
        hyper=dict(lr=1e-2),
        state=dict(L="zeros(rows, rows)", PL="eye(rows)"),
    )
    p = torch.randn(6, 3).to(device)
    p0 = p.clone()
    opt = fuser.compile(rule)([p])
    p.grad = torch.randn(6, 3).to(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert any("inv_root_newton()" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert torch.equal(opt.state[p]["PL"], torch.eye(6, device=device))
    torch.testing.assert_close(p, p0 - 1e-2 * p.grad, rtol=1e-6, atol=1e-7)
