"""8-bit states and split master weights on DTensor shards (2 gloo processes): each rank
quantizes its own shard in blocks, so a rank's step is exactly a single-process step over
its local tensors; the default state dict holds fp32 DTensors placed like the parameters."""

from __future__ import annotations

import pytest
import torch
from ranks import run_ranks

import fuser

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch was built without gloo", allow_module_level=True)

from seeds import session_seed  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402

# Odd sizes, a shard left empty on rank 1, a Shard(1) tensor, a replicated one, and bf16
# tensors that keep split masters.
LAYOUTS = [
    ((37, 3), Shard(0), torch.float32),
    ((1, 3), Shard(0), torch.float32),
    ((3, 45), Shard(1), torch.float32),
    ((70,), Replicate(), torch.float32),
    ((66, 5), Shard(0), torch.bfloat16),
]
STEPS = 3


def make_optimizer(params):
    return fuser.optim.AdamW(params, lr=0.01, weight_decay=0.1, state_dtype="q8", master_weights="bf16+int16")


def data():
    gen = torch.Generator().manual_seed(session_seed(4321))
    params = [torch.randn(shape, generator=gen).to(dtype) for shape, _, dtype in LAYOUTS]
    grads = [
        [torch.randn(shape, generator=gen).to(dtype) for shape, _, dtype in LAYOUTS] for _ in range(STEPS)
    ]
    return params, grads


def worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    full, grads = data()
    params = [torch.nn.Parameter(distribute_tensor(t, mesh, [pl])) for t, (_, pl, _) in zip(full, LAYOUTS)]
    local_init = [p.to_local().clone() for p in params]
    opt = make_optimizer(params)
    local_grads = []
    for step_grads in grads:
        for p, g, (_, pl, _) in zip(params, step_grads, LAYOUTS):
            p.grad = distribute_tensor(g, mesh, [pl])
        local_grads.append([p.grad.to_local().clone() for p in params])
        opt.step()
    saved = opt.state_dict()["state"]
    return dict(
        init=local_init,
        grads=local_grads,
        params=[p.to_local().clone() for p in params],
        stored=[
            {k: (v.to_local() if isinstance(v, DTensor) else v).clone() for k, v in opt.state[p].items()}
            for p in params
        ],
        saved_kinds=sorted(
            {
                (k, type(v).__name__, v.dtype == torch.float32 and v.placements == p.placements)
                for i, p in enumerate(params)
                for k, v in saved[i].items()
                if k in ("exp_avg", "exp_avg_sq")
            }
        ),
    )


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(worker)


def test_each_rank_steps_its_shards_as_local_tensors(ranks):
    for rank, got in enumerate(ranks):
        # the same optimizer on this rank's local pieces, as plain tensors in one process
        params = [t.detach().clone().requires_grad_() for t in got["init"] if t.numel()]
        kept = [i for i, t in enumerate(got["init"]) if t.numel()]
        opt = make_optimizer(params)
        for step_grads in got["grads"]:
            for p, i in zip(params, kept):
                p.grad = step_grads[i].clone()
            opt.step()
        for p, i in zip(params, kept):
            assert torch.equal(p.detach(), got["params"][i]), f"rank {rank}, parameter {i} {LAYOUTS[i][0]}"
            want = opt.state[p]
            stored = got["stored"][i]
            assert set(stored) == set(want), (set(stored), set(want))
            for key in want:
                assert torch.equal(torch.as_tensor(stored[key]), torch.as_tensor(want[key])), (rank, i, key)
        assert got["stored"][0]["exp_avg"].dtype == torch.int8
        assert got["stored"][0]["exp_avg_sq"].dtype == torch.uint8
        assert "master_lo" in got["stored"][4] and got["stored"][4]["master_lo"].dtype == torch.int16
        assert "master_lo" not in got["stored"][0]  # fp32 parameters are their own masters


def test_default_state_dict_is_fp32_dtensors_placed_like_parameters(ranks):
    for got in ranks:
        assert got["saved_kinds"] == [("exp_avg", "DTensor", True), ("exp_avg_sq", "DTensor", True)]
