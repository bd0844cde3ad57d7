"""Built-in optimizers against torch.optim (same keywords, same trajectory, same state) and,
where torch has no counterpart, against float64 references written here from the papers.

Every optimizer updates all SHAPES in one launch per step, with fresh random gradients
each step. fp32 results are compared with float64 references (torch's documented
algorithms in tests/optim/torch_references.py, the papers' below) within the error bound
fp32 arithmetic can guarantee for each formula (tests/numerics.py); torch's own fp32
results are held to the same bound, which checks the references.
"""

import copy
import math

import pytest
import torch
from numerics import Tracked, assert_fp32_close, sign, sqrt
from torch_references import REFERENCES

import fuser
import fuser.optim as fo

SHAPES = [(1,), (7,), (129,), (33, 5), (3, 4, 5)]


def make_params(device, dtype=torch.float32):
    """Fresh random parameters (from the test's seed, see tests/conftest.py)."""
    return [torch.randn(s).to(device=device, dtype=dtype) for s in SHAPES]


def make_grads(params, steps):
    """Fresh, nonzero random gradients for each step."""
    return [
        [(torch.randn(p.shape) + 0.1).to(device=p.device, dtype=p.dtype) for p in params]
        for _ in range(steps)
    ]


def clones(params, dtype=None):
    return [p.detach().clone().to(dtype or p.dtype) for p in params]


def run(opt, params, grads_per_step):
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.clone().to(p.dtype)
        opt.step()


def assert_like_reference(tcls, kw, params, grads, fopt, fparams, topt, tparams, keys, lr=None):
    """fuser and torch each against torch's documented algorithm in float64
    (tests/optim/torch_references.py), within fp32's error bound; ``kw`` may be a list of
    keywords per parameter (param groups), ``lr`` a list per step (a scheduler)."""
    reference = REFERENCES[tcls]
    for i, (fp, tp) in enumerate(zip(fparams, tparams)):
        args = dict(kw[i] if isinstance(kw, list) else kw)
        if lr is not None:
            args["lr"] = lr
        want_p, want_state = reference(params[i], [gs[i] for gs in grads], **args)
        for who, p, state in (("fuser", fp, fopt.state[fp]), ("torch", tp, topt.state[tp])):
            assert_fp32_close(p, want_p, f"{who} parameter")
            for k in keys:
                assert_fp32_close(state[k], want_state[k], f"{who} state {k!r}")


# (fuser class, torch class, constructor keywords, state keys compared, steps)
TORCH_CASES = {
    "sgd": (fo.SGD, torch.optim.SGD, dict(lr=0.1), [], 5),
    "sgd-wd-maximize": (fo.SGD, torch.optim.SGD, dict(lr=0.05, weight_decay=0.1, maximize=True), [], 5),
    "sgd-momentum": (
        fo.SGD,
        torch.optim.SGD,
        dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01),
        ["momentum_buffer"],
        5,
    ),
    "sgd-nesterov": (
        fo.SGD,
        torch.optim.SGD,
        dict(lr=0.05, momentum=0.8, nesterov=True, maximize=True),
        ["momentum_buffer"],
        5,
    ),
    "adam": (fo.Adam, torch.optim.Adam, dict(lr=1e-2), ["exp_avg", "exp_avg_sq"], 5),
    "adam-tensor-lr": (fo.Adam, torch.optim.Adam, dict(lr=torch.tensor(3e-2)), ["exp_avg", "exp_avg_sq"], 5),
    "adam-l2-amsgrad": (
        fo.Adam,
        torch.optim.Adam,
        dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1, amsgrad=True),
        ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
        6,
    ),
    "adam-decoupled-maximize": (
        fo.Adam,
        torch.optim.Adam,
        dict(lr=1e-2, weight_decay=0.1, maximize=True, decoupled_weight_decay=True),
        ["exp_avg", "exp_avg_sq"],
        5,
    ),
    "adamw": (fo.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), ["exp_avg", "exp_avg_sq"], 5),
    "adamw-amsgrad-maximize": (
        fo.AdamW,
        torch.optim.AdamW,
        dict(lr=1e-2, betas=(0.7, 0.8), amsgrad=True, maximize=True),
        ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
        6,
    ),
    "adagrad": (fo.Adagrad, torch.optim.Adagrad, dict(lr=0.1), ["sum"], 5),
    "adagrad-decay-init-wd-maximize": (
        fo.Adagrad,
        torch.optim.Adagrad,
        dict(lr=0.1, lr_decay=0.05, initial_accumulator_value=0.5, weight_decay=0.1, eps=1e-6, maximize=True),
        ["sum"],
        5,
    ),
    "rmsprop": (fo.RMSprop, torch.optim.RMSprop, dict(lr=1e-2), ["square_avg"], 5),
    "rmsprop-centered-wd": (
        fo.RMSprop,
        torch.optim.RMSprop,
        dict(lr=1e-2, centered=True, weight_decay=0.1, alpha=0.9),
        ["square_avg", "grad_avg"],
        5,
    ),
    "rmsprop-momentum-maximize": (
        fo.RMSprop,
        torch.optim.RMSprop,
        dict(lr=1e-2, momentum=0.9, maximize=True),
        ["square_avg", "momentum_buffer"],
        5,
    ),
    "rmsprop-centered-momentum": (
        fo.RMSprop,
        torch.optim.RMSprop,
        dict(lr=1e-2, momentum=0.5, centered=True, eps=1e-3),
        ["square_avg", "grad_avg", "momentum_buffer"],
        5,
    ),
    "nadam": (fo.NAdam, torch.optim.NAdam, dict(lr=1e-2), ["exp_avg", "exp_avg_sq", "mu_product"], 5),
    "nadam-l2-fast-decay": (
        fo.NAdam,
        torch.optim.NAdam,
        dict(lr=1e-2, weight_decay=0.1, momentum_decay=0.1, betas=(0.8, 0.95)),
        ["exp_avg", "exp_avg_sq", "mu_product"],
        5,
    ),
    "nadam-decoupled-maximize": (
        fo.NAdam,
        torch.optim.NAdam,
        dict(lr=1e-2, weight_decay=0.1, maximize=True, decoupled_weight_decay=True),
        ["exp_avg", "exp_avg_sq", "mu_product"],
        5,
    ),
    # beta2 = 0.9: rho_t crosses 5 at step 6, so both of torch's branches run.
    "radam-rectified": (
        fo.RAdam,
        torch.optim.RAdam,
        dict(lr=1e-2, betas=(0.9, 0.9)),
        ["exp_avg", "exp_avg_sq"],
        8,
    ),
    "radam-l2-maximize": (
        fo.RAdam,
        torch.optim.RAdam,
        dict(lr=1e-2, weight_decay=0.1, maximize=True),
        ["exp_avg", "exp_avg_sq"],
        5,
    ),
    "radam-decoupled": (
        fo.RAdam,
        torch.optim.RAdam,
        dict(lr=1e-2, betas=(0.5, 0.9), weight_decay=0.1, decoupled_weight_decay=True),
        ["exp_avg", "exp_avg_sq"],
        7,
    ),
}


@pytest.mark.parametrize("case", list(TORCH_CASES))
def test_matches_torch(case, device):
    fcls, tcls, kw, keys, steps = TORCH_CASES[case]
    params = make_params(device)
    fparams, tparams = clones(params), clones(params)
    fopt, topt = fcls(fparams, **kw), tcls(tparams, **kw)
    grads = make_grads(params, steps)
    launches = fuser.stats()["launches"]
    run(fopt, fparams, grads)
    run(topt, tparams, grads)
    assert fuser.stats()["launches"] == launches + steps  # one launch per step for all shapes
    # torch passing too checks the reference.
    assert_like_reference(tcls, kw, params, grads, fopt, fparams, topt, tparams, keys)
    for fp in fparams:
        assert fopt.state[fp]["step"].item() == steps
    for fp, p in zip(fparams, params):
        assert not torch.equal(fp, p)


def test_radam_rectification_switches_on_at_torch_step():
    # The branch condition of the test above: off for steps 1..5, on from step 6.
    beta2 = 0.9
    rho_inf = 2 / (1 - beta2) - 1
    rho = [rho_inf - 2 * t * beta2**t / (1 - beta2**t) for t in range(1, 9)]
    assert [r > 5 for r in rho] == [False] * 5 + [True] * 3


# --- float64 references from the papers, with fp32's error bound (tests/numerics.py) ----------


def tracked(g):
    return g if isinstance(g, Tracked) else Tracked.exact(g)


def zeros(p):
    return Tracked.exact(torch.zeros(p.value.shape, dtype=torch.float64))


def lion_reference(p, grads, lr, betas, weight_decay):
    """Chen et al. 2023, Program 1: update = sign(interp(m, g, beta1)); m = interp(m, g, beta2);
    theta -= lr * (update + wd * theta)."""
    beta1, beta2 = betas
    p = Tracked.exact(p)
    m = zeros(p)
    for g in grads:
        g = tracked(g)
        update = sign(beta1 * m + (1 - beta1) * g)
        m = beta2 * m + (1 - beta2) * g
        p = p - lr * (update + weight_decay * p)
    return p, dict(exp_avg=m)


def ademamix_reference(p, grads, lr, betas, alpha, eps, weight_decay, t_alpha=None, t_beta3=None):
    """Pagliardini et al. 2024, Algorithm 1, with the schedulers of its section 3:
    alpha(t) = min(t alpha / T, alpha);
    beta3(t) = min(exp(ln b1 ln b3 / ((1 - t/T) ln b3 + t/T ln b1)), b3)."""
    b1, b2, b3 = betas
    p = Tracked.exact(p)
    m1, m2, nu = (zeros(p) for _ in range(3))
    for t, g in enumerate(grads, 1):
        g = tracked(g)
        a = alpha if t_alpha is None else min(t * alpha / t_alpha, alpha)
        if t_beta3 is None:
            b3t = b3
        else:
            s = t / t_beta3
            b3t = min(math.exp(math.log(b1) * math.log(b3) / ((1 - s) * math.log(b3) + s * math.log(b1))), b3)
        m1 = b1 * m1 + (1 - b1) * g
        m2 = b3t * m2 + (1 - b3t) * g
        nu = b2 * nu + (1 - b2) * g * g
        m1_hat = m1 / (1 - b1**t)
        nu_hat = nu / (1 - b2**t)
        p = p - lr * ((m1_hat + a * m2) / (sqrt(nu_hat) + eps) + weight_decay * p)
    return p, dict(exp_avg_fast=m1, exp_avg_slow=m2, exp_avg_sq=nu)


def adan_reference(p, grads, lr, betas, eps, weight_decay, no_prox=False):
    """Xie et al. 2022, Algorithm 1, written with beta_i = 1 - (the paper's beta_i) and with
    zero-initialised, bias-corrected moments as in the authors' implementation:
    m = b1 m + (1-b1) g;  v = b2 v + (1-b2)(g - g_prev);  n = b3 n + (1-b3)(g + b2 (g - g_prev))^2;
    eta = lr / (sqrt(n_hat) + eps);  theta = (theta - eta (m_hat + b2 v_hat)) / (1 + lr wd)."""
    b1, b2, b3 = betas
    p = Tracked.exact(p)
    m, v, n = (zeros(p) for _ in range(3))
    g_prev = None
    for k, g in enumerate(grads, 1):
        g = tracked(g)
        diff = zeros(p) if g_prev is None else g - g_prev
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * diff
        n = b3 * n + (1 - b3) * (g + b2 * diff) ** 2
        eta = lr / (sqrt(n / (1 - b3**k)) + eps)
        step = eta * (m / (1 - b1**k) + b2 * v / (1 - b2**k))
        if no_prox:
            p = p * (1 - lr * weight_decay) - step
        else:
            p = (p - step) / (1 + lr * weight_decay)
        g_prev = g
    return p, dict(exp_avg=m, exp_avg_diff=v, exp_avg_sq=n, pre_grad=g_prev)


# (fuser class, constructor keywords, reference, reference keywords, steps)
PAPER_CASES = {
    "lion": (fo.Lion, dict(lr=1e-3), lion_reference, dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0), 5),
    "lion-wd": (
        fo.Lion,
        dict(lr=3e-3, betas=(0.95, 0.98), weight_decay=0.5),
        lion_reference,
        dict(lr=3e-3, betas=(0.95, 0.98), weight_decay=0.5),
        5,
    ),
    "ademamix": (
        fo.AdEMAMix,
        dict(lr=1e-2),
        ademamix_reference,
        dict(lr=1e-2, betas=(0.9, 0.999, 0.9999), alpha=2.0, eps=1e-8, weight_decay=0.0),
        5,
    ),
    "ademamix-warmup-wd": (
        fo.AdEMAMix,
        dict(lr=1e-2, betas=(0.8, 0.99, 0.999), alpha=5.0, alpha_warmup=4, beta3_warmup=3, weight_decay=0.1),
        ademamix_reference,
        dict(lr=1e-2, betas=(0.8, 0.99, 0.999), alpha=5.0, eps=1e-8, weight_decay=0.1, t_alpha=4, t_beta3=3),
        6,
    ),
    "adan": (
        fo.Adan,
        dict(lr=1e-2, weight_decay=0.1),
        adan_reference,
        dict(lr=1e-2, betas=(0.98, 0.92, 0.99), eps=1e-8, weight_decay=0.1),
        5,
    ),
    "adan-no-prox": (
        fo.Adan,
        dict(lr=1e-2, betas=(0.9, 0.8, 0.95), weight_decay=0.1, no_prox=True),
        adan_reference,
        dict(lr=1e-2, betas=(0.9, 0.8, 0.95), eps=1e-8, weight_decay=0.1, no_prox=True),
        5,
    ),
}


@pytest.mark.parametrize("case", list(PAPER_CASES))
def test_matches_paper_reference(case, device):
    fcls, kw, reference, ref_kw, steps = PAPER_CASES[case]
    params = make_params(device)
    fparams = clones(params)
    opt = fcls(fparams, **kw)
    grads = make_grads(params, steps)
    run(opt, fparams, grads)
    for i, fp in enumerate(fparams):
        want_p, want_state = reference(params[i], [gs[i] for gs in grads], **ref_kw)
        assert_fp32_close(fp, want_p, "parameter")
        for k, want in want_state.items():
            assert_fp32_close(opt.state[fp][k], want, f"state {k!r}")


def test_maximize_on_paper_optimizers_is_minimizing_the_negation(device):
    params = make_params(device)
    grads = make_grads(params, 3)
    for cls, kw in (
        (fo.Lion, dict(lr=1e-2, weight_decay=0.1)),
        (fo.AdEMAMix, dict(lr=1e-2)),
        (fo.Adan, dict(lr=1e-2, weight_decay=0.1)),
    ):
        a, b = clones(params), clones(params)
        run(cls(a, maximize=True, **kw), a, grads)
        run(cls(b, **kw), b, [[-g for g in gs] for gs in grads])
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


# --- bf16 parameters ---------------------------------------------------------------------------


def torch_fp64_rounded(tcls, kw, params, grads, dtype):
    """torch.optim in float64 from the same low-precision inputs, rounding the parameter to
    its storage dtype after each step as storing it does; states stay float64."""
    p64 = [p.detach().double().clone() for p in params]
    opt = tcls(p64, **kw)
    for gs in grads:
        for p, g in zip(p64, gs):
            p.grad = g.double()
        opt.step()
        with torch.no_grad():
            for p in p64:
                p.copy_(p.to(dtype).double())
    return p64


BF16_CASES = {
    "adamw": (fo.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "sgd-momentum": (fo.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    "nadam": (fo.NAdam, torch.optim.NAdam, dict(lr=1e-2)),
    "rmsprop-centered": (fo.RMSprop, torch.optim.RMSprop, dict(lr=1e-2, centered=True)),
}


@pytest.mark.parametrize("case", list(BF16_CASES))
def test_bf16_params_against_float64(case, device):
    # fp32 math on bf16 storage, rounded to nearest even: each stored parameter is the
    # float64 result rounded to bf16, except where fp32 rounding lands on the other side of a
    # bf16 rounding boundary (a chance of about 2**-16 per element and step), which moves it
    # by one bf16 ulp (at most 2**-7 relative). So: within one ulp, and nearly all exact.
    fcls, tcls, kw = BF16_CASES[case]
    steps = 4
    params = make_params(device, dtype=torch.bfloat16)
    fparams = clones(params)
    opt = fcls(fparams, **kw)
    grads = make_grads(params, steps)
    run(opt, fparams, grads)
    want = torch_fp64_rounded(tcls, kw, params, grads, torch.bfloat16)
    exact = total = 0
    for fp, w in zip(fparams, want):
        assert fp.dtype == torch.bfloat16
        assert opt.state[fp][next(k for k in opt.state[fp] if k != "step")].dtype == torch.float32
        torch.testing.assert_close(fp.double(), w, rtol=2**-7, atol=0)
        exact += int((fp.double() == w).sum())
        total += w.numel()
    assert exact >= 0.99 * total


def test_bf16_lion_against_float64(device):
    params = make_params(device, dtype=torch.bfloat16)
    fparams = clones(params)
    kw = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    opt = fo.Lion(fparams, **kw)
    grads = make_grads(params, 4)
    run(opt, fparams, grads)
    for i, fp in enumerate(fparams):
        q = Tracked.exact(params[i])
        m = zeros(q)
        for gs in grads:
            g = Tracked.exact(gs[i])
            update = sign(0.9 * m + 0.1 * g)  # may flip where 0.9 m + 0.1 g is within its error of 0
            m = 0.99 * m + 0.01 * g
            q = (q - 1e-2 * (update + 0.1 * q)).round_to(torch.bfloat16)
        assert_fp32_close(fp, q, "bf16 parameter")


# --- param groups, schedulers ------------------------------------------------------------------

GROUP_CASES = {
    "adam": (
        fo.Adam,
        torch.optim.Adam,
        dict(lr=1e-2),
        [dict(lr=3e-2, betas=(0.8, 0.9), weight_decay=0.1), dict(eps=1e-3, maximize=True)],
    ),
    "sgd": (
        fo.SGD,
        torch.optim.SGD,
        dict(lr=0.1, momentum=0.9),
        [dict(lr=0.01, dampening=0.5), dict(momentum=0.5, weight_decay=0.2)],
    ),
    "rmsprop": (
        fo.RMSprop,
        torch.optim.RMSprop,
        dict(lr=1e-2, centered=True),
        [dict(alpha=0.9), dict(lr=1e-3, weight_decay=0.1)],
    ),
}


@pytest.mark.parametrize("case", list(GROUP_CASES))
def test_param_groups_with_different_hyperparameters(case, device):
    fcls, tcls, kw, group_kw = GROUP_CASES[case]
    params = make_params(device)
    fparams, tparams = clones(params), clones(params)
    split = [slice(0, 2), slice(2, None)]

    def groups(ps):
        return [dict(params=ps[s], **g) for s, g in zip(split, group_kw)]

    fopt, topt = fcls(groups(fparams), **kw), tcls(groups(tparams), **kw)
    grads = make_grads(params, 4)
    launches = fuser.stats()["launches"]
    run(fopt, fparams, grads)
    run(topt, tparams, grads)
    assert fuser.stats()["launches"] == launches + 4
    per_param = [{**kw, **g} for s, g in zip(split, group_kw) for _ in params[s]]
    assert_like_reference(tcls, per_param, params, grads, fopt, fparams, topt, tparams, [])


def test_lr_scheduler_changes_lr_without_recompiling(device):
    params = make_params(device)
    fparams, tparams = clones(params), clones(params)
    fopt, topt = fo.Adam(fparams, lr=1e-2), torch.optim.Adam(tparams, lr=1e-2)
    fs = torch.optim.lr_scheduler.StepLR(fopt, step_size=2, gamma=0.3)
    ts = torch.optim.lr_scheduler.StepLR(topt, step_size=2, gamma=0.3)
    grads = make_grads(params, 6)
    run(fopt, fparams, grads[:1])
    run(topt, tparams, grads[:1])
    fs.step()
    ts.step()
    compiles = fuser.stats()["compiles"]
    for gs in grads[1:]:
        run(fopt, fparams, [gs])
        run(topt, tparams, [gs])
        fs.step()
        ts.step()
    assert fuser.stats()["compiles"] == compiles
    assert fopt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.3**3)
    lrs = [1e-2 * 0.3 ** (k // 2) for k in range(6)]
    keys = ["exp_avg", "exp_avg_sq"]
    assert_like_reference(torch.optim.Adam, {}, params, grads, fopt, fparams, topt, tparams, keys, lr=lrs)


def test_lambda_lr_on_sgd_without_recompiling(device):
    params = make_params(device)
    fparams, tparams = clones(params), clones(params)
    fopt = fo.SGD(fparams, lr=0.1, momentum=0.9, nesterov=True)
    topt = torch.optim.SGD(tparams, lr=0.1, momentum=0.9, nesterov=True)
    fs = torch.optim.lr_scheduler.LambdaLR(fopt, lambda k: 1 / (1 + k))
    ts = torch.optim.lr_scheduler.LambdaLR(topt, lambda k: 1 / (1 + k))
    grads = make_grads(params, 5)
    compiles = None
    for gs in grads:
        run(fopt, fparams, [gs])
        run(topt, tparams, [gs])
        fs.step()
        ts.step()
        compiles = fuser.stats()["compiles"] if compiles is None else compiles
    assert fuser.stats()["compiles"] == compiles
    kw = dict(momentum=0.9, nesterov=True)
    lrs = [0.1 / (1 + k) for k in range(5)]
    keys = ["momentum_buffer"]
    assert_like_reference(torch.optim.SGD, kw, params, grads, fopt, fparams, topt, tparams, keys, lr=lrs)


# --- state_dict: keys, round trip, interop -----------------------------------------------------

# (fuser class, torch class, keywords)
INTEROP_CASES = {
    "adamw": (fo.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adamw-amsgrad": (fo.AdamW, torch.optim.AdamW, dict(lr=1e-2, amsgrad=True)),
    "adam": (fo.Adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
    "sgd-momentum": (fo.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1)),
    "rmsprop-centered-momentum": (
        fo.RMSprop,
        torch.optim.RMSprop,
        dict(lr=1e-2, momentum=0.9, centered=True),
    ),
    "adagrad": (fo.Adagrad, torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1)),
    "nadam": (fo.NAdam, torch.optim.NAdam, dict(lr=1e-2)),
    "radam": (fo.RAdam, torch.optim.RAdam, dict(lr=1e-2, betas=(0.9, 0.9))),
}


@pytest.mark.parametrize("case", list(INTEROP_CASES))
def test_state_dict_has_torch_keys(case, device):
    fcls, tcls, kw = INTEROP_CASES[case]
    params = make_params(device)
    fparams, tparams = clones(params), clones(params)
    fopt, topt = fcls(fparams, **kw), tcls(tparams, **kw)
    assert set(fopt.state_dict()["state"]) == set(topt.state_dict()["state"])  # Adagrad: from the start
    grads = make_grads(params, 1)
    run(fopt, fparams, grads)
    run(topt, tparams, grads)
    fsd, tsd = fopt.state_dict(), topt.state_dict()
    assert set(fsd["state"]) == set(tsd["state"])
    extra = {"step"} if fcls is fo.SGD else set()  # torch's SGD keeps no step
    for i in tsd["state"]:
        assert set(fsd["state"][i]) == set(tsd["state"][i]) | extra
        for k, v in tsd["state"][i].items():
            assert fsd["state"][i][k].shape == v.shape and fsd["state"][i][k].dtype == v.dtype
    assert set(fsd["param_groups"][0]) == set(tsd["param_groups"][0])


@pytest.mark.parametrize("case", list(INTEROP_CASES))
def test_torch_checkpoint_continues_in_fuser_and_back(case, device):
    fcls, tcls, kw = INTEROP_CASES[case]
    params = make_params(device)
    grads = make_grads(params, 6)

    # torch for 3 steps; its checkpoint continues in fuser for 3 more, as torch itself does.
    tparams = clones(params)
    topt = tcls(tparams, **kw)
    run(topt, tparams, grads[:3])
    checkpoint = copy.deepcopy(topt.state_dict())
    fparams = clones(tparams)
    fopt = fcls(fparams, **kw)
    fopt.load_state_dict(copy.deepcopy(checkpoint))
    run(fopt, fparams, grads[3:])
    run(topt, tparams, grads[3:])
    # Three steps of torch then three of fuser: six fp32 steps of one algorithm.
    keys = [k for k in checkpoint["state"][0] if k != "step"]
    assert_like_reference(tcls, kw, params, grads, fopt, fparams, topt, tparams, keys)
    assert fopt.state[fparams[0]]["step"].item() == 6 or fcls is fo.SGD

    # and fuser's checkpoint continues in torch.
    checkpoint = copy.deepcopy(fopt.state_dict())
    tparams2 = clones(fparams)
    topt2 = tcls(tparams2, **kw)
    topt2.load_state_dict(checkpoint)
    more = make_grads(params, 2)
    run(fopt, fparams, more)
    run(topt2, tparams2, more)
    keys = [k for k in topt2.state[tparams2[0]] if k != "step"]
    assert_like_reference(tcls, kw, params, grads + more, fopt, fparams, topt2, tparams2, keys)


ROUND_TRIP = {
    "sgd": (fo.SGD, dict(lr=0.1, momentum=0.9)),
    "adam-amsgrad": (fo.Adam, dict(lr=1e-2, amsgrad=True)),
    "adamw": (fo.AdamW, dict(lr=1e-2)),
    "adagrad": (fo.Adagrad, dict(lr=0.1)),
    "rmsprop": (fo.RMSprop, dict(lr=1e-2, momentum=0.5)),
    "nadam": (fo.NAdam, dict(lr=1e-2)),
    "radam": (fo.RAdam, dict(lr=1e-2)),
    "lion": (fo.Lion, dict(lr=1e-2, weight_decay=0.1)),
    "ademamix": (fo.AdEMAMix, dict(lr=1e-2, alpha_warmup=5, beta3_warmup=5)),
    "adan": (fo.Adan, dict(lr=1e-2, weight_decay=0.1)),
}


@pytest.mark.parametrize("case", list(ROUND_TRIP))
def test_fuser_state_dict_round_trip_is_exact(case, device):
    fcls, kw = ROUND_TRIP[case]
    params = make_params(device)
    grads = make_grads(params, 4)
    a = clones(params)
    opt_a = fcls(a, **kw)
    run(opt_a, a, grads[:2])
    checkpoint = copy.deepcopy(opt_a.state_dict())
    b = clones(a)
    opt_b = fcls(b, **kw)
    opt_b.load_state_dict(checkpoint)
    run(opt_a, a, grads[2:])
    run(opt_b, b, grads[2:])
    for x, y in zip(a, b):
        assert torch.equal(x, y)
        for k, v in opt_a.state[x].items():
            assert torch.equal(opt_b.state[y][k], v), k
    # The checkpoint is a copy: continuing did not write into it.
    assert checkpoint["state"][0]["step"].item() == 2


def test_sgd_buffer_loaded_without_step_is_decayed_not_replaced(device):
    # torch's SGD state holds only momentum_buffer; the next fuser step must decay it.
    p = [torch.randn(7, device=device)]
    opt = fo.SGD(p, lr=0.1, momentum=0.9)
    buf = torch.randn(7, device=device)
    opt.load_state_dict(
        {
            "state": {0: {"momentum_buffer": buf.clone()}},
            "param_groups": copy.deepcopy(opt.state_dict()["param_groups"]),
        }
    )
    start = p[0].clone()
    g = torch.randn(7, device=device)
    run(opt, p, [[g]])
    want = 0.9 * Tracked.exact(buf) + Tracked.exact(g)
    assert_fp32_close(opt.state[p[0]]["momentum_buffer"], want, "momentum_buffer")
    assert_fp32_close(p[0], Tracked.exact(start) - 0.1 * want, "parameter")


def test_loaded_param_groups_choose_the_variant_as_in_torch(device):
    # A checkpoint saved with amsgrad=True turns amsgrad on in the loading optimizer, in torch
    # and in fuser alike.
    params = make_params(device)
    grads = make_grads(params, 4)
    source = clones(params)
    topt = torch.optim.Adam(source, lr=1e-2, amsgrad=True)
    run(topt, source, grads[:2])
    checkpoint = copy.deepcopy(topt.state_dict())
    fparams, tparams = clones(source), clones(source)
    fopt, topt2 = fo.Adam(fparams, lr=1e-2), torch.optim.Adam(tparams, lr=1e-2)
    fopt.load_state_dict(copy.deepcopy(checkpoint))
    topt2.load_state_dict(checkpoint)
    assert fopt.rule is fo.builtins.adam_amsgrad
    run(fopt, fparams, grads[2:])
    run(topt2, tparams, grads[2:])
    keys = ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
    kw = dict(lr=1e-2, amsgrad=True)
    assert_like_reference(torch.optim.Adam, kw, params, grads, fopt, fparams, topt2, tparams, keys)


def test_plain_sgd_keeps_its_step_count_across_a_load(device):
    params = make_params(device)
    opt = fo.SGD(params, lr=0.1)
    run(opt, params, make_grads(params, 2))
    again = clones(params)
    opt2 = fo.SGD(again, lr=0.1)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    run(opt2, again, make_grads(params, 1))
    assert opt2.state[again[0]]["step"].item() == 3


# --- structure and construction ----------------------------------------------------------------


def test_structural_options_must_agree_across_groups(device):
    a, b = torch.randn(3, device=device), torch.randn(5, device=device)
    with pytest.raises(ValueError, match="amsgrad"):
        fo.Adam([dict(params=[a]), dict(params=[b], amsgrad=True)])
    with pytest.raises(ValueError, match="nesterov"):
        fo.SGD([dict(params=[a]), dict(params=[b], momentum=0.9, nesterov=True)], momentum=0.9)
    with pytest.raises(ValueError, match="momentum"):
        fo.SGD([dict(params=[a]), dict(params=[b], momentum=0.9)])
    with pytest.raises(ValueError, match="centered"):
        fo.RMSprop([dict(params=[a]), dict(params=[b], centered=True)])
    opt = fo.RMSprop([a], momentum=0.9)
    with pytest.raises(ValueError, match="momentum"):
        opt.add_param_group(dict(params=[b], momentum=0.0))
    assert len(opt.param_groups) == 1
    opt.add_param_group(dict(params=[b], momentum=0.5))  # a different value, same structure


def test_variant_follows_the_groups_not_only_the_defaults(device):
    a = torch.randn(5, device=device)
    assert fo.Adam([dict(params=[a], amsgrad=True)]).rule is fo.builtins.adam_amsgrad
    assert fo.SGD([a], momentum=0.9, nesterov=True).rule is fo.builtins.sgd_nesterov
    assert fo.SGD([a]).rule is fo.builtins.sgd
    assert fo.RMSprop([a], centered=True, momentum=0.1).rule is fo.builtins.rmsprop_centered_momentum


def test_torch_argument_checks(device):
    a = torch.randn(5, device=device)
    with pytest.raises(ValueError, match="Nesterov"):
        fo.SGD([a], nesterov=True)
    with pytest.raises(ValueError, match="beta"):
        fo.NAdam([a], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="learning rate"):
        fo.RAdam([a], lr=-1.0)
    with pytest.raises(ValueError, match="differentiable"):
        fo.Adam([a], differentiable=True)
    with pytest.raises(ValueError, match="max_grad_norm"):
        fo.Adan([a], max_grad_norm=-1.0)


def test_every_builtin_rule_renders(device):
    from fuser.codegen.matrix import matrix_kernel_sources
    from fuser.optim import builtins
    from fuser.optim.factory import kernel_sources

    rules = [v for v in vars(builtins).values() if isinstance(v, fuser.Rule)]
    assert len(rules) == 41
    matrix = [s.digest for s in matrix_kernel_sources()]
    for rule in rules:
        for dtype in ("fp32", "bf16"):
            sources = kernel_sources(rule, dtype)
            assert [s.text for s in sources] == [s.text for s in kernel_sources(rule, dtype)]
            # a rule with a matrix function adds every variant of the matrix kernels
            want = matrix if "orthogonalize(" in rule.text else []
            assert [s.digest for s in sources if dict(s.meta)["kind"] == "matrix"] == want
            sources = [s for s in sources if dict(s.meta)["kind"] != "matrix"]
            if len(sources) == 1:
                assert f"def {rule.name}_step(" in sources[0].text
            else:  # rules with reductions: one kernel per phase
                for k, src in enumerate(sources):
                    assert f"def {rule.name}_phase{k}(" in src.text
