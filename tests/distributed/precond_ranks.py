"""The harness shared by the tests of matrix-preconditioned optimizers on DTensor parameters
sharded by rows (the built-ins' and the matrix rules'), imported by the ranks too: the
ranks' steps, state dict, DCP checkpoint and next steps; the same optimizer on whole
tensors in one process; and the checks of the ranks against it. ``make(params)`` builds
the optimizer under test; ``layouts`` are ``(shape, placement)`` pairs."""

from __future__ import annotations

import copy
import functools
import warnings

import torch
from published import assert_state, kinds, local_value, rows_of
from seeds import session_seed
from torch.distributed.tensor import Shard, distribute_tensor

import fuser

STEPS = 3  # then one more after loading the state dict


def data(layouts, steps=STEPS + 1, salt=1357):
    gen = torch.Generator().manual_seed(session_seed(salt))
    params = [torch.randn(shape, generator=gen) for shape, _ in layouts]
    grads = [[torch.randn(shape, generator=gen) for shape, _ in layouts] for _ in range(steps)]
    return params, grads


def one_thread(fn):
    """``fn()`` on one thread, as the ranks run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def _next_step(make, layouts, mesh, params, grads, load, warm=False) -> list[torch.Tensor]:
    """A new optimizer on copies of ``params``, its state from ``load(model, optimizer)``:
    this rank's shards after its next step. ``warm``: a step at lr 0 first, which changes
    no parameter (DCP's set_optimizer_state_dict would step a stateless optimizer on zero
    gradients, from which PSGDKron cannot take its first scale)."""
    again = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = make(again)
    if warm:
        for p in again:
            p.grad = distribute_tensor(torch.ones(p.shape), mesh, p.placements)
        for group in opt.param_groups:
            group["lr"] = 0.0
        opt.step()
    load(torch.nn.ParameterList(again), opt)
    for p, g, (_, pl) in zip(again, grads, layouts):
        p.grad = distribute_tensor(g, mesh, [pl])
    opt.step()
    return [p.to_local().clone() for p in again]


def worker(rank, world, make, layouts, holds_key, path, whole_sd):
    """A rank's ``STEPS`` steps: its shards, published states and their types, collectives
    per step, markers of the owner (``whole_on_rank``), whether it holds ``holds_key``, and
    the shards after the next step of optimizers loaded from DCP's and ``whole_sd``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    full, grads = data(layouts)
    params = [torch.nn.Parameter(distribute_tensor(t, mesh, [pl])) for t, (_, pl) in zip(full, layouts)]
    opt = make(params)
    collectives = []
    for step_grads in grads[:STEPS]:
        for p, g, (_, pl) in zip(params, step_grads, layouts):
            p.grad = distribute_tensor(g, mesh, [pl])
        before = fuser.stats()["collectives"]
        opt.step()
        collectives.append(fuser.stats()["collectives"] - before)
    marks = [opt.state[p].get("whole_on_rank") for p in params]
    holds = [holds_key in opt.state[p] for p in params]
    sd = opt.state_dict()
    states = {pid: {k: local_value(v) for k, v in st.items()} for pid, st in sd["state"].items()}
    types = {pid: {k: kinds(v) for k, v in st.items()} for pid, st in sd["state"].items()}
    dcp.save({"optim": sd}, checkpoint_id=path)
    # the next step of new optimizers loaded from DCP's state dict of this one (by
    # parameter names), and from the single process's state dict of whole tensors
    model = torch.nn.ParameterList(params)
    named = get_optimizer_state_dict(model, opt)
    after = functools.partial(_next_step, make, layouts, mesh, params, grads[STEPS])
    nexts = [
        after(lambda m, o: set_optimizer_state_dict(m, o, named), True),
        # (copied: the ranks' arguments share memory with the test process's tensors)
        after(lambda m, o: o.load_state_dict(copy.deepcopy(whole_sd))),
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


def single_process(make, layouts):
    """The optimizer on whole tensors in one process: its state dict and parameters after
    ``STEPS`` steps (copies), and its parameters after one more."""
    full, grads = data(layouts)
    params = [torch.nn.Parameter(t.clone()) for t in full]
    opt = make(params)
    for step, step_grads in enumerate(grads):
        if step == STEPS:
            sd, before = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params]
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        one_thread(opt.step)
    return sd, before, [p.detach() for p in params]


def assert_ranks_follow(ranks, name, layouts, sd, params, then, kind_of):
    """Each rank's results (``worker``) against one process's (``single_process``): the
    collectives, its rows of the parameters now and after either next step, and each
    published state. ``kind_of(key, value, p)``: the type a state should be published as;
    "DTensor" for the states laid out like the parameter, compared by rows."""
    world = len(ranks)
    for rank, got in enumerate(ranks):
        # an all_to_all to the owners and one back, for all row-sharded parameters
        assert got["collectives"] == [2] * STEPS, got["collectives"]
        for i, ((shape, pl), p) in enumerate(zip(layouts, params)):
            what = f"{name}, rank {rank}, parameter {i} {shape} {pl}"
            assert torch.equal(got["params"][i], rows_of(p, pl, rank, world)), what
            for how, shards in zip(("DCP's state dict", "whole state dict"), got["nexts"]):
                assert torch.equal(shards[i], rows_of(then[i], pl, rank, world)), f"{what}, {how}"
            st = sd["state"][i]
            assert set(got["states"][i]) == set(st), what
            for key, value in st.items():
                want = kind_of(key, value, p)
                kind = got["kinds"][i][key]
                assert kind == want, (what, key, kind)
                by_rows = pl if want == "DTensor" else None
                assert_state(got["states"][i][key], value, rank, world, by_rows, (what, key))


def load_checkpoint_into_one_process(make, layouts, name, path, reference, reference_params, then):
    """The 2 ranks' checkpoint loaded by DCP into an optimizer on whole tensors whose
    states differ (one step from other gradients): it then holds the reference's states,
    and its next step is the reference's."""
    import torch.distributed.checkpoint as dcp

    params = [torch.nn.Parameter(p.clone()) for p in reference_params]
    opt = make(params)
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
    for p, g in zip(params, data(layouts)[1][STEPS]):
        p.grad = g
    one_thread(opt.step)
    for i, (p, want) in enumerate(zip(params, then)):
        assert torch.equal(p.detach(), want), (name, i, "the step after loading")


def refused_layouts(rank, mesh):
    """Makers of (6, 8) tensors sharded other than by torch.chunk's rows: by columns, and
    by rows split 2 + 4 instead of 3 + 3."""
    from torch.distributed.tensor import DTensor

    rows = 2 if rank == 0 else 4
    uneven = dict(shape=(6, 8), stride=(8, 1))
    return (
        lambda: distribute_tensor(torch.randn(6, 8), mesh, [Shard(1)]),
        lambda: DTensor.from_local(torch.randn(rows, 8), mesh, [Shard(0)], **uneven),
    )


def refusal(make_tensor, make_opt):
    """A step of ``make_opt(p)`` on a parameter and gradient from ``make_tensor()``: None if
    it ran, else its error's message, whether the parameter is unchanged, and how many
    parameters have a state."""
    p = torch.nn.Parameter(make_tensor())
    p.grad = make_tensor()
    before = p.to_local().clone()
    opt = make_opt(p)
    try:
        opt.step()
        return None
    except RuntimeError as e:
        return str(e), torch.equal(p.to_local(), before), len(opt.state)
