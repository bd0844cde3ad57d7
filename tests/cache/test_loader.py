"""Loading kernels: the interpreter path on CPU, and Triton's CompiledKernel built from
stored files (its launch needs a GPU: see test_gpu.py; fuser's own ctypes launcher:
test_launcher.py)."""

import json
import subprocess
import sys

import pytest
import torch
from cache_helpers import FakeCompiled, axpy, middle

import fuser
from fuser.cache import load_kernel, precompile
from fuser.cache.aot import CompileError, compile_spec, import_kernel
from fuser.cache.entries import ensure_binary, ensure_source
from fuser.cache.loader import compiled_kernel


def _delta(before: dict) -> dict:
    now = fuser.stats()
    return {k: now[k] - before.get(k, 0) for k in ("compiles", "cache_hits", "cache_misses", "launches")}


def _run_axpy(kernel, n: int, a: float):
    x, y = torch.randn(n), torch.randn(n)
    out = torch.full((n,), float("nan"))
    block = 128
    kernel(((n + block - 1) // block,), x, y, out, n, a)
    return out, (a * x.double() + y.double()).float()


def test_cpu_load_runs_and_counts(cache_root):
    before = fuser.stats()
    kernel = load_kernel(axpy(), "cpu")
    out, want = _run_axpy(kernel, 1000, -1.75)
    torch.testing.assert_close(out, want)
    assert _delta(before) == {"compiles": 1, "cache_hits": 0, "cache_misses": 1, "launches": 1}
    assert load_kernel(axpy(), "cpu") is kernel  # remembered in the process: no new counts
    assert _delta(before)["compiles"] == 1


def test_precompiled_process_compiles_nothing(cache_root, subprocess_env):
    precompile([axpy()], ["cuda:90"])
    code = (
        "import torch, fuser\n"
        "from fuser.cache import load_kernel\n"
        "from cache_helpers import axpy\n"
        "k = load_kernel(axpy(), 'cpu')\n"
        "x = torch.arange(300.0); y = torch.ones(300); out = torch.zeros(300)\n"
        "k((3,), x, y, out, 300, 2.0)\n"
        "assert torch.equal(out, 2 * x + 1)\n"
        "print(fuser.stats()['compiles'], fuser.stats()['cache_hits'])\n"
    )
    res = subprocess.run([sys.executable, "-c", code], env=subprocess_env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["0", "1"]


def test_compiled_kernel_is_built_from_the_stored_files(cache_root):
    """What the GPU path hands Triton: checked here up to the first launch."""
    source = axpy(block=256)
    path, _ = ensure_source(source)
    fn = import_kernel(source, path, interpret=False)
    binary, hit = ensure_binary(source, "cuda:90", path)
    assert not hit
    kernel = compiled_kernel(source, fn, binary)
    assert kernel.asm["cubin"] == (binary.folder / binary.cubin).read_bytes()
    stored = json.loads((binary.folder / binary.metadata).read_text())
    assert kernel.metadata.target.arch == 90 == stored["target"]["arch"]
    assert kernel.name == source.entry
    assert kernel.metadata.num_warps == source.num_warps
    assert kernel.function is None  # nothing loaded onto a device yet
    # The launcher is generated from this signature: every parameter, constexprs included.
    assert kernel.src.signature == {"x": "*fp32", "y": "*fp32", "out": "*fp32", "n": "i32", "a": "fp32",
                                    "BLOCK": "constexpr"}  # fmt: skip
    assert kernel.src.constants == {(5,): 256}
    assert kernel.src.attrs == {}  # no divisibility assumptions: any pointer, any integer


def test_compile_spec_checks_the_declared_signature():
    source = axpy()
    spec = compile_spec(source, ["x", "y", "out", "n", "a", "BLOCK"])
    assert list(spec.signature) == ["x", "y", "out", "n", "a", "BLOCK"]
    assert spec.options == {"num_warps": 4, "num_stages": 1}
    with pytest.raises(CompileError, match="do not match"):
        compile_spec(source, ["x", "out", "y", "n", "a", "BLOCK"])
    with pytest.raises(CompileError, match="do not match"):
        compile_spec(source, ["x", "y", "out", "n", "BLOCK"])


def test_binary_kernel_launches_like_the_jit(cache_root, monkeypatch):
    """The call ``JITFunction.run`` makes: grid x, y, z, stream, function, packed metadata,
    launch metadata, the two hooks, then every parameter in order, constexprs included."""
    from triton import knobs

    from fuser.cache import loader

    source = middle()
    path, _ = ensure_source(source)
    fn = import_kernel(source, path, interpret=False)
    binary, _ = ensure_binary(source, "cuda:90", path)
    monkeypatch.setenv("FUSER_TRITON_LAUNCHER", "1")  # on a GPU host the ctypes launcher would take it
    fake = FakeCompiled()
    monkeypatch.setattr(loader, "compiled_kernel", lambda *a: fake)
    monkeypatch.setattr(loader.BinaryKernel, "_device_guard", lambda self, f, *a: f(*a))
    monkeypatch.setattr(loader, "current_stream", lambda index: 1000 + index)
    kernel = loader.BinaryKernel(source, fn, binary, device_index=1)
    before = fuser.stats()["launches"]
    x, out = torch.zeros(10), torch.zeros(10)
    kernel((5,), x, 10, out)
    kernel((2, 3), x, 7, out)
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    assert fake.calls[0] == (5, 1, 1, 1001, fake.function, (2, 1, 0), ("meta", (5, 1, 1), 1001, 5), *hooks,
                             x, 64, 10, 3, out)  # fmt: skip
    assert fake.calls[1][:3] == (2, 3, 1) and fake.calls[1][-5:] == (x, 64, 7, 3, out)
    assert fuser.stats()["launches"] - before == 2
    with pytest.raises(TypeError, match="takes 3 arguments"):
        kernel((1,), x, 10)


def test_interleaved_constexprs_compile_and_run_on_cpu(cache_root):
    (r,) = precompile([middle()], ["cuda:80"])
    assert r.binary.read_bytes()[:4] == b"\x7fELF"
    kernel = load_kernel(middle(), "cpu")
    x = torch.randn(100)
    out = torch.full((100,), float("nan"))
    kernel((2,), x, 100, out)
    torch.testing.assert_close(out, x * 3)


def test_triton_launcher_takes_the_arguments_we_pass(cache_root):
    """Generate the C launcher Triton builds on a GPU host (as ``CudaLauncher`` does) from the
    CompiledKernel we construct, and check that its argument format has one entry per
    parameter we pass, constexprs included, after Triton's fixed launch arguments."""
    import re

    from triton.backends.nvidia.driver import _BASE_ARGS_FORMAT, make_launcher

    source = middle()
    path, _ = ensure_source(source)
    fn = import_kernel(source, path, interpret=False)
    binary, _ = ensure_binary(source, "cuda:90", path)
    kernel = compiled_kernel(source, fn, binary)
    src = kernel.src
    constants = {((fn.arg_names.index(k),) if isinstance(k, str) else k): v for k, v in src.constants.items()}
    c_source = make_launcher(constants, dict(src.signature), kernel.metadata.tensordesc_meta)
    fmt = re.search(r'PyArg_ParseTuple\(args, "([^"]+)"', c_source).group(1)
    assert fmt.startswith(_BASE_ARGS_FORMAT)
    per_arg = fmt[len(_BASE_ARGS_FORMAT) :]
    # x, BLOCK, n, SCALE, out: pointers and constexprs are objects, n an int
    assert per_arg == "OOiOO"
