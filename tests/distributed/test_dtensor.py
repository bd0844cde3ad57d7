"""Optimizers on hand-made DTensor shards (``distribute_tensor``) over 2 gloo processes,
against a single-process run of the same optimizer on the full tensors."""

from __future__ import annotations

import pytest
import torch
from cases import centred, lamb_clip
from ranks import run_ranks

import fuser

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch was built without gloo", allow_module_level=True)

from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402

# (shape, placements): odd sizes; (1, 3) leaves rank 1 an empty shard; a Shard(1)
# tensor; a replicated one, which global_norm must count once.
LAYOUT = [((7, 3), "S0"), ((1, 3), "S0"), ((5,), "S0"), ((3, 5), "S1"), ((4,), "R"), ((2, 9), "S0")]
STEPS = 3
OPTIMIZERS = {
    "lamb_clip": lambda params: fuser.compile(lamb_clip)(params),
    "centred": lambda params: fuser.compile(centred)(params),
    "LAMB": lambda params: fuser.optim.LAMB(params, lr=0.05, weight_decay=0.1),
    "AdamW": lambda params: fuser.optim.AdamW(params, lr=0.05),
}


def placements(code: str):
    return {"S0": [Shard(0)], "S1": [Shard(1)], "R": [Replicate()]}[code]


def data():
    """The full initial parameters and every step's full gradients (the same on every rank)."""
    gen = torch.Generator().manual_seed(1234)
    params = [torch.randn(shape, generator=gen) for shape, _ in LAYOUT]
    grads = [[torch.randn(shape, generator=gen) for shape, _ in LAYOUT] for _ in range(STEPS)]
    return params, grads


def param_groups(params):
    """Two groups with different learning rates, as a real model's decay/no-decay split."""
    return [{"params": params[:3]}, {"params": params[3:], "lr": 0.03}]


def single_process(name: str):
    full, grads = data()
    params = [p.clone() for p in full]
    opt = OPTIMIZERS[name](param_groups(params))
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return params, [dict(opt.state[p]) for p in params]


def sharded_worker(rank, world, names):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name in names:
        full, grads = data()
        params = [torch.nn.Parameter(distribute_tensor(p, mesh, placements(code)))
                  for p, (_, code) in zip(full, LAYOUT)]
        opt = OPTIMIZERS[name](param_groups(params))
        before = fuser.stats()["collectives"]
        for k, step_grads in enumerate(grads):
            for p, g, (_, code) in zip(params, step_grads, LAYOUT):
                # Step 2 hands replicated gradients (what autograd gives for a loss summed
                # over a sharded tensor): the optimizer lays them out like the parameter.
                p.grad = distribute_tensor(g, mesh, [Replicate()] if k == 1 else placements(code))
            opt.step()
        collectives = fuser.stats()["collectives"] - before
        states = [{k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in opt.state[p].items()}
                  for p in params]
        saved = opt.state_dict()["state"]
        kinds = sorted({(k, type(v).__name__, str(getattr(v, "placements", "")) == str(p.placements))
                        for i, p in enumerate(params) for k, v in saved[i].items()})
        out[name] = dict(params=[p.full_tensor() for p in params], states=states,
                         local_numels=[p.to_local().numel() for p in params], collectives=collectives,
                         kinds=[list(k) for k in kinds])
    out["reload"] = reload_full_state(mesh)
    return out


def reload_full_state(mesh):
    """A state_dict of full tensors (as saved without sharding) loaded into an optimizer
    of DTensor parameters: each state is scattered like its parameter, and the next step
    is the one the original optimizer takes."""
    full, grads = data()
    params = [torch.nn.Parameter(distribute_tensor(p, mesh, placements(code)))
              for p, (_, code) in zip(full, LAYOUT)]
    opt = OPTIMIZERS["lamb_clip"](param_groups(params))
    for p, g, (_, code) in zip(params, grads[0], LAYOUT):
        p.grad = distribute_tensor(g, mesh, placements(code))
    opt.step()
    saved = opt.state_dict()
    saved["state"] = {i: {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in st.items()}
                      for i, st in saved["state"].items()}
    copies = [torch.nn.Parameter(distribute_tensor(p.detach().full_tensor(), mesh, placements(code)))
              for p, (_, code) in zip(params, LAYOUT)]
    reloaded = OPTIMIZERS["lamb_clip"](param_groups(copies))
    reloaded.load_state_dict(saved)
    placed = all(isinstance(reloaded.state[c][k], DTensor) and reloaded.state[c][k].placements == c.placements
                 for c in copies for k in ("m", "v"))
    for p, c, g, (_, code) in zip(params, copies, grads[1], LAYOUT):
        p.grad = distribute_tensor(g, mesh, placements(code))
        c.grad = distribute_tensor(g, mesh, placements(code))
    opt.step()
    reloaded.step()
    diffs = [(p.full_tensor() - c.full_tensor()).abs().max().item() for p, c in zip(params, copies)]
    return dict(placed=placed, diffs=diffs)


@pytest.fixture(scope="module")
def sharded():
    return run_ranks(sharded_worker, list(OPTIMIZERS))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_sharded_step_equals_a_single_process_run(sharded, name):
    want_params, want_states = single_process(name)
    for rank_result in sharded:
        got = rank_result[name]
        for i, (p, want) in enumerate(zip(got["params"], want_params)):
            torch.testing.assert_close(p, want, rtol=2e-5, atol=2e-6, msg=f"parameter {i} ({LAYOUT[i]})")
        for i, (st, want) in enumerate(zip(got["states"], want_states)):
            assert set(st) == set(want)
            for key in want:
                torch.testing.assert_close(torch.as_tensor(st[key]), torch.as_tensor(want[key]),
                                           rtol=2e-5, atol=2e-6, msg=f"state {key!r} of parameter {i}")


def test_a_shard_may_be_empty(sharded):
    assert sharded[1]["lamb_clip"]["local_numels"][1] == 0
    assert sharded[0]["lamb_clip"]["local_numels"][1] == 3


@pytest.mark.parametrize("name, per_step", [("lamb_clip", 2), ("centred", 4), ("LAMB", 1), ("AdamW", 0)])
def test_one_collective_per_reduction_phase_and_combine_op(sharded, name, per_step):
    # For all six tensors at once (one mesh). lamb_clip: phases 1 and 2 reduce, by sums.
    # centred: both of its reduction phases have sums and maxes. LAMB: one phase of
    # norms. AdamW reduces nothing.
    assert sharded[0][name]["collectives"] == per_step * STEPS


def test_state_is_sharded_like_its_parameter(sharded):
    kinds = {tuple(k) for k in sharded[0]["LAMB"]["kinds"]}
    assert kinds == {("exp_avg", "DTensor", True), ("exp_avg_sq", "DTensor", True), ("step", "Tensor", False)}


def test_a_full_state_dict_loads_into_sharded_parameters(sharded):
    for r in sharded:
        assert r["reload"]["placed"]
        assert r["reload"]["diffs"] == [0.0] * len(LAYOUT)
