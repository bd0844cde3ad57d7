"""``benchmarks/fsdp_train.py`` on CPU: its smoke preset on 2 gloo processes, through its
``main``. Both runs start from the same weights and train on the same batches; in fp32,
fuser's AdamW with the vocabulary-parallel loss must end where torch's AdamW with
``F.cross_entropy`` does."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch was built without gloo", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import fsdp_train  # noqa: E402

STEPS = 3


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_train")
    argv = [
        "--preset",
        "cpu-smoke",
        "--steps",
        str(STEPS),
        "--out",
        str(out),
        "--dump-params",
        str(out / "p.pt"),
    ]
    path = fsdp_train.main(argv)
    with open(path) as f:
        result = json.load(f)
    return result, torch.load(out / "p.pt", weights_only=True), Path(path)


def test_outputs(smoke):
    result, _, path = smoke
    assert path.with_suffix(".md").read_text().count("\n| ") == 3  # header and one row per run
    assert result["world"] == 2 and result["device"] == "cpu" and result["config"]["steps"] == STEPS
    assert set(result["runs"]) == {"baseline", "fuser"}
    for run in result["runs"].values():
        assert len(run["losses"]) == len(run["grad_norms"]) == len(run["fwd_bwd_ms"]) == STEPS
        assert len(run["opt_ms"]) == STEPS
        assert set(run["summary"]) == {"step_ms", "fwd_bwd_ms", "opt_ms", "opt_share"}
    assert result["runs"]["fuser"]["fuser_stats"]["launches"] > 0
    assert "--preset cpu-smoke" in result["command"]


def test_losses_agree_and_fall(smoke):
    result, _, _ = smoke
    base, fus = (result["runs"][k]["losses"] for k in ("baseline", "fuser"))
    assert all(math.isfinite(v) for v in base + fus)
    assert result["step0_loss_diff"] <= 1e-5 * base[0]
    assert result["max_loss_diff"] <= 1e-4
    assert base[-1] < base[0] and fus[-1] < fus[0]
    assert result["loss_floor"] < result["ln_vocab"] / 2


def test_fuser_run_ends_at_the_baseline_weights(smoke):
    result, params, _ = smoke
    # Adam is nearly blind to a gradient off by a constant factor (FSDP's average where the
    # gathered loss needs a sum): the step-0 gradient norms check the gradients themselves.
    assert result["step0_grad_norm_rel_diff"] <= 1e-5
    base, fus = params["baseline"], params["fuser"]
    assert set(base) == set(fus) and "head.weight" in fus
    assert fus["head.weight"].shape == (result["config"]["vocab"], result["config"]["dim"])
    for name in base:
        torch.testing.assert_close(fus[name], base[name], rtol=1e-5, atol=5e-5, msg=name)
    assert result["final_params"]["rel_l2"] <= 1e-5


def test_plot(smoke, tmp_path):
    pytest.importorskip("matplotlib")
    import plot_fsdp

    png = tmp_path / "fsdp.png"
    plot_fsdp.main([str(smoke[2]), str(png)])
    assert png.read_bytes()[:4] == b"\x89PNG"
