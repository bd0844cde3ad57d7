"""Rules that read a teacher's logits (``t``, ``t[y]``) and ``fuser.losses.distill``, against
float64 torch autograd on the materialised logits of both heads, written from the formulas
without fuser's IR (Liger's generalised JSD and its beta convention written out as its
``LigerFusedLinearJSDLoss`` computes it: ``F.kl_div(..., log_target=True)`` terms).

Shapes are odd: T=7 tokens, a student hidden size of 13, a teacher's of 11, V=37; the
compiled rules take ``block=16`` and chunks of 3 tokens so that rows and calls cross both.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import fuser
import fuser.losses
from fuser.codegen.loss import render_loss
from fuser.ir.loss import lower_loss
from fuser.losses.builtins import DISTILL_JSD
from fuser.runtime.loss import tokens

T, H, HT, V = 7, 13, 11, 37
IGNORE = -100
FP32 = 3e-6  # relative error of an fp32 computation of these sizes, with room
# The reverse KL's logit gradient p_s * (log p_s - log p_t - KL) carries the rounding of
# log-ratios several nats large: up to 4e-6 over draws of these sizes.
GRAD = {"kl": FP32, "jsd": FP32, "reverse_kl": 1e-5}


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every output buffer starts as NaN: an element a kernel leaves unwritten fails."""
    monkeypatch.setattr(
        tokens, "new_outputs", lambda k, n, device: torch.full((k, n), float("nan"), device=device)
    )


def draw(dtype=torch.float32, *, ignore=2, teacher_hidden=HT):
    """Student and teacher heads (the teacher's requiring grad, to see that it gets none)
    and targets with ``ignore`` of them ignored."""
    x = torch.randn(T, H, dtype=torch.float64).to(dtype).requires_grad_()
    w = (torch.randn(V, H, dtype=torch.float64) * 2 / H**0.5).to(dtype).requires_grad_()
    tx = torch.randn(T, teacher_hidden, dtype=torch.float64).to(dtype).requires_grad_()
    tw = (torch.randn(V, teacher_hidden, dtype=torch.float64) * 2 / teacher_hidden**0.5).to(dtype)
    tw.requires_grad_()
    y = torch.randint(0, V, (T,))
    y[torch.randperm(T)[:ignore]] = IGNORE
    return x, w, tx, tw, y


def soft_reference(ls, lt, kind, beta):
    """The per-token divergence of log-probabilities ``ls`` (student), ``lt`` (teacher)."""
    ps, pt = ls.exp(), lt.exp()
    if kind == "kl":
        return (pt * (lt - ls)).sum(-1)
    if kind == "reverse_kl":
        return (ps * (ls - lt)).sum(-1)
    m = beta * pt + (1 - beta) * ps
    return beta * (pt * (lt - m.log())).sum(-1) + (1 - beta) * (ps * (ls - m.log())).sum(-1)


def liger_jsd(ls, lt, beta):
    """Liger's ``LigerFusedLinearJSDFunction.distillation_loss_fn`` per token, written from its
    definition: ``F.kl_div(input, target, log_target=True)`` is ``exp(target) * (target -
    input)``; beta=0 is kl_div(student, teacher), beta=1 kl_div(teacher, student)."""
    if beta == 0:
        return F.kl_div(ls, lt, reduction="none", log_target=True).sum(-1)
    if beta == 1:
        return F.kl_div(lt, ls, reduction="none", log_target=True).sum(-1)
    log_m = torch.logsumexp(torch.stack([ls + math.log(1 - beta), lt + math.log(beta)]), 0)
    student = F.kl_div(log_m, ls, reduction="none", log_target=True)
    teacher = F.kl_div(log_m, lt, reduction="none", log_target=True)
    return (beta * teacher + (1 - beta) * student).sum(-1)


def reference(x, w, tx, tw, y, *, kind="jsd", beta=0.5, temperature=1.0, hard_weight=0.0,
              reduction="mean", bias=None, teacher_bias=None, soft=soft_reference):  # fmt: skip
    """float64 leaves of ``x``, ``w`` (and ``bias``) and the loss of their logits."""
    leaves = [t.detach().double().requires_grad_() for t in (x, w)]
    z = leaves[0] @ leaves[1].T
    t = tx.detach().double() @ tw.detach().double().T
    if bias is not None:
        leaves.append(bias.detach().double().requires_grad_())
        z = z + leaves[2]
    if teacher_bias is not None:
        t = t + teacher_bias.detach().double()
    ls, lt = torch.log_softmax(z / temperature, -1), torch.log_softmax(t / temperature, -1)
    args = (beta,) if soft is liger_jsd else (kind, beta)
    per = soft(ls, lt, *args)
    keep = y != IGNORE
    if hard_weight:
        per = per + hard_weight * F.cross_entropy(z, y.clamp(min=0), reduction="none")
    per = torch.where(keep, per, 0.0)
    if reduction == "none":
        return leaves, per
    return leaves, per.sum() / (keep.sum().clamp(min=1) if reduction == "mean" else 1)


def rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()


def check(out, ref, x, w, rx, rw, tx, tw, kind="jsd"):
    assert out.dtype == torch.float32 and not out.isnan().any()
    assert rel(out, ref) < FP32
    assert rel(x.grad, rx.grad) < GRAD[kind] and rel(w.grad, rw.grad) < GRAD[kind]
    assert tx.grad is None and tw.grad is None  # (the teacher takes no gradient)


@pytest.mark.parametrize("kind", ["kl", "reverse_kl", "jsd"])
def test_each_kind_with_temperature_a_hard_loss_and_ignored_tokens(kind):
    """Every kind at a temperature, with a teacher of another hidden size, a hard loss on
    targets of which two are ignored: the mean and the student's gradients within fp32's
    error of float64, and no gradient to the teacher."""
    x, w, tx, tw, y = draw()
    opts = dict(kind=kind, beta=0.3, temperature=0.7, hard_weight=0.4)
    out = fuser.losses.distill(x, w, tx, tw, y, **opts)
    out.backward()
    (rx, rw), ref = reference(x, w, tx, tw, y, **opts)
    ref.backward()
    check(out, ref, x, w, rx, rw, tx, tw, kind)
    assert (x.grad[y == IGNORE] == 0).all()


@pytest.mark.parametrize("hard_weight", [0.0, 0.6])
def test_jsd_of_spread_logits_whose_probabilities_underflow(hard_weight):
    """Logits tens of nats apart, where most probabilities of both heads underflow fp32 (exp
    below -87) and the mixture's too: the loss within fp32's error of float64 and every
    gradient finite (a saturated softmax's gradient is ulps of terms near 1 that cancel, not
    comparable in relative terms)."""
    x, w, tx, tw, y = draw(ignore=0)
    with torch.no_grad():
        w.mul_(40.0)
        tw.mul_(40.0)
    opts = dict(beta=0.4, hard_weight=hard_weight)
    out = fuser.losses.distill(x, w, tx, tw, y, **opts, reduction="none")
    out.sum().backward()
    _, ref = reference(x, w, tx, tw, y, **opts, reduction="none")
    z = (x.detach().double() @ w.detach().double().T).log_softmax(-1)
    t = (tx.detach().double() @ tw.detach().double().T).log_softmax(-1)
    # (both heads' probabilities underflow: 0.46 of them at the least over 300 draws)
    assert ((z < -87) & (t < -87)).float().mean() > 0.3
    assert rel(out, ref) < 1e-5
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_jsd_beta_follows_liger(beta):
    """Liger's beta convention: 0 is the forward KL (teacher to student), 1 the reverse KL
    (not the limits of the mixture, which are 0), between them the mixture's JSD."""
    x, w, tx, tw, y = draw()
    out = fuser.losses.distill(x, w, tx, tw, y, beta=beta, temperature=1.3)
    out.backward()
    (rx, rw), ref = reference(x, w, tx, tw, y, beta=beta, temperature=1.3, soft=liger_jsd)
    ref.backward()
    check(out, ref, x, w, rx, rw, tx, tw, "reverse_kl" if beta == 1 else "jsd")
    if beta in (0.0, 1.0):
        same = fuser.losses.distill(
            x, w, tx, tw, y, kind="kl" if beta == 0 else "reverse_kl", temperature=1.3
        )
        assert same.item() == out.item()


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_reductions_with_biases_across_blocks_and_chunks(reduction):
    """The JSD rule compiled with 16-column blocks and chunks of 3 tokens, both heads with a
    bias, hidden given as [B, S, H]: each reduction's values and the student's hidden,
    weight and bias gradients (under a non-uniform upstream gradient for ``none``)."""
    x, w, tx, tw, y = draw()
    b, tb = torch.randn(V, requires_grad=True), torch.randn(V)
    f = fuser.compile(DISTILL_JSD, block=16, chunk_size=3)
    hyper = dict(beta=0.6, temperature=0.9, hard_weight=0.2)
    shape = (1, T)
    teacher = dict(teacher_hidden=tx.reshape(1, T, HT), teacher_weight=tw, teacher_bias=tb)
    out = f(x.reshape(1, T, H), w, y.reshape(shape), b, reduction=reduction, **teacher, **hyper)
    (rx, rw, rb), ref = reference(x, w, tx, tw, y, reduction=reduction, bias=b, teacher_bias=tb, **hyper)
    g = (
        torch.rand(T, dtype=torch.float64) + 0.5
        if reduction == "none"
        else torch.tensor(1.0, dtype=torch.float64)
    )
    if reduction == "none":
        assert out.shape == shape and (out[0][y == IGNORE] == 0).all()
        out = out.reshape(T)
    (out * g.float()).sum().backward()
    (ref * g).sum().backward()
    check(out, ref, x, w, rx, rw, tx, tw)
    assert rel(b.grad, rb.grad) < FP32


@pytest.mark.parametrize("memory", ["lean", "fast"])
def test_lean_and_fast_memory_with_both_heads(memory, monkeypatch):
    """A teacher under ``memory="lean"`` (backward recomputes the student's and the teacher's
    logits 16 vocabulary rows at a time: three slices of 37) and ``memory="fast"`` (both
    heads' logits of every token kept from forward), both heads with a bias, per token under
    a non-uniform upstream gradient: values and the student's gradients within fp32's error
    of float64, none to the teacher."""
    import fuser.losses.api

    monkeypatch.setattr(fuser.losses.api, "vocab_cols", lambda *a, **k: 16)
    x, w, tx, tw, y = draw()
    b, tb = torch.randn(V, requires_grad=True), torch.randn(V)
    f = fuser.compile(DISTILL_JSD, block=16, chunk_size=3)
    hyper = dict(beta=0.6, temperature=0.9, hard_weight=0.2)
    teacher = dict(teacher_hidden=tx, teacher_weight=tw, teacher_bias=tb)
    out = f(x, w, y, b, reduction="none", memory=memory, **teacher, **hyper)
    (rx, rw, rb), ref = reference(x, w, tx, tw, y, reduction="none", bias=b, teacher_bias=tb, **hyper)
    g = torch.rand(T, dtype=torch.float64) + 0.5
    (out * g.float()).sum().backward()
    (ref * g).sum().backward()
    check(out, ref, x, w, rx, rw, tx, tw)
    assert rel(b.grad, rb.grad) < FP32
    # (distill's memory= reaches the same run: its mean, against float64 again)
    x.grad = w.grad = None
    mean = fuser.losses.distill(x, w, tx, tw, y, kind="kl", temperature=0.9, memory=memory)
    mean.backward()
    (rx, rw), ref = reference(x, w, tx, tw, y, kind="kl", temperature=0.9)
    ref.backward()
    check(mean, ref, x, w, rx, rw, tx, tw, "kl")


def test_bf16_inputs_have_fp32_logits():
    """bf16 heads: the loss within fp32's error of float64 on the same bf16 values (the
    logits are accumulated and kept in fp32), the gradients within bf16's."""
    x, w, tx, tw, y = draw(torch.bfloat16)
    out = fuser.losses.distill(x, w, tx, tw, y, temperature=0.8, hard_weight=0.5)
    out.backward()
    (rx, rw), ref = reference(x, w, tx, tw, y, temperature=0.8, hard_weight=0.5)
    ref.backward()
    assert out.dtype == torch.float32 and rel(out, ref) < FP32
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    assert rel(x.grad, rx.grad) < 2e-2 and rel(w.grad, rw.grad) < 2e-2
    assert tx.grad is None and tw.grad is None


def test_all_tokens_ignored_and_no_target():
    """Every target ignored: 0 (mean, sum, per token), zero gradients. ``target=None``
    ignores nothing: the mean over every token."""
    x, w, tx, tw, y = draw(ignore=T)
    out = fuser.losses.distill(x, w, tx, tw, y, kind="kl", hard_weight=1.0)
    out.backward()
    assert out.item() == 0 and (x.grad == 0).all() and (w.grad == 0).all()
    none = fuser.losses.distill(x, w, tx, tw, y, kind="kl", reduction="none")
    assert none.shape == (T,) and (none == 0).all()
    x, w, tx, tw, y = draw(ignore=0)
    out = fuser.losses.distill(x, w, tx, tw, kind="reverse_kl", temperature=2.0)
    out.backward()
    (rx, rw), ref = reference(x, w, tx, tw, y, kind="reverse_kl", temperature=2.0)
    ref.backward()
    check(out, ref, x, w, rx, rw, tx, tw, "reverse_kl")


def test_a_rule_of_t_and_t_y_and_a_traced_one():
    """A user's rule reading ``t[y]`` and reductions of ``t`` alone and of ``z`` and ``t``
    together (the teacher's log-prob of the target as a per-token weight on the student's
    cross-entropy, plus a forward KL), in text and traced: the same values as float64."""
    text = fuser.loss(
        """
        lse = logsumexp(z)
        lse_t = logsumexp(t)
        w_t = exp(t[y] - lse_t)
        loss = w_t * (lse - z[y]) + sum(exp(t - lse_t) * (t - lse_t - z + lse))
        """,
        name="weighted_ce_kl",
    )

    def traced(z, y, t):
        lse, lse_t = fuser.losses.logsumexp(z), fuser.losses.logsumexp(t)
        return fuser.exp(t[y] - lse_t) * (lse - z[y]) + fuser.losses.sum(
            fuser.exp(t - lse_t) * (t - lse_t - z + lse)
        )

    for rule in (text, fuser.loss(traced, name="weighted_ce_kl_traced")):
        x, w, tx, tw, y = draw()
        out = fuser.compile(rule, block=16)(x, w, y, teacher_hidden=tx, teacher_weight=tw, reduction="sum")
        out.backward()
        rx, rw = (t.detach().double().requires_grad_() for t in (x, w))
        z, t = rx @ rw.T, tx.detach().double() @ tw.detach().double().T
        ls, lt = z.log_softmax(-1), t.log_softmax(-1)
        keep = y != IGNORE
        yc = y.clamp(min=0)[:, None]
        per = -lt.gather(1, yc)[:, 0].exp() * ls.gather(1, yc)[:, 0] + (lt.exp() * (lt - ls)).sum(-1)
        ref = torch.where(keep, per, 0.0).sum()
        ref.backward()
        check(out, ref, x, w, rx, rw, tx, tw)


def test_t_y_under_lean_with_a_teacher_bias():
    """``memory="lean"`` gives a rule's ``t[y]`` to its vocabulary-sliced kernels as a per-token
    input (the teacher's row at the target, its bias there): per-token outputs and gradients
    with non-uniform upstream weights as float64's, the ignored tokens 0."""
    rule = fuser.loss(
        """
        lse_t = logsumexp(t)
        logp_t = t[y] - lse_t
        weighted = exp(logp_t) * (logsumexp(z) - z[y])
        """,
        name="teacher_weighted_ce",
        outputs=("logp_t", "weighted"),
    )
    x, w, tx, tw, y = draw()
    tb = torch.randn(V, dtype=torch.float64).float()
    f = fuser.compile(rule, block=16, chunk_size=3)
    logp_t, weighted = f(x, w, y, teacher_hidden=tx, teacher_weight=tw, teacher_bias=tb, memory="lean")
    up = torch.rand(2, T, dtype=torch.float64) + 0.5
    (logp_t * up[0].float()).sum().backward(retain_graph=True)
    (weighted * up[1].float()).sum().backward()
    rx, rw = (t.detach().double().requires_grad_() for t in (x, w))
    z, t = rx @ rw.T, tx.detach().double() @ tw.detach().double().T + tb.double()
    keep, yc = y != IGNORE, y.clamp(min=0)[:, None]
    want_t = torch.where(keep, t.log_softmax(-1).gather(1, yc)[:, 0], 0.0)
    want_w = torch.where(keep, want_t.exp() * -z.log_softmax(-1).gather(1, yc)[:, 0], 0.0)
    ((want_t * up[0]).sum() + (want_w * up[1]).sum()).backward()
    assert rel(logp_t, want_t) < FP32 and rel(weighted, want_w) < FP32
    assert (logp_t[~keep] == 0).all() and (weighted[~keep] == 0).all()
    assert rel(x.grad, rx.grad) < FP32 and rel(w.grad, rw.grad) < FP32
    assert tx.grad is None and tw.grad is None


def test_teacher_errors():
    """Misuse says what is wrong: the teacher missing at the call, given to a rule without
    ``t``, shapes that do not match, ``t`` outside a reduction, options the teacher does not
    take, and ``distill``'s own arguments."""
    x, w, tx, tw, y = draw()
    f = fuser.compile(DISTILL_JSD)
    with pytest.raises(TypeError, match="teacher_hidden=.*teacher_weight="):
        f(x, w, y)
    with pytest.raises(TypeError, match="reads no teacher logit t"):
        fuser.compile(fuser.losses.CROSS_ENTROPY)(x, w, y, teacher_hidden=tx, teacher_weight=tw)
    with pytest.raises(ValueError, match=r"teacher_weight must be \[V, H_t\] = \[37, 11\].*not \[36, 11\]"):
        fuser.losses.distill(x, w, tx, tw[:-1], y)
    with pytest.raises(ValueError, match=r"teacher_hidden must be \[7, H_t\].*not \[6, 11\]"):
        fuser.losses.distill(x, w, tx[:-1], tw, y)
    with pytest.raises(ValueError, match=r"teacher_bias must be \[37\]"):
        f(x, w, y, teacher_hidden=tx, teacher_weight=tw, teacher_bias=torch.zeros(5))
    with pytest.raises(TypeError, match="share a float dtype"):
        fuser.losses.distill(x, w, tx, tw.double(), y)
    with pytest.raises(fuser.RuleError, match=r"line 2, column 1: loss uses t outside a reduction"):
        fuser.loss("lse = logsumexp(z)\nloss = lse - z[y] + t", name="bad")
    with pytest.raises(
        fuser.RuleError, match=r"line 1, column 8: .*subscripts are not allowed except z\[y\], t\[y\]"
    ):
        fuser.loss("loss = t[z] + logsumexp(z)", name="bad")
    with pytest.raises(fuser.RuleError, match="reserved"):
        fuser.loss("loss = logsumexp(z) - z[y]", hyper=dict(t=1.0))
    with pytest.raises(ValueError, match="hard_weight=0.5 weighs the cross-entropy on target: pass target="):
        fuser.losses.distill(x, w, tx, tw, hard_weight=0.5)
    with pytest.raises(ValueError, match="kind must be one of"):
        fuser.losses.distill(x, w, tx, tw, y, kind="js")
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\]"):
        fuser.losses.distill(x, w, tx, tw, y, beta=1.5)
    with pytest.raises(ValueError, match="temperature must be positive"):
        fuser.losses.distill(x, w, tx, tw, y, temperature=0.0)


def test_teacher_kernel_renders_deterministically_and_reads_t_once_per_sweep():
    """The JSD's row kernel renders byte-identically twice, quotes the rule, takes the
    teacher's buffer last and loads ``t`` only in the sweeps whose reductions read it."""
    a = render_loss(lower_loss(DISTILL_JSD, "fp32"), block=16)
    b = render_loss(lower_loss(DISTILL_JSD, "fp32"), block=16)
    assert a.text == b.text and a.signature[-1] == ("teacher", "*fp32")
    assert "#   lm = log(beta * pt + (1 - beta) * ps" in a.text
    assert "t_y = tl.load(tbase + y_safe" not in a.text  # (the rule reads no t[y])
    # two sweeps and the gradient sweep, each a full-block load and a masked tail
    assert a.text.count("t = tl.load(tbase + cols") == 6


def test_main_grad_with_a_teacher():
    """``accumulate_into="main_grad"``: the student's weight gradient is added into its fp32
    ``main_grad``, as float64's."""
    x, w, tx, tw, y = draw()
    w.main_grad = torch.randn(V, H)
    before = w.main_grad.clone()
    out = fuser.losses.distill(x, w, tx, tw, y, kind="kl", temperature=0.9)
    (rx, rw), ref = reference(x, w, tx, tw, y, kind="kl", temperature=0.9)
    ref.backward()
    f = fuser.compile(fuser.losses.DISTILL_KL)
    x2 = x.detach().clone().requires_grad_()
    again = f(x2, w, y, teacher_hidden=tx, teacher_weight=tw, temperature=0.9, accumulate_into="main_grad")
    again.backward()
    assert again.item() == out.item() and rel(x2.grad, rx.grad) < FP32
    assert rel(w.main_grad - before, rw.grad) < FP32 and tx.grad is None and tw.grad is None
