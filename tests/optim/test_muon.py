"""Matrix functions in rules (``orthogonalize``) and the Muon built-in, against the
Newton–Schulz iteration written here in float64 (Jordan et al. 2024) and torch's AdamW
for Muon's auxiliary groups."""

import pytest
import torch

import fuser
import fuser.optim

QUINTIC = (3.4445, -4.7750, 2.0315)


def view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1) if t.dim() > 1 else t.reshape(1, -1)


def newton_schulz(m: torch.Tensor, steps: int = 5, coeffs=QUINTIC, dtype=torch.float64) -> torch.Tensor:
    """The iteration of the Muon paper in ``dtype`` (bf16 rounds every product, as the
    reference implementation does; float64 is the exact iteration)."""
    a, b, c = coeffs
    x = view(m).cpu().to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return (x.T if tall else x).double()


def bf16_resolution(m: torch.Tensor) -> float:
    """How far bf16 Newton–Schulz of ``m`` can land from the float64 iteration: the largest
    error over ``m`` scaled by eight factors in [1, 2), which the exact iteration ignores (it
    normalises) and bf16's rounding does not. One draw alone can be several times below
    the next, and implementations that round at different points draw differently."""
    exact = newton_schulz(m)
    return max(rel(newton_schulz(m * (1 + k / 8), dtype=torch.bfloat16), exact) for k in range(8))


def exact_newton_schulz(monkeypatch) -> None:
    """The references' Newton–Schulz in float64 (they iterate in bf16 by default): the
    exact iteration, from which fuser's bf16 products differ by their own rounding alone.
    (Against the references' bf16 iteration the two roundings add, and one draw of theirs
    can be several times another: bf16_resolution.)"""
    import pytorch_optimizer.optimizer.muon.adamuon as adamuon
    import pytorch_optimizer.optimizer.muon.base as base
    import pytorch_optimizer.optimizer.muon.normuon as normuon
    import pytorch_optimizer.optimizer.scion as scion

    original = base.zero_power_via_newton_schulz_5

    def exact(g, *args, **kwargs):
        return original(g, *args, **{**kwargs, "dtype": torch.float64})

    for module in (base, adamuon, normuon, scion):
        monkeypatch.setattr(module, "zero_power_via_newton_schulz_5", exact)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return ((a - b).norm() / b.norm()).item()


ORTHO = fuser.rule(
    """
    p = p - lr * orthogonalize(g + 0.1 * p)
""",
    name="ortho",
    hyper=dict(lr=0.1),
)

# Wide, tall, square, three of one shape (one batched launch each), a 4-D tensor viewed
# as [shape[0], prod(rest)], odd sizes, and one whose [m, m] products fit the
# interpreter's 32 x 32 tiles while its 40 columns do not.
SHAPES = [(9, 33), (33, 9), (9, 33), (9, 33), (5, 3, 2, 2), (17, 17), (32, 40)]


def test_orthogonalize_is_as_close_to_float64_as_bf16_products_allow(device):
    params = [torch.randn(s, device=device) for s in SHAPES]
    grads = [torch.randn(s, device=device) for s in SHAPES]
    mine = [torch.nn.Parameter(p.clone()) for p in params]
    opt = fuser.compile(ORTHO)(mine, lr=0.1)
    for p, g in zip(mine, grads):
        p.grad = g.clone()
    before = fuser.stats()["launches"]
    opt.step()
    # 2 phases; per shape (5 of them): 3 products per iteration, the normalisation folded in.
    assert fuser.stats()["launches"] - before == 2 + 5 * 3 * 5
    for p, start, g in zip(mine, params, grads):
        m = g.double() + 0.1 * start.double()
        exact = newton_schulz(m)
        got = view(start.double() - p.detach().double()) / 0.1
        bf16_error = bf16_resolution(m)
        assert rel(got, exact) < max(1.5 * bf16_error, 0.01), (p.shape, rel(got, exact), bf16_error)


def test_orthogonalize_keywords_give_other_iterations(device):
    # The cubic iteration (1.5, -0.5, 0) converges: the result's rows are orthonormal.
    rule = fuser.rule(
        "p = p - lr * orthogonalize(g, steps=14, a=1.5, b=-0.5, c=0, eps=1e-7)",
        name="cubic",
        hyper=dict(lr=1.0),
    )
    p = torch.nn.Parameter(torch.zeros(6, 40, device=device))
    p.grad = torch.randn(6, 40, device=device)
    fuser.compile(rule)([p]).step()
    u = -p.detach().cpu().double()
    assert rel(u, newton_schulz(p.grad, 14, (1.5, -0.5, 0.0))) < 0.02
    assert (u @ u.T - torch.eye(6, dtype=torch.float64)).abs().max().item() < 0.05


@pytest.mark.parametrize(
    "text, message",
    [
        ("p = p - orthogonalize(lr)", r"orthogonalize\(\) takes a matrix"),
        ("p = p - orthogonalize(g, step=3)", "has no keyword 'step'"),
        ("p = p - orthogonalize(g, steps=0)", "steps= must be a whole number from 1 to 20"),
        ("p = p - orthogonalize(g, steps=2.5)", "steps= must be a whole number"),
        ("p = p - orthogonalize(g, a=lr)", "a= must be a number written in the rule"),
        ("p = p - orthogonalize(g, p)", r"takes 1 argument and keywords"),
        ("r = rowmean(g)\np = p - orthogonalize(r)", r"orthogonalize\(\) takes a matrix"),
    ],
)
def test_misuse_of_orthogonalize_names_the_line(text, message):
    with pytest.raises(fuser.RuleError, match=message) as info:
        fuser.rule(text, hyper=dict(lr=0.1))
    assert "line" in str(info.value)


def muon_reference(start, grads, lr, momentum, weight_decay):
    """SGD momentum, Nesterov mix, float64 Newton–Schulz, sqrt(max(1, rows/cols)) scale and
    decoupled decay (Jordan et al. 2024)."""
    p, buf = start.double().cpu(), torch.zeros(start.shape, dtype=torch.float64)
    for g in grads:
        g = g.double().cpu()
        buf = momentum * buf + (1 - momentum) * g
        u = newton_schulz(g + momentum * (buf - g)).reshape(start.shape)
        rows, cols = view(start).shape
        p = p * (1 - lr * weight_decay) - lr * max(1, rows / cols) ** 0.5 * u
    return p, buf


def muon_groups(params):
    return [
        dict(params=params[:4], use_muon=True, lr=0.02, weight_decay=0.01),
        dict(params=params[4:], use_muon=False, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1),
    ]


def test_muon_with_auxiliary_adamw_groups_in_one_step(device):
    shapes = [(16, 24), (24, 16), (16, 24), (4, 3, 2, 5), (24,), (7, 3)]
    params = [torch.randn(s, device=device) for s in shapes]
    grads = [[torch.randn(s, device=device) for s in shapes] for _ in range(3)]
    mine = [torch.nn.Parameter(p.clone()) for p in params]
    aux = [torch.nn.Parameter(p.clone()) for p in params[4:]]
    opt = fuser.optim.Muon(muon_groups(mine))
    torch_adamw = torch.optim.AdamW(aux, lr=1e-2, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.1)
    for gs in grads:
        for p, g in zip(mine, gs):
            p.grad = g.clone()
        for p, g in zip(aux, gs[4:]):
            p.grad = g.clone()
        before = fuser.stats()["launches"]
        opt.step()
        torch_adamw.step()
        # Muon: 2 phases and 3 shapes of NS (3 launches an iteration); AdamW: 1 launch.
        assert fuser.stats()["launches"] - before == 2 + 3 * 15 + 1
    for i, p in enumerate(mine[:4]):
        want, buf = muon_reference(params[i], [gs[i] for gs in grads], 0.02, 0.95, 0.01)
        step = want - params[i].double().cpu()
        assert rel(p.detach() - params[i], step) < 0.03, p.shape
        assert rel(opt.state[p]["momentum_buffer"], buf) < 1e-6
    for p, q in zip(mine[4:], aux):
        assert rel(p.detach(), q.detach()) < 1e-6
        assert rel(opt.state[p]["exp_avg_sq"], torch_adamw.state[q]["exp_avg_sq"]) < 1e-6
    assert sorted(opt.state_dict()["state"][0]) == ["momentum_buffer", "step"]
    assert sorted(opt.state_dict()["state"][4]) == ["exp_avg", "exp_avg_sq", "step"]


def test_muon_state_dict_round_trip_continues_the_same_run(device):
    shapes = [(12, 20), (20, 12), (9,), (5, 2)]
    params = [torch.randn(s, device=device) for s in shapes]
    grads = [[torch.randn(s, device=device) for s in shapes] for _ in range(4)]

    def groups(ps):
        return [dict(params=ps[:2]), dict(params=ps[2:], use_muon=False)]

    def run(ps, opt, gs_list):
        for gs in gs_list:
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            opt.step()

    straight = [torch.nn.Parameter(p.clone()) for p in params]
    run(straight, fuser.optim.Muon(groups(straight), lr=0.05), grads)
    first = [torch.nn.Parameter(p.clone()) for p in params]
    opt = fuser.optim.Muon(groups(first), lr=0.05)
    run(first, opt, grads[:2])
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt2 = fuser.optim.Muon(groups(resumed), lr=0.05)
    opt2.load_state_dict(opt.state_dict())
    run(resumed, opt2, grads[2:])
    for a, b in zip(straight, resumed):
        assert torch.equal(a.detach(), b.detach())


def test_muon_groups_take_matrices_only(device):
    matrix, vector = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match="use_muon=False"):
        fuser.optim.Muon([matrix, vector])
    with pytest.raises(ValueError, match="ns_steps"):
        fuser.optim.Muon([matrix], ns_steps=0)


def test_muon_steps_bf16_parameters_with_fp32_momentum(device):
    p = torch.nn.Parameter(torch.randn(32, 48, device=device).bfloat16())
    start = p.detach().clone()
    p.grad = torch.randn(32, 48, device=device).bfloat16()
    opt = fuser.optim.Muon([p], lr=0.1)
    opt.step()
    assert p.dtype == torch.bfloat16 and opt.state[p]["momentum_buffer"].dtype == torch.float32
    want, _ = muon_reference(start.float(), [p.grad.float()], 0.1, 0.95, 0.0)
    # The step (~0.02 an element) is a few of bf16's spacings near 1: p is the reference's
    # rounding, within bf16's resolution, and most elements moved.
    assert rel(p.detach(), want) < 2**-8
    assert (p.detach() != start).float().mean().item() > 0.5


def test_reductions_of_an_orthogonal_factor(device):
    rule = fuser.rule(
        """
        o = orthogonalize(g)
        p = p - lr * (norm(o) * g + sum(o * g) * p)
        """,
        name="ortho_norms",
        hyper=dict(lr=0.01),
    )
    shapes = [(9, 33), (33, 9), (12, 12)]
    params = [torch.randn(s, device=device) for s in shapes]
    grads = [torch.randn(s, device=device) for s in shapes]
    mine = [torch.nn.Parameter(p.clone()) for p in params]
    opt = fuser.compile(rule)(mine)
    for p, g in zip(mine, grads):
        p.grad = g.clone()
    opt.step()
    for p, start, g in zip(mine, params, grads):
        o = newton_schulz(g.double())
        s, g2 = view(start.double().cpu()), view(g.double().cpu())
        step = 0.01 * (o.norm() * g2 + (o * g2).sum() * s)
        # The factor's norm and its dot with g carry bf16 Newton-Schulz's error.
        assert rel(view(start.double() - p.detach().double()), step) < 0.05


def test_muon_batched_view_orthogonalises_each_expert(device):
    # Expert weights [experts, out, in] (and a 2 x 2 batch of tall matrices): view="batched"
    # orthogonalises each matrix on its own, a per-expert loop of the float64 reference,
    # and every matrix of one shape, the 2-D one's too, shares one batched product.
    shapes = [(3, 9, 13), (2, 2, 13, 9), (9, 13)]
    params = [torch.randn(s, device=device) for s in shapes]
    grads = [[torch.randn(s, device=device) for s in shapes] for _ in range(3)]
    mine = [torch.nn.Parameter(p.clone()) for p in params]
    opt = fuser.optim.Muon(mine, lr=0.02, weight_decay=0.01, view="batched")
    for gs in grads:
        for p, g in zip(mine, gs):
            p.grad = g.clone()
        before = fuser.stats()["launches"]
        opt.step()
        # 2 phases, and 3 launches an iteration for each of the 2 shapes ([9, 13], [13, 9])
        assert fuser.stats()["launches"] - before == 2 + 2 * 3 * 5
    for i, p in enumerate(mine):
        rows, cols = shapes[i][-2:]
        experts = params[i].reshape(-1, rows, cols)
        for e in range(experts.shape[0]):
            expert_grads = [gs[i].reshape(-1, rows, cols)[e] for gs in grads]
            want, buf = muon_reference(experts[e], expert_grads, 0.02, 0.95, 0.01)
            got = p.detach().reshape(-1, rows, cols)[e]
            assert rel(got - experts[e], want - experts[e].double().cpu()) < 0.03, (shapes[i], e)
            assert rel(opt.state[p]["momentum_buffer"].reshape(-1, rows, cols)[e], buf) < 1e-6


def test_muon_param_groups_choose_their_view(device):
    # One optimizer, a flatten group (the default: [3, 9 * 13]) beside a batched one.
    start = torch.randn(3, 9, 13, device=device)
    grad = torch.randn(3, 9, 13, device=device)
    flat, batched = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    opt = fuser.optim.Muon([dict(params=[flat]), dict(params=[batched], view="batched")], lr=0.1)
    flat.grad, batched.grad = grad.clone(), grad.clone()
    opt.step()
    # within what bf16 products allow for each matrix (as the orthogonalisation test above)
    want_flat, _ = muon_reference(start, [grad], 0.1, 0.95, 0.0)
    bound = max(1.5 * bf16_resolution(grad.double().reshape(3, -1)), 0.03)
    assert rel(flat.detach() - start, want_flat - start.double().cpu()) < bound
    for e in range(3):
        want, _ = muon_reference(start[e], [grad[e]], 0.1, 0.95, 0.0)
        bound = max(1.5 * bf16_resolution(grad[e].double()), 0.03)
        assert rel(batched.detach()[e] - start[e], want - start[e].double().cpu()) < bound, e
    assert rel(flat.detach(), batched.detach()) > 1e-3  # the two views step differently
    with pytest.raises(ValueError, match="view must be 'flatten' or 'batched', not 'rows'"):
        fuser.optim.Muon([flat], view="rows")
