"""The matrix-preconditioned built-ins (SOAP, Shampoo, PSGDKron) on DTensor parameters
sharded by rows (2 gloo processes): each full gradient matrix is gathered once a step onto
the rank that owns its matrix work (one all_to_all for all of them), that rank alone runs
it, and every rank gets its rows back (one more all_to_all), so each rank's shards follow
the same optimizer on the whole tensors in one process. The owner keeps the factors;
state_dict() publishes states of a parameter's shape as DTensors like it and the factors
replicated, which torch.distributed.checkpoint saves on 2 ranks and loads into one
process, and a state dict of whole tensors loads on the ranks.

Bit for bit: an owner batches its own parameters' matrix work only, and on CPU MKL's
torch.bmm, eigh and qr round some sizes (9x9 products, odd sizes from 7) differently at
another place of a batch. These layouts keep such batches as in one process (the one
factor of size 7 is alone in its batch, both (6, 11) matrices are on rank 0), so equality
is exact whatever the seed, and a wrong row, a missing gather or a stale factor shows; two
9x7 matrices on different owners would differ by that rounding (docs/distributed.md)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from ranks import run_ranks

import fuser

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch was built without gloo", allow_module_level=True)

from published import assert_state, kinds, local_value, rows_of  # noqa: E402
from seeds import session_seed  # noqa: E402
from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # noqa: E402

# Wide, tall (shards of 6 and 5 rows), a matrix over the factor size limit of 8 (no factor
# for SOAP; 4 blocks for Shampoo; diagonal factors for PSGDKron), a 1-D tensor, one whose
# second shard is empty, a replicated matrix, and another of the first's shape (PSGDKron's
# first scale is one for both, from both gradients).
LAYOUTS = [
    ((6, 11), Shard(0)),
    ((11, 5), Shard(0)),
    ((9, 10), Shard(0)),
    ((7,), Shard(0)),
    ((1, 6), Shard(0)),
    ((5, 4), Replicate()),
    ((6, 11), Shard(0)),
]
STEPS = 3  # then one more after loading the state dict
FACTORS = {"SOAP": "GG", "Shampoo": "factor_matrices", "PSGDKron": "Q"}  # a factor state's key
OPTIMIZERS = {
    # factors from step 1, refreshed (QR) at step 3
    "SOAP": lambda ps: fuser.optim.SOAP(
        ps, lr=0.01, precondition_frequency=2, max_precondition_dim=8, precondition_1d=True
    ),
    # grafting only at step 1, roots from step 2, refreshed every step; blocks of 8, momentum
    "Shampoo": lambda ps: fuser.optim.Shampoo(
        ps,
        lr=0.01,
        momentum=0.5,
        max_preconditioner_dim=8,
        precondition_frequency=1,
        start_preconditioning_step=2,
    ),
    # a fit every step (heavyball's schedule), its first scale from all first gradients of
    # a shape, triangular factors up to 8
    "PSGDKron": lambda ps: fuser.optim.PSGDKron(ps, lr=0.01, weight_decay=0.01, max_size_triangular=8),
}


def data():
    gen = torch.Generator().manual_seed(session_seed(1357))
    params = [torch.randn(shape, generator=gen) for shape, _ in LAYOUTS]
    grads = [[torch.randn(shape, generator=gen) for shape, _ in LAYOUTS] for _ in range(STEPS + 1)]
    return params, grads


def _next_step(name, mesh, params, grads, load, warm=False) -> list[torch.Tensor]:
    """A new optimizer on copies of ``params``, its state from ``load(model, optimizer)``:
    this rank's shards after its next step. ``warm``: a step at lr 0 first, which changes
    no parameter (DCP's set_optimizer_state_dict would step a stateless optimizer on zero
    gradients, from which PSGDKron cannot take its first scale)."""
    again = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = OPTIMIZERS[name](again)
    if warm:
        for p in again:
            p.grad = distribute_tensor(torch.ones(p.shape), mesh, p.placements)
        for group in opt.param_groups:
            group["lr"] = 0.0
        opt.step()
    load(torch.nn.ParameterList(again), opt)
    for p, g, (_, pl) in zip(again, grads, LAYOUTS):
        p.grad = distribute_tensor(g, mesh, [pl])
    opt.step()
    return [p.to_local().clone() for p in again]


def worker(rank, world, name, path, whole_sd):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    full, grads = data()
    params = [torch.nn.Parameter(distribute_tensor(t, mesh, [pl])) for t, (_, pl) in zip(full, LAYOUTS)]
    opt = OPTIMIZERS[name](params)
    collectives = []
    for step_grads in grads[:STEPS]:
        for p, g, (_, pl) in zip(params, step_grads, LAYOUTS):
            p.grad = distribute_tensor(g, mesh, [pl])
        before = fuser.stats()["collectives"]
        opt.step()
        collectives.append(fuser.stats()["collectives"] - before)
    marks = [opt.state[p].get("whole_on_rank") for p in params]
    holds = [FACTORS[name] in opt.state[p] for p in params]
    sd = opt.state_dict()
    states = {pid: {k: local_value(v) for k, v in st.items()} for pid, st in sd["state"].items()}
    types = {pid: {k: kinds(v) for k, v in st.items()} for pid, st in sd["state"].items()}
    dcp.save({"optim": sd}, checkpoint_id=path)
    # the next step of new optimizers loaded from DCP's state dict of this one (by
    # parameter names), and from the single process's state dict of whole tensors
    model = torch.nn.ParameterList(params)
    named = get_optimizer_state_dict(model, opt)
    nexts = [
        _next_step(
            name, mesh, params, grads[STEPS], lambda m, o: set_optimizer_state_dict(m, o, named), True
        ),
        # (copied: the ranks' arguments share memory with the test process's tensors)
        _next_step(name, mesh, params, grads[STEPS], lambda m, o: o.load_state_dict(copy.deepcopy(whole_sd))),
    ]
    return dict(
        params=[p.to_local().clone() for p in params],
        nexts=nexts,
        states=states,
        kinds=types,
        collectives=collectives,
        marks=marks,
        holds=holds,
    )


def single_process(name):
    """The optimizer on whole tensors in one process (one thread, as the ranks run): its
    state dict and parameters after ``STEPS`` steps (copies), and its parameters after one
    more."""
    full, grads = data()
    params = [torch.nn.Parameter(t.clone()) for t in full]
    opt = OPTIMIZERS[name](params)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step, step_grads in enumerate(grads):
            if step == STEPS:
                sd, before = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params]
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return sd, before, [p.detach() for p in params]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_row_shards_follow_the_optimizer_on_whole_tensors(tmp_path, name):
    path = str(tmp_path / "dcp")
    sd, params, then = single_process(name)
    ranks = run_ranks(worker, name, path, sd)
    world = len(ranks)
    # each sharded parameter to the rank owning the fewest elements so far (66, 55, 90,
    # 7, 6, 66 elements), which alone holds its factors; SOAP's and Shampoo's other rank
    # holds the marker (PSGDKron's its shards of exp_avg and update)
    owners = [0, 1, 1, 0, 0, None, 0]
    for rank, got in enumerate(ranks):
        assert got["holds"] == [o in (None, rank) for o in owners], (rank, got["holds"])
        if name != "PSGDKron":
            assert got["marks"] == [None if o in (None, rank) else o for o in owners], (rank, got["marks"])
    for rank, got in enumerate(ranks):
        for i, ((shape, pl), p) in enumerate(zip(LAYOUTS, params)):
            what = f"{name}, rank {rank}, parameter {i} {shape} {pl}"
            assert torch.equal(got["params"][i], rows_of(p, pl, rank, world)), what
            for how, shards in zip(("DCP's state dict", "whole state dict"), got["nexts"]):
                assert torch.equal(shards[i], rows_of(then[i], pl, rank, world)), f"{what}, {how}"
            st = sd["state"][i]
            assert set(got["states"][i]) == set(st), what
            for key, value in st.items():
                per_element = torch.is_tensor(value) and value.shape == p.shape
                kind = got["kinds"][i][key]
                assert kind == ("DTensor" if per_element else kinds(value)), (what, key, kind)
                assert_state(
                    got["states"][i][key], value, rank, world, pl if per_element else None, (what, key)
                )
        # an all_to_all to the owners and one back, for all row-sharded parameters
        assert got["collectives"] == [2] * STEPS, got["collectives"]
    _load_checkpoint_into_one_process(name, path, sd, params, then)


def _load_checkpoint_into_one_process(name, path, reference, reference_params, then):
    """The 2 ranks' checkpoint loaded by DCP into an optimizer on whole tensors whose
    states differ (one step from other gradients): it then holds the reference's states,
    and its next step is the reference's."""
    import torch.distributed.checkpoint as dcp

    params = [torch.nn.Parameter(p.clone()) for p in reference_params]
    opt = OPTIMIZERS[name](params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    for p, q in zip(params, reference_params):
        p.data.copy_(q)
    template = opt.state_dict()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load({"optim": template}, checkpoint_id=path, no_dist=True)
    opt.load_state_dict(template)
    loaded, want = opt.state_dict()["state"], reference["state"]
    for i in range(len(params)):
        assert set(loaded[i]) == set(want[i]), (name, i)
        for key, value in want[i].items():
            assert_state(local_value(loaded[i][key]), value, 0, 1, None, (name, i, key))
    for p, g in zip(params, data()[1][STEPS]):
        p.grad = g
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        opt.step()
    finally:
        torch.set_num_threads(threads)
    for i, (p, want) in enumerate(zip(params, then)):
        assert torch.equal(p.detach(), want), (name, i, "the step after loading")


def refused_worker(rank, world, names):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,))
    rows = 2 if rank == 0 else 4  # Shard(0) split 2 + 4, not torch.chunk's 3 + 3
    uneven = dict(shape=(6, 8), stride=(8, 1))
    messages = []
    for name in names:
        for make in (
            lambda: distribute_tensor(torch.randn(6, 8), mesh, [Shard(1)]),
            lambda: DTensor.from_local(torch.randn(rows, 8), mesh, [Shard(0)], **uneven),
        ):
            p = torch.nn.Parameter(make())
            p.grad = make()
            before = p.to_local().clone()
            opt = OPTIMIZERS[name]([p])
            try:
                opt.step()
                messages.append(None)
            except RuntimeError as e:
                messages.append((str(e), torch.equal(p.to_local(), before), len(opt.state)))
    return messages


def test_layouts_other_than_row_shards_are_refused_before_any_change():
    names = list(OPTIMIZERS)
    for messages in run_ranks(refused_worker, names):
        for name, (columns, uneven) in zip(names, zip(messages[::2], messages[1::2])):
            assert columns is not None and "shard it by rows" in columns[0] and name in columns[0], columns
            assert uneven is not None and "torch.chunk's split" in uneven[0], uneven
            assert columns[1:] == (True, 0) and uneven[1:] == (True, 0), (name, columns, uneven)
