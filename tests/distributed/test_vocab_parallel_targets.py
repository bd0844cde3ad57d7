"""Vocabulary-parallel targets on CPU (2 gloo ranks, uneven slices): the bound is the global
vocabulary, the sum of the ranks' slices. A target past it is refused on every rank alike,
before any collective or gradient; one inside it but outside a rank's own slice is not.
"""

from __future__ import annotations

import re

import pytest
import torch
from ranks import run_ranks

dist = pytest.importorskip("torch.distributed")

T, H = 9, 8
SPLIT = (20, 17)
V = sum(SPLIT)
# (position, value, ignored tokens elsewhere, call keywords)
PLANTS = [
    (0, V, True, dict()),
    (T // 2, V + 10**6, False, dict(memory="lean")),
    (T - 1, -7, True, dict(accumulate_into="main_grad")),
    (0, -7, False, dict(reduction="none", memory="fast")),
]


def _worker(rank: int, world: int) -> dict:
    import fuser.losses

    g = torch.Generator().manual_seed(1234)  # (every rank draws the same tensors)
    hidden = torch.randn(T, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    lo = sum(SPLIT[:rank])
    shard = weight[lo : lo + SPLIT[rank]]
    refused = []
    for at, value, ignored, kw in PLANTS:
        target = torch.randint(0, V, (T,), generator=g)
        if ignored:
            target[1::3] = -100
        target[at] = value
        x, w = hidden.clone().requires_grad_(), shard.clone().requires_grad_()
        w.main_grad = torch.randn(w.shape)
        before = w.main_grad.clone()
        try:
            fuser.losses.cross_entropy(x, w, target, process_group=dist.group.WORLD, **kw)
        except ValueError as e:
            refused.append(str(e))
        else:
            refused.append(None)
        assert x.grad is None and w.grad is None and torch.equal(w.main_grad, before)
    # every rank still runs the same collectives: a call whose targets fall in the other
    # rank's slice (global indices) runs, and agrees across ranks
    target = torch.arange(T) * 4 % V
    target[3] = V - 1
    x, w = hidden.clone().requires_grad_(), shard.clone().requires_grad_()
    loss = fuser.losses.cross_entropy(x, w, target, process_group=dist.group.WORLD)
    loss.backward()
    return dict(refused=refused, loss=loss.detach(), finite=bool(torch.isfinite(w.grad).all()))


def test_targets_are_checked_against_the_global_vocabulary():
    results = run_ranks(_worker, timeout=240.0)
    for rank, got in enumerate(results):
        for (at, value, _, _), message in zip(PLANTS, got["refused"]):
            assert message is not None, f"rank {rank}: target {value} at {at} was not refused"
            expected = (
                f"target[{at}] = {value} is outside the global vocabulary of {V} classes "
                f"(the process group's slices: {SPLIT[0]} + {SPLIT[1]})"
            )
            assert re.match(re.escape(expected), message), (rank, message)
        assert torch.isfinite(got["loss"]) and got["finite"], rank
    assert torch.equal(results[0]["loss"], results[1]["loss"])
