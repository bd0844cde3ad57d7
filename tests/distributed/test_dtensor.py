"""Optimizers on hand-made DTensor shards (``distribute_tensor``) over 2 gloo processes
(and 4, for a 2 x 2 mesh), against a single-process run of the same optimizer on the full
tensors."""

from __future__ import annotations

import pytest
import torch
from cases import centred, lamb_clip
from ranks import run_ranks

import fuser

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch was built without gloo", allow_module_level=True)

from seeds import session_seed  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402

# (shape, placements per mesh dimension, dtype). On one mesh dimension of 2 ranks: odd
# sizes; (1, 3) leaves rank 1 an empty shard; a Shard(1) tensor; a replicated one, which
# global_norm must count once; a bf16 one, in a launch of its own whose partials go in
# the same collectives. On a 2 x 2 mesh: tensors sharded over one dimension, the other,
# both (on two tensor dimensions or nested on one), or neither.
LAYOUTS = {
    "1d": [
        ((7, 3), "S0"),
        ((1, 3), "S0"),
        ((5,), "S0"),
        ((3, 5), "S1"),
        ((4,), "R"),
        ((2, 9), "S0"),
        ((6, 5), "S0", torch.bfloat16),
    ],
    "2d": [
        ((7, 3), "S0 S1"),
        ((5, 4), "R S0"),
        ((1, 3), "S0 R"),
        ((9,), "S0 S0"),
        ((4,), "R R"),
        ((3, 3), "S1 S0"),
    ],
}
MESHES = {"1d": (2,), "2d": (2, 2)}
STEPS = 3
OPTIMIZERS = {
    "lamb_clip": lambda params: fuser.compile(lamb_clip)(params),
    "centred": lambda params: fuser.compile(centred)(params),
    "LAMB": lambda params: fuser.optim.LAMB(params, lr=0.05, weight_decay=0.1),
    "AdamW": lambda params: fuser.optim.AdamW(params, lr=0.05),
}


def placements(codes: str):
    return [{"S0": Shard(0), "S1": Shard(1), "R": Replicate()}[c] for c in codes.split()]


def data(layout: str):
    """The full initial parameters and every step's full gradients (the same on every rank)."""
    gen = torch.Generator().manual_seed(session_seed(1234))
    shapes = [(entry[0], entry[2] if len(entry) > 2 else torch.float32) for entry in LAYOUTS[layout]]
    params = [torch.randn(shape, generator=gen).to(dtype) for shape, dtype in shapes]
    grads = [[torch.randn(shape, generator=gen).to(dtype) for shape, dtype in shapes] for _ in range(STEPS)]
    return params, grads


def codes(layout: str) -> list[str]:
    return [entry[1] for entry in LAYOUTS[layout]]


def param_groups(params):
    """Two groups with different learning rates, as a real model's decay/no-decay split."""
    return [{"params": params[:3]}, {"params": params[3:], "lr": 0.03}]


def single_process(name: str, layout: str):
    full, grads = data(layout)
    params = [p.clone() for p in full]
    opt = OPTIMIZERS[name](param_groups(params))
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return params, [dict(opt.state[p]) for p in params]


def distribute(tensors, mesh, layout: str, replicated: bool = False):
    return [
        distribute_tensor(t, mesh, [Replicate()] * mesh.ndim if replicated else placements(c))
        for t, c in zip(tensors, codes(layout))
    ]


def sharded_worker(rank, world, names, layout):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", MESHES[layout])
    out = {}
    for name in names:
        full, grads = data(layout)
        params = [torch.nn.Parameter(p) for p in distribute(full, mesh, layout)]
        opt = OPTIMIZERS[name](param_groups(params))
        before = fuser.stats()["collectives"]
        for k, step_grads in enumerate(grads):
            # Step 2 hands replicated gradients (what autograd gives for a loss summed
            # over a sharded tensor): the optimizer lays them out like the parameter.
            for p, g in zip(params, distribute(step_grads, mesh, layout, replicated=k == 1)):
                p.grad = g
            opt.step()
        collectives = fuser.stats()["collectives"] - before
        states = [
            {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in opt.state[p].items()}
            for p in params
        ]
        saved = opt.state_dict()["state"]
        kinds = sorted(
            {
                (k, type(v).__name__, str(getattr(v, "placements", "")) == str(p.placements))
                for i, p in enumerate(params)
                for k, v in saved[i].items()
            }
        )
        out[name] = dict(
            params=[p.full_tensor() for p in params],
            states=states,
            local_numels=[p.to_local().numel() for p in params],
            collectives=collectives,
            kinds=[list(k) for k in kinds],
        )
    if layout == "1d":
        out["reload"] = reload_full_state(mesh, layout)
    return out


def reload_full_state(mesh, layout: str):
    """A state_dict of full tensors (as saved without sharding) loaded into an optimizer
    of DTensor parameters: each state is scattered like its parameter, and the next step
    is the one the original optimizer takes."""
    full, grads = data(layout)
    params = [torch.nn.Parameter(p) for p in distribute(full, mesh, layout)]
    opt = OPTIMIZERS["lamb_clip"](param_groups(params))
    for p, g in zip(params, distribute(grads[0], mesh, layout)):
        p.grad = g
    opt.step()
    saved = opt.state_dict()
    saved["state"] = {
        i: {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in st.items()}
        for i, st in saved["state"].items()
    }
    fulls = [p.detach().full_tensor() for p in params]
    copies = [torch.nn.Parameter(c) for c in distribute(fulls, mesh, layout)]
    reloaded = OPTIMIZERS["lamb_clip"](param_groups(copies))
    reloaded.load_state_dict(saved)
    placed = all(
        isinstance(reloaded.state[c][k], DTensor) and reloaded.state[c][k].placements == c.placements
        for c in copies
        for k in ("m", "v")
    )
    for p, c, g in zip(params, copies, distribute(grads[1], mesh, layout)):
        p.grad, c.grad = g, g.clone()
    opt.step()
    reloaded.step()
    diffs = [(p.full_tensor() - c.full_tensor()).abs().max().item() for p, c in zip(params, copies)]
    return dict(placed=placed, diffs=diffs)


@pytest.fixture(scope="module")
def sharded():
    """Every optimizer on one mesh dimension of 2 ranks."""
    return run_ranks(sharded_worker, list(OPTIMIZERS), "1d")


@pytest.fixture(scope="module")
def sharded_2d():
    """The two reduction rules on a 2 x 2 mesh (4 ranks)."""
    return run_ranks(sharded_worker, ["lamb_clip", "centred"], "2d", world=4)


def assert_matches_single_process(results: list, name: str, layout: str) -> None:
    want_params, want_states = single_process(name, layout)
    for rank_result in results:
        got = rank_result[name]
        for i, (p, want) in enumerate(zip(got["params"], want_params)):
            # A bf16 parameter may round one ulp apart where the reductions' order differs.
            tol = dict(rtol=8e-3, atol=1e-5) if want.dtype == torch.bfloat16 else dict(rtol=2e-5, atol=2e-6)
            torch.testing.assert_close(p, want, **tol, msg=f"parameter {i} {LAYOUTS[layout][i]}")
        for i, (st, want) in enumerate(zip(got["states"], want_states)):
            assert set(st) == set(want)
            for key in want:
                torch.testing.assert_close(
                    torch.as_tensor(st[key]),
                    torch.as_tensor(want[key]),
                    rtol=2e-5,
                    atol=2e-6,
                    msg=f"state {key!r} of parameter {i}",
                )


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_sharded_step_equals_a_single_process_run(sharded, name):
    assert_matches_single_process(sharded, name, "1d")


@pytest.mark.parametrize("name", ["lamb_clip", "centred"])
def test_2d_mesh_step_equals_a_single_process_run(sharded_2d, name):
    assert_matches_single_process(sharded_2d, name, "2d")


def test_a_shard_may_be_empty(sharded):
    assert sharded[1]["lamb_clip"]["local_numels"][1] == 0
    assert sharded[0]["lamb_clip"]["local_numels"][1] == 3


@pytest.mark.parametrize("name, per_step", [("lamb_clip", 2), ("centred", 4), ("LAMB", 1), ("AdamW", 0)])
def test_one_collective_per_reduction_phase_and_combine_op(sharded, name, per_step):
    # For all tensors at once, fp32 and bf16 launches together. lamb_clip: phases 1 and 2
    # reduce, by sums. centred: both of its reduction phases have sums and maxes. LAMB:
    # one phase of norms. AdamW reduces nothing.
    assert sharded[0][name]["collectives"] == per_step * STEPS


@pytest.mark.parametrize("name, per_step", [("lamb_clip", 2 * 2), ("centred", 4 * 2)])
def test_one_collective_per_mesh_dimension_on_a_2d_mesh(sharded_2d, name, per_step):
    assert sharded_2d[0][name]["collectives"] == per_step * STEPS


def test_state_is_sharded_like_its_parameter(sharded):
    kinds = {tuple(k) for k in sharded[0]["LAMB"]["kinds"]}
    assert kinds == {("exp_avg", "DTensor", True), ("exp_avg_sq", "DTensor", True), ("step", "Tensor", False)}


def test_a_full_state_dict_loads_into_sharded_parameters(sharded):
    for r in sharded:
        assert r["reload"]["placed"]
        assert r["reload"]["diffs"] == [0.0] * len(LAYOUTS["1d"])
