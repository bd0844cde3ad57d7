"""Every loss kernel compiles ahead of time for sm_80 and sm_90 on a machine with no GPU."""

import json
import subprocess
from pathlib import Path

import pytest
import triton

import fuser
import fuser.losses
from fuser.cache import precompile

from .test_loss_values import USER_RULES

# (the softcap's approx_tanh twins differ from their rules only in the tanh: the built-ins'
# precompile compiles every kernel of theirs; test_approx_tanh_is_one_instruction, below)
RULES = {r.name: r for r in fuser.losses.builtins.RULES if not r.name.endswith("_approx")}
RULES["max_margin"] = fuser.loss(USER_RULES["max_margin"][0], name="max_margin")
RULES["nested"] = fuser.loss(USER_RULES["nested"][0], name="nested")


# Shared memory a block may opt into: A100 (sm_80), H100 (sm_90).
SHARED_LIMIT = {80: 166912, 90: 232448}


def compile_for(source, capability):
    """The cubin of ``source``, compiled the way fuser precompiles and loads kernels; its
    shared memory must fit the target's GPUs."""
    (result,) = precompile([source], [f"cuda:{capability}"])
    metadata = json.loads(result.binary.with_suffix(".json").read_text())
    assert metadata["shared"] <= SHARED_LIMIT[capability], (
        source.entry,
        metadata["shared"],
    )
    return result.binary.read_bytes()


# Rules a user writes: a max (its argmax's gradient) and reductions nested two deep. The
# built-in losses' kernels compile in tests/cache/test_precompile_builtins.py (fp32, bf16 and
# fp16, both targets, every variant, with the same shared-memory check), once a sweep.
# (one of the eight cases a run: tests/README.md, sweeps)
@pytest.mark.sweep(runs=8)
@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("name", ["max_margin", "nested"])
def test_loss_kernel_compiles_ahead_of_time(name, dtype, capability):
    for source in fuser.losses.kernel_sources(RULES[name], dtype):
        cubin = compile_for(source, capability)
        assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000


@pytest.mark.sweep(runs=6)  # one of the six cases a run, all in 6 runs
@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize(
    "name, descriptors",
    [
        ("cross_entropy_full", [False, True]),
        ("entropy_regularized_cross_entropy", [False, True]),
        ("max_margin", [False]),  # its gradient kernel keeps pointer loads (a max, not only exp)
    ],
)
def test_vocab_parallel_kernels_compile_ahead_of_time(name, descriptors, capability):
    sources = fuser.losses.kernel_sources(RULES[name], "bf16", vocab_parallel=True)
    # a sweep per reduction pass, then the loss and gradient; the same in matmul kernels,
    # the gradient kernel without and, where the rule's gradient calls only exp, with tensor
    # descriptors
    grads = [s for s in sources if "_mm_grad" in s.entry]
    # (and the one through descriptors once more, warp-specialised)
    descriptors = descriptors + [True] * descriptors[-1]
    assert len(sources) >= 4 and ["make_tensor_descriptor" in s.text for s in grads] == descriptors
    for source in sources:
        cubin = compile_for(source, capability)
        assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000


def test_warp_specialized_kernels_split_into_three_warp_groups():
    # sm_90 takes the warp-specialised programs (the lean gradient kernel's, the lean
    # forward's tile sums and the scaled kernel's at small H, 4 warps asked): a producer warp
    # group issuing the loads and two consumers, 12 warps a program; Triton leaves a loop it
    # cannot split as it was
    every = fuser.losses.kernel_sources(fuser.losses.CROSS_ENTROPY, "bf16")
    sources = [s for s in every if "warp_specialize=True" in s.text]
    assert [s.entry.removeprefix("cross_entropy_loss_rows") for s in sources] == [
        "_mm_grad_tma",
        "_mm_tile_sums_tma",
        "_mm_scaled_tma",
    ]
    # a softcap's scaled kernel in [128, 128] tiles (its gradient kernel keeps pointer loads;
    # with the exact tanh its lean forward keeps the sweep); with approx_tanh, its tile sums
    # in [128, 256]
    softcap = fuser.losses.kernel_sources(fuser.losses.SOFTCAP_CROSS_ENTROPY_UNSMOOTHED, "bf16")
    sources += [s for s in softcap if "warp_specialize=True" in s.text]
    approx = fuser.losses.kernel_sources(fuser.losses.SOFTCAP_CROSS_ENTROPY_UNSMOOTHED_APPROX, "bf16")
    sources += [s for s in approx if "warp_specialize=True" in s.text and "_tile_sums" in s.entry]
    assert [dict(s.constexprs)["BN"] for s in sources[3:]] == [128, 256]
    for source in sources:
        assert source.num_warps == 4
        compile_for(source, 90)
        (result,) = precompile([source], ["cuda:90"])
        assert json.loads(result.binary.with_suffix(".json").read_text())["num_warps"] == 12, source.entry


def sass(cubin: bytes, tmp_path) -> str:
    """The machine code of ``cubin``, through the disassembler Triton ships."""
    path = tmp_path / "kernel.cubin"
    path.write_bytes(cubin)
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    return subprocess.run([str(tool), str(path)], capture_output=True, text=True, check=True).stdout


# (13 compiles of 0.6-3 s each; one target and one half a run, the lean schedule's kernels
# or the scaled ones, each with its exact twins: all in 4 runs)
@pytest.mark.sweep(runs=4)
@pytest.mark.parametrize("half", ["lean", "scaled"])
@pytest.mark.parametrize("capability", [80, 90])
def test_approx_tanh_is_one_instruction(capability, half, tmp_path):
    # the softcap's kernels with approx_tanh run the special-function unit's tanh (MUFU.TANH)
    # where the exact rule's compute it from an exponential: the lean schedule's sweep and
    # gradient kernels (the twin's also through descriptors, its epilogue a half tile at a
    # time: WIDE_GRAD_TMA_SUBTILE), the lean forward's tile sums through descriptors (and
    # warp-specialised; the exact rule keeps its sweep: tile_sums_pay) and the scaled kernel,
    # with pointers and descriptors (and the latter warp-specialised)
    def kernels(rule):
        return [s for s in fuser.losses.kernel_sources(rule, "bf16") if "_mm" in s.entry]

    approx = kernels(fuser.losses.SOFTCAP_CROSS_ENTROPY_UNSMOOTHED_APPROX)
    exact = kernels(fuser.losses.SOFTCAP_CROSS_ENTROPY_UNSMOOTHED)
    assert [s.entry.removeprefix("softcap_cross_entropy_unsmoothed_approx") for s in approx] == [
        "_loss_rows_mm0",
        "_loss_rows_mm_grad",
        "_loss_rows_mm_grad_tma",
        "_loss_rows_mm_tile_sums_tma",
        "_loss_rows_mm_tile_sums_tma",  # (warp-specialised)
        "_loss_rows_mm_scaled",
        "_loss_rows_mm_scaled_tma",
        "_loss_rows_mm_scaled_tma",  # (warp-specialised)
    ]
    assert "half_1" in approx[2].text and "block_shape=[BM, BN // 2]" in approx[2].text
    assert len(exact) == 5  # (its gradient kernel keeps pointer loads)
    # (the lean schedule's sweep, gradient and tile-sums kernels, then the scaled ones)
    approx, exact = (approx[:5], exact[:2]) if half == "lean" else (approx[5:], exact[2:])
    for a in approx:
        # (every kernel carries the helpers' definitions; only the twin's calls it)
        assert a.text.count("_approx_tanh(") > 1
        assert "MUFU.TANH" in sass(compile_for(a, capability), tmp_path), a.entry
    for e in exact:
        assert e.text.count("_approx_tanh(") == 1
        assert "MUFU.TANH" not in sass(compile_for(e, capability), tmp_path), e.entry
