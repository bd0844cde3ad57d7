"""Every schedule of the fused linear + loss against float64 autograd, on the CPU interpreter.

``chunks`` (the row kernel), ``whole`` (every token's logits kept for backward) and ``vocab``
(backward recomputes the logits in slices of vocabulary rows) must agree with the reference
for rules with one or several sweeps and with an argmax; ``vocab`` runs with slices of 64
rows so that V = 211 is crossed in four slices, the last one short.
"""

import pytest
import torch

import fuser
import fuser.losses
from fuser.codegen.loss_matmul import Tiles
from fuser.losses import api
from fuser.runtime.loss import choice
from fuser.runtime.loss.choice import choose_schedule
from fuser.runtime.loss.chunked import chunk_rows
from fuser.runtime.loss.staged import MAIN_GRAD_BUDGET, forward_rows, vocab_cols

from .reference import (
    T,
    V,
    assert_close,
    assert_norm_close,
    assert_rounding_close,
    assert_within,
    cross_entropy,
    make_inputs,
    reference,
)
from .test_loss_values import (
    USER_RULES,
    check,
    check_weight_grad_left_to_main_grad,
    label_smoothed,
    main_grad_inputs,
    run,
)

SCHEDULES = ["chunks", "whole", "vocab", "fused"]
EXTRA = 2e-4  # what the kernels may add to the rounding of the exact gradients (they add ~2e-5)
LOGIT_BUFFERS = ["chunks", "whole", "vocab"]  # the schedules that keep logits in memory


@pytest.fixture
def short_slices(monkeypatch):
    monkeypatch.setattr(choice, "vocab_cols", lambda *a, **k: 64)
    monkeypatch.setattr(choice, "slice_cols", lambda *a, **k: 64)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_every_schedule(schedule, reduction, short_slices):
    hidden, weight, b, target = make_inputs(bias=reduction != "sum")
    grad_out = torch.rand(T) + 0.5 if reduction == "none" else torch.tensor(1.7)
    f = fuser.compile(fuser.losses.CROSS_ENTROPY_FULL, chunk_size=16, schedule=schedule)
    got = run(f, hidden, weight, b, target, reduction=reduction, grad_out=grad_out, label_smoothing=0.1)
    ref = reference(label_smoothed(0.1), hidden, weight, b, target, reduction=reduction, grad_out=grad_out)
    check(got, ref)


@pytest.mark.sweep(runs=2)  # half the (rule, schedule) pairs a run, all in 2 runs
@pytest.mark.parametrize("schedule", ["whole", "vocab", "fused"])
@pytest.mark.parametrize("name", ["max_margin", "max_of_scaled", "lse_of_lse", "softcap_zloss"])
def test_user_rules_every_schedule(schedule, name, short_slices):
    # max_*: the argmax column must follow the slice in ``vocab``; lse_of_lse: two sweeps
    text, hyper, per_token = USER_RULES[name]
    f = fuser.compile(fuser.loss(text, name=name, hyper=hyper), chunk_size=16, schedule=schedule)
    hidden, weight, b, target = make_inputs(rule=per_token)
    grad_out = torch.rand(T) + 0.5
    got = run(f, hidden, weight, b, target, reduction="none", grad_out=grad_out)
    ref = reference(per_token, hidden, weight, b, target, reduction="none", grad_out=grad_out)
    check(got, ref)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_bf16_every_schedule(schedule, short_slices):
    hidden, weight, b, target = make_inputs(torch.bfloat16)
    f = fuser.compile(fuser.losses.CROSS_ENTROPY, chunk_size=16, schedule=schedule)
    got = run(f, hidden, weight, b, target, grad_out=torch.tensor(0.3))
    ref = reference(cross_entropy, hidden, weight, b, target, grad_out=torch.tensor(0.3))
    check(got, ref, 2e-2, torch.bfloat16)


@pytest.mark.parametrize("schedule", [*SCHEDULES, "scaled", "auto"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_bf16_loss_is_within_fp32s_bound_every_schedule(schedule, reduction, short_slices):
    # logits accumulated and kept in fp32 in every schedule: a bf16 call's loss carries
    # fp32's error only, against float64 on the same bf16 inputs (logits rounded to bf16
    # would move each by ~2**-9 of its size). 37 tokens cross 16-token chunks, V = 211 the
    # 64-row slices and the interpreter's 32-column tiles, H = 24 its 16-deep ones.
    if schedule == "scaled" and reduction == "none":
        pytest.skip("scaled takes reduction='none' nowhere (scaled_refusal)")
    hidden, weight, _, target = make_inputs(torch.bfloat16, bias=False)
    f = fuser.compile(fuser.losses.CROSS_ENTROPY, chunk_size=16, schedule=schedule)
    grad_out = torch.rand(T) + 0.5 if reduction == "none" else torch.tensor(0.3)
    got = run(f, hidden, weight, None, target, reduction=reduction, grad_out=grad_out)
    ref = reference(cross_entropy, hidden, weight, None, target, reduction=reduction,
                    grad_out=grad_out.to(torch.bfloat16).float())  # fmt: skip
    assert_within(got[0], ref.loss, ref.loss_bound, "loss")
    check(got, ref, 2e-2, torch.bfloat16)


@pytest.mark.parametrize("schedule", [*SCHEDULES, "auto"])
def test_fp16_gradients_under_a_loss_scale(schedule, short_slices):
    # fp16 training scales the loss (torch.amp.GradScaler, 65536 to start) so that d loss /
    # d logits stays above fp16's smallest numbers once rounded to fp16. Here each token's
    # target logit is ~14 above the others: a softmax term is ~8e-7 / 96 tokens, under
    # fp16's smallest number (6e-8) unless the scale reaches it before the rounding, and
    # half of the vocabulary is never a target, so those rows of grad_weight hold nothing else.
    t, v = 96, 64
    target = torch.randint(0, v // 2, (t,))
    hidden = (14 * torch.nn.functional.one_hot(target, v) + 0.1 * torch.randn(t, v)).half()
    weight = (torch.eye(v) + 0.1 * torch.randn(v, v)).half()
    x, w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    (65536 * torch.nn.functional.cross_entropy(x @ w.T, target)).backward()
    f = fuser.compile(fuser.losses.CROSS_ENTROPY, chunk_size=32, schedule=schedule)
    _, gx, gw, _ = run(f, hidden, weight, None, target, grad_out=torch.tensor(65536.0))
    assert_norm_close(gw[v // 2 :], w.grad[v // 2 :], 1e-2, "grad weight, rows never a target")
    # (1e-2: the schedules that keep logits round them to fp16, 4e-3 of a logit near 14)
    assert_norm_close(gw, w.grad, 1e-2, "grad weight")
    assert_norm_close(gx, x.grad, 1e-2, "grad hidden")


def test_scaled_refuses_fp16():
    hidden, weight, _, target = make_inputs(torch.float16, bias=False)
    f = fuser.compile(fuser.losses.CROSS_ENTROPY, schedule="scaled")
    with pytest.raises(ValueError, match="fp16 holds its E"):
        f(hidden.requires_grad_(), weight, target)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_main_grad_every_schedule(schedule, reduction, short_slices):
    hidden, weight, _, target = make_inputs(torch.bfloat16, bias=False)
    x = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    start = torch.randn(V, hidden.shape[-1], dtype=torch.float32)
    w.main_grad = start.clone()
    grad_out = torch.rand(T) + 0.5 if reduction == "none" else torch.tensor(2.5)
    f = fuser.compile(fuser.losses.CROSS_ENTROPY, chunk_size=16, schedule=schedule)
    out = f(x, w, target, reduction=reduction, accumulate_into="main_grad")
    (out * grad_out.to(out.dtype)).sum().backward()
    ref = reference(cross_entropy, hidden, weight, None, target, reduction=reduction,
                    grad_out=grad_out.to(torch.bfloat16).float())  # fmt: skip
    assert w.grad is None
    assert_close(w.main_grad - start, ref[2], 1e-2, "main_grad increment")
    assert_close(x.grad, ref[1], 2e-2, "grad hidden")


@pytest.mark.parametrize("schedule, memory", [("auto", "fast"), ("scaled", "auto")])
@pytest.mark.parametrize("flag", [False, True])
def test_main_grad_buffered_from_forward(schedule, memory, flag, monkeypatch):
    # memory="fast" (and schedule="scaled") take the gradients in forward, the weight's into
    # an fp32 buffer; main_grad gets grad_output times it in backward, and nothing before
    from fuser.runtime.loss import chunked, scaled

    scaled_runs = []
    for cls in (chunked.Chunked, scaled.ScaledExp):
        monkeypatch.setattr(cls, "run", _spy_scaled_runs(cls.run, scaled_runs))
    # (101 tokens: more logits than a chunk and the fp32 buffer, so that "fast" takes chunks)
    hidden, weight, target, x, w, start = main_grad_inputs(flag, shape=(101,))
    grad_out = torch.tensor(2.5)
    f = fuser.compile(fuser.losses.CROSS_ENTROPY, chunk_size=16, schedule=schedule)
    out = f(x, w, target, accumulate_into="main_grad", memory=memory)
    assert scaled_runs == [True], "the gradients were not taken in forward"
    assert torch.equal(w.main_grad, start), "main_grad changed before backward"
    (out * grad_out.to(out.dtype)).backward()
    assert scaled_runs == [True], "backward ran the schedule again"
    go = grad_out.to(torch.bfloat16).float()
    ref = reference(cross_entropy, hidden, weight, None, target, grad_out=go)
    assert_close(w.main_grad - start, ref[2], 1e-2, "main_grad increment")
    assert_close(x.grad, ref[1], 2e-2, "grad hidden")
    check_weight_grad_left_to_main_grad(w, flag)
    with pytest.raises(RuntimeError, match="once"):
        out.backward()
    assert_close(w.main_grad - start, ref[2], 1e-2, "main_grad after a refused second backward")


def _spy_scaled_runs(method, calls):
    def spy(self, *args, scale=None, **kwargs):
        calls.append(scale is not None)
        return method(self, *args, scale=scale, **kwargs)

    return spy


@pytest.mark.sweep(runs=2)  # half the cases a run, all in 2 runs
@pytest.mark.parametrize(
    "schedule, tiles",
    [(s, None) for s in (*SCHEDULES, "scaled")] + [(s, "tma") for s in ("whole", "vocab", "fused")],
)
@pytest.mark.parametrize("classes", [5, 97])
def test_target_column_errors_do_not_add_up(schedule, tiles, classes, short_slices, monkeypatch):
    # Every token of one target adds its target column's gradient ((p - 1) / 27 or 52 live
    # tokens: not a power of two) to one row of grad_weight. Rounded to bf16 with the rest of
    # the logit gradient, those errors agree in sign and add up: 2.6e-3 of main_grad and 2.9e-3
    # of the bf16 grad_weight here, against the 1e-4 and the 1.6e-3 that rounding
    # grad_weight itself costs (EXTRA: 2e-4 beyond it). The target column must enter them as fp32.
    # 5 classes: most of grad_weight's rows have no target; 97: most have one. The other rows'
    # roundings cost main_grad about in proportion to 1 / sqrt(V), whatever the tokens (V = 211
    # took 1.2e-4), so V stays 1000 and the tokens are 32: 27 live, whose (1 - p) / 27 rounds
    # by 3.0e-3 in bf16 (52's: 2.4e-3), in 16-token chunks (the last one 11) and [16, 32]
    # tiles; 64-row slices (the last one 40: the weight-gradient kernel's and fp32 blocks').
    t, h, v = (32, 40, 1000) if classes == 5 else (61, 40, classes)
    hidden = (torch.randn(t, h) * 0.25).bfloat16()
    weight = (torch.randn(v, h) * 0.25).bfloat16()
    target = torch.randint(0, classes, (t,))
    target[::7] = -100
    x, w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    torch.nn.functional.cross_entropy(x @ w.T, target).backward()
    # tiles="tma": a 16-bit grad_weight's slices take their residue rows in the weight-gradient
    # kernel where they have tiles for every processor twice, else through fp32 blocks
    from fuser.runtime.loss import residue

    launched = record_launches(monkeypatch, residue, "weight_grad")
    f = fuser.compile(fuser.losses.CROSS_ENTROPY, chunk_size=16, schedule=schedule,
                      tiles=TMA_TILES if tiles else None)  # fmt: skip
    _, gx, gw, _ = run(f, hidden, weight, None, target)
    assert bool(launched) == bool(tiles)
    assert_rounding_close(gw, w.grad, EXTRA, "grad weight")
    assert_rounding_close(gx, x.grad, EXTRA, "grad hidden")
    ww = weight.clone().requires_grad_()
    ww.main_grad = torch.zeros(v, h)
    f(hidden, ww, target, accumulate_into="main_grad").backward()  # (scaled: from its fp32 buffer)
    # (97 classes: the other columns' roundings weigh more against a smaller gradient)
    assert_norm_close(ww.main_grad, w.grad, 1e-4 if classes == 5 else 5e-4, "main_grad")


@pytest.mark.parametrize("schedule", ["whole", "fused"])
def test_weight_gradient_kernel_sums_long_runs(schedule, short_slices, monkeypatch):
    # 21 of 31 tokens share one target (in chunks of 16 and 15): its residue row is summed in
    # pieces of 16 tokens (TARGET_PIECE, 64 on a GPU: the same kernels with another L), one
    # whole and a short one of 5, then the pieces in order, before the weight-gradient kernel
    # adds it to its product. A residue is under half a bf16 step of its token's term, so the
    # short piece's may hide under the bf16 rows' own rounding (1.5e-3) and EXTRA (they did in
    # a third of 60 cases); the fp32 main_grad row, summed by the same template's fp32 kernels,
    # shows them dropped (3.6e-4 or more of the row, against at most 2.1e-5 with every piece).
    from fuser.codegen import loss_matmul
    from fuser.runtime.loss import residue

    monkeypatch.setattr(loss_matmul, "TARGET_PIECE", 16)
    launched = record_launches(monkeypatch, residue, "weight_grad")
    t, h, v = 31, 40, 97
    hidden = (torch.randn(t, h) * 0.25).bfloat16()
    weight = (torch.randn(v, h) * 0.25).bfloat16()
    target = torch.randint(0, v - 1, (t,))
    target[target >= 61] += 1  # (61 is the run's alone)
    at = torch.randperm(t)
    target[at[:21]] = 61  # 16 + 5
    target[at[21:24]] = -100
    x, w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    torch.nn.functional.cross_entropy(x @ w.T, target).backward()
    f = fuser.compile(fuser.losses.CROSS_ENTROPY, chunk_size=16, schedule=schedule, tiles=TMA_TILES)
    _, gx, gw, _ = run(f, hidden, weight, None, target)
    assert launched
    assert_rounding_close(gw, w.grad, EXTRA, "grad weight")
    assert_rounding_close(gw[61], w.grad[61], EXTRA, "the long run's row")
    assert_rounding_close(gx, x.grad, EXTRA, "grad hidden")
    ww = weight.clone().requires_grad_()
    ww.main_grad = torch.zeros(v, h)
    f(hidden, ww, target, accumulate_into="main_grad").backward()
    assert_norm_close(ww.main_grad[61], w.grad[61], 8e-5, "the long run's main_grad row")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_all_ignored_every_schedule(schedule, short_slices):
    hidden, weight, b, target = make_inputs(ignore="all")
    f = fuser.compile(fuser.losses.CROSS_ENTROPY, chunk_size=16, schedule=schedule)
    loss, gx, gw, gb = run(f, hidden, weight, b, target)
    assert torch.equal(loss, torch.zeros_like(loss))
    for g in (gx, gw, gb):
        assert torch.equal(g, torch.zeros_like(g))


TMA_TILES = Tiles(bm=16, bn=32, bk=16, group_m=2, num_warps=4, num_stages=1, tma=True)
# (dtype, hidden size, whether tensor descriptors can address the rows)
TMA_CASES = [
    (torch.float32, 24, True),  # 96-byte rows, H not a multiple of BK: zeros past the edge
    (torch.bfloat16, 40, True),
    (torch.bfloat16, 20, False),  # 40-byte rows: tensor descriptors cannot address them
]


def record_launches(monkeypatch, module, entry_part: str) -> list:
    """``(descriptors?, grid, n_rows)`` of each launch of a kernel whose entry contains
    ``entry_part``, among those ``module.load_kernel`` loads."""
    launched, load = [], module.load_kernel

    def recording(source, device):
        kernel = load(source, device)

        def launch(grid, *args):
            if entry_part in source.entry:
                launched.append(("make_tensor_descriptor" in source.text, grid, args[-6]))
            return kernel(grid, *args)

        return launch

    monkeypatch.setattr(module, "load_kernel", recording)
    return launched


@pytest.mark.sweep(runs=2)  # half the cases a run, all in 2 runs
@pytest.mark.parametrize("dtype, h, descriptors", TMA_CASES)
@pytest.mark.parametrize("main_grad", [False, True])
def test_lean_gradient_kernel_through_tensor_descriptors(dtype, h, descriptors, main_grad, short_slices,
                                                         monkeypatch):  # fmt: skip
    # Tiles(tma=True): the gradient kernel's persistent programs take their tiles through
    # tensor descriptors where the rows allow it (16-byte multiples), else the pointer kernel.
    from fuser.runtime.loss import fused

    launched = record_launches(monkeypatch, fused, "_mm_grad")
    # 61 tokens, 46 live: a full slice's 3 x 2 [16, 32] tiles take 4 programs twice, the
    # last slice (19 columns) has 3 tiles for them; the last row tile 14 rows
    hidden, weight, b, target = make_inputs(dtype, bias=not main_grad, h=h, shape=(61,))
    grad_out = torch.rand(61) + 0.5
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    bb = b.clone().requires_grad_() if b is not None else None
    start = torch.randn(V, h)
    if main_grad:
        w.main_grad = start.clone()
    f = fuser.compile(fuser.losses.CROSS_ENTROPY, tiles=TMA_TILES, schedule="fused")
    out = f(x, w, target, bb, reduction="none", accumulate_into="main_grad" if main_grad else None)
    (out * grad_out).sum().backward()
    low = dtype == torch.bfloat16
    ref = reference(cross_entropy, hidden, weight, b, target, reduction="none",
                    grad_out=grad_out)  # fmt: skip
    gw = w.main_grad - start if main_grad else w.grad
    got = (out, x.grad, gw, bb.grad if bb is not None else None)
    if low or main_grad:
        for a, e, name in zip(got, ref[:4], ("loss", "grad hidden", "grad weight", "grad bias")):
            if e is not None:
                assert_close(a, e, 2e-2 if low else 1e-5, name)
    else:
        check(got, ref)
    assert len(launched) == 4  # V = 211 in slices of 64 columns
    rows = int((target != -100).sum())
    for d, (programs,), n_rows in launched:
        assert d == descriptors and n_rows == rows
        tiles = -(-rows // TMA_TILES.bm) * 2  # (64 columns of a slice, the last one 19)
        # with descriptors, one program per processor (4 on a CPU) takes tiles in turn
        assert programs in ((min(tiles, 4), min(tiles // 2, 4)) if descriptors else (tiles, tiles // 2))


def _softcap_smoothed(z, y):
    z = 2.0 * torch.tanh(z / 2.0) / 0.7
    lse = torch.logsumexp(z, 1)
    nll = lse - z.gather(1, y[:, None])[:, 0]
    return 0.9 * nll + 0.1 * (lse - z.mean(1)) + 1e-3 * lse**2


@pytest.mark.parametrize(
    "name",
    ["cross_entropy", "softcap_cross_entropy_approx", "max_margin"],  # (the interpreter's tanh is exact)
)
def test_lean_gradient_kernel_a_half_tile_at_a_time(name, short_slices, monkeypatch):
    # Tiles(subtile=True): the gradient kernel through descriptors forms and stores each half
    # of its tile in turn; columns, the target's, an argmax's and the vocabulary's edge in
    # either half (slices of 64 columns, tiles of 32: the last slice's 19 columns in one half;
    # 46 live tokens: row tiles of 16, 16 and 14)
    from fuser.runtime.loss import fused

    launched = record_launches(monkeypatch, fused, "_mm_grad")
    hidden, weight, _, target = make_inputs(torch.float32, bias=False, h=24, shape=(61,), scale=2.0)
    if name == "max_margin":
        rule, opts, per_token = fuser.loss(USER_RULES[name][0], name=name), {}, USER_RULES[name][2]
    elif name == "softcap_cross_entropy_approx":
        rule, per_token = fuser.losses.SOFTCAP_CROSS_ENTROPY_APPROX, _softcap_smoothed
        opts = dict(softcap=2.0, temperature=0.7, label_smoothing=0.1, z_loss=1e-3)
    else:
        rule, opts, per_token = fuser.losses.CROSS_ENTROPY, {}, cross_entropy
    f = fuser.compile(rule, tiles=Tiles(**{**TMA_TILES.__dict__, "subtile": True}), schedule="fused")
    got = run(f, hidden, weight, None, target, grad_out=torch.tensor(0.6), **opts)
    check(got, reference(per_token, hidden, weight, None, target, grad_out=torch.tensor(0.6)))
    assert len(launched) == 4 and all(d for d, _, _ in launched)


def test_warp_specialized_tiles(short_slices):
    # Tiles(warp_specialize=True): the compiled tile loop of the kernels through descriptors
    # is Triton's warp-specialised range, taken with 4 warps and whole tiles; the interpreter
    # runs the same tiles in its own loop: the lean and the scaled schedule against float64
    with pytest.raises(ValueError, match="num_warps=4"):
        Tiles(tma=True, warp_specialize=True)
    with pytest.raises(ValueError, match="subtile"):
        Tiles(num_warps=4, tma=True, subtile=True, warp_specialize=True)
    tiles = Tiles(**{**TMA_TILES.__dict__, "warp_specialize": True})
    # 46 live tokens: scaled chunks of 40 and 6, the lean slices' 6 tiles over 4 programs
    hidden, weight, _, target = make_inputs(torch.bfloat16, bias=False, h=40, shape=(61,))
    ref = reference(cross_entropy, hidden, weight, None, target, grad_out=torch.tensor(0.6))
    for schedule in ("fused", "scaled"):
        f = fuser.compile(fuser.losses.CROSS_ENTROPY, tiles=tiles, schedule=schedule, chunk_size=40)
        got = run(f, hidden, weight, None, target, grad_out=torch.tensor(0.6))
        check(got, ref, 2e-2, torch.bfloat16)
    sources = (f.matmul_kernel_sources("bf16", grad_tiles=tiles)[1], f.scaled_kernel_source("bf16", tiles))
    for source in sources:
        assert "warp_specialize=True" in source.text and "flatten=True" not in source.text
    # pointer kernels have no such loop: the option leaves them as they were
    plain = Tiles(**{**TMA_TILES.__dict__, "tma": False})
    assert f.scaled_kernel_source("bf16", Tiles(**{**plain.__dict__, "warp_specialize": True})).text == (
        f.scaled_kernel_source("bf16", plain).text
    )


def test_whole_schedule_backward_runs_once():
    hidden, weight, b, target = make_inputs()
    w = weight.clone().requires_grad_()
    f = fuser.compile(fuser.losses.CROSS_ENTROPY, schedule="whole")
    loss = f(hidden, w, target, b)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="once"):
        loss.backward()


def test_vocab_schedule_backward_can_run_twice(short_slices):
    # it keeps only per-token values: a second backward recomputes and adds again
    hidden, weight, b, target = make_inputs()
    w = weight.clone().requires_grad_()
    f = fuser.compile(fuser.losses.CROSS_ENTROPY, schedule="vocab")
    loss = f(hidden, w, target, b)
    loss.backward(retain_graph=True)
    first = w.grad.clone()
    loss.backward()
    assert_close(w.grad, 2 * first.double(), 1e-6, "grad weight after two backwards")


def test_schedule_option_is_checked():
    with pytest.raises(ValueError, match="schedule must be one of"):
        fuser.compile(fuser.losses.CROSS_ENTROPY, schedule="fast")
    f = fuser.compile(fuser.losses.CROSS_ENTROPY, schedule="whole")
    hidden, weight, b, target = make_inputs()
    with pytest.raises(ValueError, match="for one device"):
        f(hidden, weight, target, b, process_group=object())


def test_memory_keyword_is_checked():
    hidden, weight, b, target = make_inputs()
    with pytest.raises(ValueError, match="memory must be one of"):
        fuser.losses.cross_entropy(hidden, weight, target, b, memory="small")
    f = fuser.compile(fuser.losses.CROSS_ENTROPY, schedule="whole")
    with pytest.raises(ValueError, match="give one or the other"):
        f(hidden, weight, target, b, memory="lean")
    with pytest.raises(RuntimeError, match="torch.distributed"):  # (vocabulary-parallel)
        fuser.losses.cross_entropy(hidden, weight, target, b, memory="lean", process_group=object())


@pytest.mark.parametrize("memory", ["fast", "lean"])
def test_ignored_rows_reach_no_kernel(memory, monkeypatch):
    # only the live rows go into the autograd Function (and so into every kernel and
    # matmul); the ignored rows still get a loss of 0 and a zero grad_hidden
    seen = []
    apply = api.LinearLoss.apply

    def recording(x, *rest):
        seen.append(x.shape[0])
        return apply(x, *rest)

    monkeypatch.setattr(api.LinearLoss, "apply", recording)
    hidden, weight, b, target = make_inputs(ignore="some")
    live = int((target != -100).sum())
    assert 0 < live < T
    grad_out = torch.rand(T) + 0.5
    got = run(fuser.losses.cross_entropy, hidden, weight, b, target, reduction="none", grad_out=grad_out,
              memory=memory)  # fmt: skip
    assert seen == [live]
    check(got, reference(cross_entropy, hidden, weight, b, target, reduction="none", grad_out=grad_out))
    assert torch.equal(got[0][target == -100], torch.zeros(T - live))
    assert torch.equal(got[1][target == -100], torch.zeros(T - live, hidden.shape[1]))


def test_gradient_kernel_block_shape_follows_the_rule():
    # the sweeps keep [128, 256] tiles; the gradient kernel takes [256, 128], or [128, 128]
    # where its formula calls a function besides exp (a softcap's tanh)
    def shapes(f):
        sweeps, grad = f.matmul_kernel_sources("bf16")
        return [(dict(k.constexprs)["BM"], dict(k.constexprs)["BN"]) for k in (*sweeps, grad)]

    assert shapes(fuser.compile(fuser.losses.SOFTCAP_CROSS_ENTROPY)) == [(128, 256), (128, 128)]
    assert shapes(fuser.compile(fuser.losses.CROSS_ENTROPY_FULL)) == [(128, 256), (256, 128)]
    entropy = fuser.compile(fuser.losses.ENTROPY_REGULARIZED_CROSS_ENTROPY)
    assert shapes(entropy) == [(128, 256), (128, 256), (256, 128)]

    # where tensor descriptors are TMA (sm_90): [128, 256] through them, except with the
    # softcap, whose kernel keeps pointer loads
    def tma_shape(f):
        _, grad = f.matmul_kernel_sources("bf16", grad_tiles=f._gradient_tiles("bf16", True))
        descriptors = "make_tensor_descriptor" in grad.text
        assert descriptors == grad.entry.endswith("_mm_grad_tma")
        return dict(grad.constexprs)["BM"], dict(grad.constexprs)["BN"], descriptors

    assert tma_shape(fuser.compile(fuser.losses.CROSS_ENTROPY)) == (128, 256, True)
    assert tma_shape(fuser.compile(fuser.losses.SOFTCAP_CROSS_ENTROPY)) == (128, 128, False)
    # fp32 tiles through descriptors would not fit in shared memory: pointers, [256, 128]
    f = fuser.compile(fuser.losses.CROSS_ENTROPY)
    _, grad = f.matmul_kernel_sources("fp32", grad_tiles=f._gradient_tiles("fp32", True))
    assert "make_tensor_descriptor" not in grad.text and dict(grad.constexprs)["BM"] == 256
    # a block shape given at compile time is used for every kernel
    tiles = Tiles(bm=64, bn=64, bk=32)
    assert shapes(fuser.compile(fuser.losses.SOFTCAP_CROSS_ENTROPY, tiles=tiles)) == [(64, 64)] * 2


# --- which schedule, and how big its pieces are ---------------------------------------------------

GIST = (32768, 768, 128256)
LLAMA8B = (8192, 4096, 128256)


def test_auto_schedule_at_the_benchmark_shapes():
    # (fp32 logits: whole at llama8b, 4 GiB, outweighs a chunk and the fp32 [V, H] buffer)
    for (t, h, v), plain, with_main_grad in ((GIST, "chunks", "vocab"), (LLAMA8B, "chunks", "vocab")):
        chunk = chunk_rows(t, h, v, 2)
        assert choose_schedule(t, h, v, 4, chunk=chunk, main_grad=False, weight_fp32=False) == plain
        assert choose_schedule(t, h, v, 4, chunk=chunk, main_grad=True, weight_fp32=False) == with_main_grad
    # whole: its logits are no bigger than a chunk plus the fp32 [V, H] accumulator
    assert choose_schedule(8192, 4096, 128256, 2, chunk=4096, main_grad=False, weight_fp32=True) == "chunks"
    assert choose_schedule(100, 64, 1000, 2, chunk=50, main_grad=True, weight_fp32=False) == "whole"
    assert choose_schedule(100, 64, 1000, 2, chunk=50, main_grad=False, weight_fp32=False) == "whole"
    # every token in one chunk: the row kernel's single launch, whatever the memory rule says
    for mg in (False, True):
        assert choose_schedule(100, 64, 1000, 2, chunk=100, main_grad=mg, weight_fp32=False) == "chunks"


@pytest.mark.parametrize("t, h, v", [GIST, LLAMA8B, (4096, 8192, 256000), (37, 24, 211)])
def test_vocab_schedule_memory_stays_in_its_budget(t, h, v):
    cols = vocab_cols(t, h, 4, 2048)  # (fp32 logits)
    assert cols % 256 == 0 and cols >= 256
    assert cols % 2048 == 0 or cols < 2048
    assert t * min(cols, v) * 4 + 4 * t * h <= MAIN_GRAD_BUDGET or cols == 256
    rows = forward_rows(v, 4)
    assert rows * v * 4 <= MAIN_GRAD_BUDGET and rows % 64 == 0


def test_chunk_rows_leaves_room_for_the_accumulator():
    # gist: fp32 logits in 1 GiB minus the fp32 [V, H] accumulator and grad_hidden, in steps
    # of 256 tokens
    t, h, v = GIST
    rows = chunk_rows(t, h, v, 2)
    assert rows * v * 4 + 4 * v * h + t * h * 2 <= 1 << 30
    assert (rows + 256) * v * 4 + 4 * v * h + t * h * 2 > 1 << 30
    assert chunk_rows(*LLAMA8B, 2) == 2048  # twice the weight's bytes, capped at 1 GiB
    assert chunk_rows(t, h, v, 2, 2) == 2304  # the scaled schedule's bf16 E: twice the tokens


@pytest.mark.parametrize("schedule", LOGIT_BUFFERS)
def test_every_launch_gets_16_byte_aligned_rows(schedule, short_slices, monkeypatch):
    # the kernels load full blocks 16 bytes at a time and assume aligned rows: V = 211 is
    # not a multiple of 8, so every driver must pad its buffers' rows
    from fuser.runtime.loss import chunked as ops
    from fuser.runtime.loss import staged

    seen = []

    def checking(load):
        def wrapped(source, device):
            kernel = load(source, device)

            def launch(grid, logits, stride, *rest):
                seen.append((logits.data_ptr() % 16, stride % 8, logits.stride(0) == stride))
                return kernel(grid, logits, stride, *rest)

            return launch

        return wrapped

    monkeypatch.setattr(ops, "load_kernel", checking(ops.load_kernel))
    monkeypatch.setattr(staged, "load_kernel", checking(staged.load_kernel))
    hidden, weight, b, target = make_inputs()
    f = fuser.compile(fuser.losses.CROSS_ENTROPY, chunk_size=16, schedule=schedule)
    got = run(f, hidden, weight, b, target)
    check(got, reference(cross_entropy, hidden, weight, b, target))
    assert seen and set(seen) == {(0, 0, True)}


@pytest.mark.sweep(runs=2)  # two of the four schedules a run, all in 2 runs
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_row_padding_holds_no_garbage(schedule, short_slices, monkeypatch):
    # a matmul may read a row's padding with it (CPU bf16 GEMMs do): memory that held NaN
    # before must not leak into the gradients
    real_empty = torch.empty

    def nan_filled(*shape, **kw):
        out = real_empty(*shape, **kw)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", nan_filled)
    for dtype, tol in ((torch.float32, None), (torch.bfloat16, 2e-2)):  # fp32: derived bounds
        hidden, weight, b, target = make_inputs(dtype)
        f = fuser.compile(fuser.losses.CROSS_ENTROPY, chunk_size=16, schedule=schedule)
        got = run(f, hidden, weight, b, target, grad_out=torch.tensor(0.3))
        ref = reference(cross_entropy, hidden, weight, b, target, grad_out=torch.tensor(0.3))
        check(got, ref, tol, dtype)
