"""On a GPU: compiled kernels, the addmm out_dtype accumulation, and the memory contract."""

import math

import pytest
import torch

import fuser
import fuser.losses
from fuser.runtime.loss import choice
from fuser.runtime.loss.chunked import accumulate_weight_grad
from fuser.runtime.loss.staged import MAIN_GRAD_BUDGET

from .reference import assert_close, assert_within, cross_entropy, make_inputs, reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_on_gpu_against_float64(dtype, reduction):
    hidden, weight, b, target = make_inputs(dtype, shape=(4, 301), v=5003, h=96)
    x, w, bb = (t.cuda().requires_grad_() for t in (hidden, weight, b))
    grad_out = torch.rand(4, 301) + 0.5 if reduction == "none" else torch.tensor(1.0)
    out = fuser.losses.cross_entropy(x, w, target.cuda(), bb, reduction=reduction)
    (out * grad_out.cuda().to(out.dtype)).sum().backward()
    ref = reference(
        cross_entropy,
        hidden,
        weight,
        b,
        target,
        reduction=reduction,
        grad_out=grad_out.to(dtype).float(),
        round_logits_to=torch.float32,  # (the logits are fp32 for every dtype; no bounds at this size)
    )
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for a, e, n in (
        (out, ref[0], "loss"),
        (x.grad, ref[1], "hidden"),
        (w.grad, ref[2], "weight"),
        (bb.grad, ref[3], "bias"),
    ):
        assert_close(a.cpu(), e, tol, n)


def test_weight_grad_accumulates_in_fp32_without_a_vocab_by_hidden_temporary():
    v, h, c = 32768, 1024, 512
    gw = torch.randn(v, h, device="cuda")
    start = gw.clone()
    dz = torch.randn(c, v, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(c, h, device="cuda", dtype=torch.bfloat16)
    # cuBLAS takes its workspace (32 MiB on an H100) at a process's first product: not a
    # temporary of this call, so a small product first
    accumulate_weight_grad(torch.randn(64, 32, device="cuda"), dz[:16, :64], x[:16, :32])
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    accumulate_weight_grad(gw, dz, x)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < v * h * 2 // 4, f"{extra} bytes of temporaries"
    ref = start.double() + dz.double().T @ x.double()
    assert (gw.double() - ref).abs().max() < 1e-2 * ref.abs().max()


def test_extra_peak_memory_is_one_chunk_and_the_fp32_weight_grad():
    t, h, v = 4096, 512, 32768
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    y = torch.randint(0, v, (t,), device="cuda")
    x.grad, w.grad = torch.zeros_like(x), torch.zeros_like(w)
    f = fuser.compile(fuser.losses.CROSS_ENTROPY, chunk_size=1024, schedule="chunks")
    f(x, w, y).backward()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    f(x, w, y).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    budget = v * h * 4 + v * h * 2 + 1024 * v * 2 + t * h * 2 + (64 << 20)
    assert extra < budget, f"extra peak {extra >> 20} MiB over {budget >> 20} MiB"


@pytest.mark.parametrize("schedule", ["chunks", "whole", "vocab"])
@pytest.mark.parametrize("main_grad", [False, True])
def test_every_schedule_on_gpu_against_float64(schedule, main_grad, monkeypatch):
    monkeypatch.setattr(choice, "vocab_cols", lambda *a, **k: 1280)  # 4 slices of 5003 rows
    hidden, weight, _, target = make_inputs(torch.bfloat16, bias=False, shape=(603,), v=5003, h=96)
    x, w = (t.cuda().requires_grad_() for t in (hidden, weight))
    start = torch.randn(weight.shape, device="cuda")
    if main_grad:
        w.main_grad = start.clone()
    f = fuser.compile(fuser.losses.CROSS_ENTROPY, chunk_size=256, schedule=schedule)
    out = f(x, w, target.cuda(), accumulate_into="main_grad" if main_grad else None)
    (out * 0.7).backward()
    ref = reference(cross_entropy, hidden, weight, None, target, grad_out=torch.tensor(0.7))
    assert_within(out.cpu(), ref.loss, ref.loss_bound, "loss")  # (fp32 logits in every schedule)
    assert_close(x.grad.cpu(), ref[1], 2e-2, "hidden")
    if main_grad:
        assert w.grad is None
        assert_close((w.main_grad - start).cpu(), ref[2], 1e-2, "main_grad increment")
    else:
        assert_close(w.grad.cpu(), ref[2], 2e-2, "weight")


@pytest.mark.parametrize("schedule, memory", [("scaled", "auto"), ("auto", "fast")])
def test_main_grad_buffered_on_gpu_against_float64(schedule, memory):
    # the gradients taken in forward (memory="fast" takes scaled here on sm_90: 64-token
    # chunks of logits weigh less than every token's), main_grad added to in backward only
    hidden, weight, _, target = make_inputs(torch.bfloat16, bias=False, shape=(603,), v=5003, h=96)
    x, w = (t.cuda().requires_grad_() for t in (hidden, weight))
    start = torch.randn(weight.shape, device="cuda")
    w.main_grad = start.clone()
    f = fuser.compile(fuser.losses.CROSS_ENTROPY, chunk_size=64, schedule=schedule)
    out = f(x, w, target.cuda(), accumulate_into="main_grad", memory=memory)
    torch.cuda.synchronize()
    assert torch.equal(w.main_grad, start), "main_grad changed before backward"
    (out * 0.7).backward()
    ref = reference(cross_entropy, hidden, weight, None, target, grad_out=torch.tensor(0.7))
    assert_close(out.cpu(), ref[0], 2e-2, "loss")
    assert_close(x.grad.cpu(), ref[1], 2e-2, "hidden")
    assert w.grad is None
    assert_close((w.main_grad - start).cpu(), ref[2], 1e-2, "main_grad increment")


@pytest.mark.parametrize("memory", ["auto", "fast", "lean"])
def test_fp16_on_gpu_under_a_loss_scale(memory):
    # fp16 takes the gradients in backward, scaled by grad_output (GradScaler's 65536 here)
    # before they are rounded to fp16: a softmax term is ~2e-4 / 603 tokens, which fp16
    # rounds coarsely (its smallest numbers are 6e-8 apart) unless the scale reaches it
    # first; most of the 5003 rows of grad_weight are no token's target and hold only those
    # terms (on sm_90 the lean schedule's gradient kernel runs through tensor descriptors).
    hidden, weight, _, target = make_inputs(torch.float16, bias=False, shape=(603,), v=5003, h=96)
    x, w = (t.cuda().requires_grad_() for t in (hidden, weight))
    out = fuser.losses.cross_entropy(x, w, target.cuda(), memory=memory)
    (out * 65536.0).backward()
    ref = reference(cross_entropy, hidden, weight, None, target, grad_out=torch.tensor(65536.0))
    never = torch.ones(5003, dtype=torch.bool)
    never[target[target >= 0]] = False
    assert_close(out.cpu(), ref[0], 1e-2, "loss")
    assert_close(x.grad.cpu(), ref[1], 1e-2, "hidden")
    assert_close(w.grad.cpu(), ref[2], 1e-2, "weight")
    assert_close(w.grad.cpu()[never], ref[2][never], 1e-2, "weight, rows never a target")


def _main_grad_inputs(t=8192, h=1024, v=50000):
    """bf16 hidden (with a .grad) and weight (with an fp32 main_grad), and targets."""
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    w.main_grad = torch.zeros(v, h, device="cuda")
    x.grad = torch.zeros_like(x)
    return x, w, torch.randint(0, v, (t,), device="cuda")


def _extra_peak(step) -> int:
    """Bytes allocated at the peak of a second ``step()`` beyond what was held before it."""
    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("t, h", [(8192, 1024), (4096, 8192)])  # memory="auto": fused, then vocab
def test_main_grad_schedule_stays_within_its_budget(t, h):
    x, w, y = _main_grad_inputs(t=t, h=h)
    extra = _extra_peak(lambda: fuser.losses.cross_entropy(x, w, y, accumulate_into="main_grad").backward())
    assert extra < MAIN_GRAD_BUDGET + (16 << 20), f"extra peak {extra >> 20} MiB"


def _norm_err(a, ref):
    return float((a.double().cpu() - ref).norm() / ref.norm())


def _weight_grad_of_rounded_dz(hidden, weight, bias, target, grad_out):
    """Mean cross-entropy's grad_weight in float64 from ``d loss / d logits`` rounded once to
    bf16 but at the target's column, as the lean schedule feeds it to its weight-gradient
    matmul (and adds the target column's residue in fp32); and how far a kernel that forms
    ``d loss / d logits`` in fp32 may land from it by rounding the other way.

    The kernel's fp32 logits err by up to (H + 2) u (|x| @ |w|.T + |b|) (Higham (3.13), u =
    2^-24), which moves each softmax value by up to p (2 dz + 8 u) and the rest of the
    element by 8 u of itself. Where the float64 value lies that close to a bf16 rounding
    boundary, the kernel may round it one bf16 spacing the other way; the bound sums those
    spacings, |flips|.T @ |x| (triangle inequality), as a relative error."""
    u = 2.0**-24
    x, w = hidden.double(), weight.double()
    b = bias.double() if bias is not None else 0.0
    z = x @ w.T + b
    live = target != -100
    p = torch.softmax(z, 1)
    dz = p.clone()
    dz[live, target[live]] -= 1.0
    scale = grad_out / live.sum()
    dz = dz * scale * live[:, None]
    bf16 = dz.to(torch.bfloat16)
    rounded = bf16.double()
    kept = rounded.clone()
    rows = live.nonzero()[:, 0]
    kept[rows, target[rows]] = dz[rows, target[rows]]
    gw = kept.T @ x
    z_err = (x.shape[1] + 2) * u * (x.abs() @ w.abs().T + abs(b)).amax(1, keepdim=True)
    reach = (p * (2 * z_err + 8 * u) + 8 * u * dz.abs() / scale) * scale * live[:, None]
    # the bf16 neighbour on dz's side of its rounding, and the boundary between the two
    other = torch.nextafter(bf16, torch.where(dz > rounded, 1.0, -1.0).to(torch.bfloat16) * float("inf"))
    boundary = (rounded + other.double()) / 2
    flips = torch.where((dz - boundary).abs() <= reach, (other.double() - rounded).abs(), 0.0)
    flips[rows, target[rows]] = 0.0
    return gw, float((flips.T @ x.abs()).norm() / gw.norm())


@pytest.mark.parametrize("h", [96, 128])  # 96: masked along H (64-wide steps); 128: unmasked
@pytest.mark.parametrize("main_grad", [False, True])
@pytest.mark.parametrize("descriptors", [False, True])  # the gradient kernel's tiles through TMA
def test_lean_schedule_on_gpu_against_float64(main_grad, h, descriptors, monkeypatch):
    if descriptors and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors are TMA from sm_90")
    monkeypatch.setattr(choice, "descriptors_pay", lambda capability: descriptors)
    monkeypatch.setattr(choice, "slice_cols", lambda *a, **k: 1280)  # 4 slices of 5003 rows
    hidden, weight, b, target = make_inputs(torch.bfloat16, bias=not main_grad, shape=(603,), v=5003, h=h)
    x, w = (t.cuda().requires_grad_() for t in (hidden, weight))
    bb = b.cuda().requires_grad_() if b is not None else None
    start = torch.randn(weight.shape, device="cuda") * 1e-3  # the size of the increment
    if main_grad:
        w.main_grad = start.clone()
    out = fuser.losses.cross_entropy(
        x, w, target.cuda(), bb, accumulate_into="main_grad" if main_grad else None, memory="lean"
    )
    (out * 0.7).backward()
    # The logits stay fp32 in the kernels: the reference does not round them.
    ref = reference(cross_entropy, hidden, weight, b, target, grad_out=torch.tensor(0.7))
    assert out.dtype == torch.float32
    assert_close(out.cpu(), ref[0], 1e-5, "loss")
    assert_close(x.grad.cpu(), ref[1], 2e-2, "hidden")
    if bb is not None:
        assert_close(bb.grad.cpu(), ref[3], 2e-2, "bias")
    gw = (w.main_grad - start) if main_grad else w.grad
    # d loss / d logits is rounded once to bf16 (relative error <= 2^-9 per element) for
    # the gradient matmuls, which accumulate in fp32; a bf16 grad_weight is rounded once more.
    assert _norm_err(gw, ref[2]) < (2**-8 if main_grad else 2**-7), _norm_err(gw, ref[2])
    if main_grad:  # nothing but that one rounding: fp32 accumulation from there on
        rounded, flips = _weight_grad_of_rounded_dz(hidden, weight, b, target, 0.7)
        assert _norm_err(gw, rounded) < 1e-4 + flips, (_norm_err(gw, rounded), flips)


@pytest.mark.parametrize("h", [100, 128])  # fp32 tiles step 16 along H: 100 masked, 128 not
def test_lean_schedule_fp32_on_gpu_against_float64(h, monkeypatch):
    monkeypatch.setattr(choice, "slice_cols", lambda *a, **k: 1280)  # 4 slices of 5003 rows
    hidden, weight, b, target = make_inputs(torch.float32, bias=True, shape=(603,), v=5003, h=h)
    x, w, bb = (t.cuda().requires_grad_() for t in (hidden, weight, b))
    out = fuser.losses.cross_entropy(x, w, target.cuda(), bb, memory="lean")
    (out * 0.7).backward()
    # (rounding the float64 logits to fp32 only skips fp32_bounds: see the scaled test below)
    ref = reference(
        cross_entropy, hidden, weight, b, target, grad_out=torch.tensor(0.7), round_logits_to=torch.float32
    )
    assert_close(out.cpu(), ref[0], 1e-5, "loss")
    # fp32 products and an fp32 d loss / d logits: nothing rounds to 16 bits
    for got, want, what in (
        (x.grad, ref[1], "hidden"),
        (w.grad, ref[2], "weight"),
        (bb.grad, ref[3], "bias"),
    ):
        assert _norm_err(got, want) < 1e-4, (what, _norm_err(got, want))


def test_lean_schedule_skips_ignored_rows_and_stays_within_its_budget():
    x, w, y = _main_grad_inputs()
    y[::3] = -100

    def step():
        fuser.losses.cross_entropy(x, w, y, accumulate_into="main_grad", memory="lean").backward()

    extra = _extra_peak(step)
    assert extra < MAIN_GRAD_BUDGET + (16 << 20), f"extra peak {extra >> 20} MiB"
    assert (x.grad[::3] == 0).all() and (x.grad[1::3] != 0).any()


# 96: masked along H for bf16 (64-wide steps); 100: for fp32 too (16-wide); 128: unmasked
@pytest.mark.parametrize("h", [96, 100, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_schedule_on_gpu_against_float64(h, dtype):
    # 3 chunks of 256 tokens, the last one short; 1 in 4 ignored; label smoothing, z-loss and
    # temperature give the gradient all three terms (softmax, target, constant)
    hidden, weight, _, target = make_inputs(dtype, bias=False, shape=(603,), v=5003, h=h)
    x, w = (t.cuda().requires_grad_() for t in (hidden, weight))
    f = fuser.compile(fuser.losses.CROSS_ENTROPY_FULL, schedule="scaled", chunk_size=256)
    opts = dict(label_smoothing=0.1, z_loss=1e-3, temperature=0.7)
    out = f(x, w, target.cuda(), **opts)
    (out * 0.7).backward()

    def per_token(z, y):
        z = z / 0.7
        lse = torch.logsumexp(z, 1)
        nll = lse - z.gather(1, y[:, None])[:, 0]
        return 0.9 * nll + 0.1 * (lse - z.mean(1)) + 1e-3 * lse**2

    # (rounding the float64 logits to fp32 only skips fp32_bounds, whose Hessians of V x V
    # per token would not fit in memory at this V)
    ref = reference(
        per_token, hidden, weight, None, target, grad_out=torch.tensor(0.7), round_logits_to=torch.float32
    )
    assert out.dtype == torch.float32
    assert_close(out.cpu(), ref[0], 1e-5, "loss")
    tol = 1e-4 if dtype == torch.float32 else 2**-7
    assert _norm_err(x.grad, ref[1]) < tol, _norm_err(x.grad, ref[1])
    assert _norm_err(w.grad, ref[2]) < tol, _norm_err(w.grad, ref[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_schedule_with_a_softcap_on_gpu_against_float64(dtype):
    # E carries the cap's derivative per logit (its tanh shared with the capped logit); the
    # target term its own at z[y]; logits of ~+-6 against a cap of 4
    hidden, weight, _, target = make_inputs(dtype, bias=False, shape=(603,), v=5003, h=128, scale=3.0)
    x, w = (t.cuda().requires_grad_() for t in (hidden, weight))
    out = fuser.losses.cross_entropy(x, w, target.cuda(), softcap=4.0, z_loss=1e-3, temperature=0.7)
    f = fuser.compile(fuser.losses.SOFTCAP_CROSS_ENTROPY_UNSMOOTHED, schedule="scaled", chunk_size=256)
    x2, w2 = (t.cuda().requires_grad_() for t in (hidden, weight))
    out2 = f(x2, w2, target.cuda(), softcap=4.0, z_loss=1e-3, temperature=0.7)
    (out2 * 0.7).backward()

    def per_token(z, y):
        z = 4.0 * torch.tanh(z / 4.0) / 0.7
        lse = torch.logsumexp(z, 1)
        return lse - z.gather(1, y[:, None])[:, 0] + 1e-3 * lse**2

    ref = reference(
        per_token, hidden, weight, None, target, grad_out=torch.tensor(0.7), round_logits_to=torch.float32
    )
    assert out.dtype == out2.dtype == torch.float32
    assert_close(out.detach().cpu(), ref[0], 1e-5, "loss")
    assert_close(out2.detach().cpu(), ref[0], 1e-5, "loss")
    tol = 1e-4 if dtype == torch.float32 else 2**-7
    assert _norm_err(x2.grad, ref[1]) < tol, _norm_err(x2.grad, ref[1])
    assert _norm_err(w2.grad, ref[2]) < tol, _norm_err(w2.grad, ref[2])


@pytest.mark.parametrize("memory", ["auto", "lean"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_with_approx_tanh_on_gpu_against_float64(dtype, memory):
    # the cap's tanh through tanh.approx.f32 (relative error within 2**-10.987): the capped
    # logit a = cap * tanh(z / cap) / t moves by at most that times cap / t, so the loss
    # (lse - a[y] + z_loss * lse**2) by (2 + 2 * z_loss * |lse|) times as much
    cap, temp, zl = 4.0, 0.7, 1e-3
    hidden, weight, _, target = make_inputs(dtype, bias=False, shape=(603,), v=5003, h=128, scale=3.0)
    x, w = (t.cuda().requires_grad_() for t in (hidden, weight))
    out = fuser.losses.cross_entropy(
        x, w, target.cuda(), softcap=cap, z_loss=zl, temperature=temp, memory=memory, approx_tanh=True
    )
    (out * 0.7).backward()

    def per_token(z, y):
        z = cap * torch.tanh(z / cap) / temp
        lse = torch.logsumexp(z, 1)
        return lse - z.gather(1, y[:, None])[:, 0] + zl * lse**2

    ref = reference(
        per_token, hidden, weight, None, target, grad_out=torch.tensor(0.7), round_logits_to=torch.float32
    )
    bound = 2**-10.987 * cap / temp
    assert out.dtype == torch.float32
    lse_max = cap / temp + math.log(5003)  # (|a| <= cap / t over 5003 columns)
    assert abs(float(out) - float(ref[0])) <= (2 + 2 * zl * lse_max) * bound + 1e-5 * abs(float(ref[0]))
    tol = 2e-3 if dtype == torch.float32 else 2**-7
    assert _norm_err(x.grad, ref[1]) < tol, _norm_err(x.grad, ref[1])
    assert _norm_err(w.grad, ref[2]) < tol, _norm_err(w.grad, ref[2])


def test_scaled_schedule_takes_gradients_again_beyond_its_range():
    hidden, weight, _, target = make_inputs(
        torch.bfloat16, bias=False, ignore="none", shape=(300,), v=5003, h=128
    )
    weight[5] = (hidden[0].float() * (150 / hidden[0].float().dot(hidden[0].float()))).to(weight.dtype)
    target[0] = 6  # token 0's logit at column 5 is ~150 above its target's
    x, w = (t.cuda().requires_grad_() for t in (hidden, weight))
    out = fuser.compile(fuser.losses.CROSS_ENTROPY, schedule="scaled")(x, w, target.cuda())
    out.backward()
    ref = reference(cross_entropy, hidden, weight, None, target)
    assert_close(out.cpu(), ref[0], 1e-5, "loss")
    assert _norm_err(x.grad, ref[1]) < 2**-7 and _norm_err(w.grad, ref[2]) < 2**-7


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("schedule", ["whole", "vocab", "fused"])
def test_weight_gradient_kernel_on_gpu_against_float64(dtype, schedule, monkeypatch):
    # A 16-bit grad_weight whose slice has tiles for every processor twice takes the target
    # column's residue rows in the weight-gradient kernel (sm_90: tensor descriptors). Slices
    # of 4352 rows: the first takes the kernel (272 tiles of [128, 256] at H = 2048), the last
    # (4096 rows, 256 tiles) fp32 blocks on an H100's 132 processors; 300 tokens of one target
    # make a run summed in pieces.
    from fuser.runtime.loss import residue

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the weight-gradient kernel runs where tensor descriptors are TMA (sm_90)")
    monkeypatch.setattr(choice, "slice_cols", lambda *a, **k: 4352)
    monkeypatch.setattr(choice, "vocab_cols", lambda *a, **k: 4352)
    launched, call = [], residue.WeightGrad.__call__

    def recording(self, gw, *args):
        launched.append(gw.shape[0])
        return call(self, gw, *args)

    monkeypatch.setattr(residue.WeightGrad, "__call__", recording)
    t, h, v = 1203, 2048, 8448
    hidden = (torch.randn(t, h, device="cuda") * 0.1).to(dtype)
    weight = (torch.randn(v, h, device="cuda") * 0.02).to(dtype)
    target = torch.randint(0, v, (t,), device="cuda")
    target[torch.randperm(t, device="cuda")[:300]] = 4099
    target[::7] = -100
    # (fp16: a sum, whose logit gradients stay clear of fp16's subnormals)
    reduction = "mean" if dtype == torch.bfloat16 else "sum"
    x64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    torch.nn.functional.cross_entropy(x64 @ w64.T, target, reduction=reduction).backward()
    f = fuser.compile(fuser.losses.CROSS_ENTROPY, schedule=schedule)
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    f(x, w, target, reduction=reduction).backward()
    assert launched == ([v] if schedule == "whole" else [4352])
    gw, gx = w64.grad.cpu(), x64.grad.cpu()
    assert _norm_err(w.grad, gw) < 2e-3, _norm_err(w.grad, gw)
    assert _norm_err(w.grad[4099], gw[4099]) < 2e-3, _norm_err(w.grad[4099], gw[4099])
    assert _norm_err(x.grad, gx) < 2e-3, _norm_err(x.grad, gx)


@pytest.mark.parametrize("schedule, softcap", [("fused", None), ("scaled", None), ("scaled", 4.0)])
def test_warp_specialized_kernels_on_gpu(schedule, softcap, monkeypatch):
    # on sm_90 at small H the lean gradient kernel and the scaled kernel run warp-specialised
    # (a producer warp group and two consumers; a softcap's scaled kernel in [128, 128]
    # tiles): the same bits as the kernels without, and within the float64 bounds
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warp-specialised programs are taken on sm_90 only")
    scale = 1.0 if softcap is None else 3.0  # (logits of ~+-6 against a cap of 4)
    hidden, weight, _, target = make_inputs(
        torch.bfloat16, bias=False, shape=(603,), v=5003, h=96, scale=scale
    )
    if softcap is None:
        rule, opts = fuser.losses.CROSS_ENTROPY_FULL, dict(label_smoothing=0.1, z_loss=1e-3)
    else:
        rule, opts = fuser.losses.SOFTCAP_CROSS_ENTROPY_UNSMOOTHED, dict(softcap=softcap, z_loss=1e-3)

    def step(max_hidden):
        monkeypatch.setattr(choice, "GRAD_WARP_SPECIALIZED_MAX_HIDDEN", max_hidden)
        monkeypatch.setattr(choice, "SCALED_WARP_SPECIALIZED_MAX_HIDDEN", max_hidden)
        x, w = (t.cuda().requires_grad_() for t in (hidden, weight))
        f = fuser.compile(rule, schedule=schedule, chunk_size=256)
        out = f(x, w, target.cuda(), **opts)
        (out * 0.7).backward()
        tiles = [k[2] for k in f._matmul] + [k[1] for k in f._scaled if k[0] == "bf16"]
        return (out, x.grad, w.grad), [t.warp_specialize for t in tiles if t.tma]

    got, used = step(1024)
    plain, unused = step(0)
    assert used == [True] and unused == [False]
    for a, b in zip(got, plain):
        assert torch.equal(a, b)

    def per_token(z, y):
        z = z if softcap is None else softcap * torch.tanh(z / softcap)
        lse = torch.logsumexp(z, 1)
        nll = lse - z.gather(1, y[:, None])[:, 0]
        smoothing = 0.1 if softcap is None else 0.0
        return (1 - smoothing) * nll + smoothing * (lse - z.mean(1)) + 1e-3 * lse**2

    ref = reference(
        per_token, hidden, weight, None, target, grad_out=torch.tensor(0.7), round_logits_to=torch.float32
    )
    assert_close(got[0].detach().cpu(), ref[0], 1e-5, "loss")
    assert _norm_err(got[1], ref[1]) < 2**-7, _norm_err(got[1], ref[1])
    assert _norm_err(got[2], ref[2]) < 2**-7, _norm_err(got[2], ref[2])
