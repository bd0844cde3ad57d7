"""Training-loop features: AMP GradScaler (unscale and skip inside the kernel), stochastic
rounding, Megatron-style main_grad, CUDA graph capture."""

import pytest
import torch
import torch_references
from numerics import Tracked, assert_fp32_close

import fuser

SHAPES = [(1,), (7,), (129,), (33, 5), (3, 4, 5)]


def scaled_step(opt, params, grads, scaler):
    """One AMP step whose (unscaled) gradients are ``grads``: the loss sum(p * g)."""
    for p in params:
        p.grad = None
    loss = sum((p * g).sum() for p, g in zip(params, grads))
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def test_grad_scaler_unscales_inside_the_kernel_like_torch(device):
    assert fuser.optim.AdamW._step_supports_amp_scaling
    a = [torch.randn(s, device=device).requires_grad_() for s in SHAPES]
    b = [p.detach().clone().requires_grad_() for p in a]
    start = [p.detach().clone() for p in a]
    oa = fuser.optim.AdamW(a, lr=1e-2)
    ob = torch.optim.AdamW(b, lr=1e-2, foreach=False)
    sa = torch.amp.GradScaler(device.type, init_scale=2.0**10)
    sb = torch.amp.GradScaler(device.type, init_scale=2.0**10)
    steps = []
    for _ in range(3):
        grads = [torch.randn(p.shape, device=device) for p in a]
        steps.append(grads)
        scale_used = sa.get_scale()
        scaled_step(oa, a, grads, sa)
        scaled_step(ob, b, grads, sb)
        # fuser leaves the gradients scaled (it unscales while reading them): no extra pass.
        assert torch.equal(a[2].grad, grads[2] * scale_used)
    # Scaling by a power of two and back is exact: AdamW on the unscaled gradients, in
    # float64 with fp32's bound (tests/numerics.py), for fuser and torch alike.
    for i, (x, y) in enumerate(zip(a, b)):
        want, _ = torch_references.adamw(start[i], [gs[i] for gs in steps], lr=1e-2)
        assert_fp32_close(x, want, "fuser p")
        assert_fp32_close(y, want, "torch p")
    assert sa.get_scale() == sb.get_scale()


def test_a_step_with_inf_or_nan_changes_nothing(device):
    params = [torch.randn(s, device=device).requires_grad_() for s in SHAPES]
    opt = fuser.optim.AdamW(params, lr=1e-2)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**8)
    scaled_step(opt, params, [torch.randn(p.shape, device=device) for p in params], scaler)
    snapshot = [p.detach().clone() for p in params]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    for bad in (float("inf"), float("nan")):
        grads = [torch.randn(p.shape, device=device) for p in params]
        grads[3][2, 1] = bad
        scale_before = scaler.get_scale()
        scaled_step(opt, params, grads, scaler)
        assert scaler.get_scale() < scale_before  # the scaler saw the overflow
        for p, s, st in zip(params, snapshot, states):
            assert torch.equal(p, s)  # bit for bit
            for k, v in st.items():
                assert torch.equal(opt.state[p][k], v), k
    assert opt.state[params[0]]["step"].item() == 1


def test_stochastic_rounding_is_unbiased_and_reproducible(device):
    rule = fuser.rule("p = p - lr * g", name="sgd_sr", hyper=dict(lr=3e-4))
    n, steps = 4099, 10
    results = {}
    for sr, seed in ((False, 0), (True, 0), (True, 0), (True, 1)):
        p = torch.ones(n, device=device, dtype=torch.bfloat16)
        p.grad = torch.ones(n, device=device, dtype=torch.bfloat16)
        opt = fuser.compile(rule, stochastic_rounding=sr, seed=seed)([p])
        for _ in range(steps):
            opt.step()
        results.setdefault((sr, seed), []).append(p.clone())
    # Round to nearest: each update (3e-4) is below half of bf16's spacing under 1
    # (2**-9 / 2), so the parameter never moves.
    assert torch.equal(results[(False, 0)][0], torch.ones(n, device=device, dtype=torch.bfloat16))
    sr = results[(True, 0)][0].double()
    expected = 1 - steps * 3e-4
    # Each step adds a rounding error with variance <= spacing**2 / 4 (spacing 2**-9 here).
    stderr = (steps * (2**-9) ** 2 / 4) ** 0.5 / n**0.5
    assert abs(sr.mean().item() - expected) < 5 * stderr
    assert torch.equal(results[(True, 0)][0], results[(True, 0)][1])  # same seed, same bits
    assert not torch.equal(results[(True, 0)][0], results[(True, 1)][0])


def test_stochastic_rounding_fp16(device):
    rule = fuser.rule("p = p - lr * g", name="sgd_sr16", hyper=dict(lr=1e-4))
    n = 8191
    start = torch.rand(n, device=device) + 1.0  # spacing 2**-10 in [1, 2)
    p = start.half()
    p.grad = torch.ones(n, device=device, dtype=torch.float16)
    opt = fuser.compile(rule, stochastic_rounding=True)([p])
    for _ in range(8):
        opt.step()
    moved = p.double() - start.half().double()
    stderr = (8 * (2**-10) ** 2 / 4) ** 0.5 / n**0.5
    assert abs(moved.mean().item() + 8 * 1e-4) < 5 * stderr


def test_main_grad_is_read_instead_of_grad(device):
    params = [torch.randn(s, device=device).bfloat16() for s in SHAPES]
    start = [p.clone() for p in params]
    for p in params:
        p.main_grad = torch.randn(p.shape, device=device)  # fp32, Megatron style
        p.grad = None
    opt = fuser.optim.SGD(params, lr=0.1, grad_attr="main_grad")
    opt.step()
    for p, s in zip(params, start):
        # fp32 math, then one rounding to bf16: the float64 result's rounding, or its
        # neighbour where fp32's error straddles a bf16 rounding boundary.
        want = (Tracked.exact(s) - 0.1 * Tracked.exact(p.main_grad)).round_to(torch.bfloat16)
        assert_fp32_close(p, want, "bf16 p")
    user = fuser.compile(
        fuser.rule("p = p - lr * g", name="plain", hyper=dict(lr=1.0)), grad_attr="main_grad"
    )
    q = torch.randn(5, device=device)
    q.main_grad = torch.randn(5, device=device)
    before = q.clone()
    user([q]).step()
    assert torch.allclose(q, before - q.main_grad)


def captured_step(opt) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``opt.step()``, captured on a side stream as torch's docs do."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        opt.step()
    torch.cuda.current_stream().wait_stream(stream)
    return graph


@pytest.mark.gpu
def test_cuda_graph_replays_equal_eager_steps_and_see_lr_changes():
    device = torch.device("cuda")
    base = [torch.randn(s, device=device) for s in SHAPES]
    grads = [torch.randn_like(p) for p in base]
    lr = torch.tensor(1e-2, device=device)

    def make(params):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        return fuser.optim.AdamW(params, lr=lr)

    eager = [p.clone() for p in base]
    opt_e = make(eager)
    graphed = [p.clone() for p in base]
    opt_g = make(graphed)
    opt_g.step()  # warm-up: builds tables and compiles outside the capture
    opt_e.step()
    graph = captured_step(opt_g)
    for k in range(5):
        if k == 3:
            lr.fill_(1e-3)  # a scheduler's in-place update, seen by the next replay
        graph.replay()
        opt_e.step()
    torch.cuda.synchronize()
    for x, y in zip(graphed, eager):
        assert torch.equal(x, y)
    assert opt_g.state[graphed[0]]["step"].item() == 6


SHAPED = {
    # Newton–Schulz (fuser's kernels and torch.bmm) beside AdamW groups
    "Muon": lambda ps: fuser.optim.Muon([dict(params=ps[:3]), dict(params=ps[3:], use_muon=False)], lr=0.02),
    # row and column statistics (tiled phases, atomics), clipped by the update's RMS
    "Adafactor": lambda ps: fuser.optim.Adafactor(ps, lr=1e-2),
    "CAME": lambda ps: fuser.optim.CAME(ps, lr=1e-3),
    "NorMuon": lambda ps: fuser.optim.NorMuon([dict(params=ps[:3]), dict(params=ps[3:], use_muon=False)]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SHAPED))
def test_cuda_graph_replays_shape_aware_steps(name):
    # Matrices of two shapes (two of one), a 3-D tensor, vectors; odd sizes.
    shapes = [(40, 24), (40, 24), (24, 72), (5, 6, 7), (33,), (3,)]
    device = torch.device("cuda")
    base = [torch.randn(s, device=device) for s in shapes]
    grads = [[torch.randn(s, device=device) for s in shapes] for _ in range(5)]
    eager, graphed = [p.clone() for p in base], [p.clone() for p in base]
    opt_e, opt_g = SHAPED[name](eager), SHAPED[name](graphed)
    for p, q, g in zip(eager, graphed, grads[0]):
        p.grad, q.grad = g.clone(), g.clone()
    opt_e.step()
    opt_g.step()  # warm-up: builds tables and compiles outside the capture
    before = [p.clone() for p in graphed]
    graph = captured_step(opt_g)
    torch.cuda.synchronize()
    for x, b in zip(graphed, before):  # capturing ran nothing
        assert torch.equal(x, b)
    for gs in grads[1:]:
        for p, q, g in zip(eager, graphed, gs):
            p.grad.copy_(g)
            q.grad.copy_(g)
        opt_e.step()
        graph.replay()
    torch.cuda.synchronize()
    # Row and column sums are atomics, whose order varies: equal up to fp32 rounding
    # carried through four steps.
    for x, y, s in zip(graphed, eager, base):
        assert not torch.equal(x, s)
        assert ((x - y).norm() / (y - s).norm()).item() < 1e-4, name
    assert opt_g.state[graphed[0]]["step"].item() == 5
