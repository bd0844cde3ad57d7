"""``load_kernel``: a launchable kernel for a ``KernelSource`` on a device.

- CPU tensors (or ``TRITON_INTERPRET=1``): the entry's source file is imported with
  Triton's interpreter on.
- CUDA: the entry's binary for the device's target (``cuda:90`` on an H100) is loaded as
  a ``triton.compiler.CompiledKernel`` from the stored cubin and metadata JSON and
  launched directly, with no compilation. On a miss it is compiled first (under the key's
  lock) and stored, then loaded from the store like any other.

Counters: ``cache_hits`` when the kernel came from disk, ``cache_misses`` and
``compiles`` when this process had to write (interpreter) or compile (GPU) it,
``launches`` on every launch.
"""

from __future__ import annotations

import threading

from fuser.cache.aot import compile_spec, import_kernel
from fuser.cache.entries import ensure_binary, ensure_source
from fuser.codegen.source import KernelSource
from fuser.log import logger
from fuser.runtime import stats

_loaded: dict[tuple, object] = {}
_lock = threading.RLock()


class JitKernel:
    """A generated kernel run through Triton's JIT (and its interpreter on CPU)."""

    def __init__(self, source: KernelSource, fn, interpret: bool):
        self.source = source
        self.fn = fn
        self._names = [n for n, _ in source.signature]
        self._options = dict(source.constexprs, num_warps=source.num_warps, num_stages=source.num_stages)
        if "INTERPRETED" in self._options:
            self._options["INTERPRETED"] = interpret

    def __call__(self, grid: tuple[int, ...], *args) -> None:
        if len(args) != len(self._names):
            raise TypeError(f"{self.source.entry} takes {len(self._names)} arguments, got {len(args)}")
        # By name: constexprs may sit between runtime parameters.
        self.fn[grid](**dict(zip(self._names, args)), **self._options)
        stats.count("launches")


class BinaryKernel:
    """A stored binary loaded as Triton's ``CompiledKernel``, launched with no compilation.

    The launch is what ``JITFunction.run`` does after its cache lookup: every parameter
    in order (constexpr values included; the C launcher skips them) after the grid, the
    stream, the function handle, the packed metadata and the launch hooks.
    """

    def __init__(self, source: KernelSource, fn, binary, device_index: int):
        from triton import knobs

        self._knobs = knobs
        spec = compile_spec(source, fn.arg_names)
        self.source = source
        self.target = binary.target
        self.device_index = device_index
        self.kernel = compiled_kernel(source, fn, binary)
        # Parameter order with each runtime argument's position, constexprs filled in.
        self._template = [spec.constexprs.get(n) for n in fn.arg_names]
        self._slots = [i for i, n in enumerate(fn.arg_names) if n not in spec.constexprs]
        self._device_guard(self._load)

    def _load(self) -> None:
        self.kernel.run  # noqa: B018 - loads the cubin onto the current device, builds the launcher

    def _device_guard(self, fn, *args):
        import torch

        if torch.cuda.current_device() == self.device_index:
            return fn(*args)
        with torch.cuda.device(self.device_index):
            return fn(*args)

    def __call__(self, grid: tuple[int, ...], *args) -> None:
        if len(args) != len(self._slots):
            raise TypeError(f"{self.source.entry} takes {len(self._slots)} arguments, got {len(args)}")
        self._device_guard(self._launch, grid, args)
        stats.count("launches")

    def _launch(self, grid, args) -> None:
        knobs = self._knobs
        full = list(self._template)
        for i, a in zip(self._slots, args):
            full[i] = a
        g = (*grid, 1, 1)
        k = self.kernel
        run = k.run
        stream = current_stream(self.device_index)
        launch_metadata = k.launch_metadata(g[:3], stream, *full)
        run(g[0], g[1], g[2], stream, k.function, k.packed_metadata, launch_metadata,
            knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *full)  # fmt: skip


def current_stream(device_index: int):
    """The raw handle of the current CUDA stream of a device, as Triton's JIT passes it."""
    from triton.runtime.driver import driver

    return driver.active.get_current_stream(device_index)


def compiled_kernel(source: KernelSource, fn, binary):
    """Triton's ``CompiledKernel`` of a stored binary: the ``(src, metadata_group, hash)``
    that ``triton.compile`` itself returns, with the group naming fuser's own files. Nothing
    touches a device until its first launch."""
    from triton.compiler import CompiledKernel

    spec = compile_spec(source, fn.arg_names)
    group = {name: str(binary.folder / name) for name in (binary.metadata, binary.cubin)}
    return CompiledKernel(spec.ast_source(fn), group, binary.key)


def device_target(device) -> str | None:
    """``cuda:<cc>`` of a CUDA device, ``None`` where fuser stores no binaries (ROCm)."""
    import torch

    if torch.version.hip:
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return f"cuda:{major}{minor}"


def load_kernel(source: KernelSource, device="cuda"):
    """The launchable kernel for ``source`` on ``device``: ``kernel(grid, *args)`` launches
    it with the runtime arguments of ``source.signature`` and counts one launch.

    CPU devices run through Triton's interpreter, whatever ``TRITON_INTERPRET`` says, so CPU
    and GPU kernels can live in one process.
    """
    import torch
    from triton import knobs

    device = torch.device(device)
    interpret = device.type == "cpu" or bool(knobs.runtime.interpret)
    if device.type == "cuda" and not interpret:
        if not torch.cuda.is_available():
            raise RuntimeError(f"cannot load {source.entry} on {device}: no CUDA device here (CPU tensors "
                               "run through Triton's interpreter; fuser.cache.precompile compiles for "
                               "GPUs without one)")  # fmt: skip
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    memo = (source.digest, "interpret" if interpret else str(device))
    kernel = _loaded.get(memo)
    if kernel is not None:
        return kernel
    with _lock:
        kernel = _loaded.get(memo)
        if kernel is None:
            kernel = _load(source, device, interpret)
            _loaded[memo] = kernel
    return kernel


def _load(source: KernelSource, device, interpret: bool):
    path, hit = ensure_source(source)
    target = None if interpret else device_target(device)
    if target is None:
        # Interpreter: the source is the whole entry. ROCm: Triton's JIT compiles it.
        _count(hit and interpret)
        return JitKernel(source, import_kernel(source, path, interpret=interpret), interpret)
    binary, hit = ensure_binary(source, target, path)
    _count(hit)
    logger.info("%s for %s: %s", source.entry, target, "cache hit" if hit else "compiled")
    return BinaryKernel(source, import_kernel(source, path, interpret=False), binary, device.index)


def _count(hit: bool) -> None:
    if hit:
        stats.count("cache_hits")
    else:
        stats.count("cache_misses")
        stats.count("compiles")
