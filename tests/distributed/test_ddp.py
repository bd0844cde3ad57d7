"""DDP needs nothing special: its parameters are plain, replicated tensors whose gradients
DDP has already averaged, so each rank's step is the single-process step (a global norm
included: nothing is exchanged, so nothing is counted twice)."""

from __future__ import annotations

import pytest
import torch
from cases import batches, lamb_clip, make_model, train
from ranks import run_ranks

import fuser

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch was built without gloo", allow_module_level=True)

STEPS = 3
# eps 1e-3: each step is then smooth in the gradient (at most 1/eps per unit of it), so the
# fp32 rounding by which DDP's averaged gradient differs from the single process's stays far
# inside the tolerance (within 3% of it over 60 session seeds). At the usual 1e-8 / 1e-6, a
# gradient entry near zero (one seed in a few hundred: 4e-7, 1% apart after rounding) moved
# a bias by 1e-5.
OPTIMIZERS = {
    "lamb_clip": lambda params: fuser.compile(lamb_clip)(params, eps=1e-3),
    "AdamW": lambda params: fuser.optim.AdamW(params, lr=0.05, weight_decay=0.1, eps=1e-3),
}


def ddp_worker(rank, world, names):
    from torch.nn.parallel import DistributedDataParallel

    out = {}
    for name in names:
        model = make_model()
        ddp = DistributedDataParallel(model)
        opt = OPTIMIZERS[name](ddp.parameters())
        before = fuser.stats()["collectives"]
        train(ddp, opt, [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in batches(STEPS)])
        out[name] = dict(
            params={n: p.detach() for n, p in model.named_parameters()},
            collectives=fuser.stats()["collectives"] - before,
        )
    return out


@pytest.fixture(scope="module")
def ddp():
    return run_ranks(ddp_worker, list(OPTIMIZERS))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_ddp_training_equals_a_single_process_run(ddp, name):
    model = make_model()
    train(model, OPTIMIZERS[name](model.parameters()), batches(STEPS))
    want = dict(model.named_parameters())
    for r in ddp:
        assert r[name]["collectives"] == 0
        for n, p in r[name]["params"].items():
            torch.testing.assert_close(p, want[n].detach(), rtol=2e-5, atol=2e-6, msg=n)
