"""The optimizer compiler end to end: user rules in both forms against float64 references
written here by hand, one launch for many tensors, tables, groups, schedulers, errors."""

import copy

import pytest
import torch
from numerics import Tracked, assert_fp32_close, sign, sqrt

import fuser

SHAPES = [(1,), (7,), (129,), (33, 5), (3, 4, 5)]

ADAMW_TEXT = """
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g**2
    p = p - lr * weight_decay * p - lr * (m / (1 - beta1**step)) / (sqrt(v / (1 - beta2**step)) + eps)
"""
ADAMW_HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def adamw_reference(p, grads, lr, beta1, beta2, eps, weight_decay, round_to=None):
    """The DESIGN.md AdamW rule in float64 with fp32's error bound (tests/numerics.py), one
    step per gradient; ``round_to`` rounds the parameter to its storage dtype after each
    step, as storing it does."""
    p = Tracked.exact(p)
    m = Tracked.exact(torch.zeros_like(p.value))
    v = Tracked.exact(torch.zeros_like(p.value))
    for step, g in enumerate(grads, 1):
        g = Tracked.exact(g)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p = p - lr * weight_decay * p - lr * (m / (1 - beta1**step)) / (sqrt(v / (1 - beta2**step)) + eps)
        if round_to is not None:
            p = p.round_to(round_to)
    return p, m, v


def momentum_reference(p, grads, lr, mu):
    """``m = mu * m + g; p = p - lr * m`` in float64 with fp32's error bound."""
    p, m = Tracked.exact(p), Tracked.exact(torch.zeros_like(p))
    for g in grads:
        m = mu * m + Tracked.exact(g)
        p = p - lr * m
    return p, m


def rel_err(a, b, scale=None):
    """||a - b|| / ||b||, or over ||scale|| when that is larger: an update that nearly
    cancels the parameter is judged against the size of what it was computed from."""
    den = b.double().norm()
    if scale is not None:
        den = torch.maximum(den, scale.double().norm())
    return ((a.double() - b.double()).norm() / den.clamp_min(1e-30)).item()


def run_steps(opt, params, grads_per_step):
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.to(p.dtype)
        opt.step()


def fresh_grads(params, steps):
    return [[torch.randn(p.shape, device=p.device) for p in params] for _ in range(steps)]


def test_text_rule_matches_float64_reference(device):
    rule = fuser.rule(ADAMW_TEXT, name="adamw", hyper=ADAMW_HYPER, state=dict(m=0.0, v=0.0))
    AdamW = fuser.compile(rule)
    params = [torch.randn(s, device=device) for s in SHAPES]
    start = [p.clone() for p in params]
    grads = fresh_grads(params, 4)
    opt = AdamW(params, lr=3e-2, weight_decay=0.1)
    run_steps(opt, params, grads)
    for i, p in enumerate(params):
        want_p, want_m, want_v = adamw_reference(
            start[i], [gs[i] for gs in grads], lr=3e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1
        )
        assert_fp32_close(p, want_p, "p")
        assert_fp32_close(opt.state[p]["m"], want_m, "m")
        assert_fp32_close(opt.state[p]["v"], want_v, "v")
        assert opt.state[p]["step"].item() == 4


def test_traced_function_rule_matches_float64_reference(device):
    @fuser.rule(hyper=dict(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1), state=dict(m=0.0))
    def lion(p, g, m, *, lr, beta1, beta2, weight_decay, step):
        u = fuser.sign(beta1 * m + (1 - beta1) * g)
        m = beta2 * m + (1 - beta2) * g
        p = p * (1 - lr * weight_decay) - lr * u
        return dict(p=p, m=m)

    Lion = fuser.compile(lion)
    params = [torch.randn(s, device=device) for s in SHAPES]
    start = [p.clone() for p in params]
    grads = fresh_grads(params, 3)
    run_steps(Lion(params), params, grads)
    for i, p in enumerate(params):
        q, m = Tracked.exact(start[i]), Tracked.exact(torch.zeros_like(start[i]))
        for gs in grads:
            g = Tracked.exact(gs[i])
            u = sign(0.9 * m + 0.1 * g)
            m = 0.99 * m + 0.01 * g
            q = q * (1 - 1e-2 * 0.1) - 1e-2 * u
        assert_fp32_close(p, q, "p")


def test_approx_tanh_in_an_optimizer_rule(device):
    # tanh.approx.f32 on a GPU (relative error within 2**-10.987), the exact tanh in the
    # interpreter, which runs no assembly (within 4 fp32 ulp: tests/codegen/test_helpers.py)
    Soft = fuser.compile(
        fuser.rule("p = p - lr * approx_tanh(g / c)", name="soft", hyper=dict(lr=0.5, c=2.0))
    )
    params = [torch.randn(s, device=device) for s in SHAPES]
    start = [p.clone() for p in params]
    grads = fresh_grads(params, 1)
    run_steps(Soft(params), params, grads)
    rel = 2**-10.987 if device.type == "cuda" else 4 * torch.finfo(torch.float32).eps
    for p, p0, (g,) in zip(params, start, zip(*grads)):
        u = torch.tanh(g.double() / 2.0)
        want = p0.double() - 0.5 * u
        bound = 0.5 * u.abs() * rel + 4 * torch.finfo(torch.float32).eps * (p0.double().abs() + 0.5 * u.abs())
        assert ((p.double() - want).abs() <= bound).all(), (p.double() - want).abs().max()


def test_generated_kernel_is_one_launch_and_readable():
    rule = fuser.rule(ADAMW_TEXT, name="adamw", hyper=ADAMW_HYPER, state=dict(m=0.0, v=0.0))
    src = fuser.compile(rule).source
    assert src.startswith("# fuser optimizer step `adamw`")
    for line in ADAMW_TEXT.strip().splitlines():
        assert "#   " + line.strip() in src
    assert src.count("@triton.jit\ndef adamw_step(") == 1


def test_500_tensors_update_in_one_launch_per_step(device):
    rule = fuser.rule(
        "m = mu * m + g\np = p - lr * m", name="momentum", hyper=dict(lr=0.1, mu=0.9), state=dict(m=0.0)
    )
    Momentum = fuser.compile(rule)
    sizes = torch.randint(1, 40, (517,)).tolist()
    params = [torch.randn(n, device=device) for n in sizes]
    start = [p.clone() for p in params]
    opt = Momentum(params)
    grads = fresh_grads(params, 2)
    before = fuser.stats()["launches"]
    run_steps(opt, params, grads[:1])
    assert fuser.stats()["launches"] == before + 1
    run_steps(opt, params, grads[1:])
    assert fuser.stats()["launches"] == before + 2
    for i, p in enumerate(params):
        want, _ = momentum_reference(start[i], [gs[i] for gs in grads], lr=0.1, mu=0.9)
        assert_fp32_close(p, want, "p")


def sgd_momentum():
    return fuser.compile(
        fuser.rule(
            "m = mu * m + g\np = p - lr * m", name="momentum", hyper=dict(lr=0.1, mu=0.5), state=dict(m=0.0)
        )
    )


def test_replacing_data_between_steps_rebuilds_tables(device):
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in SHAPES]
    opt = sgd_momentum()(params)
    run_steps(opt, params, fresh_grads(params, 1))
    builds = fuser.stats()["table_builds"]
    # New storage (and a new size for one of them): the stale addresses must not be used.
    params[2].data = torch.randn(31, device=device)
    params[0].data = torch.randn(1, device=device)
    opt.state[params[2]].clear()
    before = [p.detach().clone() for p in params]
    m_before = [opt.state[p].get("m", torch.zeros(p.shape, device=device)).clone() for p in params]
    grads = fresh_grads(params, 1)
    run_steps(opt, params, grads)
    assert fuser.stats()["table_builds"] == builds + 1
    for i, p in enumerate(params):
        m = 0.5 * Tracked.exact(m_before[i]) + Tracked.exact(grads[0][i])
        assert_fp32_close(p, Tracked.exact(before[i]) - 0.1 * m, "p")


def test_steady_state_reuses_tables_and_new_grads_only_refresh_pointers(device):
    params = [torch.randn(s, device=device) for s in SHAPES]
    start = [p.clone() for p in params]
    opt = sgd_momentum()(params)
    grads = fresh_grads(params, 4)
    run_steps(opt, params, grads[:1])
    builds = fuser.stats()["table_builds"]
    run_steps(opt, params, grads[1:])  # new gradient tensors, at new addresses, every step
    assert fuser.stats()["table_builds"] == builds
    for i, p in enumerate(params):
        want, _ = momentum_reference(start[i], [gs[i] for gs in grads], lr=0.1, mu=0.5)
        assert_fp32_close(p, want, "p")


def test_params_without_grad_are_untouched(device):
    params = [torch.randn(s, device=device) for s in SHAPES]
    frozen = params[1].clone()
    opt = sgd_momentum()(params)
    for i, p in enumerate(params):
        p.grad = None if i == 1 else torch.randn_like(p)
    opt.step()
    assert torch.equal(params[1], frozen)
    assert params[1] not in opt.state


def test_param_groups_have_their_own_hyperparameters(device):
    a = [torch.randn(s, device=device) for s in SHAPES[:2]]
    b = [torch.randn(s, device=device) for s in SHAPES[2:]]
    start = [p.clone() for p in a + b]
    opt = sgd_momentum()([{"params": a}, {"params": b, "lr": 0.01, "mu": 0.0}], lr=0.2)
    grads = fresh_grads(a + b, 2)
    run_steps(opt, a + b, grads)
    for i, p in enumerate(a + b):
        lr, mu = (0.2, 0.5) if i < 2 else (0.01, 0.0)
        want, _ = momentum_reference(start[i], [gs[i] for gs in grads], lr=lr, mu=mu)
        assert_fp32_close(p, want, f"p of group {int(i >= 2)}")


def test_scheduler_changes_lr_without_recompiling(device):
    params = [torch.randn(s, device=device) for s in SHAPES]
    start = [p.clone() for p in params]
    opt = sgd_momentum()(params, mu=0.0, lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5**k)
    grads = fresh_grads(params, 4)
    run_steps(opt, params, grads[:1])
    sched.step()
    compiles = fuser.stats()["compiles"]
    for gs in grads[1:]:
        run_steps(opt, params, [gs])
        sched.step()
    assert fuser.stats()["compiles"] == compiles
    for i, p in enumerate(params):
        want = Tracked.exact(start[i])
        for k in range(4):
            want = want - 0.5**k * Tracked.exact(grads[k][i])
        assert_fp32_close(p, want, "p")


def test_bad_gradients_raise_before_anything_changes(device):
    params = [torch.randn(s, device=device) for s in SHAPES]
    opt = sgd_momentum()(params)
    run_steps(opt, params, fresh_grads(params, 1))
    snapshot = [p.clone() for p in params]
    state = copy.deepcopy({i: dict(opt.state[p]) for i, p in enumerate(params)})
    for p in params:
        p.grad = torch.randn_like(p)
    params[3].grad = params[3].grad.to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    params[3].grad = torch.randn(5, 33, device=device).t()  # right shape, other layout
    with pytest.raises(ValueError, match="strides"):
        opt.step()
    for i, p in enumerate(params):
        assert torch.equal(p, snapshot[i])
        assert torch.equal(opt.state[p]["m"], state[i]["m"])
        assert torch.equal(opt.state[p]["step"], state[i]["step"])


def test_complex_parameters_are_refused(device):
    z = torch.randn(7, dtype=torch.complex64, device=device)
    z.grad = torch.randn_like(z)
    before = z.clone()
    opt = sgd_momentum()([z])
    with pytest.raises(RuntimeError, match="complex"):
        opt.step()
    assert torch.equal(z, before) and z not in opt.state


def test_dense_non_contiguous_parameters_work_and_strided_views_raise(device):
    base = torch.randn(5, 33, device=device)
    p = base.t()  # dense, not contiguous
    start = p.clone()
    opt = sgd_momentum()([p], mu=0.0)
    g = torch.randn(5, 33, device=device).t()  # same layout as the parameter
    p.grad = g
    opt.step()
    assert_fp32_close(p, Tracked.exact(start) - 0.1 * Tracked.exact(g), "p")

    holes = torch.randn(40, device=device)[::2]  # a view with gaps: not dense
    opt = sgd_momentum()([holes])
    holes.grad = torch.randn(20, device=device)
    before = holes.clone()
    with pytest.raises(ValueError, match="dense"):
        opt.step()
    assert torch.equal(holes, before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_fp32_math(device, dtype):
    rule = fuser.rule(ADAMW_TEXT, name="adamw", hyper=ADAMW_HYPER, state=dict(m=0.0, v=0.0))
    params = [torch.randn(s, device=device).to(dtype) for s in SHAPES]
    start = [p.clone() for p in params]
    grads = fresh_grads(params, 3)
    opt = fuser.compile(rule)(params, lr=1e-2)
    run_steps(opt, params, grads)
    for i, p in enumerate(params):
        assert p.dtype == dtype
        assert opt.state[p]["m"].dtype == torch.float32
        want, want_m, _ = adamw_reference(
            start[i],
            [gs[i].to(dtype) for gs in grads],
            lr=1e-2,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.01,
            round_to=dtype,
        )
        # The stored parameter is within its rounding of the float64 value (Tracked.round_to).
        assert_fp32_close(p, want, "p")
        assert_fp32_close(opt.state[p]["m"], want_m, "m")


def test_mixed_dtypes_launch_once_per_dtype_plan(device):
    params = [
        torch.randn(7, device=device),
        torch.randn(9, device=device).bfloat16(),
        torch.randn(33, 5, device=device).half(),
        torch.randn(3, device=device),
    ]
    start = [p.clone() for p in params]
    opt = sgd_momentum()(params, mu=0.0)
    grads = fresh_grads(params, 1)
    before = fuser.stats()["launches"]
    run_steps(opt, params, grads)
    assert fuser.stats()["launches"] == before + 3
    for i, p in enumerate(params):
        want = Tracked.exact(start[i]) - 0.1 * Tracked.exact(grads[0][i].to(p.dtype))
        assert_fp32_close(p, want.round_to(p.dtype), f"{p.dtype} p")


def test_state_dtype_option_and_state_initialised_from_p(device):
    rule = fuser.rule(
        "ema = decay * ema + (1 - decay) * p\np = p - lr * g",
        name="ema_sgd",
        hyper=dict(lr=0.1, decay=0.9),
        state=dict(ema="p"),
    )
    params = [torch.randn(s, device=device) for s in SHAPES]
    start = [p.double() for p in params]
    opt = fuser.compile(rule, state_dtype=torch.bfloat16)(params)
    grads = fresh_grads(params, 1)
    run_steps(opt, params, grads)
    for i, p in enumerate(params):
        ema = opt.state[p]["ema"]
        assert ema.dtype == torch.bfloat16
        # ema starts as a copy of p (rounded to bf16) and moves towards p's old value: itself.
        assert rel_err(ema, start[i]) < 1e-2
        assert_fp32_close(p, Tracked.exact(start[i]) - 0.1 * Tracked.exact(grads[0][i]), "p")


def test_state_dict_round_trip_continues_identically(device):
    rule = fuser.rule(ADAMW_TEXT, name="adamw", hyper=ADAMW_HYPER, state=dict(m=0.0, v=0.0))
    AdamW = fuser.compile(rule)
    a = [torch.randn(s, device=device) for s in SHAPES]
    opt_a = AdamW(a, lr=1e-2)
    run_steps(opt_a, a, fresh_grads(a, 2))
    b = [p.clone() for p in a]
    opt_b = AdamW(b, lr=0.5)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    assert opt_b.param_groups[0]["lr"] == 1e-2
    grads = fresh_grads(a, 2)
    run_steps(opt_a, a, grads)
    run_steps(opt_b, b, grads)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
        assert torch.equal(opt_a.state[x]["v"], opt_b.state[y]["v"])
        assert opt_b.state[y]["step"].item() == 4


def test_step_closure_and_zero_grad(device):
    w = torch.randn(7, device=device, requires_grad=True)
    opt = sgd_momentum()([w])

    def closure():
        opt.zero_grad()
        loss = (w**2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.item() > 0
    opt.zero_grad()
    assert w.grad is None


def test_unknown_hyperparameter_is_a_clear_error():
    with pytest.raises(TypeError, match="unknown hyperparameters"):
        sgd_momentum()([torch.randn(3)], momentum=0.9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stores_round_to_nearest_even_like_torch(device, dtype):
    copy_rule = fuser.rule("p = g", name="copy_grad", hyper={})
    g = torch.randn(4099, device=device) * 3
    # Values exactly halfway between two representable numbers, both parities.
    low = torch.randn(64, device=device).to(dtype).float()
    ulp = torch.nextafter(low.to(dtype), torch.full_like(low, float("inf")).to(dtype)).float() - low
    g[:64] = low + ulp / 2
    g[64:66] = torch.tensor([float("inf"), float("nan")], device=device)
    p = torch.empty(4099, device=device, dtype=dtype).fill_(7.0)
    p.grad_dtype = None  # an fp32 gradient on a low-precision parameter
    p.grad = g
    fuser.compile(copy_rule)([p]).step()
    want = g.to(dtype)
    assert torch.equal(p[:64], want[:64])
    assert torch.equal(p[66:], want[66:])
    assert p[64].item() == float("inf") and torch.isnan(p[65])
