"""Token rules (per-token inputs, several per-token outputs), against
float64 torch autograd on the materialised logits, written without fuser's IR.

Shapes are odd and cross the kernels' blocks (``block=16`` for compiled rules; the built-in's
default block holds a row of 37). Every draw also checks ``logp <= 0`` and ``entropy >= 0``.
"""

import pytest
import torch

import fuser
from fuser.codegen.loss import render_loss
from fuser.ir.loss import lower_loss

T, H, V = 7, 13, 37
IGNORE = -100
FP32 = 2e-6  # relative error of an fp32 computation of these sizes, with room


def draw(dtype=torch.float32, *, scale=1.0, ignore=True, t=T):
    hidden = (torch.randn(t, H, dtype=torch.float64) * scale).to(dtype)
    weight = (torch.randn(V, H, dtype=torch.float64) / H**0.5 * 1.5).to(dtype)
    target = torch.randint(0, V, (t,))
    if ignore:
        target[torch.randperm(t)[:2]] = IGNORE
    return hidden, weight, target


def reference(hidden, weight, target, *, temperature=1.0, softcap=None, bias=None):
    """float64 leaves of ``hidden``, ``weight`` (and ``bias``), and the per-token log-prob
    and entropy of their logits (0 where ignored)."""
    leaves = [t.detach().double().requires_grad_() for t in (hidden, weight)]
    b = bias.detach().double().requires_grad_() if bias is not None else None
    z = leaves[0] @ leaves[1].T + (b if b is not None else 0)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    logsm = torch.log_softmax(z / temperature, dim=-1)
    keep = target != IGNORE
    logp = torch.where(keep, logsm.gather(1, target.clamp(min=0)[:, None])[:, 0], 0.0)
    entropy = torch.where(keep, -(logsm.exp() * logsm).sum(-1), 0.0)
    return leaves + ([b] if b is not None else []), logp, entropy


def rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()


def leaves_of(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def check_signs(logp, entropy=None):
    assert logp.dtype == torch.float32 and not logp.isnan().any()
    assert (logp <= 0).all(), logp.max()
    if entropy is not None:
        assert entropy.dtype == torch.float32 and not entropy.isnan().any()
        assert (entropy >= 0).all(), entropy.min()


GRPO = """
    z = z / temperature
    logp = z[y] - logsumexp(z)
    ratio = exp(logp - old)
    loss = -minimum(ratio * adv, clamp(ratio, 1 - eps, 1 + eps) * adv) * mask
"""


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_per_token_inputs_in_a_clipped_ratio_rule(reduction):
    """A GRPO-style rule reading three per-token inputs (old log-probs, advantages, a mask,
    given in other float dtypes), with a bias: the loss and the hidden, weight and bias
    gradients against float64, and no gradient to the inputs."""
    rule = fuser.loss(
        GRPO, name="grpo_test", hyper=dict(eps=0.2, temperature=0.9), inputs=("old", "adv", "mask")
    )
    f = fuser.compile(rule, block=16)
    hidden, weight, target = draw()
    bias = torch.randn(V) * 0.5
    (rx, rw, rb), rlogp, _ = reference(hidden, weight, target, temperature=0.9, bias=bias)
    old = (rlogp.detach() + torch.randn(T, dtype=torch.float64) * 0.3).to(torch.float16).float()
    adv = torch.randn(T, dtype=torch.float64)
    mask = (torch.rand(T) > 0.3).to(torch.bfloat16)
    x, w, b = leaves_of(hidden, weight, bias)
    old_in = old.clone().requires_grad_()
    out = f(x, w, target, b, old=old_in, adv=adv, mask=mask, reduction=reduction, eps=0.25)
    ratio = torch.exp(rlogp - old.double())
    ref = -torch.minimum(ratio * adv, ratio.clamp(0.75, 1.25) * adv) * mask.double()
    ref = torch.where(target != IGNORE, ref, 0.0)
    size = ref.detach().abs().max()  # (a mean may cancel: its error is relative to its terms)
    if reduction == "mean":
        ref = ref.sum() / (target != IGNORE).sum()
    g = torch.randn(T) if reduction == "none" else torch.tensor(1.7)
    (out * g).sum().backward()
    (ref * g.double()).sum().backward()
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert (out.double() - ref).abs().max() < FP32 * size
    for got, want in ((x, rx), (w, rw), (b, rb)):
        assert rel(got.grad, want.grad) < FP32
    assert old_in.grad is None


def test_traced_function_with_inputs_and_two_outputs():
    """The traced form: inputs as keyword-only parameters, outputs as a dict."""

    def weighted(z, y, *, scale, temperature):
        z = z / temperature
        lse = fuser.losses.logsumexp(z)
        return dict(logp=scale * (z[y] - lse), top=fuser.losses.max(z) - lse)

    rule = fuser.loss(weighted, hyper=dict(temperature=1.0), inputs=("scale",), outputs=("logp", "top"))
    assert rule.inputs == ("scale",) and [n for n, _ in rule.outputs] == ["logp", "top"]
    f = fuser.compile(rule, block=16)
    hidden, weight, target = draw()
    scale = torch.rand(T) + 0.5
    x, w = leaves_of(hidden, weight)
    logp, top = f(x, w, target, scale=scale, temperature=1.3)
    g1, g2 = torch.randn(T), torch.randn(T)
    (logp * g1 + top * g2).sum().backward()
    (rx, rw), rlogp, _ = reference(hidden, weight, target, temperature=1.3)
    z = (rx @ rw.T) / 1.3
    rtop = torch.where(target != IGNORE, z.max(-1).values - torch.logsumexp(z, -1), 0.0)
    (rlogp * scale.double() * g1.double() + rtop * g2.double()).sum().backward()
    assert rel(logp, rlogp * scale.double()) < FP32 and rel(top, rtop) < FP32
    assert rel(x.grad, rx.grad) < FP32 and rel(w.grad, rw.grad) < FP32


@pytest.mark.parametrize(
    "text, options, line, col, message",
    [
        ("loss = logsumexp(z) - z[y] * adv[y]", dict(inputs=("adv",)), 1, 30, "per-token input"),
        ("loss = logsumexp(z) - z[y] * adv", dict(inputs=("adv",), hyper=dict(adv=1.0)), 1, 30, "both"),
        ("adv = 2\nloss = logsumexp(z)", dict(inputs=("adv",)), 1, 1, "cannot be assigned"),
        ("logp = z[y] - logsumexp(z)", dict(outputs=("logp", "entropy")), 1, None, "never assigns entropy"),
        ("h = logsumexp(z)\nlogp = z[y] - h + z", dict(outputs=("logp",)), 2, 1, "z outside a reduction"),
        ("loss = logsumexp(z) * w", dict(inputs=("w",), outputs=("loss", "w")), 1, 23, "input and an output"),
        ("loss = logsumexp(z)", dict(inputs=("z",)), None, None, "reserved"),
        ("loss = sum(adv) + logsumexp(z)", dict(inputs=("adv",)), 1, 1, "does not depend on z"),
    ],
)
def test_rule_errors(text, options, line, col, message):
    with pytest.raises(fuser.RuleError, match=message) as e:
        fuser.loss(text, **options)
    assert e.value.line == line and e.value.col == col


def test_token_kernel_renders_identically_and_names_its_rows():
    """Rendering twice gives the same text; the kernel reads the inputs and the upstream
    gradients as rows of one tensor."""
    rule = fuser.loss(
        GRPO, name="grpo_test", hyper=dict(eps=0.2, temperature=1.0), inputs=("old", "adv", "mask")
    )
    a, b = render_loss(lower_loss(rule, "fp32")), render_loss(lower_loss(rule, "fp32"))
    assert a.text == b.text
    assert "fp32 [4, token_stride]: old, adv, mask, d loss" in a.text
    assert ("inputs", "*fp32") in a.signature
