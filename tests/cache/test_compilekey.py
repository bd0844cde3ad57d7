"""fuser's compiles skip ``triton_key()``; nobody else's do, and nothing on the compile
path reaches Triton's driver (which on a GPU host builds ``cuda_utils`` with gcc)."""

import json
import threading

import pytest
from cache_helpers import axpy, mixed

from fuser.cache import aot
from fuser.cache.aot import compile_function, import_kernel, triton_is_interpreted
from fuser.cache.compilekey import cheap_cache_key
from fuser.cache.entries import ensure_source


class Src:
    """An ``ASTSource`` as the key function sees one."""


class Hashable:
    def __init__(self, h):
        self.h = h

    def hash(self):
        return self.h


@pytest.fixture
def triton_keys(monkeypatch):
    """Triton's ``get_cache_key`` replaced by one that records the sources it keys."""
    import triton.compiler.compiler as compiler

    seen = []

    def original(src, backend, options, env_vars):
        seen.append(src)
        return "triton-key"

    monkeypatch.setattr(compiler, "get_cache_key", original)
    return compiler, original, seen


ARGS = (Hashable("backend-hash"), Hashable("options-hash"), {"TRITON_X": "1"})


def test_only_the_named_source_gets_the_cheap_key(triton_keys):
    import triton

    compiler, original, seen = triton_keys
    ours, theirs = Src(), Src()
    with cheap_cache_key(ours, "fuser-digest"):
        assert compiler.get_cache_key is not original
        key = compiler.get_cache_key(ours, *ARGS)
        assert compiler.get_cache_key(theirs, *ARGS) == "triton-key"
    assert key == f"fuser-{triton.__version__}-fuser-digest-backend-hash-options-hash-[('TRITON_X', '1')]"
    assert seen == [theirs]
    assert compiler.get_cache_key is original
    assert compiler.get_cache_key(ours, *ARGS) == "triton-key"  # after the block: Triton's again


def test_restored_after_an_exception(triton_keys):
    compiler, original, _ = triton_keys
    with pytest.raises(KeyError), cheap_cache_key(Src(), "k"):
        raise KeyError("a compile error")
    assert compiler.get_cache_key is original


def test_overlapping_threads(triton_keys):
    """Wrapped while any thread is inside, restored when the last one leaves; each thread's
    source keeps its own key."""
    compiler, original, _ = triton_keys
    a, b = Src(), Src()
    inside, release = threading.Event(), threading.Event()
    keys = {}

    def other():
        with cheap_cache_key(b, "key-b"):
            inside.set()
            release.wait(10)
            keys["b"] = compiler.get_cache_key(b, *ARGS)

    t = threading.Thread(target=other)
    with cheap_cache_key(a, "key-a"):
        t.start()
        assert inside.wait(10)
        keys["a"] = compiler.get_cache_key(a, *ARGS)
    assert compiler.get_cache_key is not original  # the other thread is still compiling
    release.set()
    t.join(10)
    assert compiler.get_cache_key is original
    assert "key-a" in keys["a"] and "key-b" in keys["b"]


def test_a_replacement_made_meanwhile_is_kept(triton_keys):
    compiler, _, _ = triton_keys

    def someone_elses(*a):
        return "theirs"

    with cheap_cache_key(Src(), "k"):
        compiler.get_cache_key = someone_elses
    assert compiler.get_cache_key is someone_elses


needs_compiler = pytest.mark.skipif(
    triton_is_interpreted(), reason="Triton's compiler needs TRITON_INTERPRET unset"
)


def _compile(source, target="cuda:90"):
    path, _ = ensure_source(source)
    return compile_function(source, import_kernel(source, path, interpret=False), target)


@needs_compiler
@pytest.mark.parametrize("target", ["cuda:80", "cuda:90"])
def test_same_binary_as_with_tritons_key(cache_root, monkeypatch, target):
    """The key names the entry in a throwaway folder; the cubin does not depend on it."""
    import contextlib

    import triton.runtime.cache as cache

    def no_triton_key():
        raise AssertionError("triton_key() was computed")

    with monkeypatch.context() as m:
        m.setattr(cache, "triton_key", no_triton_key)
        cubin, metadata = _compile(axpy(), target)
    monkeypatch.setattr(aot, "cheap_cache_key", lambda src, key: contextlib.nullcontext())
    cubin_triton, metadata_triton = _compile(axpy(), target)
    assert cubin == cubin_triton
    ours, theirs = json.loads(metadata), json.loads(metadata_triton)
    assert ours.pop("hash") != theirs.pop("hash")
    assert ours == theirs


@needs_compiler
def test_compiling_never_reaches_tritons_driver(cache_root, monkeypatch):
    """With the target given, ``triton.compile`` needs no device: on a GPU host, touching
    ``driver.active`` would build ``cuda_utils`` with gcc (and on a CPU host it raises,
    which ``tl.target_info`` would hide)."""
    import triton.backends.nvidia.driver as nvidia_driver
    import triton.runtime.build as build
    from triton.runtime.driver import DriverConfig

    import fuser
    from fuser.clitools import Variant, kernel_sources
    from fuser.losses import builtins as losses
    from fuser.optim.builtins import adam

    touched = []

    def record(what):
        def fn(*a, **k):
            touched.append(what)
            raise RuntimeError(f"{what} was called")

        return fn

    monkeypatch.setattr(DriverConfig, "active", property(record("driver.active")))
    monkeypatch.setattr(DriverConfig, "default", property(record("driver.default")))
    monkeypatch.setattr(build, "compile_module_from_src", record("compile_module_from_src"))
    monkeypatch.setattr(nvidia_driver, "compile_module_from_src", record("compile_module_from_src"))
    loss = next(v for v in vars(losses).values() if isinstance(v, fuser.Rule))
    sources = [
        mixed(),
        *kernel_sources(adam, Variant("bf16")),
        *kernel_sources(loss, Variant("bf16"))[:1],
    ]
    for source in sources:
        _compile(source)
    assert touched == []


PACKED = """
  %7 = tail call i32 @llvm.nvvm.read.ptx.sreg.tid.x(), !dbg !9
  %8 = and i32 %7, 127, !dbg !9
  %9 = insertelement <2 x i32> poison, i32 %7, i64 0, !dbg !9
  %10 = insertelement <2 x i32> %9, i32 %8, i64 1, !dbg !9
  %11 = shl nuw nsw <2 x i32> %10, <i32 {shift}, i32 3>, !dbg !9
"""


@pytest.mark.parametrize(
    "shift, threads, flagged",
    [(31, 128, True), (31, 64, True), (26, 128, True), (25, 128, False), (15, 64, False), (63, 128, False)],
)
def test_a_packed_shift_of_the_thread_index_that_overflows_is_named(shift, threads, flagged):
    # (threads - 1) << shift past 32 bits: the NVPTX lowering of the pair as one 64-bit
    # value carries it into the other lane. A shift of 32 or more is poison that the
    # backend drops (no wrong lane), and a shift that fits leaves the other lane alone.
    why = aot.packed_thread_shift(PACKED.format(shift=shift), threads)
    assert bool(why) == flagged
    if flagged:
        assert f"by {shift} overflows 32 bits for {threads} threads" in why


def test_a_packed_shift_of_a_masked_index_is_named_and_of_another_value_is_not():
    masked = PACKED.replace("i32 %7, i64 0", "i32 %8, i64 0").format(shift=26)
    assert "by 26 overflows 32 bits for 1024 threads" in aot.packed_thread_shift(masked, 1024)  # (%8 <= 127)
    assert aot.packed_thread_shift(masked.replace("and i32 %7, 127", "and i32 %7, 63"), 1024) == ""
    argument = PACKED.replace("i32 %7, i64 0", "i32 %0, i64 0").format(shift=31)
    assert aot.packed_thread_shift(argument, 128) == ""  # (a value of unknown range)
    assert aot.packed_thread_shift(PACKED.format(shift=31).replace(" nuw nsw", ""), 128) == ""
