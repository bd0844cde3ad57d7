"""Matrix values of optimizer rules (docs/rules.md, "Matrix values of an optimizer rule";
``fuser.optim.matrix_rules``) against float64 references written here from the formulas:
the docs' Shampoo over gated refreshes on tensors of several shapes and param groups,
bf16 parameters with fp32 factors, decompositions that fail, sides over
``max_matrix_dim``, gates that evaluate one branch, checkpoints, and the contract's errors.

Error bounds (fp32 against float64, ``U = 2**-24``): a factor ``L = sum_t G_t G_t^T``
accumulated in fp32 is off by at most ``(t (cols + 1)) U`` times ``sum_t |G_t| |G_t|^T``
entry by entry; ``eigh`` is backward stable (the fp32 decomposition is exact for ``M + E``,
``||E|| <= 4 n U ||M||``, Higham 2002, ch. 8 and 19), so ``inv_root(M, k) = M^(-1/k)``, whose
divided differences are bounded by ``|f'(lambda_min)|``, moves by ``||E|| / (k lambda_min)``
relative to its norm; an eigenvector by ``||E|| / gap`` (Davis-Kahan); the Q of ``qr(A)`` by
``sqrt(2) kappa(A) ||E|| / ||A||`` (Sun 1991). Each comparison allows ``SLACK`` times the
first-order bound, and checks that the bound is small beside what it bounds (so the test
would see a wrong formula)."""

from __future__ import annotations

import copy
import io
import math
import warnings

import pytest
import torch
from numerics import SLACK, U

import fuser

F64 = torch.float64

# docs/rules.md's Shampoo, as written there.
SHAMPOO = "\n".join(
    [
        "L = L + g @ transpose(g)",
        "R = R + transpose(g) @ g",
        "PL = where(every(k), inv_root(L + eps * eye(rows), 4), PL)",
        "PR = where(every(k), inv_root(R + eps * eye(cols), 4), PR)",
        "p = p - lr * PL @ g @ PR",
    ]
)
SHAMPOO_STATE = dict(L="zeros(rows, rows)", R="zeros(cols, cols)", PL="eye(rows)", PR="eye(cols)")
# eps beside the factors' size keeps them well conditioned (kappa <= 1 + ||L|| / eps), so the
# fp32 bound is ~1e-5 of the update; gradients are drawn at this scale.
EPS, GSCALE = 0.5, 0.5


@pytest.fixture(scope="module")
def shampoo():
    rule = fuser.rule(SHAMPOO, name="shampoo", hyper=dict(lr=1e-2, eps=1e-6, k=1.0), state=SHAMPOO_STATE)
    return fuser.compile(rule)


def view(shape) -> tuple[int, int]:
    """The 2-D view of the contract: a 1-D tensor is one row, an N-D one [shape[0], prod(rest)]."""
    return (1, shape[0]) if len(shape) == 1 else (shape[0], math.prod(shape[1:]))


def d64(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float64 on the CPU, where the references run."""
    return x.detach().cpu().double()


def spectral(m: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(m, 2))


def inv_root64(m: torch.Tensor, k: int) -> torch.Tensor:
    lam, vec = torch.linalg.eigh(m)
    return (vec * lam ** (-1.0 / k)) @ vec.T


def inv_root_rtol(m: torch.Tensor, mabs: torch.Tensor, terms: int, k: int) -> float:
    """fp32's error in ``inv_root(m, k)`` relative to its norm, ``m`` summed from ``terms``
    products an entry (``mabs`` the sum of their magnitudes)."""
    n = m.shape[-1]
    shift = (terms + 4 * n) * U * spectral(mabs)
    lam = float(torch.linalg.eigvalsh(m)[0])
    assert shift < lam / 2, "the first-order bound needs a well-conditioned factor"
    return shift / (k * (lam - shift)) + 2 * n * U


class ShampooRef:
    """The docs' Shampoo on one tensor in float64, with the bound of fp32's error in ``p``
    (Frobenius norm) and in each factor. A side over ``limit`` has no factor (the identity)."""

    def __init__(self, p: torch.Tensor, limit: int | None = None):
        self.rows, self.cols = view(p.shape)
        self.p = d64(p).reshape(self.rows, self.cols).clone()
        self.t, self.err = 0, 0.0
        self.sides = {}
        for name, n in (("L", self.rows), ("R", self.cols)):
            if limit is None or n <= limit:
                z = torch.zeros(n, n, dtype=F64)
                self.sides[name] = dict(M=z, abs=z.clone(), P=torch.eye(n, dtype=F64), rtol=0.0)

    def step(self, g: torch.Tensor, lr: float, eps: float, k: int) -> None:
        self.t += 1
        G = d64(g).reshape(self.rows, self.cols)
        for name, s in self.sides.items():
            outer = (G @ G.T, G.abs() @ G.abs().T) if name == "L" else (G.T @ G, G.abs().T @ G.abs())
            s["M"] = s["M"] + outer[0]
            s["abs"] = s["abs"] + outer[1]
            if self.t % k == 0:  # a gated step keeps the last refresh (and its error)
                n = s["M"].shape[0]
                eye = torch.eye(n, dtype=F64)
                s["P"] = inv_root64(s["M"] + eps * eye, 4)
                other = self.cols if name == "L" else self.rows
                s["rtol"] = inv_root_rtol(
                    s["M"] + eps * eye, s["abs"] + eps * eye, self.t * (other + 1) + 1, 4
                )
        PL = self.sides["L"]["P"] if "L" in self.sides else torch.eye(self.rows, dtype=F64)
        PR = self.sides["R"]["P"] if "R" in self.sides else torch.eye(self.cols, dtype=F64)
        update = lr * PL @ G @ PR
        rel = sum(s["rtol"] for s in self.sides.values()) + 2 * (self.rows + self.cols + 2) * U
        self.err += rel * lr * spectral(PL) * float(G.norm()) * spectral(PR)
        self.p = self.p - update
        self.err += U * float(self.p.norm())

    def factor_err(self, name: str) -> float:
        """The bound of fp32's error in ``name``'s accumulated factor, entry by entry (max)."""
        s = self.sides[name]
        other = self.cols if name == "L" else self.rows
        return float((self.t * (other + 1)) * U * s["abs"].max())


def check_against(opt, p, ref: ShampooRef, p0: torch.Tensor) -> None:
    """``p`` and its states within the derived bounds of the float64 reference's."""
    st = opt.state[p]
    moved = float((ref.p - d64(p0).reshape(ref.p.shape)).norm())
    assert ref.err <= 1e-4 * moved, (ref.err, moved)  # the bound is tight enough to see a wrong step
    err = float((d64(p).reshape(ref.p.shape) - ref.p).norm())
    assert err <= SLACK * ref.err, (tuple(p.shape), err, ref.err)
    for name, s in ref.sides.items():
        got = d64(st[name])
        assert st[name].dtype == torch.float32 and got.shape == s["M"].shape
        assert float((got - s["M"]).abs().max()) <= SLACK * ref.factor_err(name) + 1e-30
        P = d64(st["P" + name])
        if s["rtol"] == 0.0:  # never refreshed: the identity it started as
            assert torch.equal(P, torch.eye(P.shape[0], dtype=F64))
        else:
            perr = spectral(P - s["P"])
            assert perr <= SLACK * s["rtol"] * spectral(s["P"]), (tuple(p.shape), name, perr, s["rtol"])


def grads_for(params, scale=GSCALE):
    return [(torch.randn(p.shape) * scale).to(p.device) for p in params]


# --- 1. the docs' Shampoo against float64 -----------------------------------------------------


def test_docs_shampoo_follows_float64_over_gated_refreshes(shampoo, device):
    """Four steps with k=2 (refreshes on steps 2 and 4; steps 1 and 3 keep the factors'
    last inverse roots bit for bit), two param groups of different lr, two 5x3 tensors in
    one group (one stack, each its own factors), a 5x3 tensor that skips step 1 (its own
    step count: a stack of its own), a 4x6 in both groups (two stacks), a 1-D tensor (one
    row: [1, 1] and [7, 7] factors) and a 3-D one (viewed [2, 6])."""
    first = [torch.randn(s).to(device) for s in ((5, 3), (5, 3), (7,), (4, 6), (5, 3))]
    second = [torch.randn(s).to(device) for s in ((4, 6), (2, 3, 2))]
    late = first[4]
    lrs = (0.05, 0.2)
    start = [p.clone() for p in first + second]
    opt = shampoo([{"params": first}, {"params": second, "lr": lrs[1]}], lr=lrs[0], eps=EPS, k=2.0)
    refs = [ShampooRef(p) for p in first + second]
    lr_of = [lrs[0]] * len(first) + [lrs[1]] * len(second)
    params = first + second
    history = []
    for step in range(1, 5):
        gs = grads_for(params)
        for p, g, ref, lr in zip(params, gs, refs, lr_of):
            if p is late and step == 1:
                p.grad = None
                continue
            p.grad = g
            ref.step(g, lr, EPS, 2)
        opt.step()
        history.append(
            {id(p): {s: opt.state[p][s].clone() for s in ("PL", "PR")} for p in params if p is not late}
        )
        for p, ref, p0 in zip(params, refs, start):
            if p is late and step == 1:
                assert len(opt.state[p]) == 0 and torch.equal(p, p0)  # no gradient: untouched
                continue
            check_against(opt, p, ref, p0)
    # Gated steps keep the old inverse roots exactly: the identity after step 1, step 2's after 3.
    for p in params:
        if p is late:
            continue
        h = [history[i][id(p)] for i in range(4)]
        for s in ("PL", "PR"):
            assert torch.equal(d64(h[0][s]), torch.eye(h[0][s].shape[0], dtype=F64))
            assert torch.equal(h[2][s], h[1][s]) and not torch.equal(h[3][s], h[2][s])
    assert int(opt.state[late]["step"]) == 3 and int(opt.state[first[0]]["step"]) == 4
    # One stack, each its own factors (their gradients differ, so do their factors).
    a, b = (opt.state[first[i]]["PL"] for i in (0, 1))
    assert float((a - b).abs().max()) > 1e-2
    one_row = opt.state[first[2]]
    assert one_row["L"].shape == (1, 1) and one_row["PL"].shape == (1, 1) and one_row["R"].shape == (7, 7)
    assert opt.state[second[1]]["R"].shape == (6, 6)


# --- 2. bf16 parameters, fp32 factors --------------------------------------------------------


def test_bf16_parameters_keep_fp32_factors(shampoo, device):
    """bf16 parameters and gradients: the factors are fp32 and follow the float64 reference
    (they read only the gradients, which fp32 holds exactly); each step's new parameter is
    the bf16 rounding (round to nearest: half a spacing, 2**-8 of the value) of the old one
    minus the reference's update, within fp32's error in that update."""
    params = [torch.randn(s).to(device, torch.bfloat16) for s in ((5, 3), (4, 6), (7,))]
    opt = shampoo(params, lr=0.05, eps=EPS, k=2.0)
    refs = [ShampooRef(p) for p in params]
    for _ in range(3):
        olds = [p.clone() for p in params]
        errs_before = [r.err for r in refs]
        gs = [(torch.randn(p.shape) * GSCALE).to(device, torch.bfloat16) for p in params]
        for p, g, ref, old in zip(params, gs, refs, olds):
            p.grad = g
            ref.p = d64(old).reshape(ref.p.shape)  # this step from fuser's own parameter
            ref.step(g, 0.05, EPS, 2)
        opt.step()
        for p, ref, old, e0 in zip(params, refs, olds, errs_before):
            assert p.dtype == torch.bfloat16
            x = ref.p.reshape(p.shape)  # old - update, exact
            step_err = SLACK * (ref.err - e0)
            dev = (d64(p) - x).abs()
            assert bool((dev <= 2.0**-8 * (x.abs() + step_err) + step_err + 1e-30).all()), float(dev.max())
            assert not torch.equal(p, old)  # the step moved it by more than bf16's spacing
            st = opt.state[p]
            for s in ("L", "R", "PL", "PR"):
                assert st[s].dtype == torch.float32
            for name, side in ref.sides.items():
                assert float((d64(st[name]) - side["M"]).abs().max()) <= SLACK * ref.factor_err(name)


# --- 3. decompositions that fail, and those that succeed ----------------------------------------

LEFT = "\n".join(
    [
        "L = L + g @ transpose(g)",
        "PL = where(every(k), inv_root(L + eps * eye(rows), 2), PL)",
        "p = p - lr * PL @ g",
    ]
)


def _all_finite(opt) -> bool:
    return all(
        bool(torch.isfinite(t).all()) for st in opt.state.values() for t in st.values() if torch.is_tensor(t)
    )


def test_an_inverse_root_that_fails_keeps_the_old_value_with_a_warning(device):
    """eps = 0 and a zero gradient: inv_root of the zero matrix has eigenvalues 0, a failure
    in fp32 and fp64. That tensor's PL keeps its identity (one RuntimeWarning naming the state),
    its p does not move and nothing holds a NaN; the other tensor of its stack refreshes
    as the reference, and the failed one refreshes once its factor is positive definite."""
    opt_cls = fuser.compile(
        fuser.rule(
            LEFT,
            name="left",
            hyper=dict(lr=0.1, eps=0.0, k=1.0),
            state=dict(L="zeros(rows, rows)", PL="eye(rows)"),
        )
    )
    a, b = torch.randn(2, 6).to(device), torch.randn(2, 6).to(device)
    b0 = b.clone()
    opt = opt_cls([a, b], lr=0.1)
    a.grad, b.grad = torch.randn(2, 6).to(device), torch.zeros(2, 6, device=device)
    La = d64(a.grad) @ d64(a.grad).T
    a_expected = d64(a) - 0.1 * inv_root64(La, 2) @ d64(a.grad)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    found = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(found) == 1, [str(w.message) for w in caught]
    assert "inv_root()" in str(found[0].message) and "'PL'" in str(found[0].message)
    assert torch.equal(d64(opt.state[b]["PL"]), torch.eye(2, dtype=F64)) and torch.equal(b, b0)
    assert not bool(opt.state[b]["L"].any())
    assert _all_finite(opt) and bool(torch.isfinite(a).all())
    rtol = inv_root_rtol(La, d64(a.grad).abs() @ d64(a.grad).abs().T, 7, 2)
    scale = 0.1 * spectral(inv_root64(La, 2)) * float(a.grad.norm())
    assert float((d64(a) - a_expected).norm()) <= SLACK * (rtol * scale + U * float(a_expected.norm()))
    # Next step the zero-gradient tensor's factor is positive definite: it refreshes, silently.
    b.grad = torch.randn(2, 6).to(device)
    a.grad = torch.randn(2, 6).to(device)
    Lb = d64(b.grad) @ d64(b.grad).T
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        opt.step()
    perr = spectral(d64(opt.state[b]["PL"]) - inv_root64(Lb, 2))
    rtol = inv_root_rtol(Lb, d64(b.grad).abs() @ d64(b.grad).abs().T, 7, 2)
    assert perr <= SLACK * rtol * spectral(inv_root64(Lb, 2))


BASIS = "\n".join(
    [
        "L = L + g @ transpose(g)",
        "Q = where(step == 1, eigh(L / trace(L)), qr(L @ Q))",
        "p = p - lr * Q @ tanh(transpose(Q) @ g)",
    ]
)


@pytest.fixture(scope="module")
def basis():
    rule = fuser.rule(
        BASIS, name="basis", hyper=dict(lr=0.1), state=dict(L="zeros(rows, rows)", Q="eye(rows)")
    )
    return fuser.compile(rule)


def spaced_gradient(rows: int, cols: int) -> torch.Tensor:
    """A gradient whose ``G G^T`` has eigenvalues 4, 2.25, 1, ... (well separated, so fp32's
    eigenvectors are within ``||E|| / gap`` of float64's): ``U diag(s) V^T``."""
    u = torch.linalg.qr(torch.randn(rows, rows, dtype=F64))[0]
    v = torch.linalg.qr(torch.randn(cols, cols, dtype=F64))[0][:, :rows]
    s = torch.tensor([2.0 - 0.5 * i for i in range(rows)], dtype=F64)
    return ((u * s) @ v.T).float()


def test_a_nan_the_rule_makes_keeps_the_old_basis_and_others_refresh(basis, device):
    """``eigh(L / trace(L))`` of a zero factor is the eigh of 0/0 = NaN: in the stack beside a
    good tensor, that one keeps its basis (the identity) with a RuntimeWarning and no NaN
    moves its parameter; the good one gets the float64-accurate eigenbasis, columns sorted by
    eigenvalue, largest first."""
    a, b = torch.randn(3, 5).to(device), torch.randn(3, 5).to(device)
    b0 = b.clone()
    opt = basis([a, b], lr=0.1)
    a.grad, b.grad = spaced_gradient(3, 5).to(device), torch.zeros(3, 5, device=device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    found = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(found) == 1 and "eigh()" in str(found[0].message) and "'Q'" in str(found[0].message)
    assert torch.equal(d64(opt.state[b]["Q"]), torch.eye(3, dtype=F64)) and torch.equal(b, b0)
    assert _all_finite(opt) and bool(torch.isfinite(a).all())
    G = d64(a.grad)
    M = G @ G.T
    _check_eigenbasis(opt.state[a]["Q"], M / M.trace(), G.abs() @ G.abs().T / M.trace(), 5)


def _check_eigenbasis(Q: torch.Tensor, M: torch.Tensor, Mabs: torch.Tensor, terms: int) -> None:
    lam, vec = torch.linalg.eigh(M)
    vec = vec.flip(-1)
    lam = lam.flip(-1)
    gap = float((lam[:-1] - lam[1:]).min())
    n = M.shape[0]
    E = (terms + 2 + 4 * n) * U * spectral(Mabs)
    got = d64(Q)
    signs = torch.sign((got * vec).sum(0))  # each column's sign is free
    err = float((got - vec * signs).abs().max())
    assert err <= SLACK * math.sqrt(2) * E / gap + 4 * n * U, (err, E, gap)
    d = torch.diagonal(got.T @ M @ got)
    assert bool((d[:-1] > d[1:]).all()), d  # largest first


def test_eigh_then_qr_bases_follow_float64(basis, device):
    """``where(step == 1, eigh(L / trace(L)), qr(L @ Q))`` on two tensors of one stack:
    step 1 the eigenbasis (sorted, largest first), steps 2 and 3 the Q of ``L @ Q`` with
    torch.linalg.qr's signs (each step from fuser's previous Q); the update reads the new Q."""
    params = [torch.randn(4, 6).to(device), torch.randn(4, 6).to(device)]
    opt = basis(params, lr=0.1)
    Ls = [torch.zeros(4, 4, dtype=F64) for _ in params]
    Labs = [torch.zeros(4, 4, dtype=F64) for _ in params]
    for step in (1, 2, 3):
        gs = [spaced_gradient(4, 6).to(device) for _ in params] if step == 1 else grads_for(params)
        olds = [(p.clone(), opt.state[p]["Q"].clone() if p in opt.state else None) for p in params]
        for p, g in zip(params, gs):
            p.grad = g
        opt.step()
        for i, (p, g, (p_old, q_old)) in enumerate(zip(params, gs, olds)):
            G = d64(g)
            Ls[i] = Ls[i] + G @ G.T
            Labs[i] = Labs[i] + G.abs() @ G.abs().T
            Q = opt.state[p]["Q"]
            if step == 1:
                _check_eigenbasis(Q, Ls[i] / Ls[i].trace(), Labs[i] / Ls[i].trace(), 6)
            else:
                A = Ls[i] @ d64(q_old)
                want = torch.linalg.qr(A)[0]
                kappa = float(torch.linalg.cond(A))
                # A's error (L's sums, the product) and qr's backward error, relative to ||A||.
                E = (step * (6 + 1) + 4 + 4 * 4) * U * spectral(Labs[i]) / spectral(A)
                err = float((d64(Q) - want).abs().max())
                assert err <= SLACK * math.sqrt(2) * kappa * E, (step, err, kappa * E)
                assert kappa * E <= 1e-4  # (well conditioned: the bound sees a wrong Q)
            # p from fuser's own old p and the new Q.
            Qd = d64(Q)
            expected = d64(p_old) - 0.1 * Qd @ torch.tanh(Qd.T @ G)
            bound = (2 * 4 + 4) * U * (d64(p_old).abs() + 0.1 * Qd.abs() @ (Qd.abs().T @ G.abs()))
            assert bool(((d64(p) - expected).abs() <= SLACK * bound + 1e-30).all())


@pytest.mark.parametrize("how", ["nan", "raises"])
def test_an_fp32_failure_is_retried_in_fp64(shampoo, monkeypatch, how, device):
    """torch.linalg.eigh made to fail on fp32 input (NaN eigenvectors, or an error): the
    inverse roots come from fp64, with no warning, and follow the reference."""
    real = torch.linalg.eigh

    def fp32_fails(m, *args, **kwargs):
        if m.dtype == torch.float32:
            if how == "raises":
                raise torch.linalg.LinAlgError("made to fail")
            lam, vec = real(m, *args, **kwargs)
            return lam, torch.full_like(vec, float("nan"))
        return real(m, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", fp32_fails)
    params = [torch.randn(s).to(device) for s in ((5, 3), (5, 3), (4, 6))]
    start = [p.clone() for p in params]
    opt = shampoo(params, lr=0.05, eps=EPS, k=1.0)
    refs = [ShampooRef(p) for p in params]
    for _ in range(2):
        for p, g, ref in zip(params, grads_for(params), refs):
            p.grad = g
            ref.step(g, 0.05, EPS, 1)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            opt.step()
    for p, ref, p0 in zip(params, refs, start):
        check_against(opt, p, ref, p0)


# --- 4. sides over max_matrix_dim -------------------------------------------------------------


def test_sides_over_max_matrix_dim_are_the_identity(shampoo, device):
    """max_matrix_dim=4: a side over it has no factor (its states are empty tensors) and p
    moves as the reference with the identity there; a side of exactly 4 keeps its factor."""
    params = [torch.randn(s).to(device) for s in ((5, 3), (4, 6), (7,), (5, 6))]
    start = [p.clone() for p in params]
    opt = shampoo(params, lr=0.05, eps=EPS, k=2.0, max_matrix_dim=4)
    refs = [ShampooRef(p, limit=4) for p in params]
    for _ in range(3):
        for p, g, ref in zip(params, grads_for(params), refs):
            p.grad = g
            ref.step(g, 0.05, EPS, 2)
        opt.step()
    empty = {0: ("L", "PL"), 1: ("R", "PR"), 2: ("R", "PR"), 3: ("L", "PL", "R", "PR")}
    for i, (p, ref, p0) in enumerate(zip(params, refs, start)):
        st = opt.state[p]
        for s in ("L", "PL", "R", "PR"):
            if s in empty[i]:
                assert st[s].shape == (0,), (i, s)
            else:
                assert st[s].dim() == 2 and st[s].shape[0] <= 4
        check_against(opt, p, ref, p0)
    assert opt.state[params[1]]["L"].shape == (4, 4) and opt.state[params[2]]["L"].shape == (1, 1)


def test_numbers_times_an_absent_factor_keep_their_scale(device):
    """An absent [n, n] factor is the identity: a number per tensor times it keeps its scale
    through products, traces (n), diagonals (ones) and norms (sqrt(n)); a factor kept below
    the limit reads its own."""
    rule = fuser.rule(
        "L = L + g @ transpose(g)\nR = R + transpose(g) @ g\n"
        "p = p - lr * (L / trace(L)) @ g * diag(2 * R) / (trace(0.5 * L) * norm(R))",
        name="tr",
        hyper=dict(lr=0.1),
        state=dict(L="zeros(rows, rows)", R="zeros(cols, cols)"),
    )
    params = [torch.randn(6, 3).to(device), torch.randn(3, 6).to(device)]
    start = [p.clone() for p in params]
    opt = fuser.compile(rule)(params, lr=0.1, max_matrix_dim=4)
    for p in params:
        p.grad = torch.randn(p.shape).to(device)
    opt.step()
    G0, G1 = (d64(p.grad) for p in params)
    # 6x3: L over the limit (L / trace(L) = I / 6, trace(0.5 L) = 3), R = G^T G kept.
    R0 = G0.T @ G0
    want0 = d64(start[0]) - 0.1 * (G0 / 6) * torch.diagonal(2 * R0) / (3 * R0.norm())
    # 3x6: L = G G^T kept, R over the limit (diag(2 R) = 2, norm(R) = sqrt(6)).
    L1 = G1 @ G1.T
    want1 = d64(start[1]) - 0.1 * (L1 / L1.trace()) @ G1 * 2 / (0.5 * L1.trace() * math.sqrt(6))
    for p, want, p0 in ((params[0], want0, start[0]), (params[1], want1, start[1])):
        # fp32's sums of at most 2 * 9 terms in the update, then p's own rounding.
        moved = float((want - d64(p0)).abs().max())
        bound = SLACK * (2 * 9 + 4) * U * moved + SLACK * U * want.abs()
        assert bool(((d64(p) - want).abs() <= bound).all()), float((d64(p) - want).abs().max())


# --- 5. gates evaluate only the branch they take ----------------------------------------------


def _counting(monkeypatch, name: str) -> list:
    calls = []
    real = getattr(torch.linalg, name)

    def counted(*args, **kwargs):
        calls.append(tuple(args[0].shape))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.linalg, name, counted)
    return calls


def test_inverse_roots_run_on_refresh_steps_only(shampoo, monkeypatch, device):
    """k=2: eigh (inv_root's) runs on steps 2 and 4 only, once per stack and factor."""
    calls = _counting(monkeypatch, "eigh")
    params = [torch.randn(s).to(device) for s in ((5, 3), (5, 3), (4, 6), (7,))]
    opt = shampoo(params, lr=0.05, eps=EPS, k=2.0)
    counts = []
    for _ in range(4):
        for p, g in zip(params, grads_for(params)):
            p.grad = g
        before = len(calls)
        opt.step()
        counts.append(len(calls) - before)
    assert counts == [0, 6, 0, 6], counts  # three stacks (5x3, 4x6, 1x7), two factors each
    assert sorted(calls[:6]) == sorted([(2, 5, 5), (2, 3, 3), (1, 4, 4), (1, 6, 6), (1, 1, 1), (1, 7, 7)])


def test_a_basis_starts_with_eigh_and_refreshes_with_qr(basis, monkeypatch, device):
    """``where(step == 1, eigh(...), qr(...))``: eigh on step 1 only, qr on later steps only."""
    eighs, qrs = _counting(monkeypatch, "eigh"), _counting(monkeypatch, "qr")
    params = [torch.randn(3, 5).to(device), torch.randn(4, 2).to(device)]
    opt = basis(params, lr=0.1)
    counts = []
    for _ in range(3):
        for p, g in zip(params, grads_for(params)):
            p.grad = g
        e, q = len(eighs), len(qrs)
        opt.step()
        counts.append((len(eighs) - e, len(qrs) - q))
    assert counts == [(2, 0), (0, 2), (0, 2)], counts


# --- 6. checkpoints ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, through",
    [
        (torch.float32, "file"),
        (torch.float32, "live"),
        (torch.bfloat16, "file"),
        (torch.bfloat16, "live"),
    ],
    ids=["fp32-file", "fp32-live", "bf16-file", "bf16-live"],
)
def test_state_dict_resumes_the_same_trajectory(shampoo, dtype, through, device):
    """Saved after 2 steps (k=2, a refresh just made; a side over max_matrix_dim=5 held
    empty), loaded into a fresh optimizer on copies of the parameters: 2 more steps equal
    the uninterrupted run bit for bit, and the loaded factors are fp32 (also for bf16
    parameters, whose dtype torch's load casts states to). ``live``: the dict of an
    optimizer that keeps stepping; ``file``: through torch.save."""
    params = [torch.randn(s).to(device, dtype) for s in ((5, 3), (7,), (4, 6))]
    grads = [[(torch.randn(p.shape) * GSCALE).to(device, dtype) for p in params] for _ in range(4)]
    kw = dict(lr=0.05, eps=EPS, k=2.0, max_matrix_dim=5)
    a = [p.clone() for p in params]
    opt = shampoo(a, **kw)
    for gs in grads[:2]:
        for p, g in zip(a, gs):
            p.grad = g.clone()
        opt.step()
    saved = opt.state_dict()
    if through == "file":
        buf = io.BytesIO()
        torch.save(saved, buf)
        buf.seek(0)
        saved = torch.load(buf)
    b = [p.clone() for p in a]
    other = shampoo(b, **kw)
    other.load_state_dict(saved)
    for p, q in zip(a, b):
        for s in ("L", "R", "PL", "PR"):
            assert other.state[q][s].dtype == torch.float32
            assert torch.equal(other.state[q][s], opt.state[p][s])
    for gs in grads[2:]:
        for ps, o in ((a, opt), (b, other)):
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            o.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        assert int(opt.state[p]["step"]) == 4 and int(other.state[q]["step"]) == 4
        for s in ("L", "R", "PL", "PR"):
            assert torch.equal(opt.state[p][s], other.state[q][s]), s
    assert other.state[b[2]]["R"].shape == (0,)


# --- 7. rule errors and refusals --------------------------------------------------------------


def _error(text: str, state=None, compile_it=False):
    state = dict(L="zeros(rows, rows)", R="zeros(cols, cols)") if state is None else state
    with pytest.raises(fuser.RuleError) as info:
        rule = fuser.rule(text, name="r", hyper=dict(lr=0.1), state=state)
        if compile_it:
            fuser.compile(rule)
    return info.value


@pytest.mark.parametrize(
    "text, line, at, fragment",
    [
        (
            "L = L + g @ transpose(g)\np = p - lr * g @ g",
            2,
            "@ g",
            "`@` cannot multiply a value per element ([rows, cols]) by a value per element ([rows, cols]): "
            "their sizes do not match",
        ),
        (
            "L = L + g @ transpose(g)\np = p - lr * (L + g)",
            2,
            "+ g)",
            "a [rows, rows] matrix and a value per element ([rows, cols]) cannot be combined elementwise",
        ),
        (
            "R = R + transpose(g) @ g\nL = g * g\np = p - lr * L @ g",
            2,
            None,
            "state 'L' is a [rows, rows] matrix, but this assigns it a value per element ([rows, cols])",
        ),
        (
            "L = L + g @ transpose(g)\np = p - lr * trace(g) * g",
            2,
            "trace",
            "trace() takes a [rows, rows] or [cols, cols] matrix, not a value per element ([rows, cols])",
        ),
        (
            "L = L + g @ transpose(g)\nR = R\np = transpose(g)",
            3,
            None,
            "p is a transposed value per element ([cols, rows]): transpose it back, or multiply it by a "
            "matrix",
        ),
    ],
    ids=["matmul-sizes", "elementwise", "state-kind", "trace", "transposed-p"],
)
def test_rule_errors_name_line_and_column(text, line, at, fragment):
    # The column of the operator or call that fails (`at` in the line), else the statement's.
    err = _error(text)
    col = 1 if at is None else text.splitlines()[line - 1].index(at) + 1
    assert err.line == line and err.col == col, (err.line, err.col)
    first = str(err).splitlines()[0]
    assert first.startswith(f"rule 'r', line {line}, column {col}: ") and fragment in first, first
    assert str(err).splitlines()[1].strip() == text.splitlines()[line - 1]  # the line quoted


def test_rule_errors_of_declarations_and_decompositions():
    err = _error("L = L + g\np = p - lr * g", state=dict(L="zeros(rows, cols)"))
    assert "state 'L': a matrix state is [rows, rows] or [cols, cols], not 'zeros(rows, cols)'" in str(err)
    # A decomposition no state keeps: fuser.rule takes it, fuser.compile refuses it.
    text = "L = L + g @ transpose(g)\np = p - lr * eigh(L) @ g"
    fuser.rule(text, name="r", hyper=dict(lr=0.1), state=dict(L="zeros(rows, rows)"))
    err = _error(text, state=dict(L="zeros(rows, rows)"), compile_it=True)
    assert str(err).splitlines()[0] == (
        "rule 'r', line 2, column 1: eigh() must be the value of a matrix state (directly, or a "
        "branch of where(...)): where it fails that state keeps its previous value"
    )
    assert err.line == 2 and str(err).splitlines()[1].strip() == "p = p - lr * eigh(L) @ g"


def test_unsupported_options_are_refused_and_change_nothing(shampoo, device):
    rule = fuser.rule(SHAMPOO, name="shampoo", hyper=dict(lr=1e-2, eps=1e-6, k=1.0), state=SHAMPOO_STATE)
    before = (rule.text, rule.hyper, rule.state, rule.outputs)
    with pytest.raises(ValueError, match=r"8-bit states are not supported for matrix rules"):
        fuser.compile(rule, state_dtype="q8")
    with pytest.raises(ValueError, match=r"view must be 'flatten' or 'batched'"):
        fuser.compile(rule, view="rows")
    sgd = fuser.rule("p = p - lr * g", name="sgd", hyper=dict(lr=0.1))
    with pytest.raises(ValueError, match=r"rule 'shampoo' holds matrices: compile it on its own"):
        fuser.compile(dict(sgd=sgd, shampoo=rule))
    assert (rule.text, rule.hyper, rule.state, rule.outputs) == before
    # The constructor's refusals, and a step refused for a bad hyperparameter: nothing moves.
    p = torch.randn(5, 3).to(device)
    with pytest.raises(TypeError, match="unknown hyperparameters"):
        shampoo([p], beta=0.9)
    with pytest.raises(ValueError, match=r"view must be 'flatten' or 'batched'"):
        shampoo([p], view="rows")
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match="max_matrix_dim must be a positive whole number"):
            shampoo([p], max_matrix_dim=bad)
    opt = fuser.compile(rule)([p], lr=0.05, eps=EPS, k=1.0)
    p.grad = torch.randn(5, 3).to(device)
    opt.step()
    kept = (p.clone(), copy.deepcopy(opt.state[p]))
    opt.param_groups[0]["lr"] = float("nan")
    p.grad = torch.randn(5, 3).to(device)
    with pytest.raises(ValueError, match="hyperparameter 'lr' must be a finite number"):
        opt.step()
    assert torch.equal(p, kept[0])
    assert all(torch.equal(opt.state[p][k], v) for k, v in kept[1].items())
    # The rule still compiles and steps as before the refusals.
    opt.param_groups[0]["lr"] = 0.05
    opt.step()
    assert int(opt.state[p]["step"]) == 2 and not torch.equal(p, kept[0])


def test_a_bad_hyperparameter_in_a_later_group_makes_no_state(device):
    rule = fuser.rule(SHAMPOO, name="shampoo", hyper=dict(lr=1e-2, eps=1e-6, k=1.0), state=SHAMPOO_STATE)
    a, b = torch.randn(5, 3).to(device), torch.randn(4, 2).to(device)
    opt = fuser.compile(rule)([dict(params=[a]), dict(params=[b], lr=float("inf"))])
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    with pytest.raises(ValueError, match="hyperparameter 'lr' must be a finite number"):
        opt.step()
    assert len(opt.state) == 0


@pytest.mark.parametrize("which", ["rule", "SOAP", "Shampoo", "PSGDKron"])
def test_parameters_of_no_elements_change_no_other_step(which, shampoo, device):
    """Parameters with no elements (a layer of width 0) beside others: the others' steps
    are those of the optimizer without them, their own states keep their first values and
    their step counts advance."""
    make = {
        "rule": lambda ps: shampoo(ps, lr=0.1, eps=0.1),
        "SOAP": lambda ps: fuser.optim.SOAP(ps, lr=0.1, precondition_frequency=2),
        "Shampoo": lambda ps: fuser.optim.Shampoo(
            ps, lr=0.1, epsilon=0.1, precondition_frequency=2, start_preconditioning_step=2
        ),
        "PSGDKron": lambda ps: fuser.optim.PSGDKron(
            ps, lr=0.1, preconditioner_update_probability=1.0, seed=3
        ),
    }[which]
    shapes = [(5, 3), (6,), (3, 5)]
    values = [torch.randn(s, device=device) for s in shapes]
    grads = [[torch.randn(s, device=device) for s in shapes] for _ in range(3)]
    with_empty = [torch.nn.Parameter(v.clone()) for v in values]
    empties = [torch.nn.Parameter(torch.randn(s, device=device)) for s in ((0, 4), (4, 0), (0,))]
    alone = [torch.nn.Parameter(v.clone()) for v in values]
    # (PSGDKron's probes are keyed by a parameter's position: its empty ones go last)
    order = [*with_empty, *empties] if which == "PSGDKron" else [*with_empty[:2], *empties, with_empty[2]]
    a, b = make(order), make(alone)
    first = None
    for step_grads in grads:
        for ps in (with_empty, alone):
            for p, g in zip(ps, step_grads):
                p.grad = g.clone()
        for p in empties:
            p.grad = torch.empty_like(p)
        a.step()
        b.step()
        first = first or {
            id(p): {k: v.clone() for k, v in a.state[p].items() if torch.is_tensor(v)} for p in empties
        }
    for p, q in zip(with_empty, alone):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=0)
    for p in empties:
        st = {k: v for k, v in a.state[p].items() if torch.is_tensor(v)}
        steps = [v for k, v in st.items() if k == "step"]
        assert all(float(v) == 3 for v in steps)
        for k, v in st.items():
            if k != "step":
                assert torch.equal(v, first[id(p)][k]), k


def test_grad_scaler_unscales_before_a_matrix_rule_and_skips_a_step_with_an_inf(shampoo):
    """torch.amp.GradScaler (on the CPU) unscales the gradients before the step, as for
    torch's optimizers: the steps are those of unscaled gradients (the scales are powers
    of two: the same bits), and a step whose gradients hold an inf changes nothing."""
    w0, x = torch.randn(4, 3), torch.randn(8, 4)
    plain, scaled = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    a, b = shampoo([plain], lr=0.05, eps=0.1), shampoo([scaled], lr=0.05, eps=0.1)
    for _ in range(3):
        a.zero_grad()
        (x @ plain).square().sum().backward()
        a.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(4):
        b.zero_grad()
        scaler.scale((x @ scaled).square().sum() * (float("inf") if step == 1 else 1.0)).backward()
        kept = (scaled.detach().clone(), copy.deepcopy(b.state[scaled]))
        scaler.step(b)
        scaler.update()
        if step == 1:
            assert torch.equal(scaled, kept[0])
            assert all(torch.equal(b.state[scaled][k], v) for k, v in kept[1].items())
    assert int(b.state[scaled]["step"]) == 3 and scaler.get_scale() == 512.0
    assert torch.equal(plain, scaled) and torch.equal(a.state[plain]["PL"], b.state[scaled]["PL"])
