"""``load_kernel``: a launchable kernel for a ``KernelSource`` on a device.

- CPU tensors (or ``TRITON_INTERPRET=1``): the entry's source file is imported with
  Triton's interpreter on.
- CUDA: the entry's binary for the device's target (``cuda:90`` on an H100) is loaded
  from the stored cubin and metadata JSON with the CUDA driver API and launched with
  ``cuLaunchKernel`` (``fuser.cache.launcher``): no compilation, and no C launcher for
  gcc to build. Kernels that need Triton's own launcher (``launcher.fallback_reason``),
  and launches made while a Triton launch hook is set, go through a
  ``triton.compiler.CompiledKernel`` of the same files instead. On a miss the binary is
  compiled first (under the key's lock) and stored, then loaded from the store like any
  other.

Counters: ``cache_hits`` when the kernel came from disk, ``cache_misses`` and
``compiles`` when this process had to write (interpreter) or compile (GPU) it,
``launches`` on every launch.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading

from fuser.cache import launcher
from fuser.cache.aot import compile_spec, import_kernel
from fuser.cache.entries import ensure_binary, ensure_source
from fuser.codegen.source import KernelSource
from fuser.counters import count
from fuser.log import logger

_loaded: dict[tuple, object] = {}
_lock = threading.RLock()


class JitKernel:
    """A generated kernel run through Triton's JIT (and its interpreter on CPU)."""

    def __init__(self, source: KernelSource, fn, interpret: bool):
        self.source = source
        self.fn = fn
        self._names = [n for n, _ in source.signature]
        self._options = dict(source.constexprs, num_warps=source.num_warps, num_stages=source.num_stages)
        if source.max_registers:
            self._options["maxnreg"] = source.max_registers
        if "INTERPRETED" in self._options:
            self._options["INTERPRETED"] = interpret

    def __call__(self, grid: tuple[int, ...], *args) -> None:
        if len(args) != len(self._names):
            raise TypeError(f"{self.source.entry} takes {len(self._names)} arguments, got {len(args)}")
        # By name: constexprs may sit between runtime parameters.
        self.fn[grid](**dict(zip(self._names, args)), **self._options)
        count("launches")


class BinaryKernel:
    """A stored binary, launched with no compilation.

    Launched by ``fuser.cache.launcher`` (``cuLaunchKernel`` through ctypes: nothing for
    gcc to build) unless ``launcher.fallback_reason`` names something only Triton's launcher
    does, libcuda cannot be loaded, or a Triton launch hook is set at launch time. Those
    launches go through Triton's ``CompiledKernel`` (built on first need; Triton builds its
    C launcher with gcc then), as ``JITFunction.run`` does after its cache lookup: every
    parameter in order (constexpr values included; the C launcher skips them) after the
    grid, the stream, the function handle, the packed metadata and the launch hooks.
    """

    def __init__(self, source: KernelSource, fn, binary, device_index: int):
        import torch
        from triton import knobs

        self._runtime_knobs = knobs.runtime
        self._current_device = torch.cuda.current_device
        spec = compile_spec(source, fn.arg_names)
        self.source = source
        self.target = binary.target
        self.device_index = device_index
        self._fn, self._binary = fn, binary
        self._compiled = None
        # Parameter order with each runtime argument's position, constexprs filled in.
        self._template = [spec.constexprs.get(n) for n in fn.arg_names]
        self._slots = [i for i, n in enumerate(fn.arg_names) if n not in spec.constexprs]
        self.direct = None  # the launcher.CudaKernel, when launches go through it
        metadata = json.loads((binary.folder / binary.metadata).read_bytes())
        self.fallback = launcher.fallback_reason(metadata, [t for _, t in source.signature], knobs.runtime)
        if self.fallback is None:
            try:
                driver = launcher.cuda_driver()
            except OSError as e:
                self.fallback = f"libcuda.so.1 cannot be loaded ({e})"
        if self.fallback is None:
            cubin = (binary.folder / binary.cubin).read_bytes()
            self.direct = self._device_guard(launcher.CudaKernel, driver, cubin, metadata, source.signature,
                                             device_index)  # fmt: skip
        else:
            logger.info("%s: Triton's launcher (%s)", source.entry, self.fallback)
            self._device_guard(self._load)

    @property
    def kernel(self):
        """Triton's ``CompiledKernel`` of the binary, built on first use."""
        if self._compiled is None:
            self._compiled = compiled_kernel(self.source, self._fn, self._binary)
        return self._compiled

    def _load(self) -> None:
        self.kernel.run  # noqa: B018 - loads the cubin onto the current device, builds the launcher

    def _device_guard(self, fn, *args):
        if self._current_device() == self.device_index:
            return fn(*args)
        import torch

        with torch.cuda.device(self.device_index):
            return fn(*args)

    def __call__(self, grid: tuple[int, ...], *args) -> None:
        if len(args) != len(self._slots):
            raise TypeError(f"{self.source.entry} takes {len(self._slots)} arguments, got {len(args)}")
        direct = self.direct
        if direct is not None and not launcher.launch_hooks_set(self._runtime_knobs):
            if direct.scratch_size:
                self._device_guard(self._launch_with_scratch, direct, grid, args)
            else:
                self._device_guard(direct.launch, grid, args, current_stream(self.device_index))
        else:
            self._device_guard(self._launch, grid, args)
        count("launches")

    def _launch_with_scratch(self, direct, grid, args) -> None:
        """A direct launch of a kernel that makes tensor descriptors: each program's global
        scratch from torch's allocator on the launch's stream (Triton's launcher asks
        ``triton.set_allocator``'s function for the same bytes), freed back to it once the
        launch is queued; the stream orders any reuse after the kernel."""
        programs = 1
        for n in grid:
            programs *= n
        if programs <= 0:
            return
        scratch = scratch_buffer(programs * direct.scratch_size, self.device_index)
        direct.launch(grid, args, current_stream(self.device_index), scratch.data_ptr())

    def _launch(self, grid, args) -> None:
        hooks = self._runtime_knobs
        full = list(self._template)
        for i, a in zip(self._slots, args):
            full[i] = a
        g = (*grid, 1, 1)
        k = self.kernel
        run = k.run
        stream = current_stream(self.device_index)
        launch_metadata = k.launch_metadata(g[:3], stream, *full)
        with _scratch_allocator():
            run(g[0], g[1], g[2], stream, k.function, k.packed_metadata, launch_metadata,
                hooks.launch_enter_hook, hooks.launch_exit_hook, *full)  # fmt: skip


@contextlib.contextmanager
def _scratch_allocator():
    """Triton's launcher takes a kernel's global scratch from ``triton.set_allocator``'s
    function; where the program set none, torch's allocator for the duration of a launch."""
    from triton.runtime import _allocation

    if not isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        yield
        return
    token = _allocation._allocator.set(_torch_scratch)
    try:
        yield
    finally:
        _allocation._allocator.reset(token)


def _torch_scratch(size: int, alignment: int, stream):
    import torch

    return scratch_buffer(size, torch.cuda.current_device())


def scratch_buffer(nbytes: int, device_index: int):
    """``nbytes`` of global scratch on a device, from torch's allocator on its current
    stream (aligned to ``launcher.SCRATCH_ALIGN``)."""
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device_index}")


def current_stream(device_index: int) -> int:
    """The raw handle of the current CUDA stream of a device, as Triton's JIT passes it
    (from torch: Triton's ``driver.active`` would build its ``cuda_utils`` with gcc)."""
    return _raw_stream()(device_index)


@functools.cache
def _raw_stream():
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw or (lambda index: torch.cuda.current_stream(index).cuda_stream)


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
        count("cache_hits")
    else:
        count("cache_misses")
        count("compiles")
