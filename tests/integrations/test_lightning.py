"""fuser in PyTorch Lightning: examples/lightning_module.py run as a script, and its module
driven in-process to check that each step applied the scheduler's learning rate."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from childenv import child_env

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "lightning_module.py"


def run_example(*args) -> str:
    env = child_env(HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_example_script_trains():
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("needs lightning")
    out = run_example("--steps", "24")
    rows = [
        (int(s), float(loss), float(lr))
        for s, loss, lr in re.findall(r"step\s+(\d+)\s+loss ([\d.]+)\s+lr ([\d.e+-]+)", out)
    ]
    assert [r[0] for r in rows] == list(range(1, 25))
    lrs = [r[2] for r in rows]
    peak = lrs.index(max(lrs))
    assert 0 < peak < len(lrs) - 1 and lrs[-1] < lrs[peak] / 10  # warmup, then decay
    assert sum(r[1] for r in rows[-4:]) < sum(r[1] for r in rows[:4]) / 3
    assert "'launches': 24" in out


def load_example():
    spec = importlib.util.spec_from_file_location("lightning_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class StepCheck:
    """Lion moves every element by exactly lr (after decay): p' = p (1 - lr wd) - lr sign(u).
    Check that against the learning rate the scheduler set for each step."""

    def __init__(self):
        self.checked = 0

    def on_before_optimizer_step(self, trainer, module, optimizer):
        group = optimizer.param_groups[0]
        self.lr, self.wd = group["lr"], group["weight_decay"]
        self.before = [p.detach().clone() for p in module.parameters()]

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.lr < 1e-4:
            return  # the step is below fp32 resolution of the parameters
        for p0, p in zip(self.before, module.parameters()):
            moved = (p.detach().double() - p0.double() * (1 - self.lr * self.wd)).abs()
            torch.testing.assert_close(moved, torch.full_like(moved, self.lr), rtol=1e-3, atol=1e-7)
        self.checked += 1


def test_configure_optimizers_steps_with_the_schedulers_lr():
    # (imported here, not at collection: lightning's import takes seconds in every worker)
    L = pytest.importorskip("lightning")
    example = load_example()
    x = torch.randn(96, 13)
    y = torch.tanh(x[:, :1])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    check = type("StepCheck", (StepCheck, L.Callback), {})()
    trainer = L.Trainer(
        max_steps=9,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[check],
    )
    trainer.fit(example.Regressor(lr=3e-3, weight_decay=0.1), loader)
    (opt,) = trainer.optimizers
    assert isinstance(opt, example.Lion)
    assert trainer.lr_scheduler_configs[0].interval == "step"
    assert check.checked >= 6
