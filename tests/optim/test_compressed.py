"""Compressed optimizer state (issue 16): 8-bit blockwise states, split bf16 master weights,
and their state dicts, against float64 references written here from the formulas.

The codecs below follow FlashOptim (arXiv:2602.23349): ``int8`` is softsign-companded
(Alg. 2), ``uint8`` sqrt-companded (Alg. 3), ``int8_linear`` / ``uint8_linear`` plain absmax;
one fp32 scale per block of 32 consecutive elements of a tensor's flat view, the last block
partial; codes rounded half to even. fuser computes the state in fp32 before encoding it,
so a code may land one step away from the float64 reference's where the value sits within
fp32's error of a rounding boundary (a chance of ~1e-5 per element): codes must be the
reference's except there, and decoded values within one code step of their block's.

Split master weights keep ``master = p + c * ulp(p) / 2**B`` (``c`` an int8 or int16 state):
each step's master is the fp32 master's within fp32's bound plus one step of ``c``.
"""

import copy
import io
import math
import re

import pytest
import torch
from numerics import SLACK, TINY, Tracked, U, assert_fp32_close, fp32_close, sqrt
from test_muon import bf16_resolution, newton_schulz, rel, view

import fuser
import fuser.optim as fo

QBLOCK = 32
SHAPES = [(37,), (5, 13), (3, 7, 11), (64,)]
# Format name -> (codes dtype, smallest code, largest code).
FORMATS = {
    "int8": (torch.int8, -127, 127),
    "uint8": (torch.uint8, 0, 255),
    "int8_linear": (torch.int8, -127, 127),
    "uint8_linear": (torch.uint8, 0, 255),
}
UNSIGNED = ("uint8", "uint8_linear")
# Decoding in fp32 rounds 4-5 times (q / 127, 2 - |y|, the division, the scale; or the scale
# and a square): a few U of the block's largest value, with room to spare.
DECODE_RTOL = 2.0**-20
# How close (in code units) an unrounded code computed from exact inputs may come to a
# rounding boundary and still round either way in fp32: ~5 roundings of values up to 255
# err by ~1e-4 (twice that with a GPU's approximate division and square root); 2**-11 is
# ~2e-6 of the code range.
NEAR = 2.0**-11
ADAMW_KW = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


@pytest.fixture
def gen(seed) -> torch.Generator:
    """A generator from this test's seed (tests/conftest.py): fresh inputs every run."""
    return torch.Generator().manual_seed(seed)


def randn(shape, gen, device, dtype=torch.float32):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)


def blockwise_randn(shape, gen, device):
    """Normal values times a factor 10**U(-2, 2) per block of 32: a scale that leaked from
    one block (or tensor) into another decodes its neighbours far beyond one code step."""
    n = math.prod(shape)
    factor = 10.0 ** (4 * torch.rand(-(-n // QBLOCK), generator=gen, dtype=torch.float64) - 2)
    x = torch.randn(n, generator=gen, dtype=torch.float64) * factor.repeat_interleave(QBLOCK)[:n]
    return x.reshape(shape).to(device=device, dtype=torch.float32)


def clones(params, dtype=None):
    return [p.detach().clone().to(dtype or p.dtype) for p in params]


def step_with(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone().to(p.dtype)
    opt.step()


def cpu_state(sd: dict) -> dict:
    """A state_dict's per-parameter state, copied to the CPU (a live one may hold views)."""
    return {
        i: {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in st.items()}
        for i, st in sd["state"].items()
    }


# --- the codecs, in float64 ----------------------------------------------------------------


def _blocks(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x``'s flat view as [blocks, 32] float64, the last block padded with zeros (which
    change no block's scale: every scale is a maximum of non-negative values)."""
    flat = x.detach().double().cpu().reshape(-1)
    n = flat.numel()
    padded = torch.zeros(-(-n // QBLOCK) * QBLOCK, dtype=torch.float64)
    padded[:n] = flat
    return padded.view(-1, QBLOCK), n


def raw_codes(x: torch.Tensor, fmt: str, scales=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes of ``x`` in ``fmt`` before rounding (float64, ``x``'s shape; 0 in a block
    whose scale is 0) and the per-block scales, as issue 16's spec writes them; ``scales``
    replaces the blocks' own."""
    b, n = _blocks(x)
    if fmt == "int8":  # softsign: y = 2x' / (1 + |x'|), x' = x / max|x|
        s = b.abs().amax(1, keepdim=True) if scales is None else scales.reshape(-1, 1)
        u = b / s
        code = 127 * (2 * u / (1 + u.abs()))
    elif fmt == "uint8":  # sqrt: r = sqrt(max(x, 0)), q = 255 r / max r
        r = b.clamp_min(0).sqrt()
        s = r.amax(1, keepdim=True) if scales is None else scales.reshape(-1, 1)
        code = 255 * r / s
    elif fmt == "int8_linear":
        s = b.abs().amax(1, keepdim=True) if scales is None else scales.reshape(-1, 1)
        code = 127 * b / s
    elif fmt == "uint8_linear":
        c = b.clamp_min(0)
        s = c.amax(1, keepdim=True) if scales is None else scales.reshape(-1, 1)
        code = 255 * c / s
    else:
        raise ValueError(fmt)
    code = torch.where(s > 0, code, 0.0)
    return code.reshape(-1)[:n].reshape(x.shape), s.reshape(-1)


def encode(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes (float64 integers, ``x``'s shape) and per-block scales of ``x`` in ``fmt``:
    rounded half to even; a block whose scale is 0 stores codes 0."""
    code, s = raw_codes(x, fmt)
    _, lo, hi = FORMATS[fmt]
    return torch.round(code).clamp(lo, hi), s


def decode(q: torch.Tensor, s: torch.Tensor, fmt: str) -> torch.Tensor:
    """The values that codes ``q`` (any integer dtype) and block scales ``s`` stand for."""
    shape = q.shape
    q = q.detach().double().cpu().reshape(-1)
    scale = s.detach().double().cpu().repeat_interleave(QBLOCK)[: q.numel()]
    if fmt == "int8":
        y = q / 127
        x = y / (2 - y.abs()) * scale
    elif fmt == "uint8":
        r = q / 255 * scale
        x = r * r
    elif fmt == "int8_linear":
        x = q / 127 * scale
    elif fmt == "uint8_linear":
        x = q / 255 * scale
    else:
        raise ValueError(fmt)
    return x.reshape(shape)


def block_top(s: torch.Tensor, fmt: str, n: int) -> torch.Tensor:
    """Per element, the largest magnitude its block decodes to (its block's max |x|)."""
    top = s * s if fmt == "uint8" else s
    return top.repeat_interleave(QBLOCK)[:n]


def code_step(q: torch.Tensor, s: torch.Tensor, fmt: str) -> torch.Tensor:
    """Per element, how far the decoded value moves when its code moves by one (the larger
    of the two neighbours within the code range)."""
    _, lo, hi = FORMATS[fmt]
    x = decode(q, s, fmt)
    up = decode((q + 1).clamp(lo, hi), s, fmt)
    down = decode((q - 1).clamp(lo, hi), s, fmt)
    return torch.maximum((up - x).abs(), (x - down).abs())


def block_max(values: torch.Tensor) -> torch.Tensor:
    """Per element, the largest of ``values`` over its block."""
    b, n = _blocks(values.abs())
    return b.amax(1).repeat_interleave(QBLOCK)[:n].reshape(values.shape)


def assert_quantized_close(got, want, fmt, err=None, what="state") -> None:
    """``got`` (dequantized) is ``decode(encode(want))`` within one code step of its block,
    plus fp32's rounding of the decode and, where ``want`` is the float64 value of an fp32
    computation with error bound ``err``, that bound of the block's elements (it moves the
    block's scale, hence every decoded value in it)."""
    q, s = encode(want, fmt)
    expect = decode(q, s, fmt)
    n = expect.numel()
    tol = code_step(q, s, fmt) + DECODE_RTOL * block_top(s, fmt, n).reshape(expect.shape)
    if err is not None:
        tol = tol + SLACK * block_max(err)
    got = got.detach().double().cpu().reshape(expect.shape)
    diff = (got - expect).abs()
    bad = ~(diff <= tol)
    if bool(bad.any()):
        i = int(torch.where(bad, diff / tol.clamp_min(TINY), 0.0).reshape(-1).nan_to_num(math.inf).argmax())
        raise AssertionError(
            f"{what} ({fmt}): {int(bad.sum())} of {n} elements beyond one code step of the float64 "
            f"codec; worst at flat index {i} (block {i // QBLOCK}): got {got.reshape(-1)[i].item()!r}, "
            f"want {expect.reshape(-1)[i].item()!r} (from {want.reshape(-1)[i].item()!r}), "
            f"tolerance {tol.reshape(-1)[i].item():.3e}"
        )


def near_a_boundary(want: torch.Tensor, fmt: str, err=None) -> torch.Tensor:
    """Where fp32 may round ``want``'s code either way: its unrounded code is within
    ``NEAR`` of a rounding boundary, or, for the float64 value of an fp32 computation with
    error bound ``err``, the boundary lies between the codes of ``want -+ SLACK * err``
    (under the reference's scales, each widened by the relative change those errors can make
    to the block's scale)."""
    raw, s = raw_codes(want, fmt)
    lo = hi = raw
    if err is not None:
        e = SLACK * err.double().cpu().reshape(want.shape)
        lo, _ = raw_codes(want.double().cpu() - e, fmt, s)
        hi, _ = raw_codes(want.double().cpu() + e, fmt, s)
        lo, hi = torch.minimum(lo, hi), torch.maximum(lo, hi)
        top = block_max(want.double().cpu()).clamp_min(TINY)
        widen = raw.abs() * SLACK * block_max(err) / top
        lo, hi = lo - widen, hi + widen
    return torch.round(lo - NEAR) != torch.round(hi + NEAR)


def assert_codes_match(codes, want, fmt, err=None, what="codes") -> None:
    """Stored ``codes`` are the reference's codes of ``want``, except one away where the
    value sits within fp32's reach of a rounding boundary (``near_a_boundary``)."""
    dtype, _, _ = FORMATS[fmt]
    assert codes.dtype == dtype, f"{what}: {codes.dtype}, expected {dtype}"
    q, _ = encode(want, fmt)
    assert codes.shape == q.shape, f"{what}: shape {tuple(codes.shape)}, expected {tuple(q.shape)}"
    diff = (codes.detach().cpu().long() - q.long()).abs()
    bad = (diff > 1) | ((diff == 1) & ~near_a_boundary(want, fmt, err))
    if bool(bad.any()):
        i = int(bad.reshape(-1).nonzero()[0])
        raw, _ = raw_codes(want, fmt)
        raise AssertionError(
            f"{what} ({fmt}): {int(bad.sum())} of {q.numel()} codes differ from the float64 codec's "
            f"away from a rounding boundary; first at flat index {i} (block {i // QBLOCK}): "
            f"{int(codes.reshape(-1)[i])}, expected {int(q.reshape(-1)[i])} "
            f"(unrounded {raw.reshape(-1)[i].item():.6f})"
        )


def assert_scales_exact(absmax, want, fmt, what="scales") -> None:
    """Block scales of fp32 values: the maximum is one of them, so exact; ``uint8``'s is
    its square root, in fp32 (a GPU's approximate square root errs by a few ulp)."""
    _, s = encode(want, fmt)
    assert absmax.dtype == torch.float32, f"{what}: {absmax.dtype}"
    assert absmax.shape == s.shape, f"{what}: shape {tuple(absmax.shape)}, expected {tuple(s.shape)}"
    got = absmax.detach().double().cpu()
    if fmt == "uint8":
        torch.testing.assert_close(got, s, rtol=2.0**-21, atol=0, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(got, s), f"{what}: {got} != {s}"


def assert_stored(st: dict, key: str, fmt: str, shape) -> None:
    """How ``optimizer.state[p]`` keeps state ``key`` in ``fmt``: codes of p's shape, fp32
    scales under ``key + "_absmax"``, one per block."""
    dtype, _, _ = FORMATS[fmt]
    codes, scales = st[key], st[key + "_absmax"]
    assert codes.dtype == dtype, f"state {key!r} is {codes.dtype}, expected {dtype} ({fmt})"
    assert codes.shape == shape, f"state {key!r} has shape {tuple(codes.shape)}, expected {tuple(shape)}"
    blocks = -(-math.prod(shape) // QBLOCK)
    assert scales.dtype == torch.float32, f"{key}_absmax is {scales.dtype}"
    assert tuple(scales.shape) == (blocks,), (
        f"{key}_absmax has shape {tuple(scales.shape)}, expected ({blocks},)"
    )


def test_reference_codecs_invert_themselves(gen):
    # The references are written from the spec, independently of fuser: check them against
    # their own definition. Decoding then encoding gives back the codes, each block's
    # largest element is exact, and every value is within a code step of its decoded value
    # (half a step for the linear formats; companding rounds y, not x).
    x = torch.randn(1000, generator=gen, dtype=torch.float64)
    for fmt, (_, lo, hi) in FORMATS.items():
        v = x.abs() if fmt in UNSIGNED else x
        q, s = encode(v, fmt)
        assert int(q.min()) >= lo and int(q.max()) <= hi
        y = decode(q, s, fmt)
        assert torch.equal(encode(y, fmt)[0], q), fmt
        assert torch.allclose(block_max(y), block_max(v), rtol=1e-14, atol=0), fmt
        within = code_step(q, s, fmt) / (2 if fmt.endswith("_linear") else 1)
        assert bool(((y - v).abs() <= within * (1 + 1e-12)).all()), fmt


# --- 1. each format through an optimizer: m = g ------------------------------------------------

COPY_RULE = fuser.rule(
    "m = g\np = p - lr * m", name="copy_grad_to_state", hyper=dict(lr=0.0), state=dict(m=0.0)
)


def copy_inputs(shape, fmt, gen, device):
    """Gradients for ``m = g``: blockwise scales; for unsigned formats mostly non-negative,
    with every fifth element negative (stored as 0); in a 64-element tensor the second
    block all zeros (a zero scale: codes 0, nothing divided by it)."""
    g = blockwise_randn(shape, gen, device)
    if fmt in UNSIGNED:
        g = g.abs()
        g.view(-1)[::5] *= -1
    if math.prod(shape) == 64:
        g.view(-1)[32:] = 0
    return g


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_state_round_trips_through_each_format(fmt, device, gen):
    params = [randn(s, gen, device) for s in SHAPES]
    start = clones(params)
    opt = fuser.compile(COPY_RULE, state_dtype=fmt)(params)
    # A first step of other values: codes and scales it leaves behind must all be rewritten.
    step_with(opt, params, [torch.full(p.shape, 7.0, device=device) for p in params])
    grads = [copy_inputs(s, fmt, gen, device) for s in SHAPES]
    step_with(opt, params, grads)
    plain, packed = cpu_state(opt.state_dict()), cpu_state(opt.state_dict(compressed=True))
    for i, (p, g) in enumerate(zip(params, grads)):
        assert torch.equal(p, start[i])  # lr = 0
        assert_stored(opt.state[p], "m", fmt, p.shape)
        assert torch.equal(packed[i]["m"], opt.state[p]["m"].cpu())
        assert torch.equal(packed[i]["m_absmax"], opt.state[p]["m_absmax"].cpu())
        assert_codes_match(packed[i]["m"], g, fmt, what=f"codes of parameter {i}")
        assert_scales_exact(packed[i]["m_absmax"], g, fmt, f"scales of parameter {i}")
        assert plain[i]["m"].dtype == torch.float32 and plain[i]["m"].shape == p.shape
        assert_quantized_close(plain[i]["m"], g, fmt, what=f"state m of parameter {i}")
        # The dequantized state_dict is fuser's own codes decoded (fp32 rounding only).
        torch.testing.assert_close(
            plain[i]["m"].double(),
            decode(packed[i]["m"], packed[i]["m_absmax"], fmt),
            rtol=DECODE_RTOL,
            atol=TINY,
        )


# dtype, largest number, mantissa bits, smallest normal
FP8 = {
    "fp8e4m3": (torch.float8_e4m3fn, 448.0, 3, 2.0**-6),
    "fp8e5m2": (torch.float8_e5m2, 57344.0, 2, 2.0**-14),
}


@pytest.mark.parametrize("fmt", list(FP8))
def test_fp8_states_are_the_block_scaled_values_rounded_to_fp8(fmt, device, gen):
    # Reference: each block's absmax s in float64; the code is x / s times the format's
    # largest number, rounded to nearest by torch's own cast.
    if device.type == "cuda" and fmt == "fp8e4m3" and torch.cuda.get_device_capability(device) < (8, 9):
        pytest.skip("fp8e4m3 needs compute capability 8.9")
    dtype, top, mantissa, tiny = FP8[fmt]
    params = [randn(s, gen, device) for s in SHAPES]
    opt = fuser.compile(COPY_RULE, state_dtype=fmt)(params)
    step_with(opt, params, [torch.full(p.shape, 7.0, device=device) for p in params])
    grads = [blockwise_randn(s, gen, device) for s in SHAPES]
    step_with(opt, params, grads)
    plain = cpu_state(opt.state_dict())
    for i, (p, g) in enumerate(zip(params, grads)):
        codes, scales = opt.state[p]["m"].cpu(), opt.state[p]["m_absmax"].cpu()
        assert codes.dtype == dtype and codes.shape == p.shape
        blocks, n = _blocks(g.cpu().double())
        s = blocks.abs().amax(dim=1)
        assert torch.equal(scales.double(), s.float().double()), f"scales of parameter {i}"
        scaled = (blocks / s[:, None] * top).reshape(-1)[:n]
        want = scaled.float().to(dtype).double()
        got = codes.double().reshape(-1)
        # fp32 rounding of x / s * top may move a value that sits next to a rounding
        # boundary to the other side: one fp8 step, there only.
        off = (got != want).nonzero().reshape(-1)
        step = 2.0 ** (torch.floor(torch.log2(scaled.abs().clamp(min=tiny))) - mantissa)
        for j in off.tolist():
            halfway = (scaled[j] - want[j]).abs()
            assert (halfway - step[j] / 2).abs() <= 1e-5 * scaled[j].abs(), (i, j, got[j], want[j])
        assert len(off) <= max(1, n // 50), f"parameter {i}: {len(off)} of {n} codes differ"
        # state_dict decodes them: code / top * s
        per = s.repeat_interleave(QBLOCK)[:n]
        torch.testing.assert_close(plain[i]["m"].double().reshape(-1), got / top * per, rtol=1e-6, atol=1e-30)


# --- 2. AdamW in q8 against float64, step by step ------------------------------------------------

# fuser decodes a state in fp32 as it reads it; the state_dict's fp32 copy may differ from
# that by fp32's rounding of the decode.
DECODE_ERR = 8 * U


def decoded(x: torch.Tensor) -> Tracked:
    x = x.detach().double().cpu()
    return Tracked(x, DECODE_ERR * x.abs())


def adamw_step(p, m, v, g, t, lr, betas, eps, weight_decay):
    """One step of torch.optim.AdamW as its documentation writes it, from the given state,
    in float64 with fp32's error bound (tests/numerics.py)."""
    b1, b2 = betas
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    p = p * (1 - lr * weight_decay)
    p = p - lr / (1 - b1**t) * (m / (sqrt(v) / math.sqrt(1 - b2**t) + eps))
    return p, m, v


def torch_adamw_step64(p, m, v, t, g, kw):
    """torch.optim.AdamW itself, in float64, one step from the given state (checks
    ``adamw_step``)."""
    p = p.detach().double().cpu().clone()
    opt = torch.optim.AdamW([p], **kw)
    if t > 1:
        opt.state[p] = dict(
            step=torch.tensor(float(t - 1)), exp_avg=m.double().clone(), exp_avg_sq=v.double().clone()
        )
    p.grad = g.detach().double().cpu()
    opt.step()
    return p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]


def check_adamw_q8_step(i, p_before, prev, g, t, p_after, after, kw) -> None:
    """One q8 AdamW step of parameter ``i`` from ``prev`` (its dequantized state before, or
    None) to ``after`` (dequantized state after, with the codes under ``"codes"``), against
    a float64 step from the same state."""
    zeros = torch.zeros(p_before.shape, dtype=torch.float64)
    m0, v0 = (zeros, zeros) if prev is None else (prev["exp_avg"].double(), prev["exp_avg_sq"].double())
    want_p, want_m, want_v = adamw_step(
        Tracked.exact(p_before), decoded(m0), decoded(v0), Tracked.exact(g), t, **kw
    )
    # The reference is torch's algorithm: torch.optim.AdamW in float64 agrees.
    tp, tm, tv = torch_adamw_step64(p_before, m0, v0, t, g, kw)
    for ours, theirs in ((want_p, tp), (want_m, tm), (want_v, tv)):
        torch.testing.assert_close(ours.value, theirs, rtol=1e-10, atol=1e-14)

    assert_quantized_close(after["exp_avg"], want_m.value, "int8", want_m.err, f"exp_avg {i}, step {t}")
    assert_quantized_close(
        after["exp_avg_sq"], want_v.value, "uint8", want_v.err, f"exp_avg_sq {i}, step {t}"
    )
    assert_codes_match(after["codes"]["exp_avg"], want_m.value, "int8", want_m.err, f"exp_avg codes {i}")
    assert_codes_match(
        after["codes"]["exp_avg_sq"], want_v.value, "uint8", want_v.err, f"exp_avg_sq codes {i}"
    )

    # The parameter: from the step's fp32 moments (as 8-bit optimizers do), or from the
    # moments as stored; the spec leaves which open, and either is within fp32's bound.
    b1, b2 = kw["betas"]
    stored_m, stored_v = decoded(after["exp_avg"]), decoded(after["exp_avg_sq"])
    from_stored = Tracked.exact(p_before) * (1 - kw["lr"] * kw["weight_decay"]) - kw["lr"] / (1 - b1**t) * (
        stored_m / (sqrt(stored_v) / math.sqrt(1 - b2**t) + kw["eps"])
    )
    if not (fp32_close(p_after, want_p) or fp32_close(p_after, from_stored)):
        assert_fp32_close(p_after, want_p, f"parameter {i}, step {t}")


def test_adamw_q8_each_step_within_one_code_of_float64(device, gen):
    params = [randn(s, gen, device) for s in SHAPES]
    opt = fo.AdamW(params, state_dtype="q8", **ADAMW_KW)
    prev = {}
    for t in range(1, 5):
        before = clones(params)
        grads = [blockwise_randn(s, gen, device) + 0.1 for s in SHAPES]
        step_with(opt, params, grads)
        plain, packed = cpu_state(opt.state_dict()), cpu_state(opt.state_dict(compressed=True))
        for i, p in enumerate(params):
            st = opt.state[p]
            # q8: exp_avg_sq is provably non-negative (uint8), exp_avg is not (int8).
            assert_stored(st, "exp_avg", "int8", p.shape)
            assert_stored(st, "exp_avg_sq", "uint8", p.shape)
            assert packed[i]["exp_avg"].dtype == torch.int8 and packed[i]["exp_avg_sq"].dtype == torch.uint8
            assert plain[i]["step"].item() == t
            after = dict(plain[i], codes=packed[i])
            check_adamw_q8_step(i, before[i], prev.get(i), grads[i], t, p, after, ADAMW_KW)
        prev = plain


# AdamW that also keeps each row's largest gradient: a row state, so its kernels walk tiles
# of each tensor's 2-D view (shape-aware rules), and its moments are AdamW's.
ROWS_ADAMW = fuser.rule(
    """
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    r = rowamax(abs(g))
    p = p * (1 - lr * weight_decay) - lr / (1 - beta1**step) * (m / (sqrt(v) / sqrt(1 - beta2**step) + eps))
""",
    name="rows_adamw",
    hyper=dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1),
    state=dict(m=0.0, v=0.0, r=0.0),
)


def test_8bit_states_of_a_rule_of_rows_follow_float64_each_step(device, gen):
    # Rows of a multiple of 32 elements; more rows than a tile's 32, more columns than its
    # 128, a 1-D tensor (one row) and a 3-D one viewed as [3, 32].
    shapes = [(64,), (5, 96), (3, 4, 8), (33, 32), (2, 160)]
    params = [randn(s, gen, device) for s in shapes]
    opt = fuser.compile(ROWS_ADAMW, state_dtype="q8")(params)  # its defaults are ADAMW_KW
    prev = {}
    for t in range(1, 4):
        before = clones(params)
        grads = [blockwise_randn(s, gen, device) + 0.1 for s in shapes]
        step_with(opt, params, grads)
        plain, packed = cpu_state(opt.state_dict()), cpu_state(opt.state_dict(compressed=True))
        for i, p in enumerate(params):
            st = opt.state[p]
            assert_stored(st, "m", "int8", p.shape)
            assert_stored(st, "v", "uint8", p.shape)
            rows = p.shape[0] if p.dim() > 1 else 1
            want_r = grads[i].reshape(rows, -1).abs().amax(1).cpu()
            assert st["r"].dtype == torch.float32 and torch.equal(st["r"].cpu(), want_r), f"r {i}"
            moments = dict(exp_avg=plain[i]["m"], exp_avg_sq=plain[i]["v"])
            after = dict(moments, codes=dict(exp_avg=packed[i]["m"], exp_avg_sq=packed[i]["v"]))
            check_adamw_q8_step(i, before[i], prev.get(i), grads[i], t, p, after, ADAMW_KW)
            prev[i] = moments


def test_8bit_states_of_a_rule_of_rows_need_rows_of_whole_blocks(device):
    good, bad = torch.randn(4, 64, device=device), torch.randn(5, 13, device=device)
    params = [good, bad]
    for p in params:
        p.grad = torch.randn_like(p)
    before = clones(params)
    opt = fuser.compile(ROWS_ADAMW, state_dtype="q8")(params)
    with pytest.raises(RuntimeError, match=r"shape \(5, 13\).*rows of 13 elements"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and not opt.state
    # bf16 states take any shape
    fuser.compile(ROWS_ADAMW, state_dtype="bf16")(params).step()


@pytest.mark.parametrize("name", ["came", "normuon"])
def test_came_and_normuon_keep_their_momentum_in_8_bits(name, device, gen):
    # Shape-aware built-ins with an element state: q8 steps against fp32-state steps from
    # the same start and gradients; the momentum differs by its codes' resolution only.
    # Over 25 seeds: steps at most 0.3% (CAME) and 1.7% (NorMuon, through Newton-Schulz)
    # apart, momenta 0.7%; an int8 code is within ~1.6% of its block's absmax.
    shapes = [(8, 64), (33, 32), (2, 160)]
    make = dict(
        came=lambda ps, **kw: fo.CAME(ps, lr=1e-2, weight_decay=0.01, **kw),
        normuon=lambda ps, **kw: fo.NorMuon(ps, lr=0.02, weight_decay=0.01, **kw),
    )[name]
    key = "exp_avg" if name == "came" else "momentum_buffer"
    start = [randn(s, gen, device) for s in shapes]
    grads = [[randn(s, gen, device) + 0.1 for s in shapes] for _ in range(3)]
    runs = []
    for state_dtype in (None, "q8"):
        params = clones(start)
        opt = make(params, state_dtype=state_dtype)
        for gs in grads:
            step_with(opt, params, gs)
        runs.append((params, opt))
    (full, full_opt), (q8, q8_opt) = runs
    for i, (a, b) in enumerate(zip(full, q8)):
        assert q8_opt.state[b][key].dtype == torch.int8 and full_opt.state[a][key].dtype == torch.float32
        step, want = (b - start[i]).double(), (a - start[i]).double()
        assert (step - want).norm() <= 0.05 * want.norm(), f"{name} parameter {i}"
        m, want_m = q8_opt.state_dict()["state"][i][key].double(), full_opt.state[a][key].double()
        assert (m - want_m).norm() <= 0.03 * want_m.norm(), f"{name} {key} {i}"


MUON_KW = dict(lr=0.02, momentum=0.95, weight_decay=0.01)


def test_muon_momentum_in_8_bits_follows_float64_each_step(device, gen):
    # Wide, tall, and a 3-D tensor viewed as [3, 40]; blocks of 32 cross its rows.
    shapes = [(16, 40), (40, 16), (3, 4, 10)]
    params = [randn(s, gen, device) for s in shapes]
    opt = fo.Muon(params, state_dtype="q8", **MUON_KW)
    beta, lr, wd = MUON_KW["momentum"], MUON_KW["lr"], MUON_KW["weight_decay"]
    prev = {}
    for t in range(1, 4):
        before = clones(params)
        grads = [blockwise_randn(s, gen, device) for s in shapes]
        step_with(opt, params, grads)
        plain, packed = cpu_state(opt.state_dict()), cpu_state(opt.state_dict(compressed=True))
        for i, p in enumerate(params):
            # q8: the momentum can take either sign, so int8.
            assert_stored(opt.state[p], "momentum_buffer", "int8", p.shape)
            g = grads[i].double().cpu()
            m0 = prev[i]["momentum_buffer"] if i in prev else torch.zeros(p.shape)
            want = beta * decoded(m0) + (1 - beta) * Tracked.exact(g)
            what = f"momentum of {tuple(p.shape)}, step {t}"
            assert_quantized_close(plain[i]["momentum_buffer"], want.value, "int8", want.err, what)
            assert_codes_match(packed[i]["momentum_buffer"], want.value, "int8", want.err, what)
            # The update orthogonalises the Nesterov mix of the step's own momentum (fp32,
            # before it is stored in 8 bits), within bf16 products' error: the kernel's and
            # the reference's bf16 products round differently, and with these block-scaled
            # gradients the relative error reached 0.071 over 300 seeds (0.03 typically).
            mix = g + beta * (want.value - g)
            exact = newton_schulz(mix).reshape(p.shape)
            bf16_error = bf16_resolution(mix)
            rows, cols = view(p).shape
            start = before[i].double().cpu()
            step = -lr * wd * start - lr * max(1, rows / cols) ** 0.5 * exact
            assert rel(p.detach().cpu().double() - start, step) < max(2 * bf16_error, 0.1), what
        prev = plain


# --- 3. a format per state -------------------------------------------------------------------

PER_STATE = {
    "int8-bf16": (dict(exp_avg="int8", exp_avg_sq="bf16"), dict(exp_avg="int8", exp_avg_sq=torch.bfloat16)),
    "fp32-uint8": (dict(exp_avg_sq="uint8"), dict(exp_avg=torch.float32, exp_avg_sq="uint8")),
    "linear-default": (
        dict(exp_avg="int8_linear", default="bf16"),
        dict(exp_avg="int8_linear", exp_avg_sq=torch.bfloat16),
    ),
}


@pytest.mark.parametrize("case", list(PER_STATE))
def test_each_state_takes_its_own_format(case, device, gen):
    state_dtype, expect = PER_STATE[case]
    params = [randn(s, gen, device) for s in SHAPES]
    opt = fo.AdamW(params, state_dtype=state_dtype, **ADAMW_KW)
    grads = [randn(s, gen, device) + 0.1 for s in SHAPES]
    step_with(opt, params, grads)
    plain = cpu_state(opt.state_dict())
    for i, (p, g) in enumerate(zip(params, grads)):
        st = opt.state[p]
        g = Tracked.exact(g)
        # After one step from zero: exp_avg = (1 - beta1) g, exp_avg_sq = (1 - beta2) g^2.
        want = dict(exp_avg=(1 - 0.9) * g, exp_avg_sq=(1 - 0.999) * g * g)
        for key, fmt in expect.items():
            if isinstance(fmt, str):
                assert_stored(st, key, fmt, p.shape)
                assert_quantized_close(plain[i][key], want[key].value, fmt, want[key].err, f"{key} {i}")
            else:
                assert st[key].dtype == fmt and st[key].shape == p.shape, (key, st[key].dtype)
                assert key + "_absmax" not in st
                assert_fp32_close(
                    st[key], want[key] if fmt == torch.float32 else want[key].round_to(fmt), key
                )
            # The state_dict dequantizes 8-bit states to fp32 and keeps 16-bit ones as stored.
            saved = plain[i][key]
            assert saved.dtype == (torch.float32 if isinstance(fmt, str) else fmt), f"{key}: {saved.dtype}"
            assert saved.shape == p.shape, f"{key}: {tuple(saved.shape)}"


# --- 4. split master weights ------------------------------------------------------------------

MASTER_BITS = {"bf16+int8": 8, "bf16+int16": 16}
LO_DTYPE = {"bf16+int8": torch.int8, "bf16+int16": torch.int16}


def bf16_ulp(p: torch.Tensor) -> torch.Tensor:
    """bf16's spacing at each value: 2**(floor(log2|p|) - 7); 2**-133 at 0 and subnormals."""
    p = p.detach().double().cpu()
    _, e = torch.frexp(p)  # |p| = f * 2**e with f in [0.5, 1): floor(log2|p|) = e - 1
    ulp = torch.ldexp(torch.ones_like(p), e - 8)
    return torch.where(p.abs() < 2.0**-126, 2.0**-133, ulp)


def master_of(p: torch.Tensor, lo: torch.Tensor | None, bits: int) -> torch.Tensor:
    """The master value the spec reconstructs: float(p) + c * ulp(p) / 2**B (float64, exact)."""
    p64 = p.detach().double().cpu()
    if lo is None:
        return p64
    return p64 + lo.detach().cpu().double() * bf16_ulp(p) / 2.0**bits


# SGD scaled by each row's largest gradient: a rule of rows, whose kernels walk tiles.
ROWS_SGD = fuser.rule("p = p - lr * g / rowamax(abs(g))", name="rows_sgd", hyper=dict(lr=1e-3))


def rows_sgd(params, master_weights, **kw):
    return fuser.compile(ROWS_SGD, master_weights=master_weights)(params, **kw)


MASTER_CASES = {
    "sgd": (fo.SGD, torch.optim.SGD, dict(lr=3e-3)),
    "adamw": (fo.AdamW, torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1)),
    "rows_sgd": (rows_sgd, None, dict(lr=3e-3)),
}


def row_amax(g: torch.Tensor) -> Tracked:
    """Each row's largest |g| of g's 2-D view, beside every element (exact in fp32)."""
    g = g.detach().double().cpu()
    rows = g.reshape(g.shape[0] if g.dim() > 1 else 1, -1)
    return Tracked.exact(rows.abs().amax(1, keepdim=True).expand_as(rows).reshape(g.shape))


def master_step_reference(name, master, st, g, t, kw):
    """One step from the fp32 master ``master`` (and fp32 states ``st``), float64 with
    fp32's error bound."""
    if name == "sgd":
        return Tracked.exact(master) - kw["lr"] * Tracked.exact(g)
    if name == "rows_sgd":
        return Tracked.exact(master) - kw["lr"] * Tracked.exact(g) / row_amax(g)
    zeros = torch.zeros(master.shape, dtype=torch.float64)
    m = Tracked.exact(st.get("exp_avg", zeros))
    v = Tracked.exact(st.get("exp_avg_sq", zeros))
    p, _, _ = adamw_step(
        Tracked.exact(master), m, v, Tracked.exact(g), t, kw["lr"], (0.9, 0.999), 1e-8, kw["weight_decay"]
    )
    return p


@pytest.mark.parametrize("mw", list(MASTER_BITS))
@pytest.mark.parametrize("case", list(MASTER_CASES))
def test_split_master_follows_an_fp32_master(case, mw, device, gen):
    fcls, tcls, kw = MASTER_CASES[case]
    bits, steps = MASTER_BITS[mw], 4
    params = [randn(s, gen, device, torch.bfloat16) for s in SHAPES]
    start = clones(params)
    opt = fcls(params, master_weights=mw, **kw)
    grads = [[randn(s, gen, device, torch.bfloat16) for s in SHAPES] for _ in range(steps)]
    quantization = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    for t, gs in enumerate(grads, 1):
        masters = [master_of(p, opt.state[p].get("master_lo"), bits) for p in params]
        states = [{k: v.detach().double().cpu() for k, v in opt.state[p].items()} for p in params]
        step_with(opt, params, gs)
        for i, p in enumerate(params):
            lo = opt.state[p]["master_lo"]
            assert p.dtype == torch.bfloat16
            assert lo.dtype == LO_DTYPE[mw] and lo.shape == p.shape, (lo.dtype, lo.shape)
            assert int(lo.int().abs().max()) <= 2 ** (bits - 1) - 1
            master = master_of(p, lo, bits)
            # The bf16 parameter is the master rounded to nearest.
            assert torch.equal(p.cpu(), master.to(torch.bfloat16)), f"parameter {i}, step {t}"
            # This step from the previous master: fp32's bound, plus one step of c.
            want = master_step_reference(case, masters[i], states[i], gs[i], t, kw)
            step_q = bf16_ulp(p) / 2.0**bits
            tol = SLACK * want.err + step_q
            diff = (master - want.value).abs()
            assert bool((diff <= tol).all()), (
                f"master of parameter {i}, step {t} ({mw}): error {float((diff - tol).max()):.3e} over "
                f"one code step ({float(step_q.max()):.3e}) plus fp32's bound"
            )
            quantization[i] += step_q
    # Over all steps: torch.optim's float64 run (where torch has the rule), within fp32's
    # bound of the whole trajectory plus one step of c per step (these updates never
    # amplify an error in p).
    reference = clones(start, torch.float64)
    if tcls is not None:
        topt = tcls(reference, **kw)
        for gs in grads:
            step_with(topt, reference, [g.double() for g in gs])
    for i, p in enumerate(params):
        master = master_of(p, opt.state[p]["master_lo"], bits)
        traced = trajectory(case, start[i], [gs[i] for gs in grads], kw)
        if tcls is not None:
            torch.testing.assert_close(traced.value, reference[i].detach().cpu(), rtol=1e-10, atol=1e-14)
        diff = (master - traced.value).abs()
        assert bool((diff <= SLACK * traced.err + quantization[i]).all()), (
            f"master of parameter {i} after {steps} steps"
        )


def trajectory(name, p, grads, kw) -> Tracked:
    """The whole run in float64 with fp32's error bound (an fp32 master)."""
    p = Tracked.exact(p)
    if name in ("sgd", "rows_sgd"):
        for g in grads:
            p = p - kw["lr"] * Tracked.exact(g) / (row_amax(g) if name == "rows_sgd" else 1)
        return p
    zeros = Tracked.exact(torch.zeros(p.value.shape, dtype=torch.float64))
    m = v = zeros
    for t, g in enumerate(grads, 1):
        p, m, v = adamw_step(p, m, v, Tracked.exact(g), t, kw["lr"], (0.9, 0.999), 1e-8, kw["weight_decay"])
    return p


@pytest.mark.parametrize("mw", list(MASTER_BITS))
def test_split_master_carries_updates_below_bf16_spacing(mw, device, gen):
    # |p| in [1.25, 1.75] all run long (bf16 spacing 2**-7) and every update at most 2**-9,
    # under half a spacing: plain bf16 parameters never move, the master accumulates.
    bits, steps, lr = MASTER_BITS[mw], 12, 2.0**-9
    shapes = [(37,), (5, 13)]
    sign = [torch.randint(0, 2, s, generator=gen).double() * 2 - 1 for s in shapes]
    start = [
        ((1.25 + 0.5 * torch.rand(s, generator=gen, dtype=torch.float64)) * d).to(device, torch.bfloat16)
        for s, d in zip(shapes, sign)
    ]
    # Gradients of one sign per element, |g| in [0.5, 1]: the updates add up.
    grads = [
        [
            ((0.5 + 0.5 * torch.rand(s, generator=gen, dtype=torch.float64)) * d).to(device, torch.bfloat16)
            for s, d in zip(shapes, sign)
        ]
        for _ in range(steps)
    ]
    plain, split = clones(start), clones(start)
    plain_opt, split_opt = fo.SGD(plain, lr=lr), fo.SGD(split, lr=lr, master_weights=mw)
    for gs in grads:
        step_with(plain_opt, plain, gs)
        step_with(split_opt, split, gs)
    for i in range(len(shapes)):
        want = Tracked.exact(start[i])
        for gs in grads:
            want = want - lr * Tracked.exact(gs[i])
        master = master_of(split[i], split_opt.state[split[i]]["master_lo"], bits)
        bound = SLACK * want.err + steps * bf16_ulp(split[i]) / 2.0**bits
        assert bool(((master - want.value).abs() <= bound).all()), f"master of parameter {i}"
        # The parameter moved with it: the master's nearest bf16.
        assert bool(((split[i].cpu().double() - want.value).abs() <= bf16_ulp(split[i]) / 2 + bound).all())
        # bf16 alone never moved; its error is all the updates, far beyond the master's.
        assert torch.equal(plain[i], start[i])
        plain_err = (plain[i].cpu().double() - want.value).abs()
        assert float((master - want.value).abs().max()) * 8 < float(plain_err.min())


def test_master_lo_round_trips_through_state_dict(device, gen):
    params = [randn(s, gen, device, torch.bfloat16) for s in SHAPES]
    opt = fo.AdamW(params, master_weights="bf16+int16", lr=1e-3)
    step_with(opt, params, [randn(s, gen, device, torch.bfloat16) for s in SHAPES])
    sd = copy.deepcopy(opt.state_dict())
    for i, p in enumerate(params):
        assert sd["state"][i]["master_lo"].dtype == torch.int16
        assert torch.equal(sd["state"][i]["master_lo"], opt.state[p]["master_lo"])
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    again = clones(params)
    opt2 = fo.AdamW(again, master_weights="bf16+int16", lr=1e-3)
    opt2.load_state_dict(loaded)
    grads = [randn(s, gen, device, torch.bfloat16) for s in SHAPES]
    step_with(opt, params, grads)
    step_with(opt2, again, grads)
    for p, q in zip(params, again):
        assert torch.equal(p, q)
        for k, v in opt.state[p].items():
            assert torch.equal(opt2.state[q][k], v), k


# --- 5. state dicts ---------------------------------------------------------------------------


def q8_adamw_after(steps, device, gen, **kw):
    params = [randn(s, gen, device) for s in SHAPES]
    opt = fo.AdamW(params, state_dtype="q8", **ADAMW_KW, **kw)
    for _ in range(steps):
        step_with(opt, params, [randn(s, gen, device) + 0.1 for s in SHAPES])
    return params, opt


def test_default_state_dict_is_fp32_and_torch_adamw_continues_from_it(device, gen):
    params, opt = q8_adamw_after(2, device, gen)
    sd = copy.deepcopy(opt.state_dict())
    packed = cpu_state(opt.state_dict(compressed=True))
    for i, p in enumerate(params):
        st = sd["state"][i]
        assert set(st) == {"step", "exp_avg", "exp_avg_sq"}, set(st)
        for key, fmt in (("exp_avg", "int8"), ("exp_avg_sq", "uint8")):
            assert st[key].dtype == torch.float32, f"{key}: {st[key].dtype}"
            assert st[key].shape == p.shape, f"{key}: {tuple(st[key].shape)}"
            want = decode(packed[i][key], packed[i][key + "_absmax"], fmt)
            torch.testing.assert_close(st[key].cpu().double(), want, rtol=DECODE_RTOL, atol=TINY)
    # torch.optim.AdamW takes it as its own checkpoint and continues.
    tparams = clones(params)
    topt = torch.optim.AdamW(tparams, **ADAMW_KW)
    topt.load_state_dict(copy.deepcopy(sd))
    for i, tp in enumerate(tparams):
        assert torch.equal(topt.state[tp]["exp_avg"], sd["state"][i]["exp_avg"])
    before = clones(params)
    grads = [randn(s, gen, device) + 0.1 for s in SHAPES]
    step_with(opt, params, grads)
    step_with(topt, tparams, grads)
    plain, packed = cpu_state(opt.state_dict()), cpu_state(opt.state_dict(compressed=True))
    for i, p in enumerate(params):
        prev = {k: v.cpu() for k, v in sd["state"][i].items()}
        check_adamw_q8_step(i, before[i], prev, grads[i], 3, p, dict(plain[i], codes=packed[i]), ADAMW_KW)
        # torch from the same state: the same float64 step within fp32's bound.
        m0, v0 = decoded(prev["exp_avg"]), decoded(prev["exp_avg_sq"])
        want_p, _, _ = adamw_step(Tracked.exact(before[i]), m0, v0, Tracked.exact(grads[i]), 3, **ADAMW_KW)
        assert_fp32_close(tparams[i], want_p, f"torch's parameter {i}")


def test_compressed_state_dict_round_trip_is_exact(device, gen):
    params, opt = q8_adamw_after(2, device, gen)
    packed = copy.deepcopy(opt.state_dict(compressed=True))
    for i, p in enumerate(params):
        st = packed["state"][i]
        tensors = {"step", "exp_avg", "exp_avg_absmax", "exp_avg_sq", "exp_avg_sq_absmax"}
        assert set(st) == tensors | {"exp_avg_format", "exp_avg_sq_format"}, set(st)
        assert (st["exp_avg_format"], st["exp_avg_sq_format"]) == ("int8", "uint8")
        for key in tensors:
            assert torch.equal(st[key], opt.state[p][key]), key
    again = clones(params)
    opt2 = fo.AdamW(again, state_dtype="q8", lr=0.5)
    opt2.load_state_dict(copy.deepcopy(packed))
    assert opt2.param_groups[0]["lr"] == ADAMW_KW["lr"]
    repacked = opt2.state_dict(compressed=True)
    for i in packed["state"]:
        for key, v in packed["state"][i].items():
            got = repacked["state"][i][key]
            assert got == v if isinstance(v, str) else got.dtype == v.dtype and torch.equal(got, v), (i, key)
    # Both continue bit for bit.
    grads = [randn(s, gen, device) + 0.1 for s in SHAPES]
    step_with(opt, params, grads)
    step_with(opt2, again, grads)
    for p, q in zip(params, again):
        assert torch.equal(p, q)
        for key, v in opt.state[p].items():
            assert torch.equal(opt2.state[q][key], v), key


def test_fp32_state_loaded_into_q8_is_quantized(device, gen):
    # A torch.optim.AdamW checkpoint (fp32 states) loaded by a q8 optimizer.
    params = [randn(s, gen, device) for s in SHAPES]
    topt = torch.optim.AdamW(params, **ADAMW_KW)
    for _ in range(2):
        step_with(topt, params, [blockwise_randn(s, gen, device) for s in SHAPES])
    tsd = copy.deepcopy(topt.state_dict())
    ours = clones(params)
    opt = fo.AdamW(ours, state_dtype="q8", **ADAMW_KW)
    opt.load_state_dict(copy.deepcopy(tsd))
    plain = cpu_state(opt.state_dict())
    for i, p in enumerate(ours):
        for key, fmt in (("exp_avg", "int8"), ("exp_avg_sq", "uint8")):
            x = tsd["state"][i][key]
            assert_stored(opt.state[p], key, fmt, p.shape)
            assert_codes_match(opt.state[p][key], x, fmt, what=f"{key} codes {i}")
            assert_scales_exact(opt.state[p][key + "_absmax"], x, fmt, f"{key} scales {i}")
            assert_quantized_close(plain[i][key], x, fmt, what=f"loaded {key} {i}")
        assert plain[i]["step"].item() == 2
    # and the loaded optimizer steps on from there.
    before = clones(ours)
    grads = [randn(s, gen, device) + 0.1 for s in SHAPES]
    step_with(opt, ours, grads)
    after, packed = cpu_state(opt.state_dict()), cpu_state(opt.state_dict(compressed=True))
    for i, p in enumerate(ours):
        check_adamw_q8_step(i, before[i], plain[i], grads[i], 3, p, dict(after[i], codes=packed[i]), ADAMW_KW)


@pytest.mark.parametrize("compressed", [False, True])
def test_state_dicts_save_and_load_with_weights_only(compressed, device, gen):
    params, opt = q8_adamw_after(1, device, gen)
    sd = opt.state_dict(compressed=True) if compressed else opt.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert loaded["param_groups"] == sd["param_groups"]
    for i, st in sd["state"].items():
        assert set(loaded["state"][i]) == set(st)
        for key, v in st.items():
            got = loaded["state"][i][key]
            assert got == v if isinstance(v, str) else got.dtype == v.dtype and torch.equal(got, v), key
    # It loads into a fresh q8 optimizer; the compressed form exactly.
    opt2 = fo.AdamW(clones(params), state_dtype="q8", **ADAMW_KW)
    opt2.load_state_dict(loaded)
    if compressed:
        for q, p in zip(opt2.param_groups[0]["params"], params):
            for key, v in opt.state[p].items():
                assert torch.equal(opt2.state[q][key], v), key


# --- 6. errors -------------------------------------------------------------------------------

ROWMEAN_RULE = fuser.rule(
    "m = beta * m + (1 - beta) * (g - rowmean(g))\np = p - lr * m",
    name="centered_momentum",
    hyper=dict(lr=1e-2, beta=0.9),
    state=dict(m=0.0),
)
MUON_RULE = fuser.rule(
    "m = momentum * m + (1 - momentum) * g\np = p - lr * orthogonalize(g + momentum * (m - g))",
    name="muon_like",
    hyper=dict(lr=0.02, momentum=0.95),
    state=dict(m=0.0),
)


def test_unknown_formats_are_refused(device):
    p = torch.randn(37, device=device)
    for bad in ("int4", "q4", "uint16"):
        with pytest.raises(ValueError, match="state_dtype"):
            fuser.compile(COPY_RULE, state_dtype=bad)
        with pytest.raises(ValueError, match="state_dtype"):
            fo.AdamW([p], state_dtype=bad)
    with pytest.raises(ValueError, match="int4"):
        fo.AdamW([p], state_dtype=dict(exp_avg="int4"))
    with pytest.raises(ValueError, match="master_weights"):
        fo.AdamW([p.bfloat16()], master_weights="bf16+int4")


def test_state_dtype_dict_must_name_the_rules_states(device):
    p = torch.randn(37, device=device)
    with pytest.raises(ValueError, match="momentum_buffer"):
        fo.AdamW([p], state_dtype=dict(exp_avg="int8", momentum_buffer="int8"))
    with pytest.raises(ValueError, match=r"\bv\b"):
        fuser.compile(COPY_RULE, state_dtype=dict(v="int8"))
    fuser.compile(COPY_RULE, state_dtype=dict(m="int8"))  # the rule's own name is fine


def test_8bit_states_refused_where_a_state_is_not_one_value_per_element(device):
    p = torch.randn(5, 13, device=device)
    eight_bit = r"(?i)int8|8-bit|q8|quantiz"
    with pytest.raises(ValueError, match=eight_bit):
        fo.Adafactor([p], state_dtype=dict(row_var="int8"))
    # NAdam's mu_product is one number per tensor.
    with pytest.raises(ValueError, match="mu_product"):
        fo.NAdam([p], state_dtype=dict(mu_product="int8"))
    # Those rules take 16-bit states, and element-wise rules take 8-bit ones.
    fo.Adafactor([p], state_dtype="bf16")
    # A rule-wide 8-bit format leaves states of one number per row or column in fp32.
    q = torch.randn(5, 13, device=device, requires_grad=True)
    q.grad = torch.randn(5, 13, device=device)
    opt = fo.Adafactor([q], state_dtype="int8")
    opt.step()
    assert {k: v.dtype for k, v in opt.state[q].items() if k != "step"} == {
        "row_var": torch.float32,
        "col_var": torch.float32,
    }
    fuser.compile(ROWMEAN_RULE, state_dtype="bf16")
    # A rule of rows takes 8-bit element states (blocks within rows: see above).
    fuser.compile(ROWMEAN_RULE, state_dtype=dict(m="int8"))
    fuser.compile(COPY_RULE, state_dtype="int8")
    # A matrix function's rule walks flat blocks around its products: 8 bits are fine.
    fuser.compile(MUON_RULE, state_dtype="int8")


def test_master_weights_refuse_stochastic_rounding(device):
    p = torch.randn(37, device=device).bfloat16()
    with pytest.raises(ValueError, match="stochastic_rounding"):
        fo.AdamW([p], master_weights="bf16+int16", stochastic_rounding=True)
    with pytest.raises(ValueError, match="stochastic_rounding"):
        fuser.compile(COPY_RULE, master_weights="bf16+int8", stochastic_rounding=True)


def test_fp32_parameters_are_their_own_masters(device, gen):
    # Beside bf16 parameters with split masters, fp32 ones step as without master_weights.
    shapes = SHAPES[:2]
    low = [randn(s, gen, device, torch.bfloat16) for s in shapes]
    full = [randn(s, gen, device) for s in shapes]
    plain = clones(full)
    opt = fo.AdamW([*low, *full], master_weights="bf16+int8", lr=1e-2)
    ref = fo.AdamW(plain, lr=1e-2)
    for _ in range(2):
        grads = [randn(s, gen, device) for s in shapes]
        step_with(opt, [*low, *full], [g.bfloat16() for g in grads] + grads)
        step_with(ref, plain, grads)
    for p, q in zip(full, plain):
        assert torch.equal(p, q)
        assert "master_lo" not in opt.state[p]
    assert all(opt.state[p]["master_lo"].dtype == torch.int8 for p in low)


@pytest.mark.parametrize("dtype", [torch.float16], ids=["fp16"])
def test_master_weights_need_bf16_parameters_and_change_nothing_otherwise(dtype, device, gen):
    params = [randn(s, gen, device, torch.bfloat16) for s in SHAPES[:2]]
    opt = fo.AdamW(params, master_weights="bf16+int16", lr=1e-2)
    step_with(opt, params, [randn(s, gen, device, torch.bfloat16) for s in SHAPES[:2]])
    other = randn((3, 7, 11), gen, device, dtype)
    opt.add_param_group(dict(params=[other]))
    snapshot = clones(params + [other])
    states = {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(params)}
    for p in params + [other]:
        p.grad = randn(p.shape, gen, device, p.dtype)
    with pytest.raises(RuntimeError, match=re.escape("(3, 7, 11)")):
        opt.step()
    for p, s in zip(params + [other], snapshot):
        assert torch.equal(p, s)
    for i, p in enumerate(params):
        assert set(opt.state[p]) == set(states[i])
        for k, v in states[i].items():
            assert torch.equal(opt.state[p][k], v), k
    assert len(opt.state.get(other, {})) == 0


# --- 7. partial blocks, many tensors ---------------------------------------------------------

Q8_RULE = fuser.rule(
    "m = g\nv = g * g\np = p - lr * m",
    name="copy_grad_and_square",
    hyper=dict(lr=0.0),
    state=dict(m=0.0, v=0.0),
)


def test_partial_last_blocks_keep_their_own_scale(device, gen):
    # Each tensor's last, partial block holds values 1e4 times smaller than the block before
    # it: a scale taken over the wrong elements (another block, the next tensor, the padding
    # of a partial block) decodes them far beyond one code step.
    shapes = [(1,), (31,), (33,), (65,), (2, 17), (3, 7, 11)]
    params = [randn(s, gen, device) for s in shapes]
    opt = fuser.compile(Q8_RULE, state_dtype="q8")(params)
    grads = []
    for s in shapes:
        g = randn(s, gen, device) + 0.1
        n = g.numel()
        if n > QBLOCK:
            g.view(-1)[n - n % QBLOCK or n - QBLOCK :] *= 1e-4
        grads.append(g)
    step_with(opt, params, grads)
    plain, packed = cpu_state(opt.state_dict()), cpu_state(opt.state_dict(compressed=True))
    for i, (p, g) in enumerate(zip(params, grads)):
        # q8: g * g is non-negative (uint8), g is not (int8).
        assert_stored(opt.state[p], "m", "int8", p.shape)
        assert_stored(opt.state[p], "v", "uint8", p.shape)
        assert_scales_exact(packed[i]["m_absmax"], g, "int8", f"m scales {i}")
        square = Tracked.exact(g) * Tracked.exact(g)
        for key, fmt, want, err in (("m", "int8", g, None), ("v", "uint8", square.value, square.err)):
            assert_codes_match(packed[i][key], want, fmt, err, f"{key} codes {i}")
            assert_quantized_close(plain[i][key], want, fmt, err, f"{key} of parameter {i} {tuple(p.shape)}")
