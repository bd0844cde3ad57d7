"""Schedule-free AdamW against pytorch-optimizer 4.1.0's ``ScheduleFreeAdamW``: training
steps, ``eval()`` to the average and ``train()`` back, in between and after."""

import pytest
import torch

import fuser.optim

pytorch_optimizer = pytest.importorskip("pytorch_optimizer")

SHAPES = [(7, 13), (29,), (3, 5, 4)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(
    "keywords",
    [dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1, r=0.5, warmup_steps=3), dict(maximize=True, lr=5e-3)],
    ids=["warmup_r_decay", "maximize"],
)
def test_steps_and_eval_train_follow_pytorch_optimizer(keywords, device):
    start = [torch.randn(s) for s in SHAPES]
    mine = [torch.nn.Parameter(p.clone().to(device)) for p in start]
    theirs = [torch.nn.Parameter(p.clone().double()) for p in start]
    opt = fuser.optim.ScheduleFreeAdamW(mine, **keywords)
    ref = pytorch_optimizer.ScheduleFreeAdamW(theirs, **keywords)
    for step in range(5):
        for p, q in zip(mine, theirs):
            g = torch.randn(p.shape)
            p.grad, q.grad = g.to(device), g.double()
        opt.step()
        ref.step()
        for p, q in zip(mine, theirs):
            assert rel(p, q) < 1e-6 and rel(opt.state[p]["z"], ref.state[q]["z"]) < 1e-6, step
        if step == 2:  # evaluate in the middle of training, then go on
            opt.eval()
            ref.eval()
            assert all(rel(p, q) < 1e-6 for p, q in zip(mine, theirs))
            with pytest.raises(RuntimeError, match=r"call optimizer.train\(\)"):
                opt.step()
            opt.train()
            ref.train()
    opt.eval()
    ref.eval()
    opt.eval()  # twice: no second move
    for p, q in zip(mine, theirs):
        assert rel(p, q) < 1e-6


def test_unsupported_keywords_say_so():
    p = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(NotImplementedError, match="ams_bound"):
        fuser.optim.ScheduleFreeAdamW([p], ams_bound=True)
    with pytest.raises(ValueError, match="beta1 > 0"):
        fuser.optim.ScheduleFreeAdamW([p], betas=(0.0, 0.9))
