"""NorMuon against pytorch-optimizer 4.1.0's ``NorMuon``: its NorMuon groups, whose update
passes through fuser's bf16 Newton–Schulz and the reference's iteration run in float64,
and its AdamW groups, which do not."""

import pytest
import torch
from test_muon import bf16_resolution, exact_newton_schulz

import fuser.optim

pytorch_optimizer = pytest.importorskip("pytorch_optimizer")

MATRICES = [(16, 24), (24, 16), (40, 8), (7, 13), (5, 3, 4)]
VECTORS = [(29,), (6, 2)]
STEPS = 4


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.detach().double().cpu()
    b = b.detach().double().cpu().reshape(a.shape)
    return ((a - b).norm() / b.norm()).item()


def bf16_error(ref: torch.optim.Optimizer, q: torch.Tensor, grad: torch.Tensor, group: dict) -> float:
    """How far bf16 Newton–Schulz of this step's input can land from the float64 iteration
    (bf16_resolution of the input the reference orthogonalised)."""
    buf = ref.state[q]["momentum_buffer"]
    return bf16_resolution(grad + group["momentum"] * (buf - grad) if group["nesterov"] else buf)


CONFIGS = {
    "defaults": dict(lr=0.02, momentum=0.9, beta2=0.9, weight_decay=0.1),
    "heavy_ball_match_rms_l2": dict(
        lr=0.02, nesterov=False, update_scale="match_rms", weight_decay=0.1, weight_decouple=False
    ),
    "adjusted_lr_maximize": dict(lr=0.01, use_adjusted_lr=True, weight_decay=0.05, maximize=True),
}


@pytest.mark.sweep(runs=3)  # one configuration a run, all in 3 runs
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_normuon_follows_pytorch_optimizer(config, device, monkeypatch):
    exact_newton_schulz(monkeypatch)
    keywords = dict(CONFIGS[config])
    maximize = keywords.pop("maximize", False)
    shapes = MATRICES + VECTORS
    start = [torch.randn(s) for s in shapes]
    mine = [torch.nn.Parameter(p.clone().to(device)) for p in start]
    theirs = [torch.nn.Parameter(p.clone().double()) for p in start]

    def groups(ps):
        return [
            dict(params=ps[: len(MATRICES)], use_muon=True, **keywords),
            dict(params=ps[len(MATRICES) :], use_muon=False, lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1),
        ]

    opt = fuser.optim.NorMuon(groups(mine), maximize=maximize)
    ref = pytorch_optimizer.NorMuon(groups(theirs), maximize=maximize)
    worst = [0.0] * len(MATRICES)
    for step in range(1, STEPS + 1):
        grads = [torch.randn(s) for s in shapes]
        before = [p.detach().double().cpu() for p in mine]
        ref_before = [q.detach().clone() for q in theirs]
        for p, q, g in zip(mine, theirs, grads):
            p.grad = g.to(device)
            q.grad = g.clone().double()
        opt.step()
        ref.step()
        for i, (p, q) in enumerate(zip(mine[: len(MATRICES)], theirs)):
            where = f"{config}: {tuple(p.shape)}, step {step}"
            # The momentum is exact on both sides (ours in fp32, theirs in float64), except
            # that an L2 decay (weight_decouple=False) adds weight_decay * p to the gradient,
            # and p carries the earlier steps' bf16 Newton-Schulz differences.
            m, ref_m = opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"]
            l2 = 0.0 if keywords.get("weight_decouple", True) else keywords["weight_decay"]
            drift = (before[i] - ref_before[i].cpu().reshape(before[i].shape)).norm()
            allowed = 1e-6 + l2 * (drift / ref_m.detach().cpu().norm()).item()
            assert rel(m, ref_m) < allowed, (where, rel(m, ref_m), allowed)
            # fuser's update is within bf16's Newton–Schulz error e of the reference's
            # float64 iteration; 2e leaves room for the second moment, which carries the
            # earlier steps' errors into the row normalisation.
            worst[i] = max(worst[i], bf16_error(ref, q, grads[i].double(), ref.param_groups[0]))
            bound = 2 * worst[i]
            got, want = p.detach().double().cpu() - before[i], q.detach() - ref_before[i]
            assert rel(got, want) < bound, (where, rel(got, want), worst[i])
            # The second moment is a row mean of squares of those updates: squaring doubles
            # their relative error, so 4e.
            sm, ref_sm = opt.state[p]["second_momentum_buffer"], ref.state[q]["second_momentum_buffer"]
            assert sm.shape == ref_sm.shape == (p.shape[0], 1), where
            assert rel(sm, ref_sm) < 2 * bound, (where, rel(sm, ref_sm), worst[i])
        for p, q in zip(mine[len(MATRICES) :], theirs[len(MATRICES) :]):
            assert rel(p, q) < 1e-6, (config, tuple(p.shape), step)
            for key in ("exp_avg", "exp_avg_sq"):
                assert rel(opt.state[p][key], ref.state[q][key]) < 1e-6, (config, key, step)
    assert all(not torch.equal(p.detach().cpu(), s) for p, s in zip(mine, start))


def test_normuon_state_dict_round_trip_continues_the_same_run(device):
    shapes = [(12, 20), (20, 12), (9,), (5, 2)]
    params = [torch.randn(s, device=device) for s in shapes]
    grads = [[torch.randn(s, device=device) for s in shapes] for _ in range(4)]

    def groups(ps):
        return [dict(params=ps[:2], use_muon=True), dict(params=ps[2:], use_muon=False)]

    def run(ps, opt, gs_list):
        for gs in gs_list:
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            opt.step()

    straight = [torch.nn.Parameter(p.clone()) for p in params]
    run(straight, fuser.optim.NorMuon(groups(straight), lr=0.05), grads)
    first = [torch.nn.Parameter(p.clone()) for p in params]
    opt = fuser.optim.NorMuon(groups(first), lr=0.05)
    run(first, opt, grads[:2])
    sd = opt.state_dict()
    assert sorted(sd["state"][0]) == ["momentum_buffer", "second_momentum_buffer", "step"]
    assert sorted(sd["state"][2]) == ["exp_avg", "exp_avg_sq", "step"]
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt2 = fuser.optim.NorMuon(groups(resumed), lr=0.05)
    opt2.load_state_dict(sd)
    run(resumed, opt2, grads[2:])
    for a, b in zip(straight, resumed):
        assert torch.equal(a.detach(), b.detach())


def test_normuon_adamw_groups_take_the_adamw_keywords():
    m, v = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))
    opt = fuser.optim.NorMuon(
        [dict(params=[m], use_muon=True), dict(params=[v], use_muon=False)],
        adamw_lr=1e-3,
        adamw_betas=(0.7, 0.8),
        adamw_wd=0.2,
        adamw_eps=1e-6,
    )
    aux = opt.param_groups[1]
    assert (aux["lr"], aux["betas"], aux["weight_decay"], aux["eps"]) == (1e-3, (0.7, 0.8), 0.2, 1e-6)
    assert opt.param_groups[0]["lr"] == 2e-2 and opt.param_groups[0]["eps"] == 1e-10


def test_normuon_refuses_what_it_cannot_run():
    matrix, vector = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match="use_muon=False"):
        fuser.optim.NorMuon([matrix, vector])
    with pytest.raises(ValueError, match="not a schedule of several|presets with one"):
        fuser.optim.NorMuon([matrix], ns_coeffs="quintic")
    with pytest.raises(ValueError, match="update_scale"):
        fuser.optim.NorMuon([matrix], update_scale="unit")
    with pytest.raises(ValueError, match="beta2"):
        fuser.optim.NorMuon([matrix], beta2=1.0)


def test_normuon_batched_view_is_a_loop_of_the_reference_over_experts(device, monkeypatch):
    # view="batched": each [rows, cols] matrix of an expert tensor is the reference's own
    # parameter (orthogonal factor, row second moments, norms and match_rms scale per matrix).
    exact_newton_schulz(monkeypatch)
    shapes = [(3, 5, 7), (2, 2, 7, 5)]
    start = [torch.randn(s) for s in shapes]
    mine = [torch.nn.Parameter(p.clone().to(device)) for p in start]
    experts = [e.clone().double() for p in start for e in p.reshape(-1, *p.shape[-2:])]
    theirs = [torch.nn.Parameter(e) for e in experts]
    kw = dict(lr=0.02, momentum=0.9, beta2=0.9, weight_decay=0.1, update_scale="match_rms")
    opt = fuser.optim.NorMuon(mine, view="batched", **kw)
    ref = pytorch_optimizer.NorMuon([dict(params=theirs, use_muon=True)], **kw)
    worst = [0.0] * len(theirs)
    for step in range(1, 4):
        grads = [torch.randn(s) for s in shapes]
        expert_grads = [e.double() for g in grads for e in g.reshape(-1, *g.shape[-2:])]
        before = [e.double() for p in mine for e in p.detach().cpu().reshape(-1, *p.shape[-2:])]
        ref_before = [q.detach().clone() for q in theirs]
        for p, g in zip(mine, grads):
            p.grad = g.to(device)
        for q, g in zip(theirs, expert_grads):
            q.grad = g.clone()
        opt.step()
        ref.step()
        after = [e.double() for p in mine for e in p.detach().cpu().reshape(-1, *p.shape[-2:])]
        for j, q in enumerate(theirs):
            worst[j] = max(worst[j], bf16_error(ref, q, expert_grads[j], ref.param_groups[0]))
            got, want = after[j] - before[j], q.detach() - ref_before[j]
            assert rel(got, want) < 2 * worst[j], (j, step, rel(got, want), worst[j])
    assert opt.state[mine[0]]["second_momentum_buffer"].shape == (3, 5, 1)
    assert opt.state[mine[1]]["second_momentum_buffer"].shape == (2, 2, 7, 1)
    # (the reference's [rows, 1] buffers, expert after expert, are ours in memory order)
    sm = torch.cat([opt.state[p]["second_momentum_buffer"].reshape(-1) for p in mine])
    ref_sm = torch.cat([ref.state[q]["second_momentum_buffer"].reshape(-1) for q in theirs])
    assert rel(sm, ref_sm) < 4 * max(worst)
