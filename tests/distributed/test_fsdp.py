"""FSDP2 (``fully_shard``) with a fuser optimizer on 2 gloo processes, and its
``torch.distributed.checkpoint``: saved on 2 ranks and loaded on 2 and on 1, saved on 1
and loaded on 2."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from cases import batches, lamb_clip, make_model, train
from ranks import run_ranks

import fuser

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch was built without gloo", allow_module_level=True)

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor  # noqa: E402

STEPS, SAVE_AFTER = 4, 2
# eps 1e-3: the step is then smooth in the gradient (at most 1/eps per unit of it), so the
# fp32 rounding by which FSDP's averaged gradient differs from the single process's stays
# far inside the tolerance. At lamb_clip's 1e-6, a gradient entry near zero (one session
# seed in a few hundred: 4e-7, 1% apart after rounding) moved a bias by 1e-5.
Optimizer = functools.partial(fuser.compile(lamb_clip), eps=1e-3)


def sharded_model(mesh):
    """The test model under FSDP2, or the reason this torch cannot run it on CPU/gloo."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError as e:
        return f"torch.distributed.fsdp.fully_shard is not available: {e}"
    model = make_model()
    try:
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    except (NotImplementedError, RuntimeError, ValueError, AssertionError) as e:
        return f"fully_shard does not run on a CPU mesh with gloo in torch {torch.__version__}: {e}"
    return model


def checkpoint(model, opt) -> dict:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def resume(model, path: str, data, **load) -> dict:
    """Load the checkpoint at ``path`` into ``model`` and a new optimizer, train on
    ``data``, and return the full parameters."""
    opt = Optimizer(model.parameters())
    sd = checkpoint(model, opt)
    dcp.load(sd, checkpoint_id=path, **load)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    train(model, opt, data)
    return {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in model.named_parameters()}


def fsdp_worker(rank, world, path, single_path):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model = sharded_model(mesh)
    if isinstance(model, str):
        return {"skip": model}
    local = [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in batches(STEPS)]
    opt = Optimizer(model.parameters())
    train(model, opt, local[:SAVE_AFTER])
    dcp.save(checkpoint(model, opt), checkpoint_id=path)
    checks = fuser.stats()["full_checks"]
    train(model, opt, local[SAVE_AFTER:])
    return dict(
        full_checks=fuser.stats()["full_checks"] - checks,
        final={n: p.full_tensor() for n, p in model.named_parameters()},
        local_numels=[p.to_local().numel() for p in model.parameters()],
        state_types=sorted({type(v).__name__ for st in opt.state.values() for v in st.values()}),
        # Fresh models and optimizers on 2 ranks, from this run's checkpoint and
        # from the single-process run's.
        resumed=resume(sharded_model(mesh), path, local[SAVE_AFTER:]),
        from_one=resume(sharded_model(mesh), single_path, local[SAVE_AFTER:]),
    )


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """The final parameters of a single-process run, and its checkpoint after SAVE_AFTER steps."""
    path = str(tmp_path_factory.mktemp("dcp_single"))
    model = make_model()
    opt = Optimizer(model.parameters())
    train(model, opt, batches(STEPS)[:SAVE_AFTER])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(checkpoint(model, opt), checkpoint_id=path, no_dist=True)
    train(model, opt, batches(STEPS)[SAVE_AFTER:])
    return dict(model.named_parameters()), path


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory, single_process):
    path = str(tmp_path_factory.mktemp("dcp"))
    results = run_ranks(fsdp_worker, path, single_process[1])
    if "skip" in results[0]:
        pytest.skip(results[0]["skip"])
    return path, results


def assert_params_close(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name].detach(), rtol=2e-5, atol=2e-6, msg=name)


def test_fsdp_training_equals_a_single_process_run(fsdp, single_process):
    _, results = fsdp
    assert results[1]["local_numels"][-2:] == [0, 0]  # the (1, 3) weight and (1,) bias
    assert results[0]["state_types"] == ["DTensor", "Tensor"]  # sharded m and v, a plain step
    # New sharded gradients every step, same layout: no per-parameter walk after the first.
    assert [r["full_checks"] for r in results] == [0, 0]
    for r in results:
        assert_params_close(r["final"], single_process[0])


def test_dcp_checkpoint_resumes_on_the_same_two_ranks(fsdp):
    _, results = fsdp
    for r in results:
        assert_params_close(r["resumed"], r["final"])


def test_dcp_saved_on_one_process_resumes_on_two_ranks(fsdp, single_process):
    _, results = fsdp
    for r in results:
        assert_params_close(r["from_one"], single_process[0])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_saved_on_two_ranks_resumes_on_one_process(fsdp, single_process):
    path, _ = fsdp
    model = make_model()  # its initial values are overwritten by the checkpoint's
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    opt = Optimizer(model.parameters())
    sd = checkpoint(model, opt)
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    assert all(type(v) is torch.Tensor for st in opt.state.values() for v in st.values())
    assert {float(st["step"]) for st in opt.state.values()} == {SAVE_AFTER}
    train(model, opt, batches(STEPS)[SAVE_AFTER:])
    assert_params_close(dict(model.named_parameters()), single_process[0])
