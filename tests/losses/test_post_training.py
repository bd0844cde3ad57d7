"""Token rules (per-token inputs, several per-token outputs) and ``token_logprobs``, against
float64 torch autograd on the materialised logits, written without fuser's IR.

Shapes are odd and cross the kernels' blocks (``block=16`` for compiled rules; the built-in's
default block holds a row of 37). Every draw also checks ``logp <= 0`` and ``entropy >= 0``.
"""

import pytest
import torch

import fuser
import fuser.losses
from fuser.codegen.loss import render_loss
from fuser.explainer import explanation
from fuser.ir.loss import lower_loss
from fuser.runtime.loss import tokens


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every output buffer starts as NaN: an element a kernel leaves unwritten fails."""
    monkeypatch.setattr(
        tokens, "new_outputs", lambda k, n, device: torch.full((k, n), float("nan"), device=device)
    )


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


@pytest.mark.parametrize("softcap", [None, 2.5])
def test_logp_entropy_and_gradients_with_two_upstream_gradients(softcap):
    """Both outputs of ``token_logprobs(entropy=True)`` at a temperature (and a soft cap),
    with different non-uniform upstream gradients on each: values and the hidden and weight
    gradients within fp32's error of float64 autograd."""
    hidden, weight, target = draw()
    x, w = leaves_of(hidden, weight)
    logp, ent = fuser.losses.token_logprobs(x, w, target, temperature=0.7, entropy=True, softcap=softcap)
    check_signs(logp, ent)
    g1, g2 = torch.randn(T), torch.rand(T) + 0.5
    (logp * g1 + ent * g2).sum().backward()
    (rx, rw), rlogp, rent = reference(hidden, weight, target, temperature=0.7, softcap=softcap)
    (rlogp * g1.double() + rent * g2.double()).sum().backward()
    assert rel(logp, rlogp) < FP32 and rel(ent, rent) < FP32
    assert (logp[target == IGNORE] == 0).all() and (ent[target == IGNORE] == 0).all()
    assert rel(x.grad, rx.grad) < FP32 and rel(w.grad, rw.grad) < FP32
    assert (x.grad[target == IGNORE] == 0).all()


@pytest.mark.parametrize("used", ["logp", "entropy"])
def test_an_unused_output_takes_no_gradient(used):
    """A loss of one output: autograd gives the other none, and the gradients are that
    output's alone."""
    hidden, weight, target = draw()
    x, w = leaves_of(hidden, weight)
    logp, ent = fuser.losses.token_logprobs(x, w, target, entropy=True)
    check_signs(logp, ent)
    g = torch.randn(T)
    ((logp if used == "logp" else ent) * g).sum().backward()
    (rx, rw), rlogp, rent = reference(hidden, weight, target)
    ((rlogp if used == "logp" else rent) * g.double()).sum().backward()
    assert rel(x.grad, rx.grad) < FP32 and rel(w.grad, rw.grad) < FP32


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


@pytest.mark.parametrize("memory", ["auto", "fast", "lean"])
def test_a_reduced_rule_into_main_grad(memory):
    """A rule whose one output is ``loss``, reduced by ``"sum"``, into a ``main_grad`` that
    held values: ``auto`` recomputes the logits in backward and adds there, ``fast`` takes
    the gradients in the forward sweep into an fp32 buffer and scales them by
    ``grad_output`` (a second backward through the same graph refused), ``lean`` adds each
    vocabulary slice's rows. All against float64."""
    rule = fuser.loss(
        GRPO, name="grpo_sum", hyper=dict(eps=0.2, temperature=0.9), inputs=("old", "adv", "mask")
    )
    hidden, weight, target = draw()
    (rx, rw), rlogp, _ = reference(hidden, weight, target, temperature=0.9)
    old, adv = rlogp.detach() + torch.randn(T, dtype=torch.float64) * 0.3, torch.randn(T, dtype=torch.float64)
    mask = torch.rand(T, dtype=torch.float64)
    x, w = leaves_of(hidden, weight)
    w.main_grad = torch.full(w.shape, 0.5)
    out = fuser.compile(rule, block=16)(x, w, target, old=old, adv=adv, mask=mask, reduction="sum",
                                        accumulate_into="main_grad", memory=memory)  # fmt: skip
    ratio = torch.exp(rlogp - old)
    ref = torch.where(target != IGNORE, -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * mask, 0.0)
    (out * -0.6).backward(retain_graph=True)
    (ref.sum() * -0.6).backward()
    assert abs(float(out) - float(ref.sum())) < FP32 * float(ref.abs().sum())
    assert w.grad is None and rel(w.main_grad - 0.5, rw.grad) < FP32 and rel(x.grad, rx.grad) < FP32
    if memory == "fast":
        with pytest.raises(RuntimeError, match="backward can run through it once"):
            out.backward()


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


def test_all_negative_logits():
    """Positive hidden states and negative weights: every logit is below 0."""
    hidden, weight, target = draw()
    hidden, weight = hidden.abs() + 0.1, -(weight.abs() + 0.05)
    assert (hidden @ weight.T).max() < 0
    x, w = leaves_of(hidden, weight)
    logp, ent = fuser.losses.token_logprobs(x, w, target, entropy=True)
    check_signs(logp, ent)
    g1, g2 = torch.randn(T), torch.randn(T)
    (logp * g1 + ent * g2).sum().backward()
    (rx, rw), rlogp, rent = reference(hidden, weight, target)
    (rlogp * g1.double() + rent * g2.double()).sum().backward()
    assert rel(logp, rlogp) < FP32 and rel(ent, rent) < FP32
    assert rel(x.grad, rx.grad) < FP32 and rel(w.grad, rw.grad) < FP32


def test_confident_tokens_stay_at_or_below_zero():
    """Targets that hold all but under 1e-6 of the probability: log p near 0 and never
    above, entropy near 0 and never below, no NaN in values or gradients."""
    hidden, weight, _ = draw(ignore=False, t=40)
    z = (hidden.double() @ weight.double().T).sort(-1).values
    margin = z[:, -1] - z[:, -2]
    hidden = hidden[margin > 0.5][:T]  # (rows whose top two logits are apart)
    target = (hidden @ weight.T).argmax(-1)
    # each row scaled so that the target leads the others by 16 to 19 nats
    x_big = hidden * ((16 + 3 * torch.rand(T)) / margin[margin > 0.5][:T]).float()[:, None]
    (_, _), rlogp, rent = reference(x_big, weight, target)
    assert (rlogp > -1e-6).all() and (rlogp < -1e-12).all(), rlogp
    x, w = leaves_of(x_big, weight)
    logp, ent = fuser.losses.token_logprobs(x, w, target, entropy=True)
    check_signs(logp, ent)
    assert (logp - rlogp).abs().max() < 1e-6 and (ent - rent).abs().max() < 1e-5
    (logp.sum() + ent.sum()).backward()
    assert x.grad.isfinite().all() and w.grad.isfinite().all()


def test_every_token_ignored():
    """Zeros in both outputs, zero gradients."""
    hidden, weight, target = draw()
    target[:] = IGNORE
    x, w = leaves_of(hidden, weight)
    logp, ent = fuser.losses.token_logprobs(x, w, target, entropy=True)
    assert logp.shape == ent.shape == (T,) and (logp == 0).all() and (ent == 0).all()
    (logp.sum() + ent.sum()).backward()
    assert (x.grad == 0).all() and (w.grad == 0).all()


def test_bf16_inputs_keep_fp32_logits():
    """bf16 hidden, weight and bias: the log-probs are within fp32's error of float64 on the
    same bf16 values (rounding the logits to bf16 would be ~1e-3 off), gradients within
    bf16's. The entropy ``lse(u) - sum p u`` is a difference of numbers as large as the
    scaled logits ``u``: its fp32 error is relative to them, not to itself, which these
    large logits take near 0 for confident tokens (seed 279: 3.9e-6 of the largest entropy)."""
    hidden, weight, target = draw(torch.bfloat16, scale=3.0)
    bias = (torch.randn(V) * 0.5).to(torch.bfloat16)
    x, w, b = leaves_of(hidden, weight, bias)
    f = fuser.compile(fuser.losses.TOKEN_LOGPROBS_ENTROPY, chunk_size=3)
    logp, ent = f(x, w, target, b, temperature=0.8)
    check_signs(logp, ent)
    (logp.sum() + ent.sum()).backward()
    (rx, rw, rb), rlogp, rent = reference(hidden, weight, target, temperature=0.8, bias=bias)
    (rlogp.sum() + rent.sum()).backward()
    assert logp.dtype == torch.float32
    u = (rx @ rw.T + rb).detach() / 0.8
    assert rel(logp, rlogp) < FP32
    assert (ent.double() - rent).abs().max() < FP32 * max(rent.abs().max(), u.abs().max())
    for got, want in ((x, rx), (w, rw), (b, rb)):
        assert got.grad.dtype == torch.bfloat16 and rel(got.grad, want.grad) < 2e-2


@pytest.mark.parametrize("memory", ["fast", "lean"])
def test_bf16_target_rows_take_the_logit_gradients_residue(memory):
    """bf16 inputs whose targets are all one class, the weight gradient into an fp32
    main_grad: that class's row sums every token's target-column gradient, which the
    rounding of the logit gradient to bf16 would offset by ~1e-3; with its residue added
    back it is within fp32's error, as every other row is within bf16's."""
    hidden, weight, _ = draw(torch.bfloat16, ignore=False, t=23)
    target = torch.full((23,), 5)
    x, w = leaves_of(hidden, weight)
    w.main_grad = torch.zeros(w.shape)
    logp, ent = fuser.compile(fuser.losses.TOKEN_LOGPROBS_ENTROPY)(
        x, w, target, accumulate_into="main_grad", memory=memory
    )
    g1 = torch.rand(23) + 0.5
    (logp * g1 - 0.1 * ent).sum().backward()
    (rx, rw), rlogp, rent = reference(hidden, weight, target)
    (rlogp * g1.double() - 0.1 * rent).sum().backward()
    assert rel(w.main_grad[5], rw.grad[5]) < 1e-5
    assert rel(w.main_grad, rw.grad) < 1e-2 and rel(x.grad, rx.grad) < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_memory_recomputes_the_logits_by_vocabulary_slices(dtype, monkeypatch):
    """``memory="lean"``: forward in chunks of 3 tokens keeps each token's reductions, and
    backward recomputes the logits 16 vocabulary rows at a time (three slices of 37, the
    last one short), with a bias: both outputs and every gradient against float64, fp32's
    error for fp32 inputs, bf16's for bf16 (whose gradients come in bf16)."""
    import fuser.runtime.loss.residue as residue_module
    import fuser.runtime.loss.staged as staged_module

    monkeypatch.setattr(fuser.losses.api, "vocab_cols", lambda *a, **k: 16)
    loaded = []  # (every kernel the call loads is one `fuser precompile` compiles)
    for module in (staged_module, residue_module):
        load = module.load_kernel
        record = lambda s, d, load=load: loaded.append(s.digest) or load(s, d)  # noqa: E731
        monkeypatch.setattr(module, "load_kernel", record)
    hidden, weight, target = draw(dtype)
    bias = (torch.randn(V) * 0.5).to(dtype)
    x, w, b = leaves_of(hidden, weight, bias)
    f = fuser.compile(fuser.losses.TOKEN_LOGPROBS_ENTROPY, block=16, chunk_size=3)
    logp, ent = f(x, w, target, b, memory="lean", temperature=0.8)
    check_signs(logp, ent)
    g1, g2 = torch.randn(T), torch.rand(T) + 0.5
    (logp * g1 + ent * g2).sum().backward()
    (rx, rw, rb), rlogp, rent = reference(hidden, weight, target, bias=bias, temperature=0.8)
    (rlogp * g1.double() + rent * g2.double()).sum().backward()
    assert rel(logp, rlogp) < FP32 and rel(ent, rent) < FP32
    grad = FP32 if dtype == torch.float32 else 2e-2
    for got, want in ((x, rx), (w, rw), (b, rb)):
        assert got.grad.dtype == dtype and rel(got.grad, want.grad) < grad
    assert (x.grad[target == IGNORE] == 0).all()
    name = "fp32" if dtype == torch.float32 else "bf16"
    listed = fuser.losses.kernel_sources(fuser.losses.TOKEN_LOGPROBS_ENTROPY, name, block=16)
    listed = {s.digest for s in listed}
    assert loaded and set(loaded) <= listed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_memory_keeps_the_logits_for_backward(dtype, monkeypatch):
    """``memory="fast"``: forward takes each chunk's logits (3 tokens) into one buffer of
    every token's, and backward takes no product of them again; both outputs and every
    gradient against float64 (fp32's error, bf16's for bf16 gradients). A second backward
    through the graph (``retain_graph``) computes them again and gets the same gradients.
    bf16's ``grad_weight`` comes from fp32 blocks of 7 rows (a budget of 7 rows), each rounded
    once: within one rounding of ``auto``'s, which adds chunk by chunk in fp32."""
    products = []
    real = tokens.fp32_logits
    monkeypatch.setattr(tokens, "fp32_logits", lambda *a: products.append(1) or real(*a))
    monkeypatch.setattr(tokens, "BLOCK_BUDGET", 4 * H * 7)
    hidden, weight, target = draw(dtype)
    bias = (torch.randn(V) * 0.5).to(dtype)
    x, w, b = leaves_of(hidden, weight, bias)
    f = fuser.compile(fuser.losses.TOKEN_LOGPROBS_ENTROPY, block=16, chunk_size=3)
    logp, ent = f(x, w, target, b, memory="fast", temperature=0.8)
    check_signs(logp, ent)
    forward = len(products)
    g1, g2 = torch.randn(T), torch.rand(T) + 0.5
    (logp * g1 + ent * g2).sum().backward(retain_graph=True)
    live = int((target != IGNORE).sum())  # (ignored rows are left out of every product)
    assert forward == -(-live // 3) >= 2 and len(products) == forward
    (rx, rw, rb), rlogp, rent = reference(hidden, weight, target, bias=bias, temperature=0.8)
    (rlogp * g1.double() + rent * g2.double()).sum().backward()
    assert rel(logp, rlogp) < FP32 and rel(ent, rent) < FP32
    grad = FP32 if dtype == torch.float32 else 2e-2
    first = [t.grad.clone() for t in (x, w, b)]
    for got, want in ((x, rx), (w, rw), (b, rb)):
        assert got.grad.dtype == dtype and rel(got.grad, want.grad) < grad
    assert (x.grad[target == IGNORE] == 0).all()
    for t in (x, w, b):
        t.grad = None
    (logp * g1 + ent * g2).sum().backward()
    assert len(products) == 2 * forward
    for t, want in zip((x, w, b), first):
        assert rel(t.grad, want) < 1e-6
    if dtype == torch.bfloat16:
        w.grad = None
        logp, ent = f(x, w, target, b, memory="auto", temperature=0.8)
        (logp * g1 + ent * g2).sum().backward()
        assert rel(first[1], w.grad) < 2.0**-8


def test_logp_alone_and_its_shape():
    """``entropy=False`` returns one tensor of target's shape ([B, S] here)."""
    hidden, weight, target = draw(ignore=False, t=6)
    logp = fuser.losses.token_logprobs(hidden.reshape(2, 3, H), weight, target.reshape(2, 3))
    _, rlogp, _ = reference(hidden, weight, target)
    assert logp.shape == (2, 3)
    check_signs(logp)
    assert rel(logp.reshape(-1), rlogp) < FP32


def test_main_grad_receives_the_weight_gradient():
    hidden, weight, target = draw()
    x, w = leaves_of(hidden, weight)
    w.main_grad = torch.full(w.shape, 0.5)
    rule = fuser.losses.TOKEN_LOGPROBS_ENTROPY
    logp, ent = fuser.compile(rule, block=16)(x, w, target, accumulate_into="main_grad")
    (logp.sum() - 0.3 * ent.sum()).backward()
    (rx, rw), rlogp, rent = reference(hidden, weight, target)
    (rlogp.sum() - 0.3 * rent.sum()).backward()
    assert w.grad is None and rel(w.main_grad - 0.5, rw.grad) < FP32


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


def test_traced_function_errors():
    def two(z, y):
        return dict(logp=z[y] - fuser.losses.logsumexp(z))

    with pytest.raises(fuser.RuleError, match=r"returns dict\(logp=..., top=...\)"):
        fuser.loss(two, outputs=("logp", "top"))

    def reads(z, y, *, adv):
        return adv * fuser.losses.logsumexp(z)

    with pytest.raises(fuser.RuleError, match="neither a hyperparameter nor an input"):
        fuser.loss(reads)
    assert fuser.loss(reads, inputs=("adv",)).inputs == ("adv",)


def test_call_errors_name_what_to_fix():
    rule = fuser.loss("loss = (logsumexp(z) - z[y]) * adv", inputs=("adv",), name="weighted_ce")
    f = fuser.compile(rule, block=16)
    hidden, weight, target = draw()
    adv = torch.rand(T)
    with pytest.raises(TypeError, match=r"missing the per-token input\(s\) \['adv'\]"):
        f(hidden, weight, target)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['other'\]"):
        f(hidden, weight, target, adv=adv, other=adv)
    with pytest.raises(ValueError, match=r"target's shape \[7\]"):
        f(hidden, weight, target, adv=torch.rand(T + 1))
    with pytest.raises(TypeError, match="must be a float tensor"):
        f(hidden, weight, target, adv=torch.ones(T, dtype=torch.int64))
    with pytest.raises(ValueError, match="memory must be one of"):
        f(hidden, weight, target, adv=adv, memory="small")
    with pytest.raises(ValueError, match="memory='lean' with process_group= does not run yet"):
        f(hidden, weight, target, adv=adv, memory="lean", process_group=object())
    with pytest.raises(ValueError, match="schedule='auto' or 'chunks'"):
        fuser.compile(rule, schedule="fused")(hidden, weight, target, adv=adv)
    two = fuser.compile(fuser.losses.TOKEN_LOGPROBS_ENTROPY)
    with pytest.raises(ValueError, match="take no reduction"):
        two(hidden, weight, target, reduction="mean")
    with pytest.raises(ValueError, match="temperature must be positive"):
        fuser.losses.token_logprobs(hidden, weight, target, temperature=0.0)


def test_explain_shows_inputs_outputs_and_fp32_logits():
    rule = fuser.loss(
        GRPO, name="grpo_test", hyper=dict(eps=0.2, temperature=1.0), inputs=("old", "adv", "mask")
    )
    text = explanation(rule, "bf16")
    assert "bf16 hidden states and weight, fp32 logits" in text
    assert "per-token inputs: old, adv, mask" in text and "each chunk's logits: fp32" in text
    two = explanation(fuser.losses.TOKEN_LOGPROBS_ENTROPY)
    assert "the per-token outputs, in the order a call returns them" in two
    assert "     logp = " in two and "     entropy = " in two


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


def _example():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "post_training.py"
    spec = importlib.util.spec_from_file_location("post_training_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("which", ["grpo_loss", "grpo_loss_one_rule"])
def test_example_grpo_loss_matches_float64(which):
    """examples/post_training.py's GRPO loss (clipped ratio with epsilon_low/high, k3 KL to
    reference log-probs, entropy bonus, DAPO's token-level mean) and its gradients against
    the same objective on float64 logits (TRL's per-token formulas); also written as one
    rule (gradients from the forward sweep)."""
    grpo_loss = getattr(_example(), which)
    B, S = 3, 5
    hidden = torch.randn(B, S, H)
    weight = torch.randn(V, H) / H**0.5 * 1.5
    completion = torch.randint(0, V, (B, S))
    mask = (torch.rand(B, S) > 0.25).float()
    advantages = torch.randn(B)
    old = (torch.randn(B, S) * 0.3 - 3.5).clamp(max=-0.01)
    ref = (torch.randn(B, S) * 0.3 - 3.5).clamp(max=-0.01)
    x, w = leaves_of(hidden, weight)
    loss = grpo_loss(
        x, w, completion, mask, advantages, old, ref, beta=0.1, entropy_coef=0.05, temperature=0.9
    )
    loss.backward()

    rx, rw = leaves_of(hidden.double(), weight.double())
    logsm = torch.log_softmax(rx @ rw.T / 0.9, dim=-1)
    logp = logsm.gather(-1, completion[..., None])[..., 0]
    entropy = -(logsm.exp() * logsm).sum(-1)
    coef_1 = torch.exp(logp - old.double())
    coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.28)
    a = advantages.double()[:, None]
    per_token = -torch.min(coef_1 * a, coef_2 * a)
    kl = torch.exp(ref.double() - logp) - (ref.double() - logp) - 1
    per_token = per_token + 0.1 * kl - 0.05 * entropy
    want = (per_token * mask.double()).sum() / mask.double().sum()
    want.backward()
    assert loss.dtype == torch.float32
    scale = (per_token * mask.double()).abs().sum() / mask.double().sum()  # (the mean's terms)
    assert abs(loss.item() - want.item()) < FP32 * scale.item()
    assert rel(x.grad, rx.grad) < FP32 and rel(w.grad, rw.grad) < FP32


def test_example_runs(capsys):
    _example().main()
    out = capsys.readouterr().out
    assert out.count("GRPO loss") == 3 and out.count("SimPO loss") == 2 and "nan" not in out


@pytest.mark.gpu
@pytest.mark.parametrize("memory", ["auto", "lean", "fast"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_token_logprobs_on_the_gpu(dtype, memory, monkeypatch):
    """On CUDA (cuBLAS products with fp32 outputs, several chunks of tokens, an odd vocabulary
    whose rows are no multiple of 16 bytes; ``lean``: four vocabulary slices in backward;
    ``fast``: every token's logits kept for backward):
    both outputs and both gradients against float64 on the same inputs. fp32 inputs may take
    TF32 products (10 mantissa bits), hence 1e-3."""
    monkeypatch.setattr(fuser.losses.api, "vocab_cols", lambda *a, **k: 1280)
    t, h, v = 1031, 257, 5003
    hidden = (torch.randn(t, h, dtype=torch.float64) * 2).to(dtype)
    weight = (torch.randn(v, h, dtype=torch.float64) / h**0.5 * 1.5).to(dtype)
    target = torch.randint(0, v, (t,))
    target[torch.randperm(t)[: t // 7]] = IGNORE
    x, w = (u.detach().cuda().requires_grad_() for u in (hidden, weight))
    logp, ent = fuser.losses.token_logprobs(x, w, target.cuda(), temperature=0.9, entropy=True, memory=memory)
    check_signs(logp, ent)
    g1, g2 = torch.randn(t), torch.rand(t) + 0.5
    (logp * g1.cuda() + ent * g2.cuda()).sum().backward()
    (rx, rw), rlogp, rent = reference(hidden, weight, target, temperature=0.9)
    (rlogp * g1.double() + rent * g2.double()).sum().backward()
    values = 1e-5 if dtype == torch.bfloat16 else 1e-3
    assert rel(logp.cpu(), rlogp) < values and rel(ent.cpu(), rent) < values
    grads = 2e-2 if dtype == torch.bfloat16 else 1e-3
    assert rel(x.grad.cpu(), rx.grad) < grads and rel(w.grad.cpu(), rw.grad) < grads
    assert (logp.cpu()[target == IGNORE] == 0).all() and (x.grad.cpu()[target == IGNORE] == 0).all()
