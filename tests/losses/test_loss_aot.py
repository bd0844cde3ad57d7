"""Every loss kernel compiles ahead of time for sm_80 and sm_90 on a machine with no GPU."""

import pytest

import fuser
import fuser.losses
from fuser.cache import precompile

from .test_loss_values import USER_RULES

RULES = {r.name: r for r in fuser.losses.builtins.RULES}
RULES["max_margin"] = fuser.loss(USER_RULES["max_margin"][0], name="max_margin")
RULES["nested"] = fuser.loss(USER_RULES["nested"][0], name="nested")


def compile_for(source, capability):
    """The cubin of ``source``, compiled the way fuser precompiles and loads kernels."""
    (result,) = precompile([source], [f"cuda:{capability}"])
    return result.binary.read_bytes()


@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("name", sorted(RULES))
def test_loss_kernel_compiles_ahead_of_time(name, dtype, capability):
    for source in fuser.losses.kernel_sources(RULES[name], dtype):
        cubin = compile_for(source, capability)
        assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000


@pytest.mark.parametrize("capability", [80, 90])
def test_fp16_cross_entropy_compiles(capability):
    for source in fuser.losses.kernel_sources(fuser.losses.CROSS_ENTROPY, "fp16"):
        cubin = compile_for(source, capability)
        assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000


@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("name", ["cross_entropy_full", "entropy_regularized_cross_entropy", "max_margin"])
def test_vocab_parallel_kernels_compile_ahead_of_time(name, capability):
    sources = fuser.losses.kernel_sources(RULES[name], "bf16", vocab_parallel=True)
    # a sweep per reduction pass, then the loss and gradient; the same in matmul kernels
    assert len(sources) >= 4 and sum(s.entry.endswith("_mm_grad") for s in sources) == 1
    for source in sources:
        cubin = compile_for(source, capability)
        assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000
