"""Decision 6 on a real GPU: stored binaries are loaded and launched with no compilation
(through ``fuser.cache.launcher``: see test_gpu_launcher.py); a miss compiles once,
stores, and loads from the store."""

import subprocess
import sys

import pytest
from cache_helpers import axpy

pytestmark = pytest.mark.gpu

# Run in a fresh process where any call to Triton's compiler fails loudly.
NO_COMPILE = """
import triton, triton.compiler, triton.compiler.compiler as cc
def _boom(*a, **k):
    raise AssertionError("triton.compile was called")
triton.compile = triton.compiler.compile = cc.compile = _boom
"""

AXPY_CHECKS = """
import torch, fuser
from fuser.cache import load_kernel
from cache_helpers import axpy
k = load_kernel(axpy(), "cuda")
assert type(k).__name__ == "BinaryKernel", type(k)
assert k.direct is not None, k.fallback  # launched by fuser.cache.launcher
for n, offset in ((1000, 0), (1, 0), (4099, 1), (129, 3)):
    # offset: pointers that are not 16-byte aligned; n == 1: an integer Triton's JIT would specialize
    x = torch.randn(n + offset, device="cuda")[offset:]
    y = torch.randn(n + offset, device="cuda")[offset:]
    out = torch.full((n + offset,), float("nan"), device="cuda")[offset:]
    k(((n + 127) // 128,), x, y, out, n, 0.5)
    torch.testing.assert_close(out, (0.5 * x.double() + y.double()).float())
s = fuser.stats()
print(s["compiles"], s["cache_hits"], s["launches"])
"""


def _target():
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"cuda:{major}{minor}"


def _run(code, env):
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return res.stdout.split()


def test_precompiled_binary_launches_without_compiling(cache_root, subprocess_env):
    from fuser.cache import precompile

    (r,) = precompile([axpy()], [_target()])  # the CPU-side path, here on the GPU host
    assert r.status == "compiled"
    compiles, hits, launches = _run(NO_COMPILE + AXPY_CHECKS, subprocess_env)
    assert (compiles, hits, launches) == ("0", "1", "4")


def test_miss_compiles_once_then_hits(cache_root, subprocess_env):
    compiles, hits, _ = _run(AXPY_CHECKS, subprocess_env)
    assert (compiles, hits) == ("1", "0")
    assert len(list(cache_root.rglob("*.cubin"))) == 1
    compiles, hits, _ = _run(NO_COMPILE + AXPY_CHECKS, subprocess_env)
    assert (compiles, hits) == ("0", "1")


def test_second_device(cache_root):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from fuser.cache import load_kernel

    k0, k1 = load_kernel(axpy(), "cuda:0"), load_kernel(axpy(), "cuda:1")
    assert k0 is not k1
    x, y = torch.randn(777, device="cuda:1"), torch.randn(777, device="cuda:1")
    out = torch.empty_like(x)
    with torch.cuda.device(0):
        k1(((777 + 127) // 128,), x, y, out, 777, 2.0)
    torch.testing.assert_close(out, 2.0 * x + y)


ADAMW = """
import os, torch, fuser
import fuser.optim
torch.manual_seed(int(os.environ["FUSER_TEST_CASE_SEED"]))  # the test's seed (tests/seeds.py)
params = [torch.randn(s, device="cuda") for s in ((64, 33), (33,), (7, 5, 3))]
ref = [p.clone().requires_grad_() for p in params]
mine = [p.clone().requires_grad_() for p in params]
opt = fuser.optim.AdamW(mine, lr=1e-2, weight_decay=0.1)
ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
for _ in range(3):
    for a, b in zip(mine, ref):
        g = torch.randn_like(a)
        a.grad, b.grad = g.clone(), g.clone()
    opt.step(); ref_opt.step()
for a, b in zip(mine, ref):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
print(fuser.stats()["compiles"])
"""


def test_builtin_adamw_from_a_precompiled_cache_compiles_nothing(cache_root, subprocess_env):
    # (with this GPU's launch profile where it has one, as docs/cache.md says to precompile)
    import torch

    from fuser import cli
    from fuser.codegen.render import device_profile

    profile = device_profile(torch.device("cuda"))
    flags = ["--device-profile", profile] if profile else []
    assert cli.main(["precompile", "--builtins", "--target", _target(), "--dtype", "fp32", *flags]) == 0
    assert _run(NO_COMPILE + ADAMW, subprocess_env) == ["0"]
