"""Ahead-of-time compilation: a generated module's kernel -> cubin + Triton metadata.

``compile_spec`` is the one place that turns a ``KernelSource`` into what Triton's
compiler and launcher take (signature, constexprs, attrs, options); precompilation on a
CPU machine and compile-on-miss on a GPU both go through it, and so does the loader (it
checks the ``KernelSource`` signature that the ctypes launcher packs against the kernel's
parameters, and builds Triton's ``CompiledKernel`` from it where Triton launches), so the
binary and its launcher can never disagree about the arguments.

No ``tt.divisibility`` attributes are passed: the binary assumes nothing about the
alignment of pointers or the value of integers, so it is launchable with any arguments.
(Triton's JIT would specialize 16-byte-aligned pointers and integers equal to 1, which
makes its binaries valid only for arguments like the ones it first saw.) fuser's kernels
read tensor addresses from device tables, which no attribute could describe anyway.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from fuser.cache.compilekey import cheap_cache_key
from fuser.cache.errors import CompileError
from fuser.cache.keys import binary_key, gpu_target
from fuser.codegen.source import KernelSource


@dataclass(frozen=True)
class CompileSpec:
    """Arguments of ``ASTSource`` and ``triton.compile`` for one kernel."""

    signature: dict[str, str]  # every parameter in order; constexprs typed "constexpr"
    constexprs: dict[str, object]
    attrs: dict
    options: dict

    def ast_source(self, fn):
        from triton.compiler import ASTSource

        return ASTSource(fn, dict(self.signature), dict(self.constexprs), dict(self.attrs))


def compile_spec(source: KernelSource, arg_names: list[str]) -> CompileSpec:
    """The signature in parameter order (``arg_names`` from the ``JITFunction``)."""
    types = dict(source.signature)
    constexprs = dict(source.constexprs)
    runtime = [n for n in arg_names if n not in constexprs]
    if runtime != [n for n, _ in source.signature] or set(constexprs) - set(arg_names):
        raise CompileError(
            f"kernel {source.entry}: parameters {arg_names} do not match the declared signature "
            f"{[n for n, _ in source.signature]} + constexprs {list(constexprs)}"
        )
    signature = {n: ("constexpr" if n in constexprs else types[n]) for n in arg_names}
    options = {"num_warps": source.num_warps, "num_stages": source.num_stages}
    if source.max_registers:
        options["maxnreg"] = source.max_registers
    return CompileSpec(signature, constexprs, {}, options)


_imported: dict[tuple, object] = {}


def import_kernel(source: KernelSource, path: Path, *, interpret: bool):
    """Import the module at ``path`` and return its entry function: a ``JITFunction``, or
    with ``interpret`` the interpreter's function, whatever ``TRITON_INTERPRET`` says."""
    from triton import knobs

    memo = (str(path), source.entry, interpret)
    if memo in _imported:
        return _imported[memo]
    name = f"fuser_kernels.{path.parent.name[:16]}_{source.entry}{'_interpret' if interpret else ''}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    with knobs.runtime.scope():
        knobs.runtime.interpret = interpret
        spec.loader.exec_module(module)
    # Triton resolves helper functions through the module's globals; keep it reachable.
    sys.modules[name] = module
    _imported[memo] = fn = getattr(module, source.entry)
    return fn


def triton_is_interpreted() -> bool:
    """Whether Triton was imported with ``TRITON_INTERPRET=1``: its own library functions
    (``tl.sum``, ``tl.cdiv`` ...) are then interpreter objects that its compiler rejects."""
    import triton.language.standard as standard
    from triton.runtime.jit import JITFunction

    return not isinstance(standard.sum, JITFunction)


def compile_binary(source: KernelSource, path: Path, target: str) -> tuple[bytes, bytes]:
    """Compile the kernel whose source file is ``path`` for ``target``: (cubin, metadata
    JSON). In a process whose Triton runs in interpreter mode, a helper process compiles."""
    if triton_is_interpreted():
        from fuser.cache.worker import compile_in_worker

        return compile_in_worker(source, path, target)
    return compile_function(source, import_kernel(source, path, interpret=False), target)


def compile_function(source: KernelSource, fn, target: str) -> tuple[bytes, bytes]:
    """Compile ``fn`` (a ``JITFunction``) for ``target``: (cubin, metadata JSON).

    Triton's own file cache is pointed at a temporary folder for the call, so the result
    never comes from, or depends on, files outside fuser's store; within it the kernel is
    keyed by fuser's binary key (``compilekey``), sparing the hash of Triton's sources.
    The target is passed explicitly, so Triton never asks its driver for the device's.
    """
    import triton
    from triton import knobs

    spec = compile_spec(source, fn.arg_names)
    src = spec.ast_source(fn)
    key = binary_key(source, target).digest
    tmp_cache = tempfile.TemporaryDirectory(prefix="fuser-triton-")
    with tmp_cache as tmp, knobs.cache.scope(), cheap_cache_key(src, key):
        knobs.cache.dir = tmp
        try:
            compiled = triton.compile(src, target=gpu_target(target), options=spec.options)
        except Exception as e:  # noqa: BLE001 - Triton raises many types; all mean the same here
            raise CompileError(f"kernel {source.entry} does not compile for {target}: {_one_line(e)}") from e
        metadata = Path(compiled.metadata_group[f"{compiled.name}.json"]).read_bytes()
        binary = compiled.asm["cubin"]
        overflow = packed_thread_shift(compiled.asm.get("llir", ""), 32 * source.num_warps)
    if overflow:
        raise CompileError(
            f"kernel {source.entry} does not compile correctly for {target} with {source.num_warps} warps: "
            f"{overflow}; launch it in another shape (for a step kernel: FUSER_OPTIM_SUB, FUSER_OPTIM_WARPS "
            "or FUSER_OPTIM_QBLOCK)"
        )
    json.loads(metadata)  # a metadata file that does not parse must not reach the store
    return binary, metadata


_TID = re.compile(r"(%[\w.]+) = (?:tail )?call i32 @llvm\.nvvm\.read\.ptx\.sreg\.tid\.x\(\)")
_AND = re.compile(r"(%[\w.]+) = and i32 (%[\w.]+), (\d+)")
_LANE = re.compile(r"(%[\w.]+) = insertelement <2 x i32> (poison|%[\w.]+), i32 (%[\w.]+), i64 ([01])")
_SHL = re.compile(r"= shl nuw(?: nsw)? <2 x i32> (%[\w.]+), <i32 (\d+), i32 (\d+)>")


def packed_thread_shift(llir: str, threads: int) -> str:
    """Why a kernel's LLVM IR would be miscompiled by the NVPTX backend that Triton 3.6
    bundles, or ``""``: a ``shl nuw`` of two packed 32-bit lanes, one of them the thread
    index (or the index masked by ``and``) shifted so far that it overflows for the block's
    ``threads`` (a lane whose value is unused, so LLVM may leave it poison). The backend
    lowers the pair as one 64-bit value (``mul.wide.u32`` of the index, the other lane
    shifted into the high word), so the overflowing lane's high bits land in the other one:
    per-thread offsets come out wrong. On an H100 that read "misaligned address" at the
    8-byte loads of a step's 8-bit states with 1024 elements a pass over 4 warps (32-element
    scale blocks); the same IR comes with 512 over 2 warps and 16-element blocks."""
    if "shl nuw" not in llir:
        return ""
    largest = {name: threads - 1 for name in _TID.findall(llir)}  # of the index and its masks
    for name, value, mask in _AND.findall(llir):
        if value in largest:
            largest[name] = min(largest[value], int(mask))
    lanes: dict[str, list] = {}
    for name, prev, value, lane in _LANE.findall(llir):
        pair = list(lanes.get(prev, [None, None]))
        pair[int(lane)] = value
        lanes[name] = pair
    for vec, *shifts in _SHL.findall(llir):
        for value, shift in zip(lanes.get(vec, ()), shifts):
            if value in largest and int(shift) < 32 and largest[value] << int(shift) >= 1 << 32:
                return (
                    f"a packed shift of the thread index by {shift} overflows 32 bits for {threads} "
                    "threads, which this Triton's NVPTX backend lets into the other lane"
                )
    return ""


def _one_line(e: BaseException) -> str:
    """The most telling line of a compiler error (Triton's carry the source excerpt first)."""
    text = str(e).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    last = lines[-1]
    head = lines[0]
    return f"{type(e).__name__}: {head}" + (f" ... {last}" if last != head else "")
