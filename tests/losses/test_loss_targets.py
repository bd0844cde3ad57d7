"""A target outside the vocabulary, and tensors out of contract: a clear error before anything
runs, never a NaN loss or gradient, in every schedule and through every front end.

The range check reads its counts with the host read that leaves the ignored rows out, so the
error comes before any kernel, matmul or gradient: no ``.grad`` and no ``main_grad`` changes.
"""

import re

import pytest
import torch

import fuser
import fuser.losses
from fuser.losses import checks

from .reference import T, V, make_inputs

USER_RULE = """
m = max(z)
loss = m + log(sum(exp(z - m))) - z[y] + 0.1 * (m - z[y])
"""

# (name, callable factory, call keywords, dtype, accumulate into main_grad)
CASES = [
    ("builtin-auto", lambda: fuser.losses.cross_entropy, dict(), torch.float32, False),
    ("builtin-lean", lambda: fuser.losses.cross_entropy, dict(memory="lean"), torch.float32, False),
    ("builtin-fast-none", lambda: fuser.losses.cross_entropy, dict(memory="fast", reduction="none"),
     torch.float32, False),
    ("builtin-softcap-bf16", lambda: fuser.losses.cross_entropy, dict(softcap=5.0, label_smoothing=0.1),
     torch.bfloat16, False),
    ("entropy-sum", lambda: fuser.losses.entropy_regularized_cross_entropy, dict(reduction="sum"),
     torch.float32, False),
    ("main-grad-auto", lambda: fuser.losses.cross_entropy, dict(accumulate_into="main_grad"),
     torch.bfloat16, True),
    ("main-grad-fast", lambda: fuser.losses.cross_entropy, dict(accumulate_into="main_grad", memory="fast"),
     torch.float32, True),
    ("main-grad-lean", lambda: fuser.losses.cross_entropy, dict(accumulate_into="main_grad", memory="lean"),
     torch.bfloat16, True),
    *[
        (f"compiled-{s}", lambda s=s: fuser.compile(fuser.losses.CROSS_ENTROPY_FULL, schedule=s),
         dict(label_smoothing=0.05), torch.float32, False)
        for s in ("chunks", "whole", "vocab", "fused", "scaled")
    ],
    ("compiled-scaled-main-grad", lambda: fuser.compile(fuser.losses.CROSS_ENTROPY, schedule="scaled"),
     dict(accumulate_into="main_grad"), torch.bfloat16, True),
    ("user-rule-vocab", lambda: fuser.compile(fuser.loss(USER_RULE, name="targets_user"), schedule="vocab"),
     dict(reduction="none"), torch.float32, False),
]  # fmt: skip

# (position, value, with ignored tokens elsewhere): each position and each value twice,
# each value with and without ignored tokens
PLANTS = [
    ("first", V, True),
    ("middle", V + 10**6, False),
    ("last", -7, True),
    ("first", -7, False),
    ("middle", V, True),
    ("last", V + 10**6, True),
]
AT = {"first": 0, "middle": T // 2, "last": T - 1}


def planted(position, value, ignored, dtype=torch.float32, shape=(T,), device="cpu"):
    """Inputs with one target out of range at ``position`` of the flattened targets (the
    others in range, a quarter of them ``-100`` where ``ignored``), leaves needing grads."""
    hidden, weight, b, target = make_inputs(dtype, ignore="some" if ignored else "none", shape=shape)
    flat = target.view(-1)
    at = {"first": 0, "middle": flat.numel() // 2, "last": flat.numel() - 1}[position]
    flat[at] = value
    assert (flat == -100).any() == ignored
    x, w, bb = (t.to(device).requires_grad_() for t in (hidden, weight, b))
    return x, w, bb, target.to(device), at


def message_of(value, vocab, index):
    return re.escape(f"target[{index}] = {value} is outside the") + ".*" + re.escape(f"of {vocab} classes")


@pytest.mark.parametrize(("position", "value", "ignored"), PLANTS)
@pytest.mark.parametrize(("name", "make", "kw", "dtype", "main_grad"), CASES, ids=[c[0] for c in CASES])
def test_out_of_range_target_is_refused_before_anything_runs(name, make, kw, dtype, main_grad, position,
                                                             value, ignored):  # fmt: skip
    x, w, b, target, at = planted(position, value, ignored, dtype)
    if main_grad:
        w.main_grad = torch.randn(w.shape)
        before = w.main_grad.clone()
    bias = None if main_grad or "scaled" in name else b  # (the scaled schedule takes no bias)
    f = make()
    launches = fuser.stats()["launches"]
    with pytest.raises(ValueError, match=message_of(value, V, at)):
        f(x, w, target, bias, **kw)
    assert fuser.stats()["launches"] == launches
    assert x.grad is None and w.grad is None and b.grad is None
    if main_grad:
        assert torch.equal(w.main_grad, before)


def test_the_first_of_several_is_named_in_the_targets_shape():
    x, w, b, target, _ = planted("last", -7, True, shape=(3, 13))
    target[1, 4], target[2, 0] = V, V + 3
    with pytest.raises(ValueError, match=r"target\[1, 4\] = 211 .*\(3 targets are out of range"):
        fuser.losses.cross_entropy(x, w, target, b)
    assert x.grad is None and w.grad is None


def test_existing_grads_are_left_as_they_were():
    x, w, b, target, at = planted("middle", V, True)
    grads = [torch.randn(t.shape) for t in (x, w, b)]
    for t, g in zip((x, w, b), grads):
        t.grad = g.clone()
    with pytest.raises(ValueError, match=message_of(V, V, at)):
        fuser.losses.cross_entropy(x, w, target, b, memory="fast")
    for t, g in zip((x, w, b), grads):
        assert torch.equal(t.grad, g)


def test_out_of_range_under_no_grad_and_with_an_in_vocabulary_ignore_index():
    x, w, b, target, at = planted("first", V + 10**6, False)
    with torch.no_grad(), pytest.raises(ValueError, match=message_of(V + 10**6, V, at)):
        fuser.losses.cross_entropy(x, w, target, b)
    # an ignore_index inside the vocabulary is ignored, the bound is still V
    target[0] = 3
    target[5] = V
    with pytest.raises(ValueError, match=message_of(V, V, 5)):
        fuser.losses.cross_entropy(x, w, target, b, ignore_index=3)
    target[5] = 3
    loss = fuser.losses.cross_entropy(x, w, target, b, ignore_index=3)
    assert torch.isfinite(loss)


def test_ignore_index_itself_is_never_out_of_range():
    x, w, b, target, _ = planted("first", 0, True)
    target[:] = -100
    target[[2, 9]] = V - 1
    loss = fuser.losses.cross_entropy(x, w, target, b, reduction="none")
    assert torch.isfinite(loss).all() and int((loss != 0).sum()) == 2


def test_integer_target_dtypes_are_checked_alike():
    x, w, b, target, at = planted("last", V + 10**6, False)
    with pytest.raises(ValueError, match=message_of(V + 10**6, V, at)):
        fuser.losses.cross_entropy(x, w, target.to(torch.int32), b)
    target[at] = V
    with pytest.raises(ValueError, match=message_of(V, V, at)):
        fuser.losses.cross_entropy(x, w, target.to(torch.int16), b)


def test_ignore_index_must_be_an_int():
    x, w, b, target, _ = planted("first", 0, True)
    for bad in (-100.0, True, torch.tensor(-100)):
        with pytest.raises(TypeError, match="ignore_index must be an int"):
            fuser.losses.cross_entropy(x, w, target, b, ignore_index=bad)


def test_live_rows_counts_and_positions():
    y = torch.tensor([4, -100, 0, 9, -100, 2])
    idx, count = checks.live_rows(y, -100, 10, y.shape)
    assert count == 4 and idx.tolist() == [0, 2, 3, 5]
    assert checks.live_rows(y.clamp(min=0), -100, 10, y.shape) == (None, 6)
    assert checks.live_rows(torch.full((5,), -100), -100, 10, (5,)) == (None, 0)
    assert checks.live_rows(torch.empty(0, dtype=torch.int64), -100, 10, (0,)) == (None, 0)
    with pytest.raises(ValueError, match=r"target\[3\] = 9 is outside the global vocabulary of 9 classes "
                                         r"\(the process group's slices: 5 \+ 4\)"):  # fmt: skip
        checks.live_rows(y, -100, 9, y.shape, slices=(5, 4))


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ("weight_h", ValueError, r"weight must be \[V, 24\] \(hidden's last size H = 24\), not \[211, 23\]"),
        ("bias_shape", ValueError, r"bias must be \[211\]"),
        ("target_len", ValueError, r"leading shape \[37\], not \[36\]"),
        ("target_float", TypeError, "integer tensor"),
        ("target_complex", TypeError, "integer tensor"),
        ("target_meta", ValueError, "must be on one device"),
        ("main_grad_dtype", ValueError, r"fp32 tensor of weight's shape \[211, 24\]; got torch.bfloat16"),
        ("main_grad_shape", ValueError, r"got torch.float32 \[211, 23\]"),
        ("main_grad_device", ValueError, "main_grad must be on weight's device"),
        ("main_grad_strided", ValueError, "contiguous"),
        ("weight_strided_main_grad", ValueError, "contiguous"),
    ],
)
def test_tensors_out_of_contract(change, error, match):
    hidden, weight, b, target = make_inputs()
    w = weight.clone()
    if change == "weight_h":
        w = w[:, :-1].contiguous()
    if change == "weight_strided_main_grad":
        w = weight.t().contiguous().t()
    w.requires_grad_()
    w.main_grad = torch.zeros(w.shape)
    kw = dict(accumulate_into="main_grad") if change.startswith(("main_grad", "weight_strided")) else {}
    bias = b[:-1] if change == "bias_shape" else (None if kw else b)
    target = {
        "target_len": target[:-1],
        "target_float": target.float(),
        "target_complex": target.to(torch.complex64),
        "target_meta": target.to("meta"),
    }.get(change, target)
    w.main_grad = {
        "main_grad_dtype": torch.zeros(w.shape, dtype=torch.bfloat16),
        "main_grad_shape": torch.zeros(w.shape[0], w.shape[1] - 1),
        "main_grad_device": torch.zeros(w.shape, device="meta"),
        "main_grad_strided": torch.zeros(w.shape[1], w.shape[0]).t(),
    }.get(change, w.main_grad)
    before = w.main_grad.clone() if w.main_grad.device.type == "cpu" else None
    with pytest.raises(error, match=match):
        fuser.losses.cross_entropy(hidden, w, target, bias, **kw)
    assert w.grad is None
    if before is not None:
        assert torch.equal(w.main_grad, before)


@pytest.mark.parametrize("schedule", ["chunks", "vocab"])
def test_strided_inputs_give_what_their_contiguous_copies_give(schedule):
    # the residue's kernels (16-bit inputs) read rows H elements apart: a strided weight,
    # hidden or bias is made contiguous first, not read as if it were
    hidden, weight, b, target = make_inputs(torch.bfloat16, ignore="none", shape=(13,), h=16, v=53)
    f = fuser.compile(fuser.losses.CROSS_ENTROPY, schedule=schedule, chunk_size=8)
    strided = (hidden.t().contiguous().t(), weight.t().contiguous().t(), torch.stack((b, b), 1)[:, 0])
    assert not any(t.is_contiguous() for t in strided)
    got = []
    for inputs in (strided, (hidden, weight, b)):
        x, w, bb = (t.detach().clone() if t.is_contiguous() else t.detach() for t in inputs)
        x, w, bb = (t.requires_grad_() for t in (x, w, bb))
        loss = f(x, w, target, bb)
        loss.backward()
        got.append((loss, x.grad, w.grad, bb.grad))
    for a, e in zip(*got):
        assert torch.equal(a, e)


@pytest.mark.gpu
@pytest.mark.parametrize(("position", "value", "ignored"), PLANTS[:3])
@pytest.mark.parametrize("memory", ["auto", "lean", "fast"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_out_of_range_target_is_refused_on_gpu(memory, dtype, position, value, ignored):
    x, w, b, target, at = planted(position, value, ignored, dtype, device="cuda")
    w.main_grad = torch.randn(w.shape, device="cuda")
    before = w.main_grad.clone()
    for kw in (dict(), dict(accumulate_into="main_grad")):
        with pytest.raises(ValueError, match=message_of(value, V, at)):
            fuser.losses.cross_entropy(x, w, target, None if kw else b, memory=memory, **kw)
    torch.cuda.synchronize()
    assert x.grad is None and w.grad is None and b.grad is None
    assert torch.equal(w.main_grad, before)
    target[at] = 1  # the same call with the target in range runs
    loss = fuser.losses.cross_entropy(x, w, target, b, memory=memory)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(w.grad).all()


@pytest.mark.gpu
def test_the_check_adds_no_synchronisation_on_gpu():
    # the counts, the first bad position and its value come back in one copy; the positions
    # of the live rows are then found without another
    y = torch.randint(0, V, (4096,), device="cuda")
    y[::3] = -100
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with pytest.warns(UserWarning, match="synchroniz") as record:
            idx, count = checks.live_rows(y, -100, V, y.shape)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len([r for r in record if "synchroniz" in str(r.message)]) == 1
    assert count == int((y != -100).sum()) and torch.equal(idx, (y != -100).nonzero()[:, 0])


@pytest.mark.gpu
def test_a_cuda_graph_capture_is_refused_with_a_message():
    # refused before any device work, on a first call too (nothing compiled or cached yet)
    x, w, b, target, _ = planted("first", 0, True, torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    f = fuser.compile(fuser.losses.CROSS_ENTROPY_FULL)
    with torch.cuda.stream(stream), pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        with torch.cuda.graph(graph, stream=stream):
            f(x, w, target, b, label_smoothing=0.1)
    assert x.grad is None and w.grad is None
    assert torch.isfinite(f(x, w, target, b, label_smoothing=0.1))  # (the stream is usable after)
