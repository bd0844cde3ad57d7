"""The step kernels' launch shape: each program of a flat phase walks BLOCK elements of one
tensor SUB at a time (FUSER_OPTIM_BLOCK / FUSER_OPTIM_SUB); each program of a tiled phase
(rules of rows and columns) walks a strip of FUSER_OPTIM_STRIP tiles of BR x BC
(FUSER_OPTIM_TILE) down a tensor's rows. Results must not depend on it: reductions
accumulate over passes, tiles and blocks, 8-bit states re-encode per 32 elements whatever
the pass, and tails of every length take the masked path."""

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest
import test_shaped as shaped
import torch
import triton
from numerics import assert_fp32_close
from test_reductions import check_centered_step, fresh, lamb_reference, set_grads

import fuser
from fuser import clitools
from fuser.cache import precompile
from fuser.cache.errors import CompileError
from fuser.cache.keys import entry_key
from fuser.codegen import render
from fuser.codegen.render import COMPRESSED_MAX_REGISTERS
from fuser.optim import builtins
from fuser.optim.factory import kernel_sources

# Sizes around the pass and block edges of the shapes below, and 8-bit blocks cut short.
SHAPES = [(1,), (127,), (128,), (129,), (700,), (33, 17), (2, 3, 41)]
LAUNCH_SHAPES = [(256, 128), (512, 256), (1024, 1024), None]  # None: the defaults


@pytest.fixture
def launch_shape(request, monkeypatch):
    """Render kernels with (BLOCK, SUB) = request.param (the defaults for ``None``)."""
    monkeypatch.delenv("FUSER_OPTIM_BLOCK", raising=False)
    monkeypatch.delenv("FUSER_OPTIM_SUB", raising=False)
    if request.param is not None:
        block, sub = request.param
        monkeypatch.setenv("FUSER_OPTIM_BLOCK", str(block))
        monkeypatch.setenv("FUSER_OPTIM_SUB", str(sub))
    return request.param


def test_a_changed_launch_variable_renders_new_kernels_in_the_same_process(monkeypatch):
    rule = fuser.optim.AdamW.rule
    monkeypatch.setenv("FUSER_OPTIM_BLOCK", "512")
    monkeypatch.setenv("FUSER_OPTIM_SUB", "128")
    first = dict(kernel_sources(rule, "bf16")[0].constexprs)
    monkeypatch.setenv("FUSER_OPTIM_SUB", "256")
    second = dict(kernel_sources(rule, "bf16")[0].constexprs)
    assert (first["BLOCK"], first["SUB"]) == (512, 128)
    assert (second["BLOCK"], second["SUB"]) == (512, 256)


@pytest.mark.parametrize(
    "options, shape",
    [
        (dict(), (2048, 2048, 8)),  # every element tensor fp32
        (dict(state_dtype="param"), (8192, 1024, 8)),  # every element tensor 16-bit
        (dict(state_dtype="fp32"), (8192, 1024, 4)),  # bf16 parameters, fp32 states
        (dict(state_dtype="q8"), (8192, 512, 2)),  # every state one byte
        (dict(state_dtype="q8", master_weights="bf16+int8"), (8192, 512, 2)),
        (dict(state_dtype="q8", master_weights="bf16+int16"), (8192, 512, 4)),
        (dict(master_weights="bf16+int8"), (8192, 512, 4)),  # fp32 states
        (dict(state_dtype=dict(exp_avg="int8")), (8192, 512, 4)),  # v stays fp32
    ],
)
def test_default_launch_shapes_follow_the_bytes_of_an_element(monkeypatch, options, shape):
    for name in ("FUSER_OPTIM_BLOCK", "FUSER_OPTIM_SUB", "FUSER_OPTIM_WARPS"):
        monkeypatch.delenv(name, raising=False)
    dtype = "bf16" if options else "fp32"
    src = kernel_sources(fuser.optim.AdamW.rule, dtype, **options)[0]
    constexprs = dict(src.constexprs)
    assert (constexprs["BLOCK"], constexprs["SUB"], src.num_warps) == shape, options


def test_a_gpu_profile_changes_the_launch_shapes_it_names_and_no_other(monkeypatch):
    # The H200's profile walks 8192 elements 1024 at a time over 8 warps where every element
    # tensor is fp32; other layouts keep the defaults. A profile is part of the rendering's
    # key (its kernels are others), a CPU device has none, and the CLI offers each one.
    for name in ("FUSER_OPTIM_BLOCK", "FUSER_OPTIM_SUB", "FUSER_OPTIM_WARPS"):
        monkeypatch.delenv(name, raising=False)
    rule = fuser.optim.LAMB.rule
    for dtype, options, shape in (
        ("fp32", {}, (8192, 1024, 8)),
        ("bf16", dict(state_dtype="q8"), (8192, 512, 2)),
    ):
        plain = kernel_sources(rule, dtype, **options)
        h200 = kernel_sources(rule, dtype, profile="h200", **options)
        assert len(plain) == len(h200) == 2  # (LAMB's two phases)
        for src in h200:
            constexprs = dict(src.constexprs)
            assert (constexprs["BLOCK"], constexprs["SUB"], src.num_warps) == shape
        changed = {a.digest != b.digest for a, b in zip(plain, h200)}
        assert changed == {dtype == "fp32"}
    with pytest.raises(ValueError, match="profile must be one of"):
        kernel_sources(rule, "fp32", profile="h900")
    assert render.device_profile(torch.device("cpu")) == ""
    assert clitools.DEVICE_PROFILES == tuple(sorted(render.LAUNCH_PROFILES))
    variant = clitools.variants(rule, [("fp32", None)], profile="h200")[0]
    assert [s.digest for s in clitools.kernel_sources(rule, variant)] == [
        s.digest for s in kernel_sources(rule, "fp32", profile="h200")
    ]


@pytest.mark.parametrize("launch_shape", LAUNCH_SHAPES, indirect=True)
def test_lamb_matches_the_paper_for_every_launch_shape(device, launch_shape):
    params = [torch.randn(s, device=device) for s in SHAPES]
    start = [p.clone() for p in params]
    opt = fuser.optim.LAMB(params, lr=0.05, weight_decay=0.1)
    grads = fresh(params, 2)
    for gs in grads:
        set_grads(params, gs)
        opt.step()
    for i, p in enumerate(params):
        want, state = lamb_reference(start[i], [gs[i] for gs in grads], 0.05, 0.9, 0.999, 1e-6, 0.1)
        assert_fp32_close(p, want, f"p of shape {SHAPES[i]}")
        for k, v in state.items():
            assert_fp32_close(opt.state[p][k], v, k)


@pytest.mark.parametrize("launch_shape", LAUNCH_SHAPES, indirect=True)
def test_sum_mean_and_amax_span_passes_and_blocks(device, launch_shape):
    params = [torch.randn(s, device=device) for s in SHAPES]
    grads = [torch.randn(s, device=device) for s in SHAPES]
    # the largest magnitude in the middle of the last pass of the 700-element tensor
    grads[4][650] = 40.0
    check_centered_step(params, grads)


Q8_KEYS = ("exp_avg", "exp_avg_absmax", "exp_avg_sq", "exp_avg_sq_absmax")


def _q8_run(device, seed):
    gen = torch.Generator().manual_seed(seed)
    params = [(torch.randn(s, generator=gen) * 0.02).bfloat16().to(device) for s in SHAPES]
    grads = [[(torch.randn(s, generator=gen) * 1e-3).bfloat16().to(device) for s in SHAPES] for _ in range(2)]
    opt = fuser.optim.AdamW(params, lr=1e-2, weight_decay=0.01, state_dtype="q8")
    for gs in grads:
        set_grads(params, gs)
        opt.step()
    return [(p.cpu(), *(opt.state[p][k].cpu() for k in Q8_KEYS)) for p in params]


def test_8bit_codes_and_scales_do_not_depend_on_the_launch_shape(device, monkeypatch):
    seed = int(torch.randint(0, 2**31, ()).item())
    runs = {}
    for shape in [(256, 128), (512, 256), None]:
        monkeypatch.delenv("FUSER_OPTIM_BLOCK", raising=False)
        monkeypatch.delenv("FUSER_OPTIM_SUB", raising=False)
        if shape is not None:
            monkeypatch.setenv("FUSER_OPTIM_BLOCK", str(shape[0]))
            monkeypatch.setenv("FUSER_OPTIM_SUB", str(shape[1]))
        runs[shape] = _q8_run(device, seed)
    for shape, run in runs.items():
        for i, (got, want) in enumerate(zip(run, runs[None])):
            for name, a, b in zip(
                ("p", "exp_avg", "exp_avg_absmax", "exp_avg_sq", "exp_avg_sq_absmax"), got, want
            ):
                assert torch.equal(a, b), f"{name} of shape {SHAPES[i]} differs with (BLOCK, SUB) = {shape}"


@pytest.mark.parametrize(
    "env, message",
    [
        (dict(FUSER_OPTIM_SUB="100"), "FUSER_OPTIM_SUB must be a power of two from 128 to BLOCK"),
        (dict(FUSER_OPTIM_BLOCK="256", FUSER_OPTIM_SUB="512"), "from 128 to BLOCK (256), not 512"),
        (dict(FUSER_OPTIM_BLOCK="3000"), "FUSER_OPTIM_BLOCK must be a power of two"),
        (dict(FUSER_OPTIM_MAXNREG="16"), "FUSER_OPTIM_MAXNREG must be 0 or a count from 24 to 255"),
        (dict(FUSER_OPTIM_MAXNREG="lots"), "FUSER_OPTIM_MAXNREG must be 0 or a count from 24 to 255"),
    ],
)
def test_a_bad_launch_shape_is_refused_with_its_variable(device, monkeypatch, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    p = torch.randn(5, device=device)
    p.grad = torch.randn(5, device=device)
    before = p.clone()
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        fuser.optim.AdamW([p], lr=0.1).step()
    assert torch.equal(p, before)


# (tile, tiles per strip): strips of several tiles, of tiles of few rows and many columns, and
# one tile per program. The defaults (8x128 tiles, 32 a strip; the slim phases' 4x128, 64) are
# test_shaped.py's: its axis-reduction and row/column-state tests run these rules there every run.
STRIPS = [("8x16", 3), ("4x32", 5), ("16x16", 1)]


@pytest.fixture
def strip_shape(request, monkeypatch):
    """Render tiled kernels with (FUSER_OPTIM_TILE, FUSER_OPTIM_STRIP) = request.param."""
    monkeypatch.setenv("FUSER_OPTIM_TILE", request.param[0])
    monkeypatch.setenv("FUSER_OPTIM_STRIP", str(request.param[1]))
    return request.param


def tiled_shapes(strip_shape) -> list[tuple[int, ...]]:
    """The smallest tensors that cross each edge of a strip of tiles of BR x BC: the
    interpreter's time goes by programs and by masked rows (one a loop pass)."""
    (br, bc), tk = (int(x) for x in strip_shape[0].split("x")), strip_shape[1]
    rows = br * tk  # a strip's
    return [
        (7, 13),  # less than a tile, columns unaligned (the masked path)
        (29,),  # one row (1-D)
        (3, 5, 4),  # the view [3, 20] (N-D)
        (1,),  # one element
        # aligned columns: a strip of TK whole tiles, then a partial strip of a whole tile and
        # a masked row; two whole column tiles
        (rows + br + 1, 2 * bc),
        # aligned columns: whole column tiles beside a partial one (masked), a whole tile and a
        # masked row (with one tile a strip: two strips)
        (br + 1, 2 * bc + 16),
        # unaligned columns, every row masked: two strips (the second one row)
        (rows + 1, 17),
        # one row across four column tiles, the last partial
        (2, 3 * bc + 8),
    ]


@pytest.mark.sweep(runs=3)  # one of the three strip shapes a run, all in 3 runs
@pytest.mark.parametrize("strip_shape", STRIPS, indirect=True)
def test_axis_reductions_span_the_tiles_of_a_strip(device, strip_shape):
    params, grads = shaped.params_and_grads(tiled_shapes(strip_shape), 2, device=device)
    mine, _ = shaped.run(fuser.compile(shaped.AXES), params, grads, lr=0.1)
    for p, start, g0, g1 in zip(mine, params, grads[0], grads[1]):
        want = shaped.axes_reference(shaped.axes_reference(start, g0, 0.1), g1, 0.1)
        assert shaped.rel_err(p, want, start) < 2e-6, (p.shape, strip_shape)


@pytest.mark.sweep(runs=3)  # one of the three strip shapes a run, all in 3 runs
@pytest.mark.parametrize("strip_shape", STRIPS, indirect=True)
def test_row_column_and_tensor_states_span_the_tiles_of_a_strip(device, strip_shape):
    params, grads = shaped.params_and_grads(tiled_shapes(strip_shape), 3, device=device)
    mine, opt = shaped.run(fuser.compile(shaped.FACTORED), params, grads)
    err = shaped.rel_err
    for p, (want, r, c, s) in zip(mine, shaped.factored_reference(params, grads)):
        st = opt.state[p]
        assert shaped.view(p).shape == (r.numel(), c.numel())
        assert err(p, want) < 2e-6, (p.shape, strip_shape)
        assert err(st["r"], r) < 2e-6 and err(st["c"], c) < 2e-6 and err(st["s"], s) < 2e-6


@pytest.mark.parametrize("text", ["0", "-2", "two"])
def test_a_bad_strip_is_refused_with_its_variable(device, monkeypatch, text):
    monkeypatch.setenv("FUSER_OPTIM_STRIP", text)
    p = torch.randn(3, 5, device=device)
    p.grad = torch.randn_like(p)
    before = p.clone()
    with pytest.raises(ValueError, match="FUSER_OPTIM_STRIP must be a whole number of tiles"):
        fuser.optim.Adafactor([p], lr=0.1).step()
    assert torch.equal(p, before)


def test_8bit_blocks_longer_than_a_pass_are_refused(device, monkeypatch):
    monkeypatch.setenv("FUSER_OPTIM_QBLOCK", "512")
    monkeypatch.setenv("FUSER_OPTIM_SUB", "256")
    p = torch.randn(700, device=device)
    p.grad = torch.randn_like(p)
    before = p.clone()
    with pytest.raises(
        ValueError, match=r"blocks of 512 elements \(FUSER_OPTIM_QBLOCK\) must fit in a pass of 256"
    ):
        fuser.optim.AdamW([p], lr=0.1, state_dtype="q8").step()
    assert torch.equal(p, before)


CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def _registers(cubin: Path) -> int:
    usage = subprocess.run(
        [str(CUOBJDUMP), "-res-usage", str(cubin)], capture_output=True, text=True, check=True
    )
    return int(re.search(r"REG:(\d+)", usage.stdout).group(1))


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="Triton's cuobjdump is not installed")
def test_8bit_step_kernels_compile_within_their_register_cap(monkeypatch):
    # The cap reaches ptxas (the binary holds no more registers than it), is part of the
    # kernel's key, and FUSER_OPTIM_MAXNREG=0 lifts it.
    options = dict(state_dtype="q8", master_weights="bf16+int8")
    monkeypatch.delenv("FUSER_OPTIM_MAXNREG", raising=False)
    (capped,) = kernel_sources(builtins.adamw, "bf16", **options)
    assert capped.max_registers == COMPRESSED_MAX_REGISTERS
    (plain,) = kernel_sources(builtins.adamw, "bf16")
    assert plain.max_registers == 0
    monkeypatch.setenv("FUSER_OPTIM_MAXNREG", "0")
    (lifted,) = kernel_sources(builtins.adamw, "bf16", **options)
    assert lifted.max_registers == 0 and lifted.text == capped.text
    assert entry_key(lifted).digest != entry_key(capped).digest
    (result,) = precompile([capped], ["cuda:90"])
    assert _registers(result.binary) <= COMPRESSED_MAX_REGISTERS


PACKED_SHIFT_KERNEL = Path(__file__).parent / "data" / "q8_step_packed_shift.triton"


@pytest.mark.skipif(triton.__version__ != "3.6.0", reason="the IR Triton 3.6's NVPTX backend miscompiles")
def test_a_step_kernel_that_triton_miscompiles_is_refused(monkeypatch):
    # The file is AdamW's 8-bit step kernel as fuser rendered it when its codes went
    # through float conversions, at 1024 elements a pass over 4 warps (32-element scale
    # blocks). There the per-thread offsets pass through a packed shift whose unused lane
    # (the thread index << 31) overflows into the used one: on an H100, "misaligned
    # address" at the codes' 8-byte loads. The compile refuses it for every target and
    # stores no binary (a second try compiles and refuses again). Today's rendering at
    # the same shape, and at 512 over 2 warps with 16-element blocks (the same IR then),
    # compiles.
    for sub, warps, qblock in ((512, 2, 16), (1024, 4, 32)):
        monkeypatch.setenv("FUSER_OPTIM_SUB", str(sub))
        monkeypatch.setenv("FUSER_OPTIM_WARPS", str(warps))
        monkeypatch.setenv("FUSER_OPTIM_QBLOCK", str(qblock))
        (source,) = kernel_sources(builtins.adamw, "bf16", state_dtype="q8")
        (result,) = precompile([source], ["cuda:90"])
        assert result.binary.exists()
    old = dataclasses.replace(source, text=PACKED_SHIFT_KERNEL.read_text())  # (1024 over 4: its signature)
    for target in ("cuda:80", "cuda:90", "cuda:90"):
        with pytest.raises(CompileError, match="packed shift of the thread index by 31 .* 128 threads"):
            precompile([old], [target])
