"""8-bit states of a rule of rows and columns on DTensor shards (2 gloo processes). Its
tiles quantize in blocks of 32 within each row of the shard here, and a shard holds whole
rows (or, for a 1-D tensor, 32-element-aligned pieces of its one row), so every rank's
parameters, codes and scales are exactly those of the same optimizer over its local
tensors in one process; its row state (a row's largest gradient) spans the whole row."""

from __future__ import annotations

import pytest
import torch
from cases import step_local_pieces
from ranks import run_ranks

import fuser

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch was built without gloo", allow_module_level=True)

from seeds import session_seed  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402

# Rows of whole 32-element blocks: tall and wide matrices split by rows, a 3-D tensor viewed
# as [5, 32], a 1-D tensor whose one row is split by columns, a replicated matrix, and one
# row that leaves rank 1 empty.
LAYOUTS = [
    ((9, 64), Shard(0)),
    ((33, 32), Shard(0)),
    ((5, 2, 16), Shard(0)),
    ((64,), Shard(0)),
    ((3, 32), Replicate()),
    ((1, 96), Shard(0)),
]
STEPS = 3

# AdamW's moments beside each row's largest gradient (a row state).
ROWS_ADAMW = fuser.rule(
    """
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    r = rowamax(abs(g))
    p = p * (1 - lr * weight_decay) - lr / (1 - beta1**step) * (m / (sqrt(v) / sqrt(1 - beta2**step) + eps))
""",
    name="rows_adamw_dt",
    hyper=dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1),
    state=dict(m=0.0, v=0.0, r=0.0),
)
ELEMENT_KEYS = ("m", "m_absmax", "v", "v_absmax")


def make_optimizer(params):
    return fuser.compile(ROWS_ADAMW, state_dtype="q8")(params)


def data():
    gen = torch.Generator().manual_seed(session_seed(2468))
    params = [torch.randn(shape, generator=gen) for shape, _ in LAYOUTS]
    grads = [[torch.randn(shape, generator=gen) for shape, _ in LAYOUTS] for _ in range(STEPS)]
    return params, grads


def worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    full, grads = data()
    params = [torch.nn.Parameter(distribute_tensor(t, mesh, [pl])) for t, (_, pl) in zip(full, LAYOUTS)]
    local_init = [p.to_local().clone() for p in params]
    opt = make_optimizer(params)
    local_grads = []
    for step_grads in grads:
        for p, g, (_, pl) in zip(params, step_grads, LAYOUTS):
            p.grad = distribute_tensor(g, mesh, [pl])
        local_grads.append([p.grad.to_local().clone() for p in params])
        opt.step()
    local = lambda v: (v.to_local() if isinstance(v, DTensor) else v).clone()  # noqa: E731
    return dict(
        init=local_init,
        grads=local_grads,
        params=[p.to_local().clone() for p in params],
        stored=[{k: local(v) for k, v in opt.state[p].items()} for p in params],
        rows=[opt.state[p]["r"].full_tensor() for p in params],
    )


def test_each_rank_quantizes_its_rows_as_local_tensors():
    ranks = run_ranks(worker)
    full, grads = data()
    for rank, got in enumerate(ranks):
        opt, params, kept = step_local_pieces(make_optimizer, got)
        for p, i in zip(params, kept):
            what = f"rank {rank}, parameter {i} {LAYOUTS[i]}"
            assert torch.equal(p.detach(), got["params"][i]), what
            stored, want = got["stored"][i], opt.state[p]
            assert stored["m"].dtype == torch.int8 and stored["v"].dtype == torch.uint8, what
            for key in ELEMENT_KEYS:
                assert torch.equal(stored[key], want[key]), f"{what}: {key}"
        for i, (shape, _) in enumerate(LAYOUTS):
            # the row state spans the whole row, the 1-D tensor's split one included
            g = grads[-1][i]
            want_r = g.reshape(shape[0] if len(shape) > 1 else 1, -1).abs().amax(1)
            assert torch.equal(got["rows"][i].reshape(-1), want_r), f"rank {rank}, parameter {i}: r"
