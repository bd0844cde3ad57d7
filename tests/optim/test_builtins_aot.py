"""Every built-in rule's kernel compiles ahead of time for sm_80 and sm_90 (no GPU needed):
the interpreter accepts code the compiler rejects, so running them on CPU is not enough."""

import pytest

import fuser
from fuser.cache import precompile
from fuser.optim import builtins
from fuser.optim.factory import kernel_sources

RULES = {name: rule for name, rule in vars(builtins).items() if isinstance(rule, fuser.Rule)}


@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(RULES))
def test_builtin_compiles_ahead_of_time(name, dtype, capability):
    for result in precompile(kernel_sources(RULES[name], dtype), [f"cuda:{capability}"]):
        cubin = result.binary.read_bytes()
        assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000
