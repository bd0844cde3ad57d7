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
from fuser.codegen import loss_matmul
from fuser.codegen.loss_matmul import linear_sums, scaled_exp_form
from fuser.ir.loss import VOCAB, Z_Y, lower_loss, reduction_symbol
from fuser.runtime.loss import choice, scaled

from .reference import V, assert_within, make_inputs, reference
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
    for name in ("max_margin", "lse_of_lse"):
        text, hyper, _ = USER_RULES[name]
        assert scaled_exp_form(lower_loss(fuser.loss(text, name=name, hyper=hyper), "fp32")) is None


def test_form_of_a_softcap():
    # a(z) = c * tanh(z / c) / t is not linear: every term carries a'(z), the target term
    # taken at z = z_y; with label smoothing's mean the constant term would be per logit
    form = scaled_exp_form(lower_loss(fuser.losses.SOFTCAP_CROSS_ENTROPY_UNSMOOTHED, "bf16"))
    c, zl, t = sympy.symbols("softcap z_loss temperature", real=True)
    z, zy, r = sympy.Symbol("z", real=True), sympy.Symbol("z_y", real=True), reduction_symbol(form.lse)
    subs = {
        s: sympy.Symbol(s.name, real=True)
        for e in (form.scale, form.target, form.factor)
        for s in e.free_symbols
    }
    expected = (
        1 + 2 * zl * r,  # A
        -(1 - sympy.tanh(zy / c) ** 2) / t,  # B: the target's own a'(z_y)
        sympy.Integer(0),  # C
        (1 - sympy.tanh(z / c) ** 2) / t,  # D(z)
    )
    got = (form.scale, form.target, form.const, form.factor)
    for g, e in zip(got, expected):
        assert sympy.simplify(g.xreplace(subs) - e.xreplace(subs)) == 0, (g, e)
    text, hyper, _ = USER_RULES["softcap_zloss"]
    user = scaled_exp_form(lower_loss(fuser.loss(text, name="softcap_zloss", hyper=hyper), "fp32"))
    assert user is not None and user.const == 0 and Z_Y in user.target.free_symbols


def softcap_ce(cap, z_loss, temperature):
    def per_token(z, y):
        z = cap * torch.tanh(z / cap) / temperature
        lse = torch.logsumexp(z, 1)
        return lse - z.gather(1, y[:, None])[:, 0] + z_loss * lse**2

    return per_token


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_softcap(dtype, reduction):
    # logits of ~+-6 against a cap of 3: the cap's derivative spans ~0.1 to 1
    hidden, weight, _, target = make_inputs(dtype, bias=False, scale=3.0)
    opts = dict(softcap=3.0, z_loss=1e-3, temperature=0.7)
    f = fuser.compile(fuser.losses.SOFTCAP_CROSS_ENTROPY_UNSMOOTHED, chunk_size=16, schedule="scaled")
    grad_out = torch.tensor(1.3)
    got = run(f, hidden, weight, None, target, reduction=reduction, grad_out=grad_out, **opts)
    ref = reference(
        softcap_ce(3.0, 1e-3, 0.7), hidden, weight, None, target, reduction=reduction, grad_out=grad_out
    )
    check(got, ref, None if dtype == torch.float32 else 2e-2, dtype)


@pytest.mark.parametrize("dtype, h, descriptors", TMA_CASES)
def test_softcap_through_tensor_descriptors(dtype, h, descriptors):
    # a user rule: the cap's tanh once per logit, shared by a(z) and its derivative
    text, hyper, per_token = USER_RULES["softcap_zloss"]
    rule = fuser.loss(text, name="softcap_zloss", hyper=hyper)
    # 46 live tokens in chunks of 40 and 6: 21 and 7 [16, 32] tiles, more than 4 programs
    hidden, weight, _, target = make_inputs(dtype, bias=False, h=h, shape=(61,))
    f = fuser.compile(rule, chunk_size=40, tiles=TMA_TILES, schedule="scaled")
    got = run(f, hidden, weight, None, target, grad_out=torch.tensor(0.8))
    ref = reference(per_token, hidden, weight, None, target, grad_out=torch.tensor(0.8))
    check(got, ref, None if dtype == torch.float32 else 2e-2, dtype)
    source = f.scaled_kernel_source("bf16", TMA_TILES)
    # once per logit in the interpreter's loop and the compiled one
    assert source.text.split(f"def {source.entry}(")[1].count("_tanh(") == 2


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
    # (46 live tokens: chunks of 40 and 6, 21 and 7 tiles for 4 programs)
    hidden, weight, _, target = make_inputs(dtype, bias=False, h=h, shape=(61,))
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


def test_sums_linear_in_the_logit():
    # sum(alpha * z + beta) over the vocabulary is alpha * (hidden . sum(W)) + beta * V; the
    # sum of exp(z) stays a reduction of the kernel's tiles
    rule = fuser.loss(
        "loss = logsumexp(z) - z[y] + k * mean(s * z + 1) + q * log(sum(exp(z)))",
        name="linear_sums",
        hyper=dict(s=1.7, k=0.3, q=0.05),
    )
    plan = lower_loss(rule, "fp32")
    assert len(linear_sums(plan)) == 1 and scaled_exp_form(plan) is not None

    def per_token(z, y):
        lse = torch.logsumexp(z, 1)
        return lse - z.gather(1, y[:, None])[:, 0] + 0.3 * (1.7 * z + 1).mean(1) + 0.05 * lse

    hidden, weight, _, target = make_inputs(bias=False)
    f = fuser.compile(rule, chunk_size=16, schedule="scaled")
    got = run(f, hidden, weight, None, target, grad_out=torch.tensor(0.8))
    check(got, reference(per_token, hidden, weight, None, target, grad_out=torch.tensor(0.8)))


def test_all_ignored():
    hidden, weight, _, target = make_inputs(bias=False, ignore="all")
    f = fuser.compile(fuser.losses.CROSS_ENTROPY, chunk_size=16, schedule="scaled")
    loss, gx, gw, _ = run(f, hidden, weight, None, target)
    assert float(loss.detach()) == 0.0 and not gx.any() and not gw.any()


@pytest.mark.parametrize("grad_out", [None, 0.8])
def test_row_kernel_takes_over_beyond_the_range(monkeypatch, grad_out):
    # token 0's logit at column 5 is 150, ~150 above its target's: exp(z - z[y]) would
    # overflow fp32. Backward scales the gradients by grad_output before it reads the range
    # flag, and again after the rerun rewrote them.
    hidden, weight, _, target = make_inputs(bias=False, ignore="none")
    weight[5] = hidden[0] * (150 / hidden[0].dot(hidden[0]))
    target[0] = 6
    reruns = []
    monkeypatch.setattr(scaled.ScaledExp, "_rerun", _spy(scaled.ScaledExp._rerun, reruns))
    f = fuser.compile(fuser.losses.CROSS_ENTROPY, chunk_size=16, schedule="scaled")
    go = None if grad_out is None else torch.tensor(grad_out)
    got = run(f, hidden, weight, None, target, grad_out=go)
    assert reruns, "no chunk was out of the scaled schedule's range"
    check(got, reference(fuser_ce, hidden, weight, None, target, grad_out=go))


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


def test_auto_picks_it_where_it_pays():
    # 16-bit inputs on sm_90 or later with H up to SCALED_MAX_HIDDEN, and only calls it can
    # run (a CUDA device of a given capability, described to the choice on this CPU machine)
    capability = [9]

    def pick(
        rule=fuser.losses.CROSS_ENTROPY, hid=768, device="cuda", dtype="bf16", bias=None, group=None, **kw
    ):
        loss = fuser.compile(rule)
        args = dict(memory="auto", want_grad=True, main_grad=False, reduction="mean")
        call = choice.LossCall(
            dtype, 32768, hid, 128256, loss._form(dtype), device=device,
            capability=(capability[0], 0) if device == "cuda" else None,
            bias=bias is not None, vocab_parallel=group is not None, **{**args, **kw},
        )  # fmt: skip
        return choice.choose(call).schedule

    assert pick() == "scaled" and pick(memory="fast") == "scaled"
    assert (
        pick(hid=choice.SCALED_MAX_HIDDEN) == "scaled" and pick(fuser.losses.CROSS_ENTROPY_FULL) == "scaled"
    )
    assert pick(hid=4096) == "chunks"  # (cuBLAS's logits matmul outruns the scaled kernel)
    assert pick(dtype="fp32") == "chunks" and pick(device="cpu") == "chunks"
    assert pick(fuser.losses.SOFTCAP_CROSS_ENTROPY) == "chunks"  # (label smoothing's mean: no form)
    assert pick(fuser.losses.SOFTCAP_CROSS_ENTROPY_UNSMOOTHED) == "scaled"
    assert pick(reduction="none") == "chunks" and pick(bias=torch.empty(0)) == "chunks"
    assert pick(main_grad=True) == "fused" and pick(memory="lean") == "fused"
    assert pick(main_grad=True, memory="fast") == "scaled"  # (main_grad buffered from forward)
    assert pick(main_grad=True, hid=choice.LEAN_MAIN_GRAD_MAX_HIDDEN) == "fused"
    assert pick(main_grad=True, hid=8192) == "vocab" and pick(main_grad=True, device="cpu") == "vocab"
    assert pick(want_grad=False) == "chunks"
    # fp16 (gradients in backward): the lean schedule in place of chunks where it pays
    assert pick(dtype="fp16") == "fused" and pick(dtype="fp16", memory="fast") == "fused"
    assert pick(dtype="fp16", hid=2048) == "chunks" and pick(dtype="fp16", device="cpu") == "chunks"
    capability[0] = 8  # (an A100: measured on neither schedule)
    assert pick() == "chunks" and pick(main_grad=True) == "vocab"


def test_warp_specialized_where_measured():
    # sm_90 takes warp-specialised [128, 256] and [128, 128] tiles through descriptors for the
    # lean gradient kernel with H up to 1024 and the scaled kernel up to 2048; other tiles
    # (half tiles, pointer loads), larger H and
    # other GPUs keep theirs (a CUDA device described to the choice on this CPU machine)
    major = [9]
    form = fuser.compile(fuser.losses.CROSS_ENTROPY)._form("bf16")

    def pick(tiles, hid, limit):
        call = choice.LossCall("bf16", 32768, hid, 128256, form, capability=(major[0], 0))
        return choice.specialized(tiles, call, limit)

    grad, scaled_tiles = loss_matmul.WIDE_GRAD_TMA, choice.SCALED_TILES_TMA
    grad_max = choice.GRAD_WARP_SPECIALIZED_MAX_HIDDEN
    ws = pick(grad, 768, grad_max)
    assert ws.warp_specialize and (ws.bm, ws.bn, ws.num_warps, ws.group_m, ws.tma) == (128, 256, 4, 16, True)
    assert pick(grad, 1024, grad_max) == ws and pick(grad, 2048, grad_max) == grad
    limit = choice.SCALED_WARP_SPECIALIZED_MAX_HIDDEN
    assert pick(scaled_tiles, 2048, limit) == ws and pick(scaled_tiles, 4096, limit) == scaled_tiles
    narrow = pick(choice.SCALED_TILES_NARROW_TMA, 768, limit)  # (a softcap's)
    assert narrow.warp_specialize and (narrow.bm, narrow.bn, narrow.num_warps) == (128, 128, 4)
    for other in (loss_matmul.WIDE_GRAD_TMA_SUBTILE, choice.SCALED_TILES, loss_matmul.TALL_GRAD):
        assert pick(other, 768, limit) == other
    major[0] = 10  # (Blackwell: another pass, not measured)
    assert pick(grad, 768, grad_max) == grad


@pytest.mark.parametrize("piece", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_repeated_targets_sum_into_their_weight_rows(dtype, piece, monkeypatch):
    # grad_weight's target term sums B * hidden over each run of one target (tokens sorted
    # by target): runs of one to ~20 tokens, the first and the last vocabulary rows among
    # them, across chunks (46 live tokens: 40 and 6), with ignored tokens (their key sorts
    # past the vocabulary); with pieces of 3 tokens, every run but one is summed in pieces
    # (the last one short), their sums then in order
    if piece is not None:
        monkeypatch.setattr(loss_matmul, "TARGET_PIECE", piece)
    hidden, weight, _, target = make_inputs(dtype, bias=False, shape=(61,), ignore="some")
    live = target != -100
    g = torch.Generator().manual_seed(torch.randint(2**62, ()).item())
    pool = torch.tensor([0, V - 1, 7, 100])
    target[live] = pool[torch.randint(0, 4, (int(live.sum()),), generator=g)]
    target[live.nonzero()[-1]] = 3  # (a run of one)
    opts = dict(label_smoothing=0.1, z_loss=1e-3, temperature=0.7)
    f = fuser.compile(fuser.losses.CROSS_ENTROPY_FULL, chunk_size=40, schedule="scaled")
    got = run(f, hidden, weight, None, target, grad_out=torch.tensor(1.1), **opts)
    ref = reference(full_ce(0.1, 1e-3, 0.7), hidden, weight, None, target, grad_out=torch.tensor(1.1))
    check(got, ref, None if dtype == torch.float32 else 2e-2, dtype)


@pytest.mark.parametrize("needs", ["hidden", "weight"])
def test_gradient_of_one_input(needs):
    # grad_weight alone takes s * hidden from torch, grad_hidden alone skips grad_weight
    hidden, weight, _, target = make_inputs(bias=False)
    f = fuser.compile(fuser.losses.CROSS_ENTROPY_FULL, chunk_size=16, schedule="scaled")
    x = hidden.clone().requires_grad_(needs == "hidden")
    w = weight.clone().requires_grad_(needs == "weight")
    f(x, w, target, label_smoothing=0.1, z_loss=1e-3).backward()
    ref = reference(full_ce(0.1, 1e-3, 1.0), hidden, weight, None, target)
    got, expected, bound = (
        (x.grad, ref[1], ref.bounds[1]) if needs == "hidden" else (w.grad, ref[2], ref.bounds[2])
    )
    assert_within(got, expected, bound, f"grad {needs}")
    assert (w.grad if needs == "hidden" else x.grad) is None


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
