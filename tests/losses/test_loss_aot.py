"""Every loss kernel compiles ahead of time for sm_80 and sm_90 on a machine with no GPU."""

import json

import pytest

import fuser
import fuser.losses
from fuser.cache import precompile

from .test_loss_values import USER_RULES

RULES = {r.name: r for r in fuser.losses.builtins.RULES}
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
    assert len(sources) >= 4 and ["make_tensor_descriptor" in s.text for s in grads] == descriptors
    for source in sources:
        cubin = compile_for(source, capability)
        assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000
