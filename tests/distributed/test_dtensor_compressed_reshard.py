"""Compressed state dicts (8-bit codes and their block scales, split masters) resharded by
torch.distributed.checkpoint: where every row of a parameter's 2-D view is a whole number
of blocks and the parameter is sharded by rows (or replicated), no block straddles two
shards, so a checkpoint saved on 2 ranks loads into one process, and one saved in one
process loads on 2 ranks, with codes and scales exactly as they were and the next step
equal, bit for bit, to the step the saving optimizer takes. On CPU tensors over gloo, and
on two GPUs over NCCL (the single process then on cuda:0)."""

from __future__ import annotations

import warnings

import pytest
import torch

from fuser.runtime import quant

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch was built without gloo", allow_module_level=True)

from cases import layout_data, local_copy, make_compressed_optimizer, states_of, with_state  # noqa: E402
from ranks import run_ranks  # noqa: E402
from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # noqa: E402

BLOCK = 32  # the default FUSER_OPTIM_QBLOCK
# Rows of whole blocks: odd row counts (a shard of rank 1 shorter, one empty), a 3-D
# tensor, a replicated one, and bf16 parameters with split masters.
LAYOUTS = [
    ((37, 64), Shard(0), torch.float32),
    ((1, 32), Shard(0), torch.float32),
    ((5, 2, 16), Shard(0), torch.bfloat16),
    ((6, 96), Replicate(), torch.float32),
]
STEPS = 3
# The ranks' devices: CPU over gloo, one GPU each over NCCL where two are present.
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")],
    ),
]
BACKEND = {"cpu": "gloo", "cuda": "nccl"}


make_optimizer = make_compressed_optimizer


def data():
    return layout_data(LAYOUTS, STEPS, 2468)


def _distributed(mesh, tensors):
    return [distribute_tensor(t, mesh, [pl]) for t, (_, pl, _) in zip(tensors, LAYOUTS)]


def _two_steps(mesh):
    """DTensor parameters on ``mesh``, a ``make_optimizer`` over them after two steps, and
    every step's gradients (whole tensors)."""
    full, grads = data()
    params = [torch.nn.Parameter(t) for t in _distributed(mesh, full)]
    opt = make_optimizer(params)
    for step_grads in grads[:2]:
        for p, g in zip(params, _distributed(mesh, step_grads)):
            p.grad = g
        opt.step()
    return params, opt, grads


def save_on_ranks(rank, world, path, device):
    """Two steps on DTensor shards, a DCP checkpoint of state_dict(compressed=True), a
    third step; returns each rank's states at the checkpoint and its parameters before and
    after the third step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (world,))
    params, opt, grads = _two_steps(mesh)
    sd = opt.state_dict(compressed=True)
    kinds = [type(sd["state"][i]["exp_avg_absmax"]).__name__ for i in range(len(params))]
    dcp.save({"optim": sd}, checkpoint_id=path)
    saved, before = states_of(opt, params), [local_copy(p.detach()) for p in params]
    for p, g in zip(params, _distributed(mesh, grads[2])):
        p.grad = g
    opt.step()
    return dict(saved=saved, before=before, after=[local_copy(p.detach()) for p in params], kinds=kinds)


def _cpu(v):
    return v.cpu() if torch.is_tensor(v) else v


def _whole(pieces, i):
    """Parameter ``i``'s value from every rank's piece: its rows in rank order, or rank 0's
    where it is replicated."""
    if isinstance(LAYOUTS[i][1], Replicate):
        return pieces[0]
    return torch.cat(pieces)


def _scales(pieces, rows, i):
    """Parameter ``i``'s block scales from every rank's (each holding ``rows`` rows; an
    empty shard keeps one unused scale)."""
    shape = LAYOUTS[i][0]
    per_row = torch.Size(shape).numel() // shape[0] // BLOCK
    return _whole([s[: n * per_row] for s, n in zip(pieces, rows)], i)


def _value(pieces, rows, i, key):
    if key == "step":
        return pieces[0]
    return _scales(pieces, rows, i) if key.endswith("_absmax") else _whole(pieces, i)


@pytest.mark.parametrize("device", DEVICES)
def test_compressed_checkpoint_of_two_ranks_loads_into_one_process(tmp_path, device):
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "dcp")
    got = run_ranks(save_on_ranks, path, device, backend=BACKEND[device])
    # sharded parameters' scales are DTensors placed like them, replicated ones plain
    assert got[0]["kinds"] == ["DTensor", "DTensor", "DTensor", "Tensor"], got[0]["kinds"]
    params = [
        torch.nn.Parameter(_whole([g["before"][i] for g in got], i).to(device)) for i in range(len(LAYOUTS))
    ]
    opt = with_state(params)
    template = opt.state_dict(compressed=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load({"optim": template}, checkpoint_id=path, no_dist=True)
    opt.load_state_dict(template)
    for i, p in enumerate(params):
        rows = [g["before"][i].shape[0] for g in got]
        for key, value in opt.state[p].items():
            want = _value([g["saved"][i][key] for g in got], rows, i, key)
            assert torch.equal(torch.as_tensor(value).cpu(), torch.as_tensor(want)), (i, key)
        assert opt.state[p]["exp_avg"].dtype == torch.int8, i
    _, grads = data()
    for p, g in zip(params, grads[2]):
        p.grad = g.to(device)
    opt.step()
    for i, p in enumerate(params):
        want = _whole([g["after"][i] for g in got], i)
        assert torch.equal(p.detach().cpu(), want), (
            f"parameter {i} {LAYOUTS[i][0]}: the step after loading differs"
        )


def load_on_ranks(rank, world, saved, before, device):
    """This rank's shards of ``before``, a new optimizer loaded from ``saved`` (the path
    of a compressed checkpoint, or a compressed state dict of whole tensors, which each
    rank's ``load_state_dict`` scatters like the parameters), its states, and its
    parameters after the third step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (world,))
    # (the ranks' ``before`` share memory, and a replicated DTensor keeps the tensor given)
    params = [torch.nn.Parameter(t) for t in _distributed(mesh, [b.clone() for b in before])]
    opt = with_state(params)
    if isinstance(saved, str):
        template = opt.state_dict(compressed=True)
        dcp.load({"optim": template}, checkpoint_id=saved)
        saved = template
    opt.load_state_dict(saved)
    loaded = states_of(opt, params)
    _, grads = data()
    for p, g in zip(params, _distributed(mesh, grads[2])):
        p.grad = g
    opt.step()
    return dict(
        loaded=loaded,
        after=[local_copy(p.detach()) for p in params],
        rows=[p.to_local().shape[0] for p in params],
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("through", ["dcp", "state_dict"])
def test_compressed_checkpoint_of_one_process_loads_on_two_ranks(tmp_path, through, device):
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "dcp")
    full, grads = data()
    params = [torch.nn.Parameter(t.to(device)) for t in full]
    opt = make_optimizer(params)
    for step_grads in grads[:2]:
        for p, g in zip(params, step_grads):
            p.grad = g.to(device)
        opt.step()
    sd = opt.state_dict(compressed=True)
    assert [tuple(sd["state"][i]["exp_avg_absmax"].shape) for i in range(len(params))] == [
        (shape[0], torch.Size(shape).numel() // shape[0] // BLOCK) for shape, _, _ in LAYOUTS
    ]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save({"optim": sd}, checkpoint_id=path, no_dist=True)
    saved, before = states_of(opt, params), [p.detach().to("cpu", copy=True) for p in params]
    # (a state dict holds the live states, as torch's does: a copy before the next step;
    # on the CPU, for the ranks' arguments)
    whole = {"state": {i: {k: _cpu(local_copy(v)) for k, v in st.items()} for i, st in sd["state"].items()}}
    whole["param_groups"] = sd["param_groups"]
    for p, g in zip(params, grads[2]):
        p.grad = g.to(device)
    opt.step()
    got = run_ranks(
        load_on_ranks, path if through == "dcp" else whole, before, device, backend=BACKEND[device]
    )
    for i, p in enumerate(params):
        rows = [g["rows"][i] for g in got]
        for key, want in saved[i].items():
            value = _value([g["loaded"][i][key] for g in got], rows, i, key)
            assert torch.equal(torch.as_tensor(value), _cpu(torch.as_tensor(want))), (i, key)
        assert torch.equal(_whole([g["after"][i] for g in got], i), p.detach().cpu()), (
            f"parameter {i} after the step"
        )


def test_scales_follow_the_rows_they_scale():
    # The [rows, blocks a row] layout holds each row's scales in its row: a block's scale
    # is the absmax of the block it names, for any split of the rows.
    x = torch.randn(7, 3 * BLOCK)
    codes, scales = quant.encode(x, "int8", BLOCK)
    by_row = scales.view(7, 3)
    assert torch.equal(by_row, x.abs().view(7, 3, BLOCK).amax(-1))
    top, bottom = quant.encode(x[:3], "int8", BLOCK)[1], quant.encode(x[3:], "int8", BLOCK)[1]
    assert torch.equal(torch.cat([top, bottom]), scales)


def load_scales_placed_otherwise(rank, world, device):
    """Two steps on DTensor shards, then the compressed state dict with every DTensor of
    block scales replicated over the mesh (placed unlike the parameter it scales, as
    another program's state dict may hold them) loaded into a new optimizer on the same
    shards. Returns how many scales moved, both optimizers' states and their parameters
    after a third step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh(device, (world,))
    params, opt, grads = _two_steps(mesh)
    sd = opt.state_dict(compressed=True)
    moved, state = 0, {}
    for i, st in sd["state"].items():
        state[i] = dict(st)
        for key, value in st.items():
            if key.endswith("_absmax") and isinstance(value, DTensor):
                state[i][key] = value.redistribute(mesh, [Replicate()])
                moved += 1
    twins = [torch.nn.Parameter(t) for t in _distributed(mesh, [p.detach().full_tensor() for p in params])]
    new = with_state(twins)
    new.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
    saved, loaded = states_of(opt, params), states_of(new, twins)
    for ps, step_grads in ((params, grads[2]), (twins, grads[2])):
        for p, g in zip(ps, _distributed(mesh, step_grads)):
            p.grad = g
    opt.step()
    new.step()
    return dict(
        moved=moved,
        saved=saved,
        loaded=loaded,
        after=[local_copy(p.detach()) for p in params],
        twins=[local_copy(p.detach()) for p in twins],
    )


@pytest.mark.parametrize("device", DEVICES)
def test_compressed_scales_placed_unlike_their_parameter_load_on_each_rank(device):
    for rank, got in enumerate(run_ranks(load_scales_placed_otherwise, device, backend=BACKEND[device])):
        # every sharded parameter's scales (both states) were replicated before loading
        assert got["moved"] == 2 * sum(isinstance(pl, Shard) for _, pl, _ in LAYOUTS), got["moved"]
        for i, (saved, loaded) in enumerate(zip(got["saved"], got["loaded"])):
            assert saved.keys() == loaded.keys(), (rank, i)
            for key, want in saved.items():
                assert torch.equal(torch.as_tensor(loaded[key]), torch.as_tensor(want)), (rank, i, key)
        for i, (a, b) in enumerate(zip(got["after"], got["twins"])):
            assert torch.equal(a, b), f"rank {rank}, parameter {i}: the step after loading differs"
