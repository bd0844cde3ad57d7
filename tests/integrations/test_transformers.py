"""fuser in a Hugging Face Trainer: a tiny randomly initialised Llama (built from a config,
nothing downloaded) trained on CPU, with fuser optimizers beside the Trainer's own AdamW."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from childenv import child_env
from seeds import session_seed

import fuser
from fuser.integrations.transformers import trainer_optimizers

transformers = pytest.importorskip("transformers")
LlamaConfig, LlamaForCausalLM = transformers.LlamaConfig, transformers.LlamaForCausalLM
Trainer, TrainingArguments = transformers.Trainer, transformers.TrainingArguments

VOCAB = 96
STEPS = 4

ADAMW_RULE = fuser.rule(
    """
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g**2
    p = p - lr * weight_decay * p - lr * (m / (1 - beta1**step)) / (sqrt(v / (1 - beta2**step)) + eps)
""",
    name="adamw_rule",
    hyper=dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01),
    state=dict(m=0.0, v=0.0),
)


def tiny_llama(seed=0):
    torch.manual_seed(session_seed(seed))
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(config)


def dataset(n=12, length=11, seed=1):
    g = torch.Generator().manual_seed(session_seed(seed))
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (length,), generator=g)
        labels = ids.clone()
        labels[:3] = -100  # a prompt the loss ignores
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def training_args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path),
        max_steps=STEPS,
        per_device_train_batch_size=3,
        learning_rate=3e-2,
        weight_decay=0.1,
        warmup_steps=1,
        lr_scheduler_type="cosine",
        adam_beta1=0.8,
        adam_beta2=0.95,
        # eps well above the gradients' rounding: where |g| << eps, Adam's update is
        # lr * g / eps, which multiplies a difference in g by lr / eps (3e5 with eps = 1e-7:
        # seed 1059408816 moved an embedding 1.2e-4 of its update's norm from torch's)
        adam_epsilon=1e-3,
        max_grad_norm=1.0,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        seed=session_seed() % 2**31,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    return TrainingArguments(**{**base, **kw})


def train(tmp_path, args=None, **trainer_kw):
    model = trainer_kw.pop("model", None) or tiny_llama()
    args = args or training_args(tmp_path)
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), **trainer_kw)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return model, trainer, logs


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The Trainer with its own optimizer (torch's AdamW) and scheduler."""
    model, trainer, logs = train(tmp_path_factory.mktemp("reference"))
    assert "torch" in type(trainer.optimizer.optimizer).__module__
    return model, logs


def assert_same_training(model, logs, reference):
    ref_model, ref_logs = reference
    assert len(logs) == len(ref_logs) == STEPS
    # The scheduler drove fuser's learning rate exactly as it drove torch's.
    assert [h["learning_rate"] for h in logs] == [h["learning_rate"] for h in ref_logs]
    assert logs[-1]["learning_rate"] != logs[1]["learning_rate"]
    for h, r in zip(logs, ref_logs):
        assert h["loss"] == pytest.approx(r["loss"], rel=1e-5)
        assert h["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4)
    init = dict(tiny_llama().named_parameters())
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert not torch.equal(p, init[name]), f"{name} never moved"
        # Norm-wise over each tensor, against the reference's update: the two optimizers
        # round each element's update differently by a few u (~1e-6 of it), and later
        # steps feed that back through the gradients, where Adam's g / (sqrt(v) + eps)
        # magnifies it by up to lr / eps at an element whose gradient is near zero (30
        # with eps = 1e-3; 8 seeds: at most 5.5e-6 of the update's norm). 1e-4 of the norm
        # keeps a margin over that; a wrong learning rate, beta, eps or weight decay moves
        # the whole update by far more.
        update = (q - init[name]).detach().norm()
        err = (p - q).detach().norm()
        assert err <= 1e-4 * update, f"{name}: |p - torch's| = {err:.3g} > 1e-4 x |update| {update:.3g}"


@pytest.mark.parametrize("optimizer", [fuser.optim.AdamW, ADAMW_RULE], ids=["builtin", "rule"])
def test_trainer_optimizers_match_the_trainers_own(tmp_path, reference, optimizer):
    model = tiny_llama()
    args = training_args(tmp_path)
    opt, sched = trainer_optimizers(model, optimizer, args)
    launches = fuser.stats()["launches"]
    model, trainer, logs = train(tmp_path, args, model=model, optimizers=(opt, sched))
    assert trainer.optimizer.optimizer is opt
    assert fuser.stats()["launches"] - launches == STEPS  # one fused launch per step
    assert_same_training(model, logs, reference)


def test_optimizer_class_and_kwargs(tmp_path, reference):
    """The Trainer builds the groups and the scheduler itself around a fuser class."""
    kwargs = dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-3)
    model, trainer, logs = train(tmp_path, optimizer_cls_and_kwargs=(fuser.optim.AdamW, kwargs))
    assert isinstance(trainer.optimizer.optimizer, fuser.optim.AdamW)
    assert_same_training(model, logs, reference)


def test_groups_and_hyperparameters_follow_training_arguments(tmp_path):
    model = tiny_llama()
    args = training_args(tmp_path)
    compiled = fuser.compile(ADAMW_RULE)
    opt, sched = trainer_optimizers(model, compiled, args, num_training_steps=10, beta2=0.9)
    trainer = Trainer(model=tiny_llama(), args=args)
    ref_groups = trainer.create_optimizer().param_groups
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    ours_names = {id(p): n for n, p in model.named_parameters()}
    assert [sorted(ours_names[id(p)] for p in g["params"]) for g in opt.param_groups] == [
        sorted(names[id(p)] for p in g["params"]) for g in ref_groups
    ]
    assert any("norm" in ours_names[id(p)] for p in opt.param_groups[1]["params"])
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    group = opt.param_groups[0]
    assert (group["beta1"], group["beta2"], group["eps"]) == (0.8, 0.9, 1e-3)  # beta2= overrides
    # Warmup of one step out of ten, then cosine decay.
    assert sched.get_last_lr()[0] == 0.0
    assert type(sched).__name__ == "LambdaLR"


def test_scheduler_needs_the_training_length(tmp_path):
    args = training_args(tmp_path, max_steps=-1, num_train_epochs=1)
    with pytest.raises(ValueError, match="num_training_steps"):
        trainer_optimizers(tiny_llama(), fuser.optim.AdamW, args)
    with pytest.raises(TypeError, match="optimizer class or a fuser rule"):
        trainer_optimizers(tiny_llama(), "adamw", training_args(tmp_path))


def test_checkpoint_resume_restores_fuser_state(tmp_path):
    """The Trainer saves the optimizer's state_dict and loads it on resume: an interrupted
    run resumed from its checkpoint ends where an uninterrupted one does."""
    args = training_args(tmp_path / "a", save_strategy="steps", save_steps=2)
    straight, _, _ = train(tmp_path, args, optimizer_cls_and_kwargs=(fuser.optim.AdamW, dict(lr=3e-2)))
    resumed = tiny_llama(seed=5)  # different weights: the checkpoint must bring them back
    args = training_args(tmp_path / "b")
    trainer = Trainer(
        model=resumed,
        args=args,
        train_dataset=dataset(),
        optimizer_cls_and_kwargs=(fuser.optim.AdamW, dict(lr=3e-2)),
    )
    trainer.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert trainer.optimizer.optimizer.state_dict()["state"][0]["step"].item() == STEPS
    for (name, p), q in zip(resumed.named_parameters(), straight.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_example_script(tmp_path):
    """examples/hf_trainer.py, run as a new user runs it."""
    root = Path(__file__).resolve().parents[2]
    env = child_env(HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    done = subprocess.run(
        [sys.executable, str(root / "examples" / "hf_trainer.py"), "--steps", "10"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [
        (float(loss), float(lr))
        for loss, lr in re.findall(r"step\s+\d+\s+loss ([\d.]+)\s+lr ([\d.e+-]+)", done.stdout)
    ]
    assert len(rows) == 10
    assert rows[0][1] == 0.0 and max(r[1] for r in rows) == pytest.approx(1e-2)  # warmup, cosine
    assert sum(r[0] for r in rows[-3:]) < 0.85 * sum(r[0] for r in rows[:3])
    # Each step: one launch of the optimizer, one of the fused loss (a single chunk of tokens).
    assert "'launches': 20" in done.stdout
