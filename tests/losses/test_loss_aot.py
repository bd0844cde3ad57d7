"""Every loss kernel compiles ahead of time for sm_80 and sm_90 on a machine with no GPU."""

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import fuser
import fuser.losses
from fuser.cache import load_kernel

from .test_loss_values import USER_RULES

RULES = {r.name: r for r in fuser.losses.builtins.RULES}
RULES["max_margin"] = fuser.loss(USER_RULES["max_margin"][0], name="max_margin")
RULES["nested"] = fuser.loss(USER_RULES["nested"][0], name="nested")


def compile_for(source, capability):
    signature = dict(source.signature)
    signature.update({k: "constexpr" for k, _ in source.constexprs})
    return triton.compile(ASTSource(fn=load_kernel(source, "cuda").fn, signature=signature,
                                    constexprs=dict(source.constexprs)),
                          target=GPUTarget("cuda", capability, 32),
                          options=dict(num_warps=source.num_warps, num_stages=source.num_stages))


@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("name", sorted(RULES))
def test_loss_kernel_compiles_ahead_of_time(name, dtype, capability):
    for source in fuser.losses.kernel_sources(RULES[name], dtype):
        assert len(compile_for(source, capability).asm["cubin"]) > 1000


@pytest.mark.parametrize("capability", [80, 90])
def test_fp16_cross_entropy_compiles(capability):
    (source,) = fuser.losses.kernel_sources(fuser.losses.CROSS_ENTROPY, "fp16")
    assert len(compile_for(source, capability).asm["cubin"]) > 1000
