"""PSGDKron against PSGD Kron written here in float64 from its formulas (heavyball 3.2.1's
``PSGDKron``: debiased momentum, balanced factors, the Lie-group fit with a power-iteration
bound and a running lower bound, the trust-region clip, decoupled weight decay, warmup),
fed the probes fuser draws (``kron.probe``); and its guards: bad input, a fit that is not
finite, the state dict."""

import math

import pytest
import torch

import fuser.optim
from fuser.optim.builtins import kron

EPS32 = torch.finfo(torch.float32).eps


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu().reshape(-1), b.detach().double().cpu().reshape(-1)
    return ((a - b).norm() / b.norm()).item()


def top_eigenvalue(s: torch.Tensor, iterations: int) -> torch.Tensor:
    """The bound of the fit: power iterations on s² from s's row of largest norm."""
    norms = s.norm(dim=1)
    scale = norms.max()
    x = s[norms.argmax()] / scale
    a = s / scale
    for _ in range(iterations):
        x = a @ (a @ x)
        x = x / x.norm()
    return (x @ (a @ (a @ x))).sqrt() * scale


class Reference:
    """One parameter's PSGD Kron in float64. Every factor is a matrix (a diagonal one is
    ``diag(q)``, of which only the diagonal is fitted); a vector is one diagonal factor.
    The starting scale comes from ``first``: the first gradients of the group's tensors of
    this shape (heavyball's bucket)."""

    def __init__(self, p, first, triangular, hp):
        self.p, self.hp, self.tri = p.double().clone(), hp, triangular
        dims = list(p.shape)
        g = torch.cat([x.double().cpu().reshape(-1) for x in first])
        scale = ((g.abs() ** 4).mean() ** (-1 / 8)) ** 0.5
        s = scale ** (1 / len(dims))
        self.q = [s * torch.eye(d, dtype=torch.float64) for d in dims]
        self.lb = [0.0] * len(dims)
        self.m = torch.zeros_like(self.p)

    def fit(self, target, v):
        hp = self.hp
        g = target + (hp["dampening"] + EPS32 * target.abs()) * v
        logs = [q.abs().max().log() for q in self.q]
        mean = sum(logs) / len(logs)
        self.q = [q * (mean - lg).exp() for q, lg in zip(self.q, logs)]
        inv = [torch.linalg.inv(q) for q in self.q]
        if self.p.dim() == 1:
            q = self.q[0].diagonal()
            a, b = q * g, v / q
            t1, t2 = a * a, b * b
            ell = (t1 + t2).max()
            ell = max(ell, self.lb[0] + (ell - self.lb[0]) * (1 - hp["lower_bound_beta"]))
            self.lb[0] = ell
            self.q[0] = torch.diag(q - hp["precond_lr"] * q * (t1 - t2) / ell)
            return
        ql, qr = self.q
        a = ql @ g @ qr.T
        b = inv[0].T @ v @ inv[1]
        terms = [(a @ a.T, b @ b.T), (a.T @ a, b.T @ b)]
        for i, (t1, t2) in enumerate(terms):
            q = self.q[i]
            if self.tri[i]:
                ell = top_eigenvalue(t1 + t2, hp["precond_update_power_iterations"])
            else:
                ell = (t1 + t2).diagonal().max()
            ell = max(ell, self.lb[i] + (ell - self.lb[i]) * (1 - hp["lower_bound_beta"]))
            self.lb[i] = ell
            if self.tri[i]:
                step = torch.triu(t1 - t2) @ q
            else:
                step = torch.diag(q.diagonal() * (t1 - t2).diagonal())
            self.q[i] = q - hp["precond_lr"] * step / ell

    def precondition(self):
        if self.p.dim() == 1:
            return self.q[0].diagonal() ** 2 * self.m
        ql, qr = self.q
        return ql.T @ ql @ self.m @ qr.T @ qr

    def step(self, g, t, v, fit, delayed=False, clip=True):
        hp = self.hp
        g = g.double()
        self.m = self.m + (g - self.m) * ((1 - hp["beta"]) / (1 - hp["beta"] ** t))
        u = self.precondition()
        if fit:
            self.fit(self.m, v.double().reshape(self.p.shape))
        if not delayed:
            u = self.precondition()
        if clip:
            x = u / 1.5
            u = (1.5 * (0.1 * x.sign() * x.abs().log1p() + 0.9 * x.tanh())).clamp(-2, 2)
        lr = hp["lr"] * t / max(t, hp["warmup_steps"] + 1)
        self.p = self.p * (1 - lr * hp["weight_decay"]) - lr * u


HYPER = dict(
    lr=0.05,
    beta=0.8,
    weight_decay=0.1,
    warmup_steps=2,
    dampening=1e-9,
    precond_lr=0.3,
    lower_bound_beta=0.9,
    precond_update_power_iterations=2,
)


def test_psgd_kron_follows_float64_formulas(device):
    """Two 7×5 matrices (one batch), a 9×4 one whose 9 is over ``max_size_triangular``
    (a diagonal factor), a vector; fits at steps 1–3 and 5 (probability 1, then 0.5)."""
    shapes = [(7, 5), (7, 5), (5,), (9, 4)]
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
    groups = [
        dict(params=params[:3]),
        dict(params=params[3:], max_size_triangular=6, precond_lr=0.2),
    ]
    hp = {k: v for k, v in HYPER.items() if k != "beta"}
    opt = fuser.optim.PSGDKron(
        groups,
        beta=HYPER["beta"],
        preconditioner_update_probability=lambda n: 1.0 if n <= 3 else 0.5,
        seed=11,
        **hp,
    )
    refs, worst = [], 0.0
    for t in range(1, 6):
        grads = [torch.randn(s, device=device) for s in shapes]
        for p, g in zip(params, grads):
            p.grad = g
        if t == 1:
            tri = [(True, True), (True, True), (False,), (False, True)]
            his = [HYPER, HYPER, HYPER, {**HYPER, "precond_lr": 0.2}]
            first = [grads[:2], grads[:2], grads[2:3], grads[3:]]  # one scale for the two 7×5
            refs = [Reference(p.detach().cpu(), f, k, h) for p, f, k, h in zip(params, first, tri, his)]
        opt.step()
        for i, (p, g, ref) in enumerate(zip(params, grads, refs)):
            v = kron.probe(11, t, i, shapes[i], device)
            ref.step(g.cpu(), t, v.cpu(), fit=t != 4)
            worst = max(worst, rel(p, ref.p), rel(opt.state[p]["exp_avg"], ref.m))
            for q, want in zip(opt.state[p]["Q"], ref.q):
                worst = max(worst, rel(q if q.dim() == 2 else torch.diag(q), want))
    assert [q.dim() for q in opt.state[params[3]]["Q"]] == [1, 2]
    assert worst <= 1e-5, worst


def test_psgd_kron_delayed_without_clipping(device):
    """``delayed=True`` preconditions with the factors from before the fit; with
    ``update_clipping=None`` the update is not clipped."""
    p = torch.nn.Parameter(torch.randn(5, 3, device=device))
    hp = {k: v for k, v in HYPER.items() if k != "beta"}
    opt = fuser.optim.PSGDKron([p], beta=HYPER["beta"], delayed=True, update_clipping=None, seed=5, **hp)
    worst = 0.0
    for t in range(1, 4):
        p.grad = torch.randn(5, 3, device=device)
        if t == 1:
            ref = Reference(p.detach().cpu(), [p.grad.cpu()], (True, True), HYPER)
        opt.step()
        ref.step(p.grad.cpu(), t, kron.probe(5, t, 0, (5, 3), device).cpu(), True, delayed=True, clip=False)
        worst = max(worst, rel(p, ref.p), *(rel(q, w) for q, w in zip(opt.state[p]["Q"], ref.q)))
    assert worst <= 1e-5, worst


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's tanh of 1e30
def test_psgd_kron_keeps_factors_when_a_fit_is_not_finite():
    p = torch.nn.Parameter(torch.randn(7, 5))
    opt = fuser.optim.PSGDKron([p], lr=0.01)
    p.grad = torch.randn(7, 5)
    opt.step()
    before = [q.clone() for q in opt.state[p]["Q"]]
    p.grad = torch.randn(7, 5) * 1e30  # A Aᵀ overflows fp32
    with pytest.warns(RuntimeWarning, match="not finite"):
        opt.step()
    assert all(torch.equal(q, b) for q, b in zip(opt.state[p]["Q"], before))
    assert torch.isfinite(p).all()


def test_psgd_kron_refuses_bad_input_and_changes_nothing():
    p = torch.nn.Parameter(torch.randn(7, 5))
    with pytest.raises(ValueError, match="merge_dims"):
        fuser.optim.PSGDKron([p], merge_dims=True)
    with pytest.raises(ValueError, match="update_clipping"):
        fuser.optim.PSGDKron([p], update_clipping=lambda x: x)
    with pytest.raises(ValueError, match="hessian_approx"):
        fuser.optim.PSGDKron([p], hessian_approx=True)
    with pytest.raises(TypeError, match="unknown"):
        fuser.optim.PSGDKron([p], foo=1)
    fresh = fuser.optim.PSGDKron([p])
    p.grad = torch.zeros(7, 5)
    with pytest.raises(ValueError, match="all zeros"):
        fresh.step()  # precond_init_scale=None has no scale to take from it
    assert not fresh.state and "step_count" not in fresh.param_groups[0]
    opt = fuser.optim.PSGDKron([p], lr=0.01, grad_attr="main_grad")
    p.main_grad = torch.randn(7, 5)
    opt.step()
    saved = opt.state_dict()
    start = p.detach().clone()
    state = {k: [x.clone() for x in v] if isinstance(v, list) else v.clone() for k, v in opt.state[p].items()}
    p.main_grad = torch.randn(5, 7)
    with pytest.raises(RuntimeError, match="shape"):
        opt.step()
    bad = {**saved, "state": {0: {**saved["state"][0], "Q": [torch.eye(7), torch.eye(4)]}}}
    with pytest.raises(ValueError, match="factors"):
        opt.load_state_dict(bad)
    assert torch.equal(p, start) and opt.state_dict()["psgd"] == saved["psgd"]
    for k, v in state.items():
        now = opt.state[p][k]
        assert all(torch.equal(a, b) for a, b in zip(now, v)) if isinstance(v, list) else torch.equal(now, v)


def test_psgd_kron_state_dict_round_trip():
    """Saved after two steps and loaded into a new optimizer (bf16 parameters: the factors
    come back in fp32), both take the same third step."""
    start = torch.randn(7, 5)
    a, b = (torch.nn.Parameter(start.clone().bfloat16()) for _ in range(2))
    opt = fuser.optim.PSGDKron([a], lr=0.01, seed=3)
    for _ in range(2):
        a.grad = torch.randn(7, 5).bfloat16()
        opt.step()
    saved = opt.state_dict()
    assert set(saved["state"][0]) == {"exp_avg", "Q", "running_lower_bound", "step"}
    b.data.copy_(a.data)
    other = fuser.optim.PSGDKron([b], lr=0.01, seed=3)
    other.load_state_dict(saved)
    assert other.state[b]["Q"][0].dtype == torch.float32
    g = torch.randn(7, 5).bfloat16()
    a.grad, b.grad = g, g.clone()
    opt.step()
    other.step()
    assert torch.equal(a, b)
    assert all(torch.equal(x, y) for x, y in zip(opt.state[a]["Q"], other.state[b]["Q"]))
    assert math.isclose(other.state_dict()["psgd"]["cumulative_prob"], 3.0)


def test_psgd_kron_under_grad_scaler():
    """GradScaler unscales the gradients before the step and skips a step with an inf."""
    start, g = torch.randn(7, 5), torch.randn(7, 5)
    a, b = (torch.nn.Parameter(start.clone()) for _ in range(2))
    mine, plain = fuser.optim.PSGDKron([a], lr=0.01), fuser.optim.PSGDKron([b], lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaler.scale((a * g).sum()).backward()
    b.grad = g.clone()
    scaler.step(mine)
    scaler.update()
    plain.step()
    assert torch.equal(a, b)
    a.grad = None
    scaler.scale((a * torch.full_like(g, float("inf"))).sum()).backward()
    before = a.detach().clone()
    scaler.step(mine)
    assert torch.equal(a, before)
