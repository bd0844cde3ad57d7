"""8-bit states and split master weights on DTensor shards (2 gloo processes): each rank
quantizes its own shard in blocks, so a rank's step is exactly a single-process step over
its local tensors; the default state dict holds fp32 DTensors placed like the parameters,
which torch.distributed.checkpoint saves on 2 ranks and loads into one process."""

from __future__ import annotations

import warnings

import pytest
import torch
from cases import (
    batches,
    layout_data,
    make_compressed_optimizer,
    make_model,
    states_of,
    step_local_pieces,
    train,
    with_state,
)
from ranks import run_ranks

import fuser
from fuser.runtime import quant

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch was built without gloo", allow_module_level=True)

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


make_optimizer = make_compressed_optimizer


def data():
    return layout_data(LAYOUTS, STEPS, 4321)


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
        opt, params, kept = step_local_pieces(make_optimizer, got)
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


def fsdp_worker(rank, world, path):
    """FSDP2 with 8-bit AdamW states: two steps, then a DCP checkpoint of the default
    (fp32) state dict; returns the saved states as full tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = fuser.optim.AdamW(model.parameters(), lr=0.05, state_dtype="q8")
    train(model, opt, [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in batches(2)])
    osd = get_optimizer_state_dict(model, opt)
    dcp.save({"model": get_model_state_dict(model), "optim": osd}, checkpoint_id=path)
    return {
        name: {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in st.items()}
        for name, st in osd["state"].items()
    }


def test_dcp_saves_8bit_states_on_two_ranks_and_loads_them_in_one_process(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    path = str(tmp_path / "dcp")
    saved = run_ranks(fsdp_worker, path)[0]
    model = make_model()
    opt = fuser.optim.AdamW(model.parameters(), lr=0.05, state_dtype="q8")
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(sd, checkpoint_id=path, no_dist=True)
    set_optimizer_state_dict(model, opt, sd["optim"])
    named = dict(model.named_parameters())
    for name, st in saved.items():
        assert set(st) == {"step", "exp_avg", "exp_avg_sq"}, (name, set(st))
        p = named[name]
        for key, fmt in (("exp_avg", "int8"), ("exp_avg_sq", "uint8")):
            assert opt.state[p][key].dtype == (torch.int8 if fmt == "int8" else torch.uint8), (name, key)
            # the saved fp32 values, quantized in blocks of the whole tensor
            codes, scales = quant.encode(st[key], fmt, 32)
            assert torch.equal(opt.state[p][key], codes), (name, key)
            assert torch.equal(opt.state[p][key + "_absmax"], scales), (name, key)
        assert opt.state[p]["step"].item() == st["step"].item() == 2


def _step(opt, params, mesh, step_grads):
    for p, g, (_, pl, _) in zip(params, step_grads, LAYOUTS):
        p.grad = distribute_tensor(g, mesh, [pl])
    opt.step()


def compressed_dcp_worker(rank, world, path):
    """Two steps, a DCP checkpoint of state_dict(compressed=True), a third step; then the
    parameters as they were at the checkpoint, a new optimizer loaded from it, and the
    third step again."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    full, grads = data()
    params = [torch.nn.Parameter(distribute_tensor(t, mesh, [pl])) for t, (_, pl, _) in zip(full, LAYOUTS)]
    opt = make_optimizer(params)
    for step_grads in grads[:2]:
        _step(opt, params, mesh, step_grads)
    sd = opt.state_dict(compressed=True)
    scale_kinds = sorted({type(st["exp_avg_absmax"]).__name__ for st in sd["state"].values()})
    dcp.save({"optim": sd}, checkpoint_id=path)
    saved, at_checkpoint = states_of(opt, params), [p.to_local().clone() for p in params]
    _step(opt, params, mesh, grads[2])
    continued = [p.to_local().clone() for p in params]

    with torch.no_grad():
        for p, value in zip(params, at_checkpoint):
            p.to_local().copy_(value)
    again = with_state(params)
    template = again.state_dict(compressed=True)
    dcp.load({"optim": template}, checkpoint_id=path)
    again.load_state_dict(template)
    loaded = states_of(again, params)
    _step(again, params, mesh, grads[2])
    return dict(
        saved=saved,
        loaded=loaded,
        continued=continued,
        resumed=[p.to_local().clone() for p in params],
        scale_kinds=scale_kinds,
    )


def test_compressed_state_dict_round_trips_through_dcp_on_the_same_ranks(tmp_path):
    path = str(tmp_path / "dcp")
    for rank, got in enumerate(run_ranks(compressed_dcp_worker, path)):
        # sharded parameters' scales are DTensors (every rank's saved), replicated ones plain
        assert got["scale_kinds"] == ["DTensor", "Tensor"], got["scale_kinds"]
        for i, (saved, loaded) in enumerate(zip(got["saved"], got["loaded"])):
            assert set(saved) == set(loaded), (rank, i, set(saved), set(loaded))
            for key in saved:
                assert torch.equal(torch.as_tensor(saved[key]), torch.as_tensor(loaded[key])), (rank, i, key)
            assert saved["exp_avg"].dtype == torch.int8, (rank, i)
        for i, (a, b) in enumerate(zip(got["continued"], got["resumed"])):
            assert torch.equal(a, b), f"rank {rank}, parameter {i} {LAYOUTS[i][0]}: the resumed step differs"


def test_compressed_checkpoint_of_two_ranks_is_refused_by_one_process(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = str(tmp_path / "dcp")
    run_ranks(compressed_dcp_worker, path)
    full, _ = data()
    params = [torch.nn.Parameter(t.clone()) for t in full]
    opt = with_state(params)
    before = states_of(opt, params)
    template = opt.state_dict(compressed=True)
    # Each rank's scales are a row of a [2, L] tensor: torch.distributed.checkpoint
    # refuses them before it reads anything (a compressed state dict loads into the
    # sharding it was saved from; the default fp32 one reshards).
    with warnings.catch_warnings(), pytest.raises(CheckpointException, match="Size mismatch"):
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load({"optim": template}, checkpoint_id=path, no_dist=True)
    for got, want in zip(states_of(opt, params), before):
        for key in want:
            assert torch.equal(torch.as_tensor(got[key]), torch.as_tensor(want[key])), key
