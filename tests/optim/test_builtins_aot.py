"""Every built-in rule's kernel compiles ahead of time for sm_80 and sm_90 (no GPU needed):
the interpreter accepts code the compiler rejects, so running them on CPU is not enough."""

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import fuser
from fuser.cache import load_kernel
from fuser.optim import builtins
from fuser.optim.factory import kernel_sources

RULES = {name: rule for name, rule in vars(builtins).items() if isinstance(rule, fuser.Rule)}


@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(RULES))
def test_builtin_compiles_ahead_of_time(name, dtype, capability):
    for source in kernel_sources(RULES[name], dtype):
        signature = dict(source.signature)
        signature.update({k: "constexpr" for k, _ in source.constexprs})
        compiled = triton.compile(ASTSource(fn=load_kernel(source, "cuda").fn, signature=signature,
                                            constexprs=dict(source.constexprs)),
                                  target=GPUTarget("cuda", capability, 32),
                                  options=dict(num_warps=source.num_warps, num_stages=source.num_stages))
        assert len(compiled.asm["cubin"]) > 1000
