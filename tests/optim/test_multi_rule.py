"""Several rules in one optimizer: ``fuser.compile({name: rule, ...})`` whose param groups
choose their rule, against each rule compiled alone on the same inputs."""

import pytest
import torch

import fuser

MUON = fuser.rule(
    """
    m = momentum * m + (1 - momentum) * g
    p = p * (1 - lr * wd) - lr * maximum(1, rows / cols) ** 0.5 * orthogonalize(g + momentum * (m - g))
""",
    name="muon",
    hyper=dict(lr=0.02, momentum=0.95, wd=0.0),
    state=dict(m=0.0),
)
ADAMW = fuser.rule(
    """
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g**2
    p = p * (1 - lr * wd) - lr * (m / (1 - beta1**step)) / (sqrt(v / (1 - beta2**step)) + eps)
""",
    name="adamw",
    hyper=dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, wd=0.0),
    state=dict(m=0.0, v=0.0),
)
SHAPES = [(16, 24), (24, 16), (9,), (5, 3)]


def params_on(device):
    return [torch.randn(s, device=device) for s in SHAPES]


def groups(ps, **muon):
    return [dict(params=ps[:2], **muon), dict(params=ps[2:], rule="adamw", lr=3e-3)]


def step_all(ps, opt, grads):
    """Steps with ``grads``, written into the gradients in place (as a static optimizer
    requires) once they exist."""
    for gs in grads:
        for p, g in zip(ps, gs):
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
        opt.step()


def test_groups_choose_their_rule_and_match_each_rule_alone(device):
    start = params_on(device)
    grads = [[torch.randn(s, device=device) for s in SHAPES] for _ in range(3)]
    Both = fuser.compile(dict(muon=MUON, adamw=ADAMW))
    mine = [torch.nn.Parameter(p.clone()) for p in start]
    opt = Both(groups(mine), wd=0.01)
    assert [g["rule"] for g in opt.param_groups] == ["muon", "adamw"]
    assert opt.param_groups[0]["lr"] == 0.02 and opt.param_groups[1]["beta2"] == 0.95
    before = fuser.stats()["launches"]
    step_all(mine, opt, grads)
    # Per step: Muon's two phases and two shapes of Newton-Schulz (15 launches each), AdamW's one launch.
    assert fuser.stats()["launches"] - before == 3 * (2 + 2 * 15 + 1)
    alone_m = [torch.nn.Parameter(p.clone()) for p in start[:2]]
    alone_a = [torch.nn.Parameter(p.clone()) for p in start[2:]]
    step_all(alone_m, fuser.compile(MUON)(alone_m, wd=0.01), [gs[:2] for gs in grads])
    step_all(alone_a, fuser.compile(ADAMW)(alone_a, lr=3e-3, wd=0.01), [gs[2:] for gs in grads])
    for a, b in zip(mine, alone_m + alone_a):
        assert torch.equal(a.detach(), b.detach())
    assert sorted(opt.state[mine[0]]) == ["m", "step"] and sorted(opt.state[mine[2]]) == ["m", "step", "v"]


def test_a_skipped_amp_step_changes_no_rule_s_tensors(device):
    mine = [torch.nn.Parameter(p) for p in params_on(device)]
    opt = fuser.compile(dict(muon=MUON, adamw=ADAMW))(groups(mine))
    step_all(mine, opt, [[torch.randn(s, device=device) for s in SHAPES]])
    kept = [p.detach().clone() for p in mine]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in mine]
    opt.found_inf = torch.ones((), device=device)
    step_all(mine, opt, [[torch.randn(s, device=device) for s in SHAPES]])
    for p, k, st in zip(mine, kept, states):
        assert torch.equal(p.detach(), k)
        assert all(torch.equal(opt.state[p][key], v) for key, v in st.items())


def test_state_dict_round_trip_and_schedulers_per_group(device):
    start = params_on(device)
    grads = [[torch.randn(s, device=device) for s in SHAPES] for _ in range(4)]
    Both = fuser.compile(dict(muon=MUON, adamw=ADAMW), static=True)
    straight = [torch.nn.Parameter(p.clone()) for p in start]
    opt = Both(groups(straight))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 0.5**s, lambda s: 1.0 + s])
    for gs in grads:
        step_all(straight, opt, [gs])
        sched.step()
    first = [torch.nn.Parameter(p.clone()) for p in start]
    opt1 = Both(groups(first))
    sched1 = torch.optim.lr_scheduler.LambdaLR(opt1, [lambda s: 0.5**s, lambda s: 1.0 + s])
    for gs in grads[:2]:
        step_all(first, opt1, [gs])
        sched1.step()
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt2 = Both(groups(resumed))
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, [lambda s: 0.5**s, lambda s: 1.0 + s])
    opt2.load_state_dict(opt1.state_dict())
    sched2.load_state_dict(sched1.state_dict())
    for gs in grads[2:]:
        step_all(resumed, opt2, [gs])
        sched2.step()
    for a, b in zip(straight, resumed):
        assert torch.equal(a.detach(), b.detach())
    opt2.zero_grad()  # static: gradients zeroed in place, for both rules
    assert all(p.grad is not None and not p.grad.any() for p in resumed)


def test_a_group_naming_no_rule_of_the_optimizer_is_refused():
    Both = fuser.compile(dict(muon=MUON, adamw=ADAMW))
    with pytest.raises(ValueError, match="'lion' is not one of"):
        Both([dict(params=[torch.nn.Parameter(torch.randn(3, 3))], rule="lion")])
    with pytest.raises(TypeError, match="unknown hyperparameters"):
        Both([torch.nn.Parameter(torch.randn(3, 3))], betas=(0.9, 0.9))
    with pytest.raises(TypeError, match="dict of names to optimizer rules"):
        fuser.compile(dict(muon=MUON, other="adamw"))
