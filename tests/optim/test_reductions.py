"""Per-tensor and global reductions in optimizer rules: LAMB, LARS, in-step clipping,
against float64 references and third-party implementations, with launch counts."""

import pytest
import torch
import torch_references
from numerics import Tracked, amax, assert_fp32_close, cat, maximum, mean, minimum, norm, sqrt, total

import fuser

SHAPES = [(1,), (7,), (129,), (33, 5), (3, 4, 5)]


def set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()


def fresh(params, steps):
    return [[torch.randn(p.shape, device=p.device) for p in params] for _ in range(steps)]


def lamb_reference(p, grads, lr, beta1, beta2, eps, wd):
    """LAMB (You et al. 2020, Alg. 2) in float64, with fp32's error bound (tests/numerics.py)."""
    p = Tracked.exact(p)
    m, v = Tracked.exact(torch.zeros(p.value.shape)), Tracked.exact(torch.zeros(p.value.shape))
    for t, g in enumerate(grads, 1):
        g = Tracked.exact(g)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        u = (m / (1 - beta1**t)) / (sqrt(v / (1 - beta2**t)) + eps) + wd * p
        pn, un = norm(p), norm(u)
        trust = (pn / un) if pn.value > 0 and un.value > 0 else 1.0
        p = p - lr * trust * u
    return p, dict(exp_avg=m, exp_avg_sq=v)


def test_lamb_matches_the_paper_in_float64_with_two_launches_per_step(device):
    params = [torch.randn(s, device=device) for s in SHAPES]
    start = [p.clone() for p in params]
    opt = fuser.optim.LAMB(params, lr=0.05, weight_decay=0.1)
    grads = fresh(params, 3)
    before = fuser.stats()["launches"]
    for gs in grads:
        set_grads(params, gs)
        opt.step()
    assert fuser.stats()["launches"] - before == 2 * 3
    for i, p in enumerate(params):
        want, state = lamb_reference(start[i], [gs[i] for gs in grads], 0.05, 0.9, 0.999, 1e-6, 0.1)
        assert_fp32_close(p, want, "p")
        for k, v in state.items():
            assert_fp32_close(opt.state[p][k], v, k)


def test_zero_norm_tensors_take_a_unit_trust_ratio(device):
    params = [torch.zeros(7, device=device), torch.randn(5, device=device)]
    opt = fuser.optim.LAMB(params, lr=0.1)
    grads = [torch.randn(7, device=device), torch.randn(5, device=device)]
    start = [p.clone() for p in params]
    set_grads(params, grads)
    opt.step()
    for i, p in enumerate(params):
        want, _ = lamb_reference(start[i], [grads[i]], 0.1, 0.9, 0.999, 1e-6, 0.0)
        assert torch.isfinite(p).all()
        assert_fp32_close(p, want, "p")


def test_user_lamb_matches_pytorch_optimizer(device):
    po = pytest.importorskip("pytorch_optimizer")
    # pytorch-optimizer's Lamb: decoupled decay first, Adam direction without the second
    # moment's bias correction, trust ratio min(||p||, 10) / (||u|| + eps).
    lamb = fuser.rule(
        """
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g**2
        p = p * (1 - lr * weight_decay)
        u = m / (sqrt(v) + eps)
        wn = minimum(norm(p), 10)
        un = norm(u)
        trust = where(wn > 0, where(un > 0, wn / (un + eps), 1), 1)
        p = p - lr / (1 - beta1**step) * trust * u
    """,
        name="po_lamb",
        hyper=dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.0),
        state=dict(m=0.0, v=0.0),
    )
    a = [torch.randn(s, device=device) for s in SHAPES]
    b = [p.clone().requires_grad_() for p in a]
    start = [p.clone() for p in a]
    oa = fuser.compile(lamb)(a, lr=0.02, weight_decay=0.05)
    ob = po.Lamb(b, lr=0.02, weight_decay=0.05, foreach=False)
    grads = fresh(a, 4)
    for gs in grads:
        set_grads(a, gs)
        set_grads(b, gs)
        oa.step()
        ob.step()
    for i, (x, y) in enumerate(zip(a, b)):
        # The comment's formula in float64 with fp32's bound; pytorch-optimizer held to it too.
        q = Tracked.exact(start[i])
        m, v = Tracked.exact(torch.zeros(q.value.shape)), Tracked.exact(torch.zeros(q.value.shape))
        for t, gs in enumerate(grads, 1):
            g = Tracked.exact(gs[i])
            m = 0.9 * m + (1 - 0.9) * g
            v = 0.999 * v + (1 - 0.999) * g * g
            q = q * (1 - 0.02 * 0.05)
            u = m / (sqrt(v) + 1e-6)
            wn, un = minimum(norm(q), 10.0), norm(u)
            trust = wn / (un + 1e-6) if wn.value > 0 and un.value > 0 else 1.0
            q = q - 0.02 / (1 - 0.9**t) * trust * u
        assert_fp32_close(x, q, "fuser p")
        assert_fp32_close(y, q, "pytorch-optimizer p")


def test_lars_matches_the_paper_and_pytorch_optimizer(device):
    po = pytest.importorskip("pytorch_optimizer")
    # pytorch-optimizer adapts only tensors with 2+ dimensions: compare on matrices.
    shapes = [(33, 5), (3, 4, 5), (7, 2)]
    a = [torch.randn(s, device=device) for s in shapes]
    b = [p.clone().requires_grad_() for p in a]
    start = [p.clone() for p in a]
    oa = fuser.optim.LARS(a, lr=0.1, momentum=0.9, weight_decay=0.01, trust_coefficient=0.02)
    ob = po.LARS(b, lr=0.1, momentum=0.9, weight_decay=0.01, trust_coefficient=0.02, foreach=False)
    grads = fresh(a, 3)
    for gs in grads:
        set_grads(a, gs)
        set_grads(b, gs)
        oa.step()
        ob.step()
    for i, (x, y) in enumerate(zip(a, b)):
        # The paper's form, in float64 with fp32's bound: v = m v + trust (g + wd p); p -= lr v.
        p, v = Tracked.exact(start[i]), Tracked.exact(torch.zeros(start[i].shape))
        for gs in grads:
            g = Tracked.exact(gs[i])
            pn, gn = norm(p), norm(g)
            trust = 0.02 * pn / (gn + 0.01 * pn)
            v = 0.9 * v + trust * (g + 0.01 * p)
            p = p - 0.1 * v
        assert_fp32_close(x, p, "fuser p")
        assert_fp32_close(y, p, "pytorch-optimizer p")


def test_global_norm_clipping_inside_the_step_matches_clip_grad_norm(device):
    clipped_adamw = fuser.rule(
        """
        c = g * minimum(1, max_norm / (global_norm(g) + 1e-6))
        m = beta1 * m + (1 - beta1) * c
        v = beta2 * v + (1 - beta2) * c**2
        p = p * (1 - lr * weight_decay) - lr * (m / (1 - beta1**step)) / (sqrt(v / (1 - beta2**step)) + eps)
    """,
        name="clipped_adamw",
        hyper=dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, max_norm=1.0),
        state=dict(m=0.0, v=0.0),
    )
    # 259 tensors, a program each: the global norm reads their partial sums RBLOCK (128) at a
    # time, two whole chunks and a remainder, and spans them all.
    sizes = torch.randint(1, 30, (259,)).tolist()
    a = [torch.randn(n, device=device) for n in sizes]
    b = [p.clone().requires_grad_() for p in a]
    opt_a = fuser.compile(clipped_adamw)(a, lr=1e-2, max_norm=0.5)
    opt_b = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.01)
    before = fuser.stats()["launches"]
    steps = 2  # (the second step's sums start afresh; its moments and step count carry)
    start = [p.clone() for p in a]
    grads = fresh(a, steps)
    clipped = []
    for gs in grads:
        set_grads(a, gs)
        set_grads(b, gs)
        total = torch.nn.utils.clip_grad_norm_(b, max_norm=0.5)
        assert total > 0.5  # clipping is active
        opt_a.step()
        opt_b.step()
        every = norm(Tracked.exact(torch.cat([g.reshape(-1).cpu() for g in gs])))
        coef = minimum(1.0, 0.5 / (every + 1e-6))
        clipped.append([Tracked.exact(g) * coef for g in gs])
    assert fuser.stats()["launches"] - before == 2 * steps
    # In float64 with fp32's bound: the clipped gradients into torch's AdamW; torch's own
    # clip_grad_norm_ + AdamW held to it too.
    for i, (x, y) in enumerate(zip(a, b)):
        want, _ = torch_references.adamw(start[i], [c[i] for c in clipped], lr=1e-2, weight_decay=0.01)
        assert_fp32_close(x, want, "fuser p")
        assert_fp32_close(y, want, "torch p")


def test_global_norm_spans_every_launch_group(device):
    rule = fuser.rule("p = p - lr * g / global_norm(g)", name="normalized_sgd", hyper=dict(lr=0.1))
    a = [
        torch.randn(33, device=device),
        torch.randn(7, device=device).bfloat16(),
        torch.randn(5, device=device),
    ]
    start = [p.clone() for p in a]
    grads = [torch.randn(p.shape, device=device).to(p.dtype) for p in a]
    set_grads(a, grads)
    fuser.compile(rule)(a).step()
    every = Tracked.exact(torch.cat([g.reshape(-1).cpu() for g in grads]))
    global_norm = norm(every)
    for x, g, s in zip(a, grads, start):
        want = Tracked.exact(s) - 0.1 * Tracked.exact(g) / global_norm
        assert_fp32_close(x, want.round_to(x.dtype), f"{x.dtype} p")


CENTERED = fuser.rule(
    """
    centered = g - mean(g)
    scale = amax(abs(g)) * numel / sum(abs(g))
    p = p - lr * centered * scale
""",
    name="centered",
    hyper=dict(lr=0.1),
)


def check_centered_step(params, grads):
    """One step of CENTERED (lr 0.1) on ``params`` against float64."""
    start = [p.clone() for p in params]
    set_grads(params, grads)
    fuser.compile(CENTERED)(params).step()
    for p, g, s in zip(params, grads, start):
        g = Tracked.exact(g)
        want = Tracked.exact(s) - 0.1 * (g - mean(g)) * (amax(abs(g)) * g.value.numel() / total(abs(g)))
        assert_fp32_close(p, want, f"p of shape {tuple(s.shape)}")


def test_sum_mean_amax_and_numel(device):
    params = [torch.randn(s, device=device) for s in SHAPES]
    check_centered_step(params, [torch.randn(s, device=device) for s in SHAPES])


def test_reductions_of_updated_state_and_nested_reductions(device):
    # norm(u) reads the moment updated in the same step. Reductions nest three deep
    # (mean(m), then mean(u) and norm(u), then sum(abs(u - mean(u)))): three reduction
    # launches and the update.
    rule = fuser.rule(
        """
        m = beta * m + g
        u = m - mean(m)
        p = p - lr * u / norm(u) * sum(abs(u - mean(u)))
    """,
        name="nested",
        hyper=dict(lr=0.01, beta=0.5),
        state=dict(m=0.0),
    )
    params = [torch.randn(s, device=device) for s in SHAPES[1:]]
    start = [p.clone() for p in params]
    opt = fuser.compile(rule)(params)
    grads = fresh(params, 2)
    before = fuser.stats()["launches"]
    for gs in grads:
        set_grads(params, gs)
        opt.step()
    assert fuser.stats()["launches"] - before == 4 * 2
    for i, p in enumerate(params):
        q, m = Tracked.exact(start[i]), Tracked.exact(torch.zeros(start[i].shape))
        for gs in grads:
            m = 0.5 * m + Tracked.exact(gs[i])
            u = m - mean(m)
            q = q - 0.01 * u / norm(u) * total(abs(u - mean(u)))
        assert_fp32_close(p, q, "p")


def test_reductions_are_deterministic(device):
    rule = fuser.rule("p = p - lr * g / norm(g) * global_norm(p)", name="det", hyper=dict(lr=0.1))
    base = [torch.randn(5000, device=device), torch.randn(3, device=device)]
    grads = [torch.randn_like(p) for p in base]
    results = []
    for _ in range(2):
        params = [p.clone() for p in base]
        set_grads(params, grads)
        fuser.compile(rule)(params).step()
        results.append(params)
    for x, y in zip(*results):
        assert torch.equal(x, y)


def test_adan_clips_by_the_global_gradient_norm(device):
    from test_builtins import adan_reference

    params = [torch.randn(s, device=device) for s in SHAPES]
    start = [p.clone() for p in params]
    opt = fuser.optim.Adan(params, lr=1e-2, weight_decay=0.1, max_grad_norm=0.5)
    grads = fresh(params, 3)
    clipped = []
    for gs in grads:
        every = norm(Tracked.exact(torch.cat([g.reshape(-1).cpu() for g in gs])))
        assert every.value > 0.5  # clipping is active
        coef = minimum(1.0, 0.5 / (every + 1e-8))
        clipped.append([Tracked.exact(g) * coef for g in gs])
        set_grads(params, gs)
        opt.step()
    for i, p in enumerate(params):
        want, _ = adan_reference(
            start[i], [c[i] for c in clipped], lr=1e-2, betas=(0.98, 0.92, 0.99), eps=1e-8, weight_decay=0.1
        )
        assert_fp32_close(p, want, "p")


def test_a_scalar_state_carries_a_global_norm_from_step_to_step(device):
    rule = fuser.rule(
        """
        gamma = gamma * 0.5 + global_norm(g)
        p = p - lr * g * gamma
        """,
        name="global_gamma",
        hyper=dict(lr=0.1),
        state=dict(gamma=0.0),
    )
    params = [torch.randn(s, device=device) for s in SHAPES]
    ref = [Tracked.exact(p) for p in params]
    opt = fuser.compile(rule)(params)
    gamma = Tracked.exact(0.0)
    for gs in fresh(params, 3):
        set_grads(params, gs)
        opt.step()
        g = [Tracked.exact(x) for x in gs]
        gamma = gamma * 0.5 + norm(cat(g))
        ref = [r - 0.1 * x * gamma for r, x in zip(ref, g)]
    for p, want in zip(params, ref):
        assert_fp32_close(opt.state[p]["gamma"], gamma, "gamma")
        assert_fp32_close(p, want, "p")


def test_global_sums_and_dot_products_carry_a_shared_scalar(device):
    # Prodigy's pattern: a number shared by every tensor, grown from a dot product over all
    # of them (here of g and the distance from the starting point). Gradients share a
    # direction from step to step, so d grows (to ~15x) and every step takes the dot product.
    rule = fuser.rule(
        """
        d = maximum(d, global_sum(g * (p0 - p)) / (global_sum(1) * lr))
        p = p - lr * d * g / (1 + abs(global_sum(g)) / global_sum(1))
        """,
        name="shared_d",
        hyper=dict(lr=0.1),
        state=dict(d=1.0, p0="p"),
    )
    params = [torch.randn(s, device=device) for s in SHAPES]
    direction = [2 * torch.randn(s, device=device) for s in SHAPES]
    start = [Tracked.exact(p) for p in params]
    ref = list(start)
    opt = fuser.compile(rule)(params)
    d = Tracked.exact(1.0)
    count = Tracked.exact(sum(p.numel() for p in params))
    for _ in range(3):
        gs = [x + torch.randn_like(x) for x in direction]
        set_grads(params, gs)
        opt.step()
        g = [Tracked.exact(x) for x in gs]
        dot = total(cat([x * (s - r) for x, s, r in zip(g, start, ref)]))
        d = maximum(d, dot / (count * 0.1))
        shrink = 1 + abs(total(cat(g))) / count
        ref = [r - 0.1 * d * x / shrink for r, x in zip(ref, g)]
    assert d.value > 4  # the dot product set d, not its start
    for p, want in zip(params, ref):
        assert_fp32_close(opt.state[p]["d"], d, "d")
        assert_fp32_close(p, want, "p")
