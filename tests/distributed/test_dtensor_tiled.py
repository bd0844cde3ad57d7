"""Rules of rows and columns on DTensor parameters (2 gloo processes): each rank walks the
rows of its shard; what a shard holds only part of (a column's sum over rows split across
ranks, a per-tensor reduction over those rows, a 1-D tensor's one row) is combined between
phases, so every rank's shards follow the same optimizer on the whole tensors in one
process. Row states are sharded with the rows, column states replicated (and the other way
round for a 1-D tensor, whose one row is split)."""

from __future__ import annotations

import pytest
import torch
from cases import batches, make_model, train
from ranks import run_ranks

import fuser

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch was built without gloo", allow_module_level=True)

from seeds import session_seed  # noqa: E402
from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # noqa: E402

# Wide and tall matrices, a 3-D tensor viewed as [5, 12], 1-D tensors (their one row split
# by columns), a replicated matrix, and shards that leave rank 1 empty or one row each.
LAYOUTS = [
    ((9, 33), Shard(0)),
    ((33, 9), Shard(0)),
    ((5, 3, 4), Shard(0)),
    ((37,), Shard(0)),
    ((17, 17), Replicate()),
    ((1, 12), Shard(0)),
    ((2, 5), Shard(0)),
    ((1,), Shard(0)),
]
STEPS = 3

# A row state and a column state, a row and a column reduction of each combine (sum, max),
# and per-tensor reductions over rows (amax) and over columns (mean).
ROWS_AND_COLUMNS = fuser.rule(
    """
    m = beta * m + (1 - beta) * g
    a = maximum(beta * a, rowamax(abs(g)))
    b = beta * b + (1 - beta) * colmean(g * g)
    scale = a / maximum(amax(a), eps) + 1 / sqrt(b / maximum(mean(b), eps) + eps)
    p = p - lr * m * scale
""",
    name="rows_and_columns",
    hyper=dict(lr=0.05, beta=0.9, eps=1e-3),
    state=dict(m=0.0, a=0.0, b=0.0),
)


def make_optimizer(name, params):
    # (Adafactor and CAME factor the flatten view here: batched views take no DTensors)
    if name == "normuon":
        return fuser.optim.NorMuon(params, lr=0.02, weight_decay=0.01)
    if name == "adafactor":
        return fuser.optim.Adafactor(params, lr=0.02, weight_decay=0.01, view="flatten")
    if name == "came":
        return fuser.optim.CAME(params, lr=0.02, weight_decay=0.01, view="flatten")
    return fuser.compile(ROWS_AND_COLUMNS)(params)


def layouts(name):
    """NorMuon orthogonalizes matrices: its 1-D tensors go to its AdamW groups."""
    return [(shape, pl) for shape, pl in LAYOUTS if name != "normuon" or len(shape) > 1]


def data(name):
    gen = torch.Generator().manual_seed(session_seed(1357))
    params = [torch.randn(shape, generator=gen) for shape, _ in layouts(name)]
    grads = [[torch.randn(shape, generator=gen) for shape, _ in layouts(name)] for _ in range(STEPS)]
    return params, grads


def worker(rank, world, name):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,))
    full, grads = data(name)
    params = [torch.nn.Parameter(distribute_tensor(t, mesh, [pl])) for t, (_, pl) in zip(full, layouts(name))]
    opt = make_optimizer(name, params)
    collectives = []
    for step_grads in grads:
        for p, g, (_, pl) in zip(params, step_grads, layouts(name)):
            p.grad = distribute_tensor(g, mesh, [pl])
        before = fuser.stats()["collectives"]
        opt.step()
        collectives.append(fuser.stats()["collectives"] - before)
    states, placements = [], []
    for p in params:
        st = {k: v for k, v in opt.state[p].items() if isinstance(v, DTensor)}
        states.append({k: v.full_tensor() for k, v in st.items()})
        placements.append({k: (str(v.placements), tuple(v.to_local().shape)) for k, v in st.items()})
    return dict(
        params=[p.full_tensor() for p in params],
        states=states,
        placements=placements,
        collectives=collectives,
    )


def close(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor, rtol: float) -> bool:
    """``got`` within ``rtol`` of ``want``, in norm, over the larger of their and
    ``scale``'s norms (sums over rows split across ranks round in another order)."""
    got, want, scale = (t.double().reshape(-1) for t in (got, want, scale))
    return bool((got - want).norm() <= rtol * max(want.norm(), scale.norm(), 1e-30))


@pytest.mark.sweep(runs=2)  # two of the four rules a run, all in 2 runs
@pytest.mark.parametrize("name", ["rows_and_columns", "adafactor", "came", "normuon"])
def test_row_shards_follow_the_same_optimizer_on_whole_tensors(name):
    ranks = run_ranks(worker, name)
    full, grads = data(name)
    params = [torch.nn.Parameter(t.clone()) for t in full]
    opt = make_optimizer(name, params)
    # One thread, as the ranks run (tests/distributed/ranks.py): NorMuon's gathered
    # matrices then take the same bf16 products as the whole ones.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    for rank, got in enumerate(ranks):
        for i, ((shape, pl), p) in enumerate(zip(layouts(name), params)):
            what = f"{name}, rank {rank}, parameter {i} {shape} {pl}"
            step, want_step = got["params"][i] - full[i], p.detach() - full[i]
            assert close(step, want_step, want_step, 1e-5), what
            for key, value in got["states"][i].items():
                assert close(value, opt.state[p][key], value, 1e-5), f"{what}: state {key}"
        if name == "rows_and_columns":
            # each step: after the first phase, the column sums of row-sharded tensors and
            # the 1-D tensors' row maxima (a sum, a max); after the second, the maxima over
            # rows and the 1-D tensors' means over columns (a max, a sum)
            assert got["collectives"] == [4] * STEPS, got["collectives"]
    if name != "rows_and_columns":
        return
    for i, (shape, pl) in enumerate(LAYOUTS):
        placed = ranks[0]["placements"][i]
        rows_split = isinstance(pl, Shard) and len(shape) > 1
        cols_split = isinstance(pl, Shard) and len(shape) == 1
        here = (-(-shape[0] // 2),)  # rank 0's part of a split axis (torch.chunk)
        rows = shape[0] if len(shape) > 1 else 1
        cols = shape[0] if len(shape) == 1 else int(torch.tensor(shape[1:]).prod())
        want_a = ((Shard(0),), here) if rows_split else ((Replicate(),), (rows,))
        want_b = ((Shard(0),), here) if cols_split else ((Replicate(),), (cols,))
        assert placed["a"] == (str(want_a[0]), want_a[1]), (i, placed)
        assert placed["b"] == (str(want_b[0]), want_b[1]), (i, placed)


def batched_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    messages = []
    for make in (fuser.optim.Adafactor, lambda ps: fuser.optim.Muon(ps, view="batched")):
        p = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3, 5), mesh, [Shard(0)]))
        p.grad = distribute_tensor(torch.randn(4, 3, 5), mesh, [Shard(0)])
        before = p.to_local().clone()
        opt = make([p])
        try:
            opt.step()
            messages.append(None)
        except NotImplementedError as e:
            messages.append((str(e), torch.equal(p.to_local(), before), not opt.state[p]))
    return messages


def test_batched_views_of_dtensors_are_refused_before_any_change():
    for messages in run_ranks(batched_worker):
        for message, unchanged, no_state in messages:
            assert "batched views of sharded tensors are not supported" in message, message
            assert "view='flatten'" in message and unchanged and no_state


def fsdp_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model = sharded_model(mesh)
    opt = fuser.optim.Adafactor(model.parameters(), lr=0.05)
    train(model, opt, [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in batches(3)])
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def test_adafactor_under_fsdp2_follows_a_single_process_run():
    model = make_model()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    train(model, fuser.optim.Adafactor(model.parameters(), lr=0.05), batches(3))
    for got in run_ranks(fsdp_worker):
        for name, p in model.named_parameters():
            # FSDP2 averages the two halves' gradients: the same gradient up to fp32 rounding
            step, want = got[name] - start[name], p.detach() - start[name]
            assert (step - want).norm() <= 1e-4 * want.norm(), name


def checkpoint(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def resume(model, path: str, data, **load) -> dict:
    """A new Adafactor over ``model`` from the checkpoint at ``path``, trained on ``data``:
    the full parameters."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    opt = fuser.optim.Adafactor(model.parameters(), lr=0.05)
    sd = checkpoint(model, opt)
    dcp.load(sd, checkpoint_id=path, **load)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    train(model, opt, data)
    return {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in model.named_parameters()}


def sharded_model(mesh):
    """The test model under FSDP2: each linear layer, then the whole."""
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def dcp_worker(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    local = [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in batches(4)]
    model = sharded_model(mesh)
    opt = fuser.optim.Adafactor(model.parameters(), lr=0.05)
    train(model, opt, local[:2])
    dcp.save(checkpoint(model, opt), checkpoint_id=path)
    train(model, opt, local[2:])
    return dict(
        final={n: p.full_tensor() for n, p in model.named_parameters()},
        resumed=resume(sharded_model(mesh), path, local[2:]),
    )


def test_adafactor_checkpoint_of_two_ranks_resumes_on_two_ranks_and_on_one(tmp_path):
    import warnings

    path = str(tmp_path / "dcp")
    ranks = run_ranks(dcp_worker, path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        one = resume(make_model(), path, batches(4)[2:], no_dist=True)
    for got in ranks:
        for name, want in got["final"].items():
            torch.testing.assert_close(got["resumed"][name], want, rtol=2e-5, atol=2e-6, msg=name)
            torch.testing.assert_close(one[name], want, rtol=1e-4, atol=1e-5, msg=name)
