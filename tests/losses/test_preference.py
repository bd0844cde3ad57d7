"""examples/post_training.py's DPO and SimPO losses against TRL's formulas (``DPOTrainer``'s
sigmoid loss, ``CPOTrainer``'s conservative label smoothing and its ``simpo`` loss), written
here in float64 on materialised logits: loss values and the gradients of the policy's hidden
states and head; none reaches the reference."""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

N, S, H, HREF, V = 3, 7, 13, 11, 37  # N pairs: 2N sequences of S tokens
FP32 = 2e-6


def example():
    path = Path(__file__).resolve().parents[2] / "examples" / "post_training.py"
    spec = importlib.util.spec_from_file_location("post_training_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def draw():
    hidden = torch.randn(2 * N, S, H)
    weight = torch.randn(V, H) / H**0.5 * 1.5
    ref_hidden = torch.randn(2 * N, S, HREF)
    ref_weight = torch.randn(V, HREF) / HREF**0.5 * 1.5
    target = torch.randint(0, V, (2 * N, S))
    target[:, :2] = -100  # prompt
    for row, length in enumerate(torch.randint(1, S - 2, (2 * N,)).tolist()):
        target[row, 2 + length :] = -100  # completions of different lengths, padded
    return hidden, weight, ref_hidden, ref_weight, target


def logps64(hidden, weight, target, average=False):
    """Per-sequence sums (or means) of float64 log-probs over the tokens not -100."""
    logsm = torch.log_softmax(hidden.double() @ weight.double().T, dim=-1)
    keep = target != -100
    per_token = logsm.gather(-1, target.clamp(min=0)[..., None])[..., 0] * keep
    total = per_token.sum(-1)
    return total / keep.sum(-1) if average else total


def trl_smoothed(logits, beta, label_smoothing):
    # CPOTrainer.cpo_loss ("sigmoid" and "simpo"); DPOTrainer's "sigmoid" at label_smoothing=0.
    return (
        -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    ).mean()


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("beta, label_smoothing", [(0.1, 0.0), (0.5, 0.2)])
def test_dpo_loss_matches_trl_on_float64(beta, label_smoothing):
    hidden, weight, ref_hidden, ref_weight, target = draw()
    x, w, rx, rw = leaves(hidden, weight, ref_hidden, ref_weight)
    loss = example().dpo_loss(x, w, rx, rw, target, beta=beta, label_smoothing=label_smoothing)
    loss.backward()
    x64, w64 = leaves(hidden.double(), weight.double())
    policy = logps64(x64, w64, target)
    ref = logps64(ref_hidden, ref_weight, target)
    chosen_logps, rejected_logps = policy.chunk(2)
    ref_chosen, ref_rejected = ref.chunk(2)
    delta = (chosen_logps - ref_chosen) - (rejected_logps - ref_rejected)
    want = trl_smoothed(delta, beta, label_smoothing)
    want.backward()
    assert loss.dtype == torch.float32
    assert abs(loss.item() - want.item()) < FP32 * max(1.0, abs(want.item()))
    assert rel(x.grad, x64.grad) < FP32 and rel(w.grad, w64.grad) < FP32
    assert rx.grad is None and rw.grad is None  # the reference is frozen
    assert (x.grad[target == -100] == 0).all()


@pytest.mark.parametrize("beta, gamma, label_smoothing", [(2.0, 0.5, 0.0), (2.5, 1.4, 0.1)])
def test_simpo_loss_matches_trl_on_float64(beta, gamma, label_smoothing):
    hidden, weight, _, _, target = draw()
    x, w = leaves(hidden, weight)
    loss = example().simpo_loss(x, w, target, beta=beta, gamma=gamma, label_smoothing=label_smoothing)
    loss.backward()
    x64, w64 = leaves(hidden.double(), weight.double())
    chosen, rejected = logps64(x64, w64, target, average=True).chunk(2)
    logits = (chosen - rejected) - gamma / beta  # CPOTrainer: the margin over beta
    want = trl_smoothed(logits, beta, label_smoothing)
    want.backward()
    assert loss.dtype == torch.float32
    assert abs(loss.item() - want.item()) < FP32 * max(1.0, abs(want.item()))
    assert rel(x.grad, x64.grad) < FP32 and rel(w.grad, w64.grad) < FP32


def test_dpo_at_the_reference_is_log_two():
    """A policy equal to its reference: every log-ratio is 0 and the loss is log 2."""
    hidden, weight, _, _, target = draw()
    loss = example().dpo_loss(hidden, weight, hidden, weight, target, beta=0.3)
    assert abs(loss.item() - torch.log(torch.tensor(2.0)).item()) < 1e-6
