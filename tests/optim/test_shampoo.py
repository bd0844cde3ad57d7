"""fuser.optim.Shampoo against a float64 Shampoo written here from Meta's distributed Shampoo's
formulas: blocked factors, inverse roots by eigh refreshed every precondition_frequency steps,
the step grafted block by block to Adam's (or AdaGrad's) norm, decoupled weight decay."""

from __future__ import annotations

import copy
import gc
import itertools
import math
import weakref

import pytest
import torch

import fuser
from fuser.optim.builtins import shampoo

# --- the float64 reference ------------------------------------------------------------------


def _merged(shape, limit):
    dims = [d for d in shape if d != 1] or [1]
    out = [dims[0]]
    for d in dims[1:]:
        out[-1:] = [out[-1] * d] if out[-1] * d <= limit else [out[-1], d]
    return tuple(out)


class Reference:
    """One parameter's Shampoo in float64: blocks as index ranges, factors by tensordot, the
    preconditioned block contracted dimension by dimension (Meta's cyclic tensordot)."""

    def __init__(self, p, cfg):
        self.cfg = (
            dict(
                betas=(0.9, 1.0),
                beta3=-1.0,
                epsilon=1e-12,
                momentum=0.0,
                dampening=0.0,
                inv_root_override=0,
                exponent_multiplier=1.0,
                weight_decay=0.0,
                max_preconditioner_dim=1024,
                precondition_frequency=1,
                start_preconditioning_step=-1,
                use_decoupled_weight_decay=True,
                grafting="adam",
                grafting_beta2=0.999,
                grafting_epsilon=1e-8,
                use_merge_dims=True,
                use_nesterov=False,
                use_bias_correction=True,
                lr=1e-2,
            )
            | cfg
        )
        c = self.cfg
        if c["start_preconditioning_step"] == -1:
            c["start_preconditioning_step"] = c["precondition_frequency"]
        self.p, self.t = p.double().clone(), 0
        shape = _merged(p.shape, c["max_preconditioner_dim"]) if c["use_merge_dims"] else tuple(p.shape)
        self.shape, b = shape, c["max_preconditioner_dim"]
        ranges = [[slice(s, min(s + b, d)) for s in range(0, d, b)] for d in shape]
        self.blocks = list(itertools.product(*ranges))
        size = lambda s: s.stop - s.start  # noqa: E731
        self.F = [[torch.zeros(size(s), size(s), dtype=torch.float64) for s in blk] for blk in self.blocks]
        self.R = [[torch.zeros_like(f) for f in fs] for fs in self.F]
        self.m, self.v, self.mom = (torch.zeros_like(self.p) for _ in range(3))

    def step(self, g):
        c, self.t = self.cfg, self.t + 1
        t, (beta1, beta2), wd = self.t, c["betas"], c["weight_decay"]
        g = g.double()
        if not c["use_decoupled_weight_decay"]:
            g = g + wd * self.p
        gv = g.reshape(self.shape)
        for blk, fs in zip(self.blocks, self.F):
            x = gv[blk]
            for i, f in enumerate(fs):
                others = [a for a in range(x.dim()) if a != i]
                outer = torch.tensordot(x, x, dims=(others, others))
                f.copy_(f + outer if beta2 == 1.0 else beta2 * f + (1 - beta2) * outer)
        if c["grafting"] == "adagrad":
            self.v += g * g
        elif c["grafting"] in ("adam", "rmsprop"):
            self.v = c["grafting_beta2"] * self.v + (1 - c["grafting_beta2"]) * g * g
        start, every = c["start_preconditioning_step"], c["precondition_frequency"]
        if t == start or (t > start and t % every == 0):
            bc = 1 - beta2**t if beta2 < 1 and c["use_bias_correction"] else 1.0
            for fs, rs in zip(self.F, self.R):
                for f, r in zip(fs, rs):
                    lam, q = torch.linalg.eigh(f / bc)
                    lam = lam - min(lam.min().item(), 0.0) + c["epsilon"]
                    root = c["inv_root_override"] or 2 * len(fs)
                    r.copy_(q @ torch.diag(lam ** (-c["exponent_multiplier"] / root)) @ q.T)
        if beta1 > 0:
            beta3 = beta1 if c["beta3"] == -1.0 else c["beta3"]
            gbar = beta3 * self.m + (1 - beta3) * g  # this step's mix, from the EMA before it
            self.m = beta1 * self.m + (1 - beta1) * g
            gbar = gbar / (1 - beta3 * beta1 ** (t - 1)) if c["use_bias_correction"] else gbar
        else:
            gbar = g
        if c["grafting"] == "adam":
            graft = gbar / ((self.v / (1 - c["grafting_beta2"] ** t)).sqrt() + c["grafting_epsilon"])
        elif c["grafting"] in ("adagrad", "rmsprop"):
            graft = gbar / (self.v.sqrt() + c["grafting_epsilon"])
        else:
            graft = gbar if c["grafting"] == "sgd" else None
        if t < start and graft is not None:
            step = graft
        else:
            step = torch.zeros(self.shape, dtype=torch.float64)
            gb = gbar.reshape(self.shape)
            for blk, rs in zip(self.blocks, self.R):
                s = gb[blk]
                for r in rs:
                    s = torch.tensordot(s, r, dims=([0], [0]))
                step[blk] = (
                    s if graft is None else s * graft.reshape(self.shape)[blk].norm() / (s.norm() + 1e-16)
                )
            step = step.reshape(self.p.shape)
        if c["use_decoupled_weight_decay"]:
            step = step + wd * self.p
        if c["momentum"] > 0:
            mu, keep = c["momentum"], 1 - c["dampening"]
            self.mom = mu * self.mom + keep * step
            step = keep * step + mu * self.mom if c["use_nesterov"] else self.mom
        self.p = self.p - c["lr"] * step


def run_both(groups, steps, **options):
    """fuser's Shampoo over ``groups`` ([(params, keywords)], the optimizer's ``options``) and
    one Reference per parameter, the same fresh gradients each step; returns the optimizer,
    (fuser param, reference, start) triples and the kernel launches of each step."""
    params = [[0.1 * torch.randn(s) for s in shapes] for shapes, _ in groups]  # small: fp32 rounds p finer
    refs = [[Reference(p, kw) for p in ps] for ps, (_, kw) in zip(params, groups)]
    opt = fuser.optim.Shampoo([dict(params=ps, **kw) for ps, (_, kw) in zip(params, groups)], **options)
    starts = [p.clone() for ps in params for p in ps]
    launches = []
    for _ in range(steps):
        for ps, rs in zip(params, refs):
            for p, r in zip(ps, rs):
                p.grad = torch.randn(p.shape) + 0.1
                r.step(p.grad)
        before = fuser.stats()["launches"]
        opt.step()
        launches.append(fuser.stats()["launches"] - before)
    flat = [(p, r) for ps, rs in zip(params, refs) for p, r in zip(ps, rs)]
    return opt, [(p, r, s) for (p, r), s in zip(flat, starts)], launches


def assert_update_close(p, ref, start, rtol=1e-5):
    """The update ``p - start`` within ``rtol`` of the reference's, relative to its largest entry."""
    want = ref.p - start.double()
    err = ((p.double() - start.double()) - want).abs().max() / want.abs().max()
    assert err <= rtol, (tuple(p.shape), float(err))


# --- tests ----------------------------------------------------------------------------------


def _no_eigh(*args, **kwargs):
    raise AssertionError("root_method='newton' took eigh's roots for a factor it should have converged on")


@pytest.mark.parametrize("root_method", ["eigh", "newton"])
def test_adam_grafting_blocks_and_refreshes_like_the_reference(root_method, monkeypatch):
    """Six steps, roots at steps 4 and 6 (grafting alone before): a 7x5 matrix (two-sided,
    L^-1/4 G R^-1/4), the same shape blocked 4+3 by 4+1, a 1-D tensor (root -1/2), and a
    3-D tensor merged to 12x5; EMA factors with bias correction, decoupled weight decay.
    By coupled Newton the roots of these positive-definite factors need no eigh at all."""
    if root_method == "newton":
        monkeypatch.setattr(shampoo, "inverse_roots", _no_eigh)
    common = dict(
        lr=0.1,
        betas=(0.9, 0.99),
        epsilon=1e-2,
        weight_decay=0.05,
        precondition_frequency=2,
        start_preconditioning_step=4,
    )
    groups = [
        ([(7, 5), (3,)], dict(common, use_merge_dims=False)),
        ([(7, 5)], dict(common, use_merge_dims=False, max_preconditioner_dim=4)),
        ([(3, 4, 5)], dict(common, max_preconditioner_dim=20)),
    ]
    opt, results, launches = run_both(groups, 6, root_method=root_method)
    for p, ref, start in results:
        assert_update_close(p, ref, start)
    assert launches == [2] * 6  # the moments' kernel and the parameters', each over every tensor
    st = opt.state[results[2][0]]  # 7x5 in blocks (4,4), (4,1), (3,4), (3,1)
    assert [[tuple(f.shape) for f in b] for b in st["factor_matrices"]] == [
        [(4, 4), (4, 4)],
        [(4, 4), (1, 1)],
        [(3, 3), (4, 4)],
        [(3, 3), (1, 1)],
    ]
    assert [len(b) for b in opt.state[results[3][0]]["inv_factor_matrices"]] == [2]  # (12, 5)
    assert int(st["step"]) == 6 and st["grafting"].shape == (7, 5)


def test_adagrad_grafting_momentum_and_l2_like_the_reference():
    """AdaGrad grafting, summed factors (beta2 = 1), no filtering (beta1 = 0), Nesterov
    momentum, L2 weight decay in the gradient; roots every step from step 3 (where the
    1-D tensor's factor, a sum of g g^T, has full rank: fp32's eigh leaves a singular
    factor's null space at ~1e-7, whose -1/2 power then amplifies rounding)."""
    kw = dict(
        lr=0.05,
        betas=(0.0, 1.0),
        epsilon=0.1,
        grafting="adagrad",
        momentum=0.5,
        use_nesterov=True,
        weight_decay=0.1,
        use_decoupled_weight_decay=False,
        use_merge_dims=False,
        start_preconditioning_step=3,
    )
    opt, results, _ = run_both([([(5, 7), (3,)], kw)], 4)
    for p, ref, start in results:
        assert_update_close(p, ref, start)
    assert "momentum_buffer" in opt.state[results[0][0]] and "filtered_grad" not in opt.state[results[0][0]]


@pytest.mark.parametrize(
    "keywords, launches",
    [
        (dict(grafting="rmsprop", beta3=0.5, momentum=0.8, dampening=0.3, exponent_multiplier=0.5), 2),
        (dict(grafting="sgd", betas=(0.5, 0.9), inv_root_override=2, use_bias_correction=False), 2),
        (dict(grafting=None, betas=(0.0, 1.0), weight_decay=0.0), 1),
    ],
    ids=["rmsprop-beta3-dampening", "sgd-root-override", "none"],
)
def test_other_graftings_and_keywords_like_the_reference(keywords, launches):
    """RMSprop, SGD and no grafting; beta3, dampening, inv_root_override, exponent_multiplier;
    without grafting, no step before the first roots (they start at zero, as in Meta's), and
    without moments (beta1 = 0, no diagonal grafting) one launch a step."""
    kw = dict(lr=0.05, epsilon=0.1, weight_decay=0.02, use_merge_dims=False, start_preconditioning_step=4)
    _, results, counts = run_both([([(5, 7), (3,)], kw | keywords)], 5)
    for p, ref, start in results:
        assert_update_close(p, ref, start)
    assert counts == [launches] * 5


def test_state_dict_resumes_the_same_trajectory():
    kw = dict(lr=0.1, epsilon=1e-3, precondition_frequency=2, use_merge_dims=False, max_preconditioner_dim=4)
    params = [torch.randn(5, 3), torch.randn(5)]
    grads = [[torch.randn_like(p) for p in params] for _ in range(4)]
    a = [p.clone() for p in params]
    opt = fuser.optim.Shampoo(a, **kw)
    for gs in grads[:2]:
        for p, g in zip(a, gs):
            p.grad = g.clone()
        opt.step()
    saved = opt.state_dict()
    b = [p.clone() for p in a]
    other = fuser.optim.Shampoo(b, **kw)
    other.load_state_dict(saved)
    for gs in grads[2:]:
        for ps, o in ((a, opt), (b, other)):
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            o.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    st = other.state[b[0]]
    assert st["factor_matrices"][0][0].dtype == torch.float32 and int(st["step"]) == 4


def test_shampoo_holds_its_states_alone_between_steps(monkeypatch):
    """A step's buffers (the grafting direction, the filtered gradient, the direction) are
    freed when it ends, root refreshes included: between steps only the states stay."""
    made = []
    buffers = fuser.optim.Shampoo._buffers

    def recorded(self, p):
        work = buffers(self, p)
        made.extend(weakref.ref(t) for t in work.values())
        return work

    monkeypatch.setattr(fuser.optim.Shampoo, "_buffers", recorded)
    params = [torch.randn(5, 3), torch.randn(5)]
    opt = fuser.optim.Shampoo(params, lr=0.1, precondition_frequency=2, max_preconditioner_dim=4)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        gc.collect()
        assert all(r() is None for r in made)
    assert len(made) >= 6 and all("grafting" in opt.state[p] for p in params)


def test_a_failed_root_keeps_the_previous_one(monkeypatch):
    p = torch.randn(5, 3)
    opt = fuser.optim.Shampoo([p], lr=0.1, epsilon=1e-3, use_merge_dims=False)
    p.grad = torch.randn_like(p)
    opt.step()
    before = [r.clone() for r in opt.state[p]["inv_factor_matrices"][0]]

    def broken(*args, **kwargs):
        raise torch.linalg.LinAlgError("eigh did not converge")

    monkeypatch.setattr(torch.linalg, "eigh", broken)
    p.grad = torch.randn_like(p)
    with pytest.warns(RuntimeWarning, match="keep their previous roots"):
        opt.step()
    for r, old in zip(opt.state[p]["inv_factor_matrices"][0], before):
        torch.testing.assert_close(r, old, rtol=0, atol=0)
    assert torch.isfinite(p).all()


def test_newton_roots_of_singular_factors_come_from_eigh(monkeypatch):
    """A 6x3 matrix's left factor, ``G Gᵀ`` after one step, has rank 3 of 6: with ``epsilon``
    far below fp32's resolution the coupled Newton iteration cannot reach its root, which
    then comes from eigh, as ``root_method="eigh"`` computes it (the same bits); from the
    second step the factor has full rank and Newton alone computes both roots, each within
    fp32's rounding of eigh's, ``8 d u κ`` for a ``d x d`` factor of condition number ``κ``
    (on the second step a square Gaussian sum: ``κ`` often 1e4 and more)."""
    calls, iterated = [], []
    by_eigh, by_newton = shampoo.inverse_roots, shampoo.inv_root_newton

    def spy(mats, *args):
        calls.append(tuple(mats.shape))
        return by_eigh(mats, *args)

    def newton_spy(mats, k):
        iterated.append(tuple(mats.shape))
        return by_newton(mats, k)

    monkeypatch.setattr(shampoo, "inv_root_newton", newton_spy)

    kw = dict(lr=0.05, epsilon=1e-12, betas=(0.0, 1.0), grafting="adagrad", use_merge_dims=False)
    p = torch.randn(6, 3)
    q = p.clone()
    newton = fuser.optim.Shampoo([p], root_method="newton", **kw)
    eigh = fuser.optim.Shampoo([q], **kw)
    start, steps, worst = p.clone(), [], 1.0
    for t in range(4):
        p.grad = torch.randn(p.shape)
        q.grad = p.grad.clone()
        monkeypatch.setattr(shampoo, "inverse_roots", spy)
        newton.step()
        monkeypatch.setattr(shampoo, "inverse_roots", by_eigh)
        eigh.step()
        steps.append(list(calls))
        calls.clear()
        left, right = (newton.state[p]["inv_factor_matrices"][0][i] for i in (0, 1))
        want_left, want_right = (eigh.state[q]["inv_factor_matrices"][0][i] for i in (0, 1))
        if t == 0:
            assert torch.equal(left, want_left)
        assert torch.isfinite(p).all()
        for i, (got, want) in enumerate(((left, want_left), (right, want_right))):
            lam = torch.linalg.eigvalsh(eigh.state[q]["factor_matrices"][0][i].double())
            if t == 0 and i == 0:
                continue  # (equal, above)
            bound = 8 * len(lam) * 2**-24 * float(lam[-1] / lam[0])
            worst = max(worst, bound)
            assert (got - want).abs().max() <= bound * want.abs().max(), (t, i)
    assert steps == [[(1, 6, 6)], [], [], []], steps
    # (the singular factor's Cholesky failed: it went to eigh without 100 Newton iterations)
    assert iterated[0] == (1, 3, 3) and iterated[1:3] == [(1, 6, 6), (1, 3, 3)], iterated
    err = ((p - start) - (q - start)).abs().max() / (q - start).abs().max()
    assert err <= max(worst, 1e-5), (float(err), worst)


@pytest.mark.parametrize(
    "keywords, message",
    [
        (dict(betas=(0.9, 0.0)), "index 1"),
        (dict(epsilon=0.0), "epsilon"),
        (dict(precondition_frequency=4, start_preconditioning_step=2), "start_preconditioning_step"),
        (dict(max_preconditioner_dim=0), "max_preconditioner_dim"),
        (dict(grafting="lamb"), "grafting"),
        (dict(distributed_config=object()), "distributed_config"),
        (dict(state_dtype="q8"), "Shampoo stores filtered_grad, grafting and momentum_buffer in one dtype"),
        (dict(root_method="svd"), "root_method must be one of"),
        (dict(root_method="newton", exponent_multiplier=0.5), "exponent_multiplier must be 1.0"),
    ],
)
def test_bad_keywords_raise(keywords, message):
    with pytest.raises(ValueError, match=message):
        fuser.optim.Shampoo([torch.randn(3, 2)], **keywords)


def test_a_checkpoint_whose_factors_do_not_fit_is_refused_and_changes_nothing():
    p = torch.randn(7, 3)
    opt = fuser.optim.Shampoo([p], max_preconditioner_dim=4, use_merge_dims=False)
    p.grad = torch.randn_like(p)
    opt.step()
    saved = opt.state_dict()
    saved["state"][0]["factor_matrices"][1][0] = torch.zeros(4, 4)  # block (3, 3) needs 3x3
    q = p.detach().clone()
    other = fuser.optim.Shampoo([q], lr=0.5, use_merge_dims=False)
    with pytest.raises(ValueError, match="factor_matrices"):
        other.load_state_dict(saved)
    assert len(other.state) == 0 and other.param_groups[0]["max_preconditioner_dim"] == 1024
    assert math.isclose(other.param_groups[0]["lr"], 0.5)


# --- state dtypes and split masters -----------------------------------------------------------


def _fp32_value(p, st):
    """``p``'s value in float64: with a split master, bf16 ``p`` plus ``lo`` 2**-16ths of its
    bf16 spacing ``2**(e - 8)`` for ``|p| = f * 2**e``, ``f`` in [0.5, 1)."""
    lo = st.get("master_lo")
    if lo is None:
        return p.detach().double()
    _, e = torch.frexp(p.detach().double())
    return p.detach().double() + lo.double() * torch.ldexp(torch.ones_like(e, dtype=torch.float64), e - 24)


def _reference_from_state(p, st, cfg) -> Reference:
    """The float64 reference set to the optimizer's values before a step (moments as stored)."""
    r = Reference(p.detach().float(), cfg)
    if not st:  # (before the first step: the reference's own start)
        return r
    r.p, r.t = _fp32_value(p, st), int(st["step"].item())
    r.F = [[f.double() for f in fs] for fs in st["factor_matrices"]]
    r.R = [[x.double() for x in rs] for rs in st["inv_factor_matrices"]]
    for key, name in (("filtered_grad", "m"), ("grafting", "v"), ("momentum_buffer", "mom")):
        if key in st:
            setattr(r, name, st[key].double())
    return r


def _steps_from_state(opt, params, cfg, steps, gen) -> dict:
    """Each step against the reference started from the optimizer's state before it: the
    largest error of the parameters as a fraction of fp32's (storing the result, 2**-23 of
    |p|; computing the step, 1e-5 of the update), and of each stored moment as a fraction
    of half a bf16 spacing."""
    worst = {}
    for _ in range(steps):
        refs = []
        for p in params:
            refs.append(_reference_from_state(p, opt.state[p], cfg))
            p.grad = (torch.randn(p.shape, generator=gen) + 0.1).to(p.dtype)
        starts = [r.p.clone() for r in refs]
        for p, r in zip(params, refs):
            r.step(p.grad)
        opt.step()
        for p, r, p0 in zip(params, refs, starts):
            st = opt.state[p]
            bound = 2.0**-23 * r.p.norm() + 1e-5 * (r.p - p0).norm()
            worst["p"] = max(worst.get("p", 0.0), float((_fp32_value(p, st) - r.p).norm() / bound))
            for key, want in (("filtered_grad", r.m), ("grafting", r.v), ("momentum_buffer", r.mom)):
                err = (st[key].double() - want).abs() / (2.0**-8 * want.abs() + 1e-30)
                worst[key] = max(worst.get(key, 0.0), float(err.max()))
    return worst


# Roots at steps 2 and 4 of blocks 4+3 by 3, and of a 1-D tensor; epsilon keeps the factors
# of few gradients well conditioned (as in the tests above).
CFG = dict(
    lr=0.1,
    betas=(0.9, 0.99),
    epsilon=0.1,
    momentum=0.5,
    weight_decay=0.05,
    precondition_frequency=2,
    start_preconditioning_step=2,
    max_preconditioner_dim=4,
    use_merge_dims=False,
)


def test_bf16_moments_round_once_per_step():
    """``state_dtype=torch.bfloat16``: filtered_grad, grafting and momentum_buffer in bf16,
    the factors, roots and the step's buffers fp32; each new moment rounded once (to
    nearest: within half a bf16 spacing of float64's from the stored ones)."""
    gen = torch.Generator().manual_seed(21)
    params = [0.1 * torch.randn(s, generator=gen) for s in ((7, 3), (5,), (3, 2, 3))]
    opt = fuser.optim.Shampoo(params, state_dtype=torch.bfloat16, **CFG)
    worst = _steps_from_state(opt, params, CFG, 5, gen)
    assert set(worst) == {"p", "filtered_grad", "grafting", "momentum_buffer"}
    assert all(v <= 1 for v in worst.values()), worst
    st = opt.state[params[0]]
    assert st["grafting"].dtype == st["momentum_buffer"].dtype == torch.bfloat16
    assert st["factor_matrices"][0][0].dtype == torch.float32


def test_split_masters_follow_float64_and_load_back_exactly():
    """bf16 parameters, ``master_weights="bf16+int16"``, ``state_dtype="param"`` and coupled
    (L2) decay, which torch adds to the gradient from the master: the parameter's value
    follows float64 to fp32's precision, and a state dict continues the run exactly."""
    gen = torch.Generator().manual_seed(22)
    cfg = dict(CFG, use_decoupled_weight_decay=False)
    params = [(0.1 * torch.randn(s, generator=gen)).bfloat16() for s in ((7, 3), (5,), (3, 2, 3))]

    def make(ps):
        return fuser.optim.Shampoo(ps, state_dtype="param", master_weights="bf16+int16", **cfg)

    opt = make(params)
    worst = _steps_from_state(opt, params, cfg, 5, gen)
    assert all(v <= 1 for v in worst.values()), worst
    assert opt.state[params[0]]["master_lo"].dtype == torch.int16
    twins = [p.clone() for p in params]
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
        for key in ("filtered_grad", "grafting", "momentum_buffer", "master_lo"):
            assert other.state[q][key].dtype == opt.state[p][key].dtype
            assert torch.equal(other.state[q][key], opt.state[p][key]), key
