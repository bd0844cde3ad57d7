"""fuser.optim.SOAP against a float64 SOAP written here from the paper (Vyas et al. 2024) and
pytorch-optimizer 4.1.0's conventions: Adam in the eigenbasis of Shampoo's factors, the
bases from eigh once and then a QR power iteration every precondition_frequency steps."""

from __future__ import annotations

import copy
import gc
import importlib
import sys
import warnings
import weakref

import pytest
import torch

import fuser

# --- the float64 reference ------------------------------------------------------------------


def _merge(shape, limit):
    out, prod = [], 1
    for d in shape:
        prod *= d
        if prod > limit:
            out.append(prod // d)
            prod = d
    return [*out, prod]


class Reference:
    """One parameter's SOAP in float64, dimension by dimension with tensordot."""

    def __init__(self, p, cfg, channels_last):
        self.p, self.cfg, self.t = p.double().clone(), cfg, 0
        self.perm = channels_last and cfg.get("merge_dims") and p.dim() == 4
        shape = self.to_pre(p).shape
        limit = cfg.get("max_precondition_dim", 10000)
        if p.dim() == 1 and not cfg.get("precondition_1d"):
            limit = 0
        self.L = [torch.zeros(d, d, dtype=torch.float64) if d <= limit else None for d in shape]
        self.Q = None
        self.m = torch.zeros_like(self.p)
        self.v = torch.zeros_like(self.p)

    def to_pre(self, x):
        if not self.cfg.get("merge_dims") or x.dim() < 2:
            return x
        x = x.permute(0, 3, 1, 2) if self.perm else x
        return x.reshape(_merge(x.shape, self.cfg["max_precondition_dim"]))

    def from_pre(self, x):
        if not self.cfg.get("merge_dims") or self.p.dim() < 2:
            return x
        if self.perm:
            n, h, w, c = self.p.shape
            return x.reshape(n, c, h, w).permute(0, 2, 3, 1)
        return x.reshape(self.p.shape)

    def rotate(self, x, back=False):
        x = self.to_pre(x)
        for i, q in enumerate(self.Q):
            if q is not None:
                x = torch.movedim(torch.tensordot(x, q.T if back else q, dims=([i], [0])), -1, i)
        return self.from_pre(x)

    def accumulate(self, g, step):
        beta = self.cfg.get("shampoo_beta") or self.cfg["betas"][1]
        x = self.to_pre(g)
        for i, L in enumerate(self.L):
            if L is not None:
                rest = [k for k in range(x.dim()) if k != i]
                L.mul_(beta).add_((1 - beta) * torch.tensordot(x, x, dims=(rest, rest)))
        if self.Q is None:
            self.Q = [None if L is None else torch.linalg.eigh(L)[1].flip(1) for L in self.L]
        if step > 0 and step % self.cfg["precondition_frequency"] == 0:
            v = self.to_pre(self.v)
            for i, L in enumerate(self.L):
                if L is not None:
                    power = L @ self.Q[i]
                    order = torch.argsort(torch.diag(self.Q[i].T @ power), descending=True)
                    self.Q[i] = torch.linalg.qr(power[:, order])[0]
                    v = v.index_select(i, order)
            self.v = self.from_pre(v)

    def step(self, g, group_step):
        """``group_step``: the param group's step count after this step."""
        if group_step == 1:
            return
        (b1, b2), lr, eps = self.cfg["betas"], self.cfg["lr"], 1e-8
        self.m = b1 * self.m + (1 - b1) * g
        self.v = b2 * self.v + (1 - b2) * self.rotate(g) ** 2
        u = self.rotate(self.rotate(self.m) / (self.v.sqrt() + eps), back=True)
        if self.cfg.get("normalize_gradient"):
            u = u / (u.pow(2).mean().sqrt() + eps)
        t = group_step - 1
        size = lr * (1 - b2**t) ** 0.5 / (1 - b1**t) if self.cfg.get("correct_bias", True) else lr
        self.p = (self.p - size * u) * (1 - lr * self.cfg.get("weight_decay", 0.01))
        self.accumulate(g, t)


# --- tests -----------------------------------------------------------------------------------

# Every factor full rank from the first gradient on (square or under max_precondition_dim in
# the other dimensions), so each eigenbasis is unique up to signs, which SOAP's update ignores.
GROUPS = [
    dict(shapes=[(7, 5), (7,), (3, 5, 4)], max_precondition_dim=6),
    dict(shapes=[(2, 3, 2, 5)], max_precondition_dim=6, merge_dims=True),
    dict(
        shapes=[(2,), (3, 3)],
        precondition_1d=True,
        normalize_gradient=True,
        correct_bias=False,
        weight_decay=0.1,
        lr=1e-2,
    ),
]
COMMON = dict(lr=0.1, betas=(0.9, 0.95), precondition_frequency=2)


def _problem(seed):
    gen = torch.Generator().manual_seed(seed)
    params = [[torch.randn(s, generator=gen, dtype=torch.float64) for s in g["shapes"]] for g in GROUPS]
    grads = [
        [[torch.randn(s, generator=gen, dtype=torch.float64) for s in g["shapes"]] for g in GROUPS]
        for _ in range(7)
    ]
    return params, grads


def _fuser_groups(params):
    groups = []
    for g, ps in zip(GROUPS, params):
        cfg = {k: v for k, v in g.items() if k != "shapes"}
        groups.append(dict(params=ps, **cfg))
    return groups


def test_soap_matches_float64_reference():
    params, grads = _problem(0)
    ours = [[p.float().requires_grad_() for p in ps] for ps in params]
    opt = fuser.optim.SOAP(_fuser_groups(ours), data_format="channels_last", **COMMON)
    refs = [[Reference(p, {**COMMON, **g}, True) for p in ps] for g, ps in zip(GROUPS, params)]
    launches = fuser.stats()["launches"]
    for k, step_grads in enumerate(grads):  # 7 steps: bases refreshed after steps 3, 5 and 7
        for ps, rs, gs in zip(ours, refs, step_grads):
            for p, r, g in zip(ps, rs, gs):
                p.grad = g.float()
                if k == 0:
                    r.accumulate(g, 0)
                r.step(g, k + 1)
        opt.step()
    for ps, rs, p0s in zip(ours, refs, params):
        for p, r, p0 in zip(ps, rs, p0s):
            err = (p.detach().double() - r.p).abs().max() / (r.p - p0).abs().max()
            assert err <= 1e-5, (tuple(p.shape), err.item())
            for key, want in (("exp_avg", r.m), ("exp_avg_sq", r.v)):
                err = (opt.state[p][key].double() - want).abs().max() / want.abs().max()
                assert err <= 1e-5, (tuple(p.shape), key, err.item())
    st = opt.state[ours[0][0]]
    assert sorted(st) == ["GG", "Q", "exp_avg", "exp_avg_sq", "precondition_frequency", "shampoo_beta"]
    assert st["GG"][0] == [] and st["Q"][0] == [] and st["GG"][1].shape == (5, 5)
    assert opt.param_groups[0]["step"] == 7
    # per step: soap_precondition, soap, and soap_normalized's two phases (its mean first)
    assert fuser.stats()["launches"] - launches == 6 * 4
    assert [len(q) for q in opt.state[ours[0][1]]["Q"]] == [0]  # a 1-D param, no precondition_1d


def _one_step(maximize, grad, p):
    p = p.clone().requires_grad_()
    opt = fuser.optim.SOAP([p], maximize=maximize, precondition_frequency=1, lr=0.1)
    for _ in range(3):
        p.grad = grad.clone()
        opt.step()
    return p.detach(), p.grad


def test_soap_maximize_and_state_dict():
    gen = torch.Generator().manual_seed(1)
    p, g = torch.randn(5, 3, generator=gen), torch.randn(5, 3, generator=gen)
    up, grad = _one_step(True, g, p)
    assert torch.equal(grad, g)  # the gradient is left as it is
    torch.testing.assert_close(up, _one_step(False, -g, p)[0], rtol=0, atol=0)

    a = p.clone().requires_grad_()
    opt = fuser.optim.SOAP([a], precondition_frequency=2, max_precondition_dim=4)
    for _ in range(3):
        a.grad = torch.randn(5, 3, generator=gen)
        opt.step()
    b = a.detach().clone().requires_grad_()
    other = fuser.optim.SOAP([b])
    other.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch's load shares same-dtype tensors
    assert other.param_groups[0]["precondition_frequency"] == 2 and other.state[b]["GG"][0] == []
    for _ in range(2):
        a.grad = torch.randn(5, 3, generator=gen)
        b.grad = a.grad.clone()
        opt.step()
        other.step()
    assert torch.equal(a, b)


def test_soap_bf16_param_keeps_fp32_states():
    p = torch.randn(5, 3, dtype=torch.bfloat16, requires_grad=True)
    opt = fuser.optim.SOAP([p], precondition_frequency=1)
    for _ in range(3):
        p.grad = torch.randn(5, 3, dtype=torch.bfloat16)
        opt.step()
    st = opt.state[p]
    assert st["exp_avg"].dtype == st["Q"][0].dtype == torch.float32 and p.dtype == torch.bfloat16
    assert torch.isfinite(p).all()


def _from_state(ref, st, p):
    """``ref`` (a Reference) set to the optimizer's values before a step."""
    ref.p = _fp32_value(p, st)
    ref.m, ref.v = st["exp_avg"].double(), st["exp_avg_sq"].double()
    ref.L = [gg.double() if len(gg) else None for gg in st["GG"]]
    ref.Q = [q.double() if len(q) else None for q in st["Q"]]


def _fp32_value(p, st):
    """``p``'s value in float64: with a split master, bf16 ``p`` plus ``lo`` 2**-16ths of its
    bf16 spacing ``2**(e - 8)`` for ``|p| = f * 2**e``, ``f`` in [0.5, 1)."""
    lo = st.get("master_lo")
    if lo is None:
        return p.detach().double()
    _, e = torch.frexp(p.detach().double())
    return p.detach().double() + lo.double() * torch.ldexp(torch.ones_like(e, dtype=torch.float64), e - 24)


def _steps_from_state(opt, params, cfg, steps, gen):
    """Each step of ``opt`` against the float64 reference started from its state before it
    (moments as stored): the largest error of the parameters as a fraction of fp32's (storing
    the result, 2**-23 of |p|, and computing the step, 1e-5 of the update), and of each
    moment's as a fraction of half a bf16 spacing."""
    worst = dict(p=0.0, exp_avg=0.0, exp_avg_sq=0.0)
    for _ in range(steps):
        refs = []
        for p in params:
            r = Reference(p.detach().float(), cfg, False)
            _from_state(r, opt.state[p], p)
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
            refs.append((r, r.p.clone()))
        step = opt.param_groups[0]["step"] + 1
        for p, (r, _) in zip(params, refs):
            r.step(p.grad.double(), step)
        opt.step()
        for p, (r, p0) in zip(params, refs):
            st = opt.state[p]
            got = _fp32_value(p, st)
            bound = 2.0**-23 * r.p.norm() + 1e-5 * (r.p - p0).norm()
            worst["p"] = max(worst["p"], float((got - r.p).norm() / bound))
            for key, want in (("exp_avg", r.m), ("exp_avg_sq", r.v)):
                err = (st[key].double() - want).abs() / (2.0**-8 * want.abs() + 1e-30)
                worst[key] = max(worst[key], float(err.max()))
    return worst


def test_soap_bf16_moments_round_once_per_step():
    """``state_dtype=torch.bfloat16``: exp_avg and exp_avg_sq stored in bf16, the factors, bases
    and the step's buffers fp32; a step reads the stored moments and rounds each new one
    once (to nearest: within half a bf16 spacing), refresh steps included."""
    gen = torch.Generator().manual_seed(11)
    cfg = dict(COMMON, max_precondition_dim=6)
    params = [torch.randn(s, generator=gen).requires_grad_() for s in ((7, 5), (7,), (3, 5, 4))]
    opt = fuser.optim.SOAP(params, state_dtype=torch.bfloat16, **cfg)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()  # (the first builds the preconditioner)
    worst = _steps_from_state(opt, params, cfg, 4, gen)  # (refreshes after steps 3 and 5)
    assert all(v <= 1 for v in worst.values()), worst
    for p in params:
        st = opt.state[p]
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16
        assert all(gg.dtype == torch.float32 for gg in st["GG"] if len(gg)), p.shape


def test_soap_split_masters_and_param_dtype_moments():
    """bf16 parameters with ``master_weights="bf16+int16"`` and ``state_dtype="param"``: the
    moments in bf16 and the parameter's value (bf16 and its low part) following float64 to
    fp32's precision; a state dict carries it all and the run continues exactly."""
    gen = torch.Generator().manual_seed(12)
    cfg = dict(COMMON, max_precondition_dim=6)
    shapes = ((7, 5), (6,), (3, 5, 4))
    params = [torch.randn(s, generator=gen).bfloat16().requires_grad_() for s in shapes]
    make = lambda ps: fuser.optim.SOAP(ps, state_dtype="param", master_weights="bf16+int16", **cfg)  # noqa: E731
    opt = make(params)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).bfloat16()
    opt.step()
    worst = _steps_from_state(opt, params, cfg, 4, gen)
    assert all(v <= 1 for v in worst.values()), worst
    st = opt.state[params[0]]
    assert st["exp_avg"].dtype == torch.bfloat16 and st["master_lo"].dtype == torch.int16
    twins = [p.detach().clone().requires_grad_() for p in params]
    other = make(twins)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    for _ in range(3):
        for p, q in zip(params, twins):
            p.grad = torch.randn(p.shape, generator=gen).bfloat16()
            q.grad = p.grad.clone()
        opt.step()
        other.step()
    for p, q in zip(params, twins):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "master_lo"):
            assert other.state[q][key].dtype == opt.state[p][key].dtype
            assert torch.equal(other.state[q][key], opt.state[p][key]), key


def test_soap_failed_decomposition_keeps_its_basis(monkeypatch):
    soap = sys.modules["fuser.optim.builtins.soap"]  # the module (its name in builtins is the rule)

    p = torch.randn(5, 3, requires_grad=True)
    opt = fuser.optim.SOAP([p], precondition_frequency=1)
    for _ in range(2):
        p.grad = torch.randn(5, 3)
        opt.step()
    before = [q.clone() for q in opt.state[p]["Q"]]
    v = opt.state[p]["exp_avg_sq"].clone()
    qr = soap._qr_basis
    # fails in fp32 only: the fp64 retry gives the new basis, with no warning
    monkeypatch.setattr(soap, "_qr_basis", lambda m: qr(m) if m.dtype == torch.float64 else m * float("nan"))
    p.grad = torch.randn(5, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    assert not any(torch.equal(q, b) for q, b in zip(opt.state[p]["Q"], before))
    before = [q.clone() for q in opt.state[p]["Q"]]
    monkeypatch.setattr(soap, "_qr_basis", lambda m: torch.full_like(m, float("nan")))
    p.grad = torch.randn(5, 3)
    with pytest.warns(RuntimeWarning, match="keeps its previous basis"):
        opt.step()
    assert all(torch.equal(q, b) for q, b in zip(opt.state[p]["Q"], before))
    assert torch.isfinite(p).all() and not torch.equal(opt.state[p]["exp_avg_sq"], v)


def test_soap_decomposes_within_the_matrix_workspace(monkeypatch):
    """Factors of one size are multiplied (``G Gᵀ``) and decomposed in slices whose stacks fit
    FUSER_MATRIX_WORKSPACE: with room for one factor a slice, each product, eigh and QR
    takes one, and the steps are those of one stack a size."""
    soap = importlib.import_module("fuser.optim.builtins.soap")
    eigh, qr, bmm = soap._eigh_basis, soap._qr_basis, torch.bmm
    seen = []

    def products(a, b):  # (G Gᵀ is the step's only square product: the projections are not)
        out = bmm(a, b)
        if out.shape[-1] == out.shape[-2]:
            seen.append(("G Gᵀ", out.shape[-1], len(out)))
        return out

    monkeypatch.setattr(soap, "_eigh_basis", lambda m: seen.append(("eigh", m.shape[-1], len(m))) or eigh(m))
    monkeypatch.setattr(soap, "_qr_basis", lambda m: seen.append(("qr", m.shape[-1], len(m))) or qr(m))
    monkeypatch.setattr(torch, "bmm", products)
    start = [torch.randn(6, 4) for _ in range(3)]
    grads = [[torch.randn(6, 4) for _ in start] for _ in range(3)]
    ends = {}
    # (240 bytes: less than one 4x4 factor's decomposition, 320, or one 6x6 G Gᵀ with its G)
    for budget in ("unlimited", "240"):
        monkeypatch.setenv("FUSER_MATRIX_WORKSPACE", budget)
        seen.clear()
        ps = [torch.nn.Parameter(x.clone()) for x in start]
        opt = fuser.optim.SOAP(ps, precondition_frequency=1, max_precondition_dim=6)
        for gs in grads:
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            opt.step()
        ends[budget] = ps, sorted(set(seen))
    (whole, stacks), (sliced, slices) = ends.values()
    assert stacks == [(what, d, 3) for what in ("G Gᵀ", "eigh", "qr") for d in (4, 6)]
    assert slices == [(what, d, 1) for what in ("G Gᵀ", "eigh", "qr") for d in (4, 6)]
    for a, b in zip(whole, sliced):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_soap_reads_grad_attr():
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(4, 3, generator=gen, requires_grad=True)
    b = a.detach().clone().requires_grad_()
    opts = (
        fuser.optim.SOAP([a], precondition_frequency=1),
        fuser.optim.SOAP([b], precondition_frequency=1, grad_attr="main_grad"),
    )
    for _ in range(3):
        a.grad = torch.randn(4, 3, generator=gen)
        b.main_grad = a.grad.clone()
        for opt in opts:
            opt.step()
    assert torch.equal(a, b) and b.grad is None


def test_soap_holds_its_states_alone_between_steps(monkeypatch):
    """A step's buffers (the projected gradient and first moment, the direction) are freed
    when it ends, refresh steps included: between steps only the states stay."""
    made = []
    buffers = fuser.optim.SOAP._buffers

    def recorded(self, p):
        work = buffers(self, p)
        made.extend(weakref.ref(t) for t in work.values())
        return work

    monkeypatch.setattr(fuser.optim.SOAP, "_buffers", recorded)
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(5, 3, generator=gen, requires_grad=True)
    opt = fuser.optim.SOAP([a], precondition_frequency=2)
    for _ in range(4):
        a.grad = torch.randn(5, 3, generator=gen)
        opt.step()
        gc.collect()
        assert all(r() is None for r in made)
    assert len(made) >= 9 and set(opt.state[a]) >= {"exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-1.0), "learning rate"),
        (dict(betas=(0.9, 1.0)), "beta2"),
        (dict(betas=(0.9,)), "2 values"),
        (dict(shampoo_beta=-0.1), "shampoo_beta"),
        (dict(precondition_frequency=0), "precondition_frequency"),
        (dict(max_precondition_dim=2.5), "max_precondition_dim"),
        (dict(data_format="nchw"), "data_format"),
        (dict(state_dtype="q8"), "SOAP stores exp_avg and exp_avg_sq in one dtype"),
        (dict(state_dtype=dict(exp_avg="bf16")), "SOAP stores exp_avg and exp_avg_sq in one dtype"),
    ],
)
def test_soap_rejects_bad_keywords(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fuser.optim.SOAP([torch.zeros(3, requires_grad=True)], **kwargs)


def test_soap_rejects_unknown_keyword_and_sparse_grads_changing_nothing():
    with pytest.raises(TypeError, match="weight_decouple"):
        fuser.optim.SOAP([torch.zeros(3, requires_grad=True)], weight_decouple=True)
    a, b = torch.randn(4, 3, requires_grad=True), torch.randn(5, requires_grad=True)
    opt = fuser.optim.SOAP([a, b])
    a.grad = torch.randn(4, 3)
    b.grad = torch.randn(5).to_sparse()
    before = a.detach().clone()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert torch.equal(a, before) and len(opt.state) == 0 and opt.param_groups[0]["step"] == 0
