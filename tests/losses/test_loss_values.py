"""Fused linear + loss against float64 autograd on materialised logits, on the CPU interpreter.

Shapes are small and odd (T=37, H=24, V=211). ``chunk_size`` and ``block`` are set small in
some cases so that several token chunks and several vocabulary blocks per row are crossed.
"""

import pytest
import torch

import fuser
import fuser.losses
from fuser.cache import load_kernel
from fuser.codegen.loss_matmul import GRAD_SCALE_BLOCK, render_grad_scale
from fuser.runtime.loss.chunked import dtype_name

from .reference import (
    IGNORE,
    T,
    V,
    assert_close,
    assert_within,
    cross_entropy,
    decidable_draw,
    make_inputs,
    reference,
)

# Low-precision inputs: bf16/fp16 logits against float64 on the same rounded logits, the
# max error relative to the largest element (fp32 inputs are held to derived bounds).
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def run(f, hidden, weight, bias, target, *, reduction="mean", grad_out=None, **kw):
    x = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    b = bias.clone().requires_grad_() if bias is not None else None
    out = f(x, w, target, b, reduction=reduction, **kw)
    go = torch.ones_like(out) if grad_out is None else grad_out.to(out.dtype)
    (out * go).sum().backward()
    return out, x.grad, w.grad, (b.grad if b is not None else None)


def check(got, ref, tol=None, dtype=torch.float32):
    """Loss and gradients against the float64 reference: within fp32's derived bounds for
    fp32 inputs (reference.fp32_bounds), the loss within them for every dtype (where the
    reference's logits were not rounded), the gradients of 16-bit inputs within ``tol`` of
    the largest element. The loss is fp32, the gradients have the inputs' ``dtype``."""
    assert got[0].dtype == torch.float32
    assert all(g.dtype == dtype for g in got[1:] if g is not None)
    names = ("loss", "grad hidden", "grad weight", "grad bias")
    for i, (a, e, name) in enumerate(zip(got, ref[:4], names)):
        if e is None:
            continue
        if ref.bounds is not None:
            assert_within(a, e, ref.bounds[i], name)
        elif i == 0 and ref.loss_bound is not None:
            assert_within(a, e, ref.loss_bound, name)
        else:
            assert_close(a, e, tol, name)


def label_smoothed(eps):
    def per_token(z, y):
        lse = torch.logsumexp(z, 1)
        return (1 - eps) * (lse - z.gather(1, y[:, None])[:, 0]) + eps * (lse - z.mean(1))

    return per_token


# torch.nn.functional.linear_cross_entropy exists from torch 2.13 (the GPU image has 2.11).
needs_torch_lce = pytest.mark.skipif(
    not hasattr(torch.nn.functional, "linear_cross_entropy"),
    reason="this torch has no torch.nn.functional.linear_cross_entropy",
)


# --- built-in cross-entropy against torch's own linear_cross_entropy ------------------------------


@needs_torch_lce
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore", ["none", "some"])
def test_cross_entropy_matches_torch_linear_cross_entropy(reduction, ignore):
    bias = reduction != "sum"
    hidden, weight, b, target = make_inputs(bias=bias, ignore=ignore)
    grad_out = torch.rand(T) + 0.5 if reduction == "none" else torch.tensor(1.7)
    got = run(fuser.losses.cross_entropy, hidden, weight, b, target, reduction=reduction, grad_out=grad_out)

    x = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    bb = b.clone().requires_grad_() if b is not None else None
    ref = torch.nn.functional.linear_cross_entropy(
        x, w, target, linear_bias=bb, reduction=reduction, ignore_index=IGNORE
    )
    (ref * grad_out).sum().backward()
    # fuser and torch each within fp32's bounds of the float64 reference
    want = reference(cross_entropy, hidden, weight, b, target, reduction=reduction, grad_out=grad_out)
    check(got, want)
    check((ref, x.grad, w.grad, bb.grad if b is not None else None), want)


@needs_torch_lce
def test_cross_entropy_label_smoothing_and_batched_input_match_torch():
    hidden, weight, b, target = make_inputs(shape=(3, 11))
    got = run(fuser.losses.cross_entropy, hidden, weight, b, target, label_smoothing=0.1)
    x = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    bb = b.clone().requires_grad_()
    ref = torch.nn.functional.linear_cross_entropy(
        x.reshape(-1, x.shape[-1]),
        w,
        target.reshape(-1),
        linear_bias=bb,
        label_smoothing=0.1,
        ignore_index=IGNORE,
    )
    ref.backward()
    assert got[1].shape == hidden.shape
    want = reference(label_smoothed(0.1), hidden, weight, b, target)
    check(got, want)
    check((ref, x.grad, w.grad, bb.grad), want)


# (without label smoothing a softcap runs a rule of its own: SOFTCAP_CROSS_ENTROPY_UNSMOOTHED;
# approx_tanh takes their approx_tanh twins, whose tanh the interpreter computes exactly)
@pytest.mark.parametrize("approx", [False, True])
@pytest.mark.parametrize("ls", [0.05, 0.0])
@pytest.mark.parametrize("memory", ["auto", "lean"])
def test_cross_entropy_all_options_against_float64(memory, ls, approx):
    hidden, weight, b, target = make_inputs(scale=3.0)
    cap, temp, zl = 4.0, 0.7, 1e-3

    def per_token(z, y):
        z = cap * torch.tanh(z / cap) / temp
        lse = torch.logsumexp(z, 1)
        return (lse - (1 - ls) * z.gather(1, y[:, None])[:, 0] - ls * z.mean(1)) + zl * lse**2

    got = run(
        fuser.losses.cross_entropy,
        hidden,
        weight,
        b,
        target,
        softcap=cap,
        temperature=temp,
        label_smoothing=ls,
        z_loss=zl,
        memory=memory,
        approx_tanh=approx,
    )
    check(got, reference(per_token, hidden, weight, b, target))


def test_approx_tanh_needs_a_softcap():
    hidden, weight, b, target = make_inputs()
    with pytest.raises(ValueError, match="softcap"):
        fuser.losses.cross_entropy(hidden, weight, target, approx_tanh=True)


# --- user rules, including ones no built-in covers ------------------------------------------------


def _softcap_zloss(z, y):
    z = 3.0 * torch.tanh(z / 3.0)
    lse = torch.logsumexp(z, 1)
    return lse - z.gather(1, y[:, None])[:, 0] + 1e-2 * lse**2


def _entropy_regularized(z, y):
    z = z / 1.3
    logp = torch.log_softmax(z, 1)
    entropy = -(logp.exp() * logp).sum(1)
    return -logp.gather(1, y[:, None])[:, 0] - 0.2 * entropy


def _max_margin(z, y):
    # max with its argmax gradient, a mean, and where()
    m = z.max(1).values
    return m - z.gather(1, y[:, None])[:, 0] + 0.1 * torch.where(z > 0, z, 0.5 * z).mean(1)


def _relative_to_target(z, y):
    # reductions reading z[y]: log(sum(exp(z - z[y]))) is cross-entropy, via the target adjoint
    zy = z.gather(1, y[:, None])
    return torch.log(torch.exp(z - zy).sum(1)) + 0.1 * torch.sigmoid(zy[:, 0])


def _nested(z, y):
    # a logsumexp whose argument reads an earlier reduction that is not a closed form away
    m = z.mean(1, keepdim=True)
    z2 = z * z / (1 + m * m) + torch.log1p(torch.exp(-z.abs()))
    return torch.logsumexp(z2, 1) - z2.gather(1, y[:, None])[:, 0]


def _max_of_scaled(z, y):
    # a max whose argument reads an earlier reduction: the argmax's own derivative
    s = z.mean(1, keepdim=True)
    return (z * (1 + s * s)).max(1).values - z.gather(1, y[:, None])[:, 0]


def _lse_of_lse(z, y):
    # the derivative of a logsumexp with respect to an earlier reduction is not closed-form:
    # it becomes a softmax-weighted sum in one more sweep
    a = torch.logsumexp(z, 1, keepdim=True)
    return torch.logsumexp(z * a / 10, 1) - z.gather(1, y[:, None])[:, 0] * a[:, 0] / 10


def _shift_clamp(z, y):
    z = (z - z.gather(1, y[:, None])).clamp(-4, 4)
    return torch.logsumexp(torch.where(z > 0, 2 * z, z), 1) + torch.log1p(torch.exp(-z.abs())).sum(1) / 50


def _trig_gate(z, y):
    # sin, cos, and a condition joining a hyperparameter's comparison with a logit's
    z = z + 0.3 * torch.sin(z) * torch.where(z > 0, 1.0, 0.5)
    return (
        torch.logsumexp(z, 1) - z.gather(1, y[:, None])[:, 0] + 0.1 * torch.cos(z.gather(1, y[:, None])[:, 0])
    )


USER_RULES = {
    "softcap_zloss": (
        """
        z = cap * tanh(z / cap)
        lse = logsumexp(z)
        loss = lse - z[y] + z_loss * lse**2
    """,
        dict(cap=3.0, z_loss=1e-2),
        _softcap_zloss,
    ),
    "max_margin": (
        """
        m = max(z)
        loss = m - z[y] + 0.1 * mean(where(z > 0, z, 0.5 * z))
    """,
        {},
        _max_margin,
    ),
    "relative_to_target": (
        """
        loss = log(sum(exp(z - z[y]))) + 0.1 * sigmoid(z[y])
    """,
        {},
        _relative_to_target,
    ),
    "nested": (
        """
        m = mean(z)
        z = z * z / (1 + m * m) + log1p(exp(-abs(z)))
        loss = logsumexp(z) - z[y]
    """,
        {},
        _nested,
    ),
    "lse_of_lse": (
        """
        a = logsumexp(z)
        loss = logsumexp(z * a / 10) - z[y] * a / 10
    """,
        {},
        _lse_of_lse,
    ),
    "shift_clamp": (
        """
        z = clamp(z - z[y], -4, 4)
        loss = logsumexp(where(z > 0, 2 * z, z)) + sum(log1p(exp(-abs(z)))) / 50
    """,
        {},
        _shift_clamp,
    ),
    "trig_gate": (
        """
        z = z + 0.3 * sin(z) * where(cap > 0 and z > 0, 1, 0.5)
        loss = logsumexp(z) - z[y] + 0.1 * cos(z[y])
    """,
        dict(cap=1.0),
        _trig_gate,
    ),
    "max_of_scaled": (
        """
        s = mean(z)
        loss = max(z * (1 + s**2)) - z[y]
    """,
        {},
        _max_of_scaled,
    ),
}


@pytest.mark.parametrize("name", sorted(USER_RULES))
def test_user_rule_against_float64(name):
    text, hyper, per_token = USER_RULES[name]
    f = fuser.compile(fuser.loss(text, name=name, hyper=hyper))
    hidden, weight, b, target = make_inputs(bias=name != "nested", rule=per_token)
    got = run(f, hidden, weight, b, target)
    check(got, reference(per_token, hidden, weight, b, target))


def test_entropy_regularized_builtin_across_chunks_and_blocks():
    # 28 live tokens in 2 token chunks (16 + 12), 4 vocabulary blocks per row (64 * 4 > 211)
    hidden, weight, b, target = make_inputs()
    rule = fuser.losses.ENTROPY_REGULARIZED_CROSS_ENTROPY
    f = fuser.compile(rule, chunk_size=16, block=64)
    grad_out = torch.rand(T) + 0.5
    got = run(
        f, hidden, weight, b, target, reduction="none", grad_out=grad_out, entropy_coef=0.2, temperature=1.3
    )
    ref = reference(_entropy_regularized, hidden, weight, b, target, reduction="none", grad_out=grad_out)
    check(got, ref)


@pytest.mark.parametrize("memory", ["auto", "lean"])
def test_entropy_regularized_function_is_the_builtin_rule(memory):
    # (the compiled rule across chunks and blocks once, above, not again for each memory)
    hidden, weight, b, target = make_inputs()
    grad_out = torch.rand(T) + 0.5
    ref = reference(_entropy_regularized, hidden, weight, b, target, reduction="none", grad_out=grad_out)
    got2 = run(
        fuser.losses.entropy_regularized_cross_entropy,
        hidden,
        weight,
        b,
        target,
        reduction="none",
        grad_out=grad_out,
        entropy_coef=0.2,
        temperature=1.3,
        memory=memory,
    )
    check(got2, ref)


def test_traced_function_rule_equals_text_rule():
    @fuser.loss(hyper=dict(cap=3.0, z_loss=1e-2))
    def softcap_zloss(z, y, *, cap, z_loss):
        z = cap * fuser.tanh(z / cap)
        lse = fuser.losses.logsumexp(z)
        return lse - z[y] + z_loss * lse**2

    hidden, weight, b, target = make_inputs(bias=False)
    f = fuser.compile(softcap_zloss, chunk_size=10)
    got = run(f, hidden, weight, b, target, reduction="sum", cap=2.0)

    def per_token(z, y):
        z = 2.0 * torch.tanh(z / 2.0)
        lse = torch.logsumexp(z, 1)
        return lse - z.gather(1, y[:, None])[:, 0] + 1e-2 * lse**2

    check(got, reference(per_token, hidden, weight, b, target, reduction="sum"))


def confident_logits(per_token, lead):
    """Logits [T, V] as hidden states through an identity weight (exact logits), each
    token's target ahead of every other logit's magnitude by ``lead`` or more."""

    def draw():
        z = torch.randn(T, V)
        target = torch.randint(0, V, (T,))
        z[torch.arange(T), target] = z.abs().amax(1) + lead + torch.rand(T)
        return z, torch.eye(V), None, target

    z, eye, _, target = decidable_draw(draw, per_token)
    return z, eye, target


@pytest.mark.parametrize("name", ["cross_entropy", "nested"])
def test_confident_tokens_within_the_bound_of_their_cancelling_gradient(name):
    # The target's gradient p_y - 1 is ~1e-6 or less while p_y ~ 1 carries the rounding of
    # logsumexp (~u |lse|): the error is a fraction of the cancelling terms, not of d_y.
    if name == "cross_entropy":
        f, per_token, lead = fuser.losses.cross_entropy, cross_entropy, 20.0
    else:
        text, hyper, per_token = USER_RULES[name]
        f, lead = fuser.compile(fuser.loss(text, name=name, hyper=hyper)), 3.0
    z, eye, target = confident_logits(per_token, lead)
    got = run(f, z, eye, None, target, reduction="sum")
    ref = reference(per_token, z, eye, None, target, reduction="sum")
    assert float(ref.grad_hidden[torch.arange(T), target].abs().max()) < 1e-5
    check(got, ref)


# --- reductions, ignore patterns, low precision -----------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_gives_zero_loss_and_zero_grads(reduction):
    hidden, weight, b, target = make_inputs(ignore="all")
    loss, gx, gw, gb = run(fuser.losses.cross_entropy, hidden, weight, b, target, reduction=reduction)
    assert torch.equal(loss, torch.zeros_like(loss))
    for g in (gx, gw, gb):
        assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_low_precision_inputs(dtype, reduction):
    hidden, weight, b, target = make_inputs(dtype)
    grad_out = torch.rand(T) + 0.5 if reduction == "none" else torch.rand(()) + 0.5
    text, hyper, per_token = USER_RULES["softcap_zloss"]
    f = fuser.compile(fuser.loss(text, name="softcap_zloss", hyper=hyper), chunk_size=20)
    got = run(f, hidden, weight, b, target, reduction=reduction, grad_out=grad_out)
    ref = reference(per_token, hidden, weight, b, target, reduction=reduction, grad_out=grad_out)
    check(got, ref, TOL[dtype], dtype)  # (the loss within fp32's bound: its logits stay fp32)


@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
def test_grad_scale_kernel_rounds_the_product_once(src):
    # the kernel that scales a forward's gradients by grad_output in backward: whole blocks
    # and a ragged tail, fp32 into bf16 and bf16 in place, against the float64 product
    n = 2 * GRAD_SCALE_BLOCK + 37
    g = (torch.randn(n, dtype=torch.float64) * torch.rand(n, dtype=torch.float64) * 1e3).to(src)
    go = torch.rand(1) + 0.5
    ref = g.double() * go.double()
    out = g.clone() if src == torch.bfloat16 else torch.full((n,), float("nan"), dtype=torch.bfloat16)
    kernel = load_kernel(render_grad_scale(dtype_name(src), "bf16"), g.device)
    kernel((-(-n // GRAD_SCALE_BLOCK),), out if src == torch.bfloat16 else g, go, out, n)
    # one rounding of the fp32 product to nearest even: torch's fp32 product cast to bf16,
    # bit for bit, and within bf16's unit roundoff (2**-8) of the exact product
    assert torch.equal(out, (g.float() * go).to(torch.bfloat16))
    assert ((out.double() - ref).abs() <= (2.0**-8 + 2.0**-23) * ref.abs()).all()


def test_bf16_target_gradient_is_rounded_once():
    # A confident prediction: p_y ~ 0.999, so d loss / d z_y = p_y - 1 ~ -1e-3. Rounding p_y
    # to bf16 first (steps of 2**-8 near 1) and subtracting 1 afterwards would lose it all.
    # With one token, grad_bias is the stored logit gradient itself.
    hidden, weight, b, target = make_inputs(torch.bfloat16, ignore="none", shape=(1,))
    y = target[0]
    z = hidden.double() @ weight.double().T + b.double()
    others = torch.logsumexp(torch.cat([z[0, :y], z[0, y + 1 :]]), 0)
    b = b.double()
    b[y] += others + 6.5 - z[0, y]  # 1 - p_y = about exp(-6.5) = 1.5e-3
    b = b.to(torch.bfloat16)
    loss, gx, gw, gb = run(fuser.losses.cross_entropy, hidden, weight, b, target)
    ref = reference(cross_entropy, hidden, weight, b, target)  # (the logits stay fp32)
    assert -5e-3 < ref[3][y] < -1e-5
    assert abs(gb[y].double() - ref[3][y]) <= 1e-2 * abs(ref[3][y])
    assert_close(gb, ref[3], 1e-2, "grad bias")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_low_precision_inputs_give_an_fp32_loss(dtype, reduction):
    # Logits exact in the input dtype (hidden states through an identity weight), so the
    # float64 loss on them is the truth: the loss comes back within fp32's bound of it, where
    # rounding it to the inputs' dtype would move it by a good part of its spacing (2**-8 of
    # the value in bf16: 11.9375 for 11.9167).
    hidden = (torch.randn(T, V) * 2).to(dtype)
    eye = torch.eye(V, dtype=dtype)
    target = make_inputs(v=V)[3]
    loss, *_ = run(fuser.losses.cross_entropy, hidden, eye, None, target, reduction=reduction)
    assert loss.dtype == torch.float32
    ref = reference(cross_entropy, hidden.float(), eye.float(), None, target, reduction=reduction)
    assert_within(loss, ref.loss, ref.bounds[0], "loss")
    if reduction == "none":
        # ~28 per-token losses: rounded to the dtype, some lands beyond the bound (one mean
        # may fall near a representable value by chance: fp16's spacing at 5 is 4e-3).
        rounded = ref.loss.to(dtype).double()
        assert bool(((rounded - ref.loss).abs() > 4 * ref.bounds[0])[ref.loss != 0].any())


def test_no_grad_call_and_hyper_overrides():
    hidden, weight, b, target = make_inputs()
    text, hyper, per_token = USER_RULES["softcap_zloss"]
    f = fuser.compile(fuser.loss(text, name="softcap_zloss", hyper=hyper))
    with torch.no_grad():
        loss = f(hidden.requires_grad_(), weight, target, b)
    assert loss.grad_fn is None
    ref = reference(per_token, hidden, weight, b, target)
    assert_within(loss, ref.loss, ref.bounds[0], "loss")
    with pytest.raises(TypeError, match="unexpected keyword"):
        f(hidden, weight, target, b, capp=2.0)
    with pytest.raises(ValueError, match="reduction"):
        f(hidden, weight, target, b, reduction="avg")


def test_launches_one_kernel_per_chunk():
    hidden, weight, b, target = make_inputs()
    f = fuser.compile(fuser.losses.CROSS_ENTROPY, chunk_size=16)
    f(hidden, weight, target, b)  # load once
    before = fuser.stats()["launches"]
    run(f, hidden, weight, b, target)
    live = int((target != IGNORE).sum())  # ignored rows are left out before the chunks
    assert fuser.stats()["launches"] - before == -(-live // 16) < -(-T // 16)


# --- Megatron's main_grad ----------------------------------------------------------------------------


@pytest.mark.parametrize("flag", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_main_grad_accumulation(flag, reduction):
    hidden, weight, target, x, w, start = main_grad_inputs(flag)
    grad_out = torch.rand(T) + 0.5 if reduction == "none" else torch.tensor(2.5)
    out = fuser.losses.cross_entropy(x, w, target, reduction=reduction, accumulate_into="main_grad")
    (out * grad_out.to(out.dtype)).sum().backward()
    ref = reference(
        cross_entropy,
        hidden,
        weight,
        None,
        target,
        reduction=reduction,
        grad_out=grad_out.to(torch.bfloat16).float(),
    )
    assert_close(w.main_grad - start, ref[2], 2e-2, "main_grad increment")
    assert_close(x.grad, ref[1], 2e-2, "grad hidden")
    check_weight_grad_left_to_main_grad(w, flag)
    # a second step adds again, once
    out = fuser.losses.cross_entropy(x, w, target, reduction=reduction, accumulate_into="main_grad")
    (out * grad_out.to(out.dtype)).sum().backward()
    assert_close(w.main_grad - start, 2 * ref[2], 2e-2, "main_grad after two steps")


def main_grad_inputs(flag, shape=(T,)):
    """bf16 inputs, and leaf copies ``x``, ``w`` whose fp32 ``main_grad`` starts random
    (``start``); with ``flag``, ``w`` carries Megatron's ``grad_added_to_main_grad``."""
    hidden, weight, _, target = make_inputs(torch.bfloat16, bias=False, shape=shape)
    x = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    start = torch.randn(V, hidden.shape[-1], dtype=torch.float32)
    w.main_grad = start.clone()
    if flag:
        w.grad_added_to_main_grad = False
    return hidden, weight, target, x, w, start


def check_weight_grad_left_to_main_grad(w, flag):
    """Megatron's contract after backward: ``w.grad`` is None, or zeros with the flag set
    where the weight has ``grad_added_to_main_grad``."""
    if flag:
        assert w.grad_added_to_main_grad is True
        assert w.grad is not None and torch.count_nonzero(w.grad) == 0
    else:
        assert w.grad is None


def test_main_grad_requires_fp32_main_grad():
    hidden, weight, b, target = make_inputs(bias=False)
    w = weight.clone().requires_grad_()
    with pytest.raises(ValueError, match="main_grad"):
        fuser.losses.cross_entropy(hidden, w, target, accumulate_into="main_grad")


@needs_torch_lce
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_cross_entropy_matches_torch(dtype):
    hidden, weight, b, target = make_inputs(dtype, shape=(3, 13))
    grad_out = torch.rand(3, 13) + 0.5
    got = run(fuser.losses.cross_entropy, hidden, weight, b, target, reduction="none", grad_out=grad_out)
    x = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    bb = b.clone().requires_grad_()
    ref = torch.nn.functional.linear_cross_entropy(
        x.reshape(-1, x.shape[-1]),
        w,
        target.reshape(-1),
        linear_bias=bb,
        reduction="none",
        ignore_index=IGNORE,
    )
    ref = ref.reshape(3, 13)
    (ref * grad_out.to(dtype)).sum().backward()
    assert got[0].shape == (3, 13) and got[0].dtype == torch.float32
    assert_close(got[0], ref.detach().double(), TOL[dtype], "loss")
    for a, e, n in ((got[1], x.grad, "hidden"), (got[2], w.grad, "weight"), (got[3], bb.grad, "bias")):
        assert a.dtype == e.dtype
        assert_close(a, e.double(), TOL[dtype], f"grad {n}")


@pytest.mark.parametrize("frozen", ["weight", "hidden"])
def test_only_the_inputs_that_need_grad_get_one(frozen):
    hidden, weight, b, target = make_inputs(bias=False)
    x = hidden.clone().requires_grad_(frozen != "hidden")
    w = weight.clone().requires_grad_(frozen != "weight")
    fuser.losses.cross_entropy(x, w, target).backward()
    ref = reference(cross_entropy, hidden, weight, None, target)
    if frozen == "weight":
        assert w.grad is None
        assert_within(x.grad, ref.grad_hidden, ref.bounds[1], "grad hidden")
    else:
        assert x.grad is None
        assert_within(w.grad, ref.grad_weight, ref.bounds[2], "grad weight")


def test_second_backward_through_the_eager_schedule_says_why():
    hidden, weight, b, target = make_inputs(bias=False)
    w = weight.clone().requires_grad_()
    loss = fuser.losses.cross_entropy(hidden, w, target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="once"):
        loss.backward()


@pytest.mark.parametrize("schedule", ["chunks", "whole", "vocab"])
def test_online_logsumexp_on_rows_that_keep_raising_their_max(schedule):
    """Logits given directly (an identity weight): rows whose maximum rises at every column,
    falls from the first, spans +-80 (exp of it overflows fp32 unless shifted), is constant,
    or is random; per-token loss and grad_hidden against float64, every schedule, with a
    block that leaves a masked tail on each row. A NaN logit makes its own row's loss NaN."""
    v = 211
    g = torch.Generator().manual_seed(torch.randint(2**62, ()).item())
    z = torch.stack(
        [
            torch.linspace(-80.0, 80.0, v),
            torch.linspace(80.0, -80.0, v),
            torch.linspace(-80.0, 80.0, v)[torch.randperm(v, generator=g)],
            torch.full((v,), 3.25),
            torch.randn(v, generator=g) * 30.0,
            torch.rand(v, generator=g) * 0.1 - 5.0,
        ]
    )
    target = torch.randint(0, v, (z.shape[0],), generator=g)
    f = fuser.compile(fuser.losses.CROSS_ENTROPY, schedule=schedule, block=64, chunk_size=4)
    x = z.clone().requires_grad_()
    loss = f(x, torch.eye(v), target, reduction="none")
    grad_out = torch.rand(z.shape[0], generator=g) + 0.5
    (loss * grad_out).sum().backward()
    want = reference(cross_entropy, z, torch.eye(v), None, target, reduction="none", grad_out=grad_out)
    assert_within(loss, want.loss, want.bounds[0], "loss")
    assert_within(x.grad, want.grad_hidden, want.bounds[1], "grad hidden")

    z[4, 17] = float("nan")
    x = z.clone().requires_grad_()
    loss = f(x, torch.eye(v), target, reduction="none")
    assert torch.isnan(loss[4]) and torch.isfinite(loss[torch.arange(z.shape[0]) != 4]).all()


def test_a_coefficient_off_by_1e4_fails_the_comparison():
    """The derived bounds see a label-smoothing coefficient moved by 1e-4. (1e-5 is below
    what can be told apart here: the logits of a depth-24 fp32 matmul may err by
    26 U |x| |w|, about 1e-5 of a loss, before the epilogue starts.)"""
    smoothed = label_smoothed
    hidden, weight, b, target = make_inputs()
    got = run(fuser.losses.cross_entropy, hidden, weight, b, target, label_smoothing=0.1)
    check(got, reference(smoothed(0.1), hidden, weight, b, target))
    with pytest.raises(AssertionError, match="beyond fp32's bound"):
        check(got, reference(smoothed(0.1 + 1e-4), hidden, weight, b, target))
