"""The scaled schedule (fuser.runtime.loss.scaled) against float64 autograd, on the CPU
interpreter: rules whose gradient is ``A * softmax + B * [target] + C`` per token, several
chunks of tokens (the last one short), fp32 and bf16, ignored rows, and the row kernel's
schedule taking over a call whose logits reach beyond the schedule's range."""

import re

import pytest
import sympy
import torch

import fuser
import fuser.losses
from fuser.codegen.loss_matmul import scaled_exp_form
from fuser.ir.loss import VOCAB, Z_Y, lower_loss, reduction_symbol
from fuser.losses import api
from fuser.runtime.loss import scaled

from .reference import V, make_inputs, reference
from .test_loss_schedules import TMA_CASES, TMA_TILES, record_launches
from .test_loss_values import USER_RULES, check, run


def full_ce(eps, z_loss, temperature):
    """Label smoothing, z-loss and temperature as torch writes them (the built-in's rule)."""

    def per_token(z, y):
        z = z / temperature
        lse = torch.logsumexp(z, 1)
        nll = lse - z.gather(1, y[:, None])[:, 0]
        return (1 - eps) * nll + eps * (lse - z.mean(1)) + z_loss * lse**2

    return per_token


def test_form_of_the_builtins():
    ce = scaled_exp_form(lower_loss(fuser.losses.CROSS_ENTROPY, "bf16"))
    assert (ce.scale, ce.target, ce.const, ce.ref) == (1, -1, 0, Z_Y)
    full = scaled_exp_form(lower_loss(fuser.losses.CROSS_ENTROPY_FULL, "bf16"))
    eps, zl, t = sympy.symbols("label_smoothing z_loss temperature", real=True)
    r = reduction_symbol(full.lse)
    subs = {s: sympy.Symbol(s.name, real=True) for s in full.scale.free_symbols | full.const.free_symbols}
    expected = ((1 + 2 * zl * r) / t, (eps - 1) / t, -eps / (t * VOCAB))
    got = (full.scale.xreplace(subs), full.target.xreplace(subs), full.const.xreplace(subs))
    for g, e in zip(got, expected):
        assert sympy.simplify(g - e.xreplace(subs)) == 0, (g, e)
    for rule in (fuser.losses.SOFTCAP_CROSS_ENTROPY, fuser.losses.ENTROPY_REGULARIZED_CROSS_ENTROPY):
        assert scaled_exp_form(lower_loss(rule, "bf16")) is None
    for name in ("softcap_zloss", "max_margin", "lse_of_lse"):
        text, hyper, _ = USER_RULES[name]
        assert scaled_exp_form(lower_loss(fuser.loss(text, name=name, hyper=hyper), "fp32")) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_full_cross_entropy(dtype, reduction, monkeypatch):
    monkeypatch.setattr(scaled, "TERM_ROWS", 10)  # grad_weight's target terms in four pieces
    hidden, weight, _, target = make_inputs(dtype, bias=False)
    opts = dict(label_smoothing=0.1, z_loss=1e-3, temperature=0.7)
    f = fuser.compile(fuser.losses.CROSS_ENTROPY_FULL, chunk_size=16, schedule="scaled")
    grad_out = torch.tensor(1.7)
    got = run(f, hidden, weight, None, target, reduction=reduction, grad_out=grad_out, **opts)
    ref = reference(
        full_ce(0.1, 1e-3, 0.7), hidden, weight, None, target, reduction=reduction, grad_out=grad_out
    )
    if dtype == torch.float32:
        check(got, ref)
    else:
        check(got, ref, 2e-2, torch.bfloat16)


@pytest.mark.parametrize("dtype, h, descriptors", TMA_CASES)
def test_kernel_through_tensor_descriptors(dtype, h, descriptors, monkeypatch):
    # Tiles(tma=True): persistent programs take the tiles through tensor descriptors where
    # the rows allow it, E stored through one (nothing past the last token and column)
    launched = record_launches(monkeypatch, scaled, "_mm_scaled")
    # chunks of 40 tokens: more [16, 32] tiles per chunk than programs, the last one short
    hidden, weight, _, target = make_inputs(dtype, bias=False, h=h, shape=(101,))
    opts = dict(label_smoothing=0.1, z_loss=1e-3, temperature=0.7)
    f = fuser.compile(fuser.losses.CROSS_ENTROPY_FULL, chunk_size=40, tiles=TMA_TILES, schedule="scaled")
    got = run(f, hidden, weight, None, target, grad_out=torch.tensor(1.3), **opts)
    ref = reference(full_ce(0.1, 1e-3, 0.7), hidden, weight, None, target, grad_out=torch.tensor(1.3))
    check(got, ref, None if dtype == torch.float32 else 2e-2, dtype)
    tiles_n = -(-V // TMA_TILES.bn)
    rows = int((target != -100).sum())  # (the ignored rows are compacted away first)
    assert [n for _, _, n in launched] == [min(40, rows - s) for s in range(0, rows, 40)]
    for d, (programs,), n_rows in launched:
        tiles = -(-n_rows // TMA_TILES.bm) * tiles_n
        # with descriptors, one program per processor (4 on a CPU) takes tiles in turn
        assert d == descriptors and programs == (min(tiles, 4) if descriptors else tiles)


def test_user_rule():
    # a mean's gradient is the constant term C = k / V
    rule = fuser.loss(
        "loss = logsumexp(z * s) - z[y] * s + k * mean(z)", name="mean_term", hyper=dict(s=1.3, k=0.2)
    )
    assert scaled_exp_form(lower_loss(rule, "fp32")).const != 0

    def per_token(z, y):
        return torch.logsumexp(z * 1.3, 1) - 1.3 * z.gather(1, y[:, None])[:, 0] + 0.2 * z.mean(1)

    hidden, weight, _, target = make_inputs(bias=False)
    f = fuser.compile(rule, chunk_size=16, schedule="scaled")
    got = run(f, hidden, weight, None, target, grad_out=torch.tensor(0.6))
    check(got, reference(per_token, hidden, weight, None, target, grad_out=torch.tensor(0.6)))


def test_all_ignored():
    hidden, weight, _, target = make_inputs(bias=False, ignore="all")
    f = fuser.compile(fuser.losses.CROSS_ENTROPY, chunk_size=16, schedule="scaled")
    loss, gx, gw, _ = run(f, hidden, weight, None, target)
    assert float(loss) == 0.0 and not gx.any() and not gw.any()


def test_row_kernel_takes_over_beyond_the_range(monkeypatch):
    # token 0's logit at column 5 is 150, ~150 above its target's: exp(z - z[y]) would
    # overflow fp32
    hidden, weight, _, target = make_inputs(bias=False, ignore="none")
    weight[5] = hidden[0] * (150 / hidden[0].dot(hidden[0]))
    target[0] = 6
    reruns = []
    monkeypatch.setattr(scaled.ScaledExp, "_rerun", _spy(scaled.ScaledExp._rerun, reruns))
    f = fuser.compile(fuser.losses.CROSS_ENTROPY, chunk_size=16, schedule="scaled")
    got = run(f, hidden, weight, None, target)
    assert reruns, "no chunk was out of the scaled schedule's range"
    check(got, reference(fuser_ce, hidden, weight, None, target))


def fuser_ce(z, y):
    return torch.logsumexp(z, 1) - z.gather(1, y[:, None])[:, 0]


def _spy(method, calls):
    def spy(self, *args, **kwargs):
        calls.append(1)
        return method(self, *args, **kwargs)

    return spy


@pytest.mark.parametrize(
    "rule, kw, message",
    [
        (fuser.losses.SOFTCAP_CROSS_ENTROPY, dict(), "not A * softmax"),
        (fuser.losses.CROSS_ENTROPY, dict(reduction="none"), "reduction='none'"),
        (fuser.losses.CROSS_ENTROPY, dict(bias=True), "no bias"),
    ],
)
def test_refusals_say_why(rule, kw, message):
    kw = dict(kw)  # (the parameter's dict is shared by every run of the test)
    hidden, weight, b, target = make_inputs(bias=kw.pop("bias", False))
    f = fuser.compile(rule, schedule="scaled")
    with pytest.raises(ValueError, match=re.escape(message)):
        f(hidden.requires_grad_(), weight, target, b, **kw)


def test_only_the_schedule_option_picks_it():
    f = fuser.compile(fuser.losses.CROSS_ENTROPY)
    w = torch.empty(0)

    def pick(loss, hid, **kw):
        call = api._Call("bf16", torch.device("cuda"), None, -100, 32768, hid, 128256, 2)
        args = dict(
            memory="auto", want_grad=True, main_grad=False, weight=w, group=None, bias=None, reduction="mean"
        )
        return loss._schedule_of(call, **{**args, **kw})

    assert pick(f, 768) == "chunks" and pick(f, 768, memory="fast") == "chunks"
    assert pick(fuser.compile(fuser.losses.CROSS_ENTROPY, schedule="scaled"), 768) == "scaled"


def test_add_rows_sums_repeated_indices():
    index = torch.randint(0, 7, (41,))
    index[:5] = 3  # a run of one index at the start, and at the end below
    index[-3:] = 6
    values = torch.randn(41, 5)
    out = torch.randn(9, 5)
    expected = out.double().index_add(0, index, values.double())
    scaled.add_rows(out, index, values)
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)


def test_buffers_poisoned_with_nan_leak_nothing(monkeypatch):
    # every buffer the schedule allocates uninitialised starts as NaN: E's tiles, the
    # partials, the rows of grad_hidden must all be written before they are read (also
    # through tensor descriptors, whose store leaves E's padding alone)
    real_empty = torch.empty

    def nan_filled(*shape, **kw):
        out = real_empty(*shape, **kw)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", nan_filled)
    for dtype, tiles in ((torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, TMA_TILES)):
        hidden, weight, _, target = make_inputs(dtype, bias=False, h=40)
        f = fuser.compile(fuser.losses.CROSS_ENTROPY, chunk_size=16, schedule="scaled", tiles=tiles)
        got = run(f, hidden, weight, None, target, grad_out=torch.tensor(0.3))
        ref = reference(fuser_ce, hidden, weight, None, target, grad_out=torch.tensor(0.3))
        check(got, ref, None if dtype == torch.float32 else 2e-2, dtype)
