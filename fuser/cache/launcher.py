"""Launching a stored cubin through the CUDA driver API with ``ctypes``: nothing to build.

Triton's own launch path builds two C extensions with gcc on first use: ``cuda_utils``
(~0.38 s on an H100 host) and one launcher per signature (~0.47 s each). A process whose
kernels are all precompiled would pay that at its first step, and could not run at all
on a host without gcc. Here the cubin is loaded with ``cuModuleLoadData`` and each launch
is one ``cuLaunchKernel``, its parameters packed by the kernel's Triton signature into a
buffer allocated once per kernel.

The parameters are what Triton 3.6's launcher passes (``make_launcher`` in
``triton/backends/nvidia/driver.py``): the runtime arguments in order, constexprs left
out, each stored as the C type of its signature type (``PARAM_FORMATS``), then two
pointers Triton appends to every kernel: global scratch (the caller's buffer of
``scratch_size`` bytes per program, where the kernel keeps the tensor descriptors it
makes; NULL when it needs none) and profile scratch (NULL).

``fallback_reason`` names what a kernel needs that only Triton's launcher does (thread
block clusters, cooperative or PDL launches, profile scratch, tensor descriptor arguments,
16-bit float scalars, Triton's load hooks); ``launch_hooks_set`` says when a launch must go
through Triton because one of its launch hooks is set. The loader then launches through
Triton's ``CompiledKernel`` instead.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from dataclasses import dataclass

# Triton signature type -> ``struct`` format of the C type Triton's launcher passes it as
# (``ty_to_cpp``; floats as the storage type of ``FLOAT_STORAGE_TYPE``). Every pointer
# type ("*fp32", "*i64" ...) is a CUdeviceptr, POINTER_FORMAT.
PARAM_FORMATS = {
    "i1": "b",
    "i8": "b",
    "i16": "h",
    "i32": "i",
    "i64": "q",
    "u1": "B",
    "u8": "B",
    "u16": "H",
    "u32": "I",
    "u64": "Q",
    "fp32": "f",
    "f32": "f",
    "fp64": "d",
}
POINTER_FORMAT = "Q"
SLOT_BYTES = 8  # each parameter has an 8-byte slot: every C type above fits, aligned
SCRATCH_PARAMS = 2  # global_scratch, profile_scratch
SCRATCH_ALIGN = 512  # the alignment of torch's CUDA allocations, which hold the scratch

ENV_TRITON_LAUNCHER = "FUSER_TRITON_LAUNCHER"

# From cuda.h.
CUDA_ERROR_INVALID_CONTEXT = 201
CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0
CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
SHARED_OPTIN = 97  # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
CU_FUNC_CACHE_PREFER_SHARED = 1
STATIC_SHARED_LIMIT = 49152  # bytes a kernel may use without opting in


def is_pointer(ty) -> bool:
    return isinstance(ty, str) and ty.startswith("*")


def param_format(ty) -> str | None:
    """The ``struct`` format of a Triton signature type, ``None`` for one not launched here."""
    if is_pointer(ty):
        return POINTER_FORMAT
    return PARAM_FORMATS.get(ty) if isinstance(ty, str) else None


def fallback_reason(metadata: dict, types, runtime_knobs=None) -> str | None:
    """Why a kernel must be launched by Triton's launcher, or ``None`` when it can be
    launched here. ``metadata`` is the stored Triton metadata JSON, ``types`` the Triton
    types of its runtime arguments in order (constexprs left out), ``runtime_knobs``
    ``triton.knobs.runtime``: Triton calls its load hooks when it loads a binary. (Its
    launch hooks are for each launch to check: ``launch_hooks_set``.)"""
    if os.environ.get(ENV_TRITON_LAUNCHER) == "1":
        return f"{ENV_TRITON_LAUNCHER}=1"
    target = metadata.get("target") or {}
    if target.get("backend", "cuda") != "cuda":
        return f"a {target.get('backend')} binary"
    for key in ("name", "num_warps", "shared"):
        if key not in metadata:
            return f"metadata without {key!r}"
    if metadata.get("num_ctas", 1) != 1:
        return f"num_ctas={metadata['num_ctas']}"
    cluster = metadata.get("cluster_dims")
    if cluster is not None and tuple(cluster) not in ((), (1,), (1, 1), (1, 1, 1)):
        return f"cluster_dims={tuple(cluster)}"
    for key in ("launch_cooperative_grid", "launch_pdl", "profile_scratch_size"):
        if metadata.get(key):
            return f"{key}={metadata[key]}"
    if metadata.get("tensordesc_meta"):
        return "tensor descriptor arguments"
    if int(metadata.get("global_scratch_align") or 1) > SCRATCH_ALIGN:
        return f"global_scratch_align={metadata['global_scratch_align']}"
    unknown = [ty for ty in types if param_format(ty) is None]
    if unknown:
        return f"signature types {unknown}"
    if runtime_knobs is not None:
        if _hooks_set(runtime_knobs.kernel_load_start_hook, runtime_knobs.kernel_load_end_hook):
            return "a kernel load hook is set"
    return None


def launch_hooks_set(runtime_knobs) -> bool:
    """Whether ``triton.knobs.runtime`` has a launch hook to call around each launch (a
    ``HookChain`` with calls, or a function assigned in its place)."""
    return _hooks_set(runtime_knobs.launch_enter_hook, runtime_knobs.launch_exit_hook)


def _hooks_set(*hooks) -> bool:
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


@dataclass(frozen=True)
class ParamLayout:
    """Where each runtime argument goes in the parameter buffer: slot ``i`` (8 bytes at
    ``8 * i``) holds argument ``i``; the two slots after them hold the scratch pointers
    (zero unless a launch passes global scratch)."""

    names: tuple[str, ...]
    types: tuple[str, ...]
    format: str  # ``struct`` format of the argument slots, padding included
    pointers: tuple[int, ...]  # positions of pointer arguments

    @property
    def n_params(self) -> int:
        return len(self.types) + SCRATCH_PARAMS

    @property
    def size(self) -> int:
        return SLOT_BYTES * self.n_params


def param_layout(signature) -> ParamLayout:
    """The layout of a kernel's runtime arguments, ``signature`` as ``KernelSource.signature``
    (``(name, Triton type)`` in launch order). Raises ``ValueError`` for a type
    ``param_format`` does not know."""
    names = tuple(n for n, _ in signature)
    types = tuple(t for _, t in signature)
    parts = []
    for name, ty in signature:
        fmt = param_format(ty)
        if fmt is None:
            raise ValueError(f"parameter {name} has type {ty!r}, which fuser's launcher does not pass")
        parts.append(fmt + "x" * (SLOT_BYTES - struct.calcsize(fmt)))
    pointers = tuple(i for i, ty in enumerate(types) if is_pointer(ty))
    return ParamLayout(names, types, "<" + "".join(parts), pointers)


def device_pointer(arg) -> int:
    """The device address of a pointer argument: a CUDA tensor's ``data_ptr()``, an int
    taken as an address, ``None`` as NULL, or anything else's ``data_ptr()``."""
    try:
        if arg.is_cuda:
            return arg.data_ptr()
    except AttributeError:
        if arg is None:
            return 0
        if isinstance(arg, int):
            return arg
        data_ptr = getattr(arg, "data_ptr", None)
        if data_ptr is None:
            raise TypeError(f"a pointer argument must be a CUDA tensor, an address or None, not "
                            f"{type(arg).__name__}") from None  # fmt: skip
        return data_ptr()
    # A host address would be read by the kernel as a device address: an illegal access
    # that poisons the context. Triton's launcher rejects it too (cuPointerGetAttribute).
    raise ValueError(f"a pointer argument is a tensor on {arg.device}, not on a CUDA device")


class Params:
    """A kernel's parameter storage: the slots of ``layout`` in one buffer, and the
    ``void *`` array of their addresses that ``cuLaunchKernel`` takes."""

    def __init__(self, layout: ParamLayout):
        self.layout = layout
        self.buffer = ctypes.create_string_buffer(layout.size)
        base = ctypes.addressof(self.buffer)
        slots = [base + SLOT_BYTES * i for i in range(layout.n_params)]
        self.array = (ctypes.c_void_p * layout.n_params)(*slots)
        self.address = ctypes.addressof(self.array)
        self._pack_into = struct.Struct(layout.format).pack_into
        self._pointers = layout.pointers

    def pack(self, args, scratch: int = 0) -> None:
        """Store the runtime arguments ``args`` (in signature order) in their slots, and
        ``scratch`` (a device address, or 0) in the global scratch slot."""
        values = list(args)
        for i in self._pointers:
            values[i] = device_pointer(values[i])
        try:
            self._pack_into(self.buffer, 0, *values)
        except struct.error:
            raise self._bad_argument(values) from None
        struct.pack_into("<Q", self.buffer, SLOT_BYTES * len(self.layout.types), scratch)

    def _bad_argument(self, values) -> Exception:
        for name, ty, value in zip(self.layout.names, self.layout.types, values):
            try:
                struct.pack("<" + param_format(ty), value)
            except (struct.error, OverflowError) as e:
                return TypeError(f"argument {name} ({ty}) = {value!r}: {e}")
        return TypeError(f"arguments {values!r} do not fit the signature {list(self.layout.types)}")


class CudaError(RuntimeError):
    """A CUDA driver call that did not return CUDA_SUCCESS."""


class CudaDriver:
    """The driver API functions fuser calls, from ``libcuda.so.1``."""

    def __init__(self, lib: ctypes.CDLL):
        c = ctypes
        ptr, out_int, out_ptr = c.c_void_p, c.POINTER(c.c_int), c.POINTER(c.c_void_p)
        u = c.c_uint
        functions = {
            "cuInit": [u],
            "cuGetErrorName": [c.c_int, c.POINTER(c.c_char_p)],
            "cuGetErrorString": [c.c_int, c.POINTER(c.c_char_p)],
            "cuDeviceGet": [out_int, c.c_int],
            "cuDeviceGetAttribute": [out_int, c.c_int, c.c_int],
            "cuCtxGetCurrent": [out_ptr],
            "cuCtxSetCurrent": [ptr],
            "cuDevicePrimaryCtxRetain": [out_ptr, c.c_int],
            "cuModuleLoadData": [out_ptr, c.c_char_p],
            "cuModuleGetFunction": [out_ptr, ptr, c.c_char_p],
            "cuFuncGetAttribute": [out_int, c.c_int, ptr],
            "cuFuncSetAttribute": [ptr, c.c_int, c.c_int],
            "cuFuncSetCacheConfig": [ptr, c.c_int],
            # f, grid x y z, block x y z, shared bytes, stream, params, extra
            "cuLaunchKernel": [ptr, u, u, u, u, u, u, u, ptr, ptr, ptr],
        }
        for name, argtypes in functions.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = c.c_int
            setattr(self, name, fn)
        self.check(self.cuInit(0), "cuInit")

    def error_name(self, code: int) -> str:
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        if self.cuGetErrorName(code, ctypes.byref(name)) != 0 or not name.value:
            return f"CUDA error {code}"
        self.cuGetErrorString(code, ctypes.byref(text))
        return f"{name.value.decode()} ({text.value.decode() if text.value else code})"

    def check(self, code: int, what: str) -> None:
        if code != 0:
            raise CudaError(f"{what} failed: {self.error_name(code)}")

    def device(self, index: int) -> int:
        dev = ctypes.c_int()
        self.check(self.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
        return dev.value

    def ensure_context(self, device_index: int) -> None:
        """Make the device's primary context (torch's) current when no context is."""
        ctx = ctypes.c_void_p()
        self.check(self.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if ctx.value:
            return
        self.check(self.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), self.device(device_index)),
                   "cuDevicePrimaryCtxRetain")  # fmt: skip
        self.check(self.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def device_attribute(self, attribute: int, device_index: int) -> int:
        value = ctypes.c_int()
        self.check(self.cuDeviceGetAttribute(ctypes.byref(value), attribute, self.device(device_index)),
                   "cuDeviceGetAttribute")  # fmt: skip
        return value.value

    def function_attribute(self, attribute: int, function: int) -> int:
        value = ctypes.c_int()
        self.check(self.cuFuncGetAttribute(ctypes.byref(value), attribute, function), "cuFuncGetAttribute")
        return value.value


_driver: CudaDriver | None = None
_driver_lock = threading.Lock()


def cuda_driver() -> CudaDriver:
    """The process's ``CudaDriver``; raises ``OSError`` when libcuda cannot be loaded (from
    the loader's search path, or the folder ``TRITON_LIBCUDA_PATH`` names, as Triton)."""
    global _driver
    with _driver_lock:
        if _driver is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError:
                folder = os.environ.get("TRITON_LIBCUDA_PATH")
                if not folder:
                    raise
                lib = ctypes.CDLL(os.path.join(folder, "libcuda.so.1"))
            _driver = CudaDriver(lib)
        return _driver


class CudaKernel:
    """A cubin loaded onto one device, launched with ``cuLaunchKernel``."""

    def __init__(self, driver: CudaDriver, cubin: bytes, metadata: dict, signature, device_index: int):
        """Loads ``cubin`` (Triton's ``loadBinary`` in ``driver.c`` does the same): the
        function named by ``metadata``, and the opt-in to more than 48 KiB of dynamic shared
        memory when the kernel needs it. Raises Triton's ``OutOfResources`` when the device
        lacks the shared memory or threads per block that the kernel takes."""
        self.name = metadata["name"]
        self.device_index = device_index
        self.shared = int(metadata["shared"])
        self.block = 32 * int(metadata["num_warps"])
        # Bytes of global scratch each program needs (its tensor descriptors), 0 for none.
        self.scratch_size = int(metadata.get("global_scratch_size") or 0)
        self.params = Params(param_layout(signature))
        self._driver = driver
        self._lock = threading.Lock()  # one launch at a time packs the buffer
        driver.ensure_context(device_index)
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        driver.check(driver.cuModuleLoadData(ctypes.byref(module), cubin), f"cuModuleLoadData({self.name})")
        driver.check(driver.cuModuleGetFunction(ctypes.byref(function), module, self.name.encode()),
                     f"cuModuleGetFunction({self.name})")  # fmt: skip
        self.module, self.function = module.value, function.value
        self._check_resources()

    def _check_resources(self) -> None:
        driver, function = self._driver, self.function
        optin = driver.device_attribute(SHARED_OPTIN, self.device_index)
        max_threads = driver.function_attribute(CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, function)
        if self.shared > optin or self.block > max_threads:
            from triton.runtime.errors import OutOfResources

            if self.shared > optin:
                raise OutOfResources(self.shared, optin, "shared memory")
            raise OutOfResources(self.block, max_threads, "threads")
        if self.shared > STATIC_SHARED_LIMIT and optin > STATIC_SHARED_LIMIT:
            rc = driver.cuFuncSetCacheConfig(function, CU_FUNC_CACHE_PREFER_SHARED)
            driver.check(rc, "cuFuncSetCacheConfig")
            static = driver.function_attribute(CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, function)
            driver.check(driver.cuFuncSetAttribute(function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                   optin - static), "cuFuncSetAttribute")  # fmt: skip

    def launch(self, grid, args, stream: int, scratch: int = 0) -> None:
        """Launch on ``grid`` (1 to 3 sizes) with the runtime arguments ``args`` on the raw
        CUDA stream ``stream``; ``scratch``: the address of ``scratch_size`` bytes per
        program, allocated by the caller on that stream (``SCRATCH_ALIGN``-aligned), for a
        kernel that needs them. The device's context must be current (the caller's device
        guard); with none current at all, its primary context is made current."""
        g = (*grid, 1, 1)
        if g[0] * g[1] * g[2] <= 0:
            return  # as Triton's launcher: an empty grid launches nothing
        if self.scratch_size and not scratch:
            raise ValueError(f"{self.name} needs {self.scratch_size} bytes of global scratch per program")
        with self._lock:
            self.params.pack(args, scratch)
            rc = self._launch(g, stream)
            if rc == CUDA_ERROR_INVALID_CONTEXT:
                # A thread that never touched CUDA: no context is current yet.
                self._driver.ensure_context(self.device_index)
                rc = self._launch(g, stream)
        if rc != 0:
            self._driver.check(rc, f"launching {self.name} on grid {tuple(grid)} (cuLaunchKernel)")

    def _launch(self, g, stream: int) -> int:
        return self._driver.cuLaunchKernel(self.function, g[0], g[1], g[2], self.block, 1, 1, self.shared,
                                           stream, self.params.address, None)  # fmt: skip
