"""The ctypes launcher without a GPU: argument packing against Triton's own launcher and
the kernel's PTX parameters, the fallback decision, and loading and launching against a
stand-in for libcuda. Launches on a real GPU: test_gpu.py."""

import ctypes
import re
import struct

import pytest
import torch
from cache_helpers import FakeCompiled, axpy, middle, mixed, tile_copy, transpose

import fuser
from fuser.cache import launcher, loader
from fuser.cache.aot import compile_spec, import_kernel
from fuser.cache.entries import ensure_binary, ensure_source
from fuser.cache.launcher import CudaDriver, CudaKernel, Params, fallback_reason, param_layout

# C types of Triton's launcher (``ty_to_cpp``, ``FLOAT_STORAGE_TYPE``) -> struct formats.
C_FORMATS = {"int8_t": "b", "int16_t": "h", "int32_t": "i", "int64_t": "q", "uint8_t": "B", "uint16_t": "H",
             "uint32_t": "I", "uint64_t": "Q", "CUdeviceptr": "Q"}  # fmt: skip
PTX_BYTES = {"u8": 1, "b8": 1, "s8": 1, "u16": 2, "b16": 2, "s16": 2, "u32": 4, "b32": 4, "s32": 4, "f32": 4,
             "u64": 8, "b64": 8, "s64": 8, "f64": 8}  # fmt: skip


class FakeTensor:
    """A CUDA tensor as the launcher sees one."""

    is_cuda = True

    def __init__(self, address: int):
        self.address = address

    def data_ptr(self) -> int:
        return self.address


def slots(params: Params) -> list[bytes]:
    """The 8 bytes each entry of the ``void *`` array points at, read through the array."""
    array = (ctypes.c_void_p * params.layout.n_params).from_address(params.address)
    return [ctypes.string_at(array[i], 8) for i in range(params.layout.n_params)]


def test_formats_match_tritons_launcher():
    from triton.backends.nvidia.driver import FLOAT_STORAGE_TYPE, ty_to_cpp

    for ty, fmt in launcher.PARAM_FORMATS.items():
        c_type = FLOAT_STORAGE_TYPE.get(ty, ty_to_cpp(ty))
        assert struct.calcsize(fmt) == struct.calcsize(C_FORMATS[c_type]), ty
        if ty not in FLOAT_STORAGE_TYPE:
            assert fmt == C_FORMATS[c_type], ty  # signedness too
    assert launcher.param_format("*fp32") == launcher.param_format("*i64") == C_FORMATS[ty_to_cpp("*fp32")]
    for ty in ("fp16", "bf16", "nvTmaDesc", "tensordesc<fp32[16, 16]>", "constexpr", ("i32", "i32")):
        assert launcher.param_format(ty) is None


def test_packing_order_values_and_null_scratch():
    """Runtime arguments only (the signature holds no constexprs), each in its own slot in
    order, then two zero slots for the scratch pointers."""
    layout = param_layout(mixed().signature)
    assert layout.n_params == len(mixed().signature) + 2
    assert layout.pointers == (0, 9)
    params = Params(layout)
    args = [FakeTensor(0x7F0000001000), True, -5, -300, -70000, -(2**40), 200, 2**32 - 1, 2**40 + 3,
            FakeTensor(0x7F0000002008), 0.1, 1 / 3]  # fmt: skip
    params.pack(args)
    got = slots(params)
    want = [("<Q", 0x7F0000001000), ("<b", 1), ("<b", -5), ("<h", -300), ("<i", -70000), ("<q", -(2**40)),
            ("<B", 200), ("<I", 2**32 - 1), ("<Q", 2**40 + 3), ("<Q", 0x7F0000002008), ("<f", 0.1),
            ("<d", 1 / 3)]  # fmt: skip
    for i, (fmt, value) in enumerate(want):
        size = struct.calcsize(fmt)
        assert got[i][:size] == struct.pack(fmt, value), (i, fmt)
    assert got[-2:] == [bytes(8), bytes(8)]
    # fp32 is the float nearest the double, as Triton's (float) cast; i1 one byte.
    assert struct.unpack("<f", got[10][:4])[0] == struct.unpack("<f", struct.pack("<f", 0.1))[0] != 0.1
    assert got[1] == b"\x01" + bytes(7)
    # Repacking overwrites every slot and leaves the scratch slots zero.
    args[1], args[2], args[0] = False, 127, None
    params.pack(args)
    got = slots(params)
    assert got[0] == bytes(8) and got[1][:1] == b"\x00" and got[2][:1] == b"\x7f"
    assert got[-2:] == [bytes(8), bytes(8)]


def test_slots_are_aligned():
    params = Params(param_layout(mixed().signature))
    array = (ctypes.c_void_p * params.layout.n_params).from_address(params.address)
    assert all(array[i] % 8 == 0 for i in range(params.layout.n_params))


def test_pointer_arguments():
    assert launcher.device_pointer(None) == 0
    assert launcher.device_pointer(4096) == 4096
    assert launcher.device_pointer(FakeTensor(123)) == 123

    class NoIsCuda:
        def data_ptr(self):
            return 77

    assert launcher.device_pointer(NoIsCuda()) == 77
    with pytest.raises(ValueError, match="on cpu, not on a CUDA device"):
        launcher.device_pointer(torch.zeros(3))
    with pytest.raises(TypeError, match="not str"):
        launcher.device_pointer("0x1000")


def test_bad_arguments_are_named():
    params = Params(param_layout(axpy().signature))
    x = FakeTensor(256)
    with pytest.raises(TypeError, match=r"argument n \(i32\) = 2147483648"):
        params.pack([x, x, x, 2**31, 1.0])
    with pytest.raises(TypeError, match=r"argument n \(i32\) = 2.5"):
        params.pack([x, x, x, 2.5, 1.0])
    with pytest.raises(TypeError, match=r"argument a \(fp32\)"):
        params.pack([x, x, x, 3, "1.0"])
    with pytest.raises(ValueError, match="unknown|does not pass"):
        param_layout([("h", "fp16")])


def _ptx_params(source, target: str) -> list[int]:
    """Byte sizes of the parameters of ``source``'s kernel in the PTX Triton emits."""
    import tempfile

    import triton
    from triton import knobs

    from fuser.cache.compilekey import cheap_cache_key
    from fuser.cache.keys import gpu_target

    path, _ = ensure_source(source)
    fn = import_kernel(source, path, interpret=False)
    spec = compile_spec(source, fn.arg_names)
    src = spec.ast_source(fn)
    with tempfile.TemporaryDirectory() as tmp, knobs.cache.scope(), cheap_cache_key(src, "ptx-test"):
        knobs.cache.dir = tmp
        ptx = triton.compile(src, target=gpu_target(target), options=spec.options).asm["ptx"]
    entry = re.search(rf"\.entry\s+{source.entry}\((.*?)\)", ptx, re.S).group(1)
    return [PTX_BYTES[t] for t in re.findall(r"\.param\s+\.(\w+)", entry)]


@pytest.mark.parametrize("target", ["cuda:80", "cuda:90"])
def test_layout_matches_the_kernels_parameters(cache_root, target):
    """What cuLaunchKernel reads: one parameter per runtime argument, each as wide as the
    value packed for it, then the two 8-byte scratch pointers Triton 3.6 appends."""
    from fuser.cache.aot import triton_is_interpreted

    if triton_is_interpreted():
        pytest.skip("Triton's compiler does not run with TRITON_INTERPRET=1")
    for source in (mixed(), middle()):
        sizes = _ptx_params(source, target)
        layout = param_layout(source.signature)
        assert len(sizes) == layout.n_params
        assert sizes[: len(layout.types)] == [struct.calcsize(launcher.param_format(t)) for t in layout.types]
        assert sizes[-2:] == [8, 8]


OK_METADATA = {"name": "k", "num_warps": 4, "num_ctas": 1, "shared": 0, "launch_cooperative_grid": False,
               "launch_pdl": False, "global_scratch_size": 0, "profile_scratch_size": 0,
               "tensordesc_meta": [], "target": {"backend": "cuda", "arch": 90, "warp_size": 32}}  # fmt: skip


@pytest.mark.parametrize(
    "change, reason",
    [
        ({}, None),
        ({"shared": 200000}, None),  # opted into at load
        ({"num_ctas": 2}, "num_ctas=2"),
        ({"cluster_dims": [2, 1, 1]}, "cluster_dims"),
        ({"cluster_dims": [1, 1, 1]}, None),
        ({"launch_cooperative_grid": True}, "launch_cooperative_grid"),
        ({"launch_pdl": True}, "launch_pdl"),
        ({"global_scratch_size": 384, "global_scratch_align": 128}, None),  # passed by the caller
        ({"global_scratch_size": 384, "global_scratch_align": 1024}, "global_scratch_align=1024"),
        ({"profile_scratch_size": 64}, "profile_scratch_size=64"),
        ({"tensordesc_meta": [{"swizzle": 3}]}, "tensor descriptor arguments"),
        ({"target": {"backend": "hip", "arch": "gfx942", "warp_size": 64}}, "hip"),
        ({"name": None}, "without 'name'"),
    ],
)
def test_fallback_from_metadata(change, reason):
    metadata = {k: v for k, v in {**OK_METADATA, **change}.items() if v is not None}
    got = fallback_reason(metadata, ["*fp32", "i32", "fp32"])
    assert got == reason if reason is None else reason in got


def test_fallback_from_types_env_and_hooks(monkeypatch):
    from triton import knobs

    assert "fp16" in fallback_reason(OK_METADATA, ["*fp32", "fp16"])
    assert "tensordesc" in fallback_reason(OK_METADATA, ["tensordesc<fp32[16, 16]>"])
    assert fallback_reason(OK_METADATA, ["*fp32"], knobs.runtime) is None
    monkeypatch.setenv("FUSER_TRITON_LAUNCHER", "1")
    assert fallback_reason(OK_METADATA, ["*fp32"]) == "FUSER_TRITON_LAUNCHER=1"
    monkeypatch.setenv("FUSER_TRITON_LAUNCHER", "0")
    assert fallback_reason(OK_METADATA, ["*fp32"]) is None

    def hook(*a):
        pass

    for name in ("launch_enter_hook", "launch_exit_hook", "kernel_load_start_hook", "kernel_load_end_hook"):
        chain = getattr(knobs.runtime, name)
        chain.add(hook)
        try:
            # Load hooks decide at load; launch hooks at each launch (they come and go).
            reason = fallback_reason(OK_METADATA, ["*fp32"], knobs.runtime)
            assert (reason is None) == ("launch" in name)
            assert launcher.launch_hooks_set(knobs.runtime) == ("launch" in name)
        finally:
            chain.remove(hook)
        assert not launcher.launch_hooks_set(knobs.runtime)
    # Triton before HookChain: a function (or None) in the knob's place.
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
    assert launcher.launch_hooks_set(knobs.runtime)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    assert not launcher.launch_hooks_set(knobs.runtime)


class FakeLib:
    """libcuda as ``CudaDriver`` calls it: outputs written through ``byref``, calls recorded,
    each launch's parameters read back through the ``void *`` array it was given."""

    NAMES = {
        1: b"CUDA_ERROR_INVALID_VALUE",
        201: b"CUDA_ERROR_INVALID_CONTEXT",
        400: b"CUDA_ERROR_INVALID_HANDLE",
    }

    def __init__(self, optin=232448, static_shared=0, max_threads=1024, context=0x10, launch_rcs=()):
        self.optin, self.static_shared, self.max_threads = optin, static_shared, max_threads
        self.context = context
        self.launch_rcs = list(launch_rcs)
        self.calls, self.launches = [], []
        self.n_params = None
        names = ("cuInit cuGetErrorName cuGetErrorString cuDeviceGet cuDeviceGetAttribute cuCtxGetCurrent "
                 "cuCtxSetCurrent cuDevicePrimaryCtxRetain cuModuleLoadData cuModuleGetFunction "
                 "cuFuncGetAttribute cuFuncSetAttribute cuFuncSetCacheConfig cuLaunchKernel")  # fmt: skip
        for name in names.split():
            setattr(self, name, _Recorded(self, name))

    def answer(self, name, args):
        out = args[0]._obj if args and hasattr(args[0], "_obj") else None
        if name == "cuGetErrorName":
            args[1]._obj.value = self.NAMES.get(args[0])
            return 0 if args[0] in self.NAMES else 1
        if name == "cuGetErrorString":
            args[1]._obj.value = b"a description"
        elif name == "cuDeviceGet":
            out.value = args[1]
        elif name == "cuDeviceGetAttribute":
            out.value = {launcher.SHARED_OPTIN: self.optin}[args[1]]
        elif name == "cuCtxGetCurrent":
            out.value = self.context
        elif name == "cuCtxSetCurrent":
            self.context = args[0].value
        elif name == "cuDevicePrimaryCtxRetain":
            out.value = 0x20
        elif name == "cuModuleLoadData":
            assert args[1][:4] == b"\x7fELF"
            out.value = 0x30
        elif name == "cuModuleGetFunction":
            out.value = 0x40
        elif name == "cuFuncGetAttribute":
            attributes = {launcher.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: self.max_threads,
                          launcher.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: self.static_shared}  # fmt: skip
            out.value = attributes[args[1]]
        elif name == "cuLaunchKernel":
            array = (ctypes.c_void_p * self.n_params).from_address(args[9])
            self.launches.append((args[:9], [ctypes.string_at(array[i], 8) for i in range(self.n_params)]))
            assert args[10] is None
            return self.launch_rcs.pop(0) if self.launch_rcs else 0
        return 0


class _Recorded:
    def __init__(self, lib, name):
        self.lib, self.name = lib, name

    def __call__(self, *args):
        self.lib.calls.append(self.name)
        return self.lib.answer(self.name, args)


def _binary(source, target="cuda:90"):
    import json

    path, _ = ensure_source(source)
    binary, _ = ensure_binary(source, target, path)
    cubin = (binary.folder / binary.cubin).read_bytes()
    return binary, cubin, json.loads((binary.folder / binary.metadata).read_text())


def test_cuda_kernel_loads_and_launches(cache_root):
    _, cubin, metadata = _binary(axpy())
    lib = FakeLib()
    kernel = CudaKernel(CudaDriver(lib), cubin, metadata, axpy().signature, device_index=0)
    lib.n_params = 7
    assert "cuFuncSetAttribute" not in lib.calls  # 0 bytes of shared memory: no opt-in
    assert "cuDevicePrimaryCtxRetain" not in lib.calls  # a context was current
    x, y, out = FakeTensor(0x1000), FakeTensor(0x2000), FakeTensor(0x3000)
    kernel.launch((8,), (x, y, out, 1000, 0.5), stream=0x99)
    kernel.launch((2, 3), (x, y, out, 7, -1.0), stream=0)
    kernel.launch((0,), (x, y, out, 7, -1.0), stream=0)  # an empty grid: no launch, as Triton's
    (dims, params), (dims2, params2) = lib.launches
    assert dims == (0x40, 8, 1, 1, 128, 1, 1, 0, 0x99)
    assert dims2[1:4] == (2, 3, 1)
    assert params[:5] == [struct.pack("<Q", 0x1000), struct.pack("<Q", 0x2000), struct.pack("<Q", 0x3000),
                          struct.pack("<i", 1000) + bytes(4), struct.pack("<f", 0.5) + bytes(4)]  # fmt: skip
    assert params[5:] == [bytes(8), bytes(8)]
    assert params2[3][:4] == struct.pack("<i", 7)


def test_cuda_kernel_opts_into_large_shared_memory(cache_root):
    _, cubin, metadata = _binary(transpose())
    assert metadata["shared"] == 65536
    lib = FakeLib(optin=232448, static_shared=0)
    CudaKernel(CudaDriver(lib), cubin, metadata, transpose().signature, device_index=0)
    assert lib.calls[-2:] == ["cuFuncGetAttribute", "cuFuncSetAttribute"]
    assert "cuFuncSetCacheConfig" in lib.calls


def test_cuda_kernel_out_of_resources(cache_root):
    from triton.runtime.errors import OutOfResources

    _, cubin, metadata = _binary(transpose())
    with pytest.raises(OutOfResources, match="shared memory"):
        CudaKernel(CudaDriver(FakeLib(optin=49152)), cubin, metadata, transpose().signature, device_index=0)
    with pytest.raises(OutOfResources, match="threads"):
        CudaKernel(
            CudaDriver(FakeLib(max_threads=64)), cubin, metadata, transpose().signature, device_index=0
        )


def test_no_current_context_takes_the_primary_one(cache_root):
    _, cubin, metadata = _binary(axpy())
    lib = FakeLib(context=0)
    kernel = CudaKernel(CudaDriver(lib), cubin, metadata, axpy().signature, device_index=0)
    assert lib.calls[1:5] == ["cuCtxGetCurrent", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent"]
    assert lib.context == 0x20
    # A thread with no context at launch: made current, launched again.
    lib.n_params, lib.launch_rcs = 7, [launcher.CUDA_ERROR_INVALID_CONTEXT]
    lib.context = 0
    x = FakeTensor(0x1000)
    kernel.launch((1,), (x, x, x, 1, 1.0), stream=0)
    assert len(lib.launches) == 2 and lib.context == 0x20


def test_cuda_errors_are_named(cache_root):
    _, cubin, metadata = _binary(axpy())
    lib = FakeLib()
    kernel = CudaKernel(CudaDriver(lib), cubin, metadata, axpy().signature, device_index=0)
    lib.n_params, lib.launch_rcs = 7, [400]
    x = FakeTensor(0x1000)
    with pytest.raises(RuntimeError, match=r"launching axpy on grid \(5,\).*CUDA_ERROR_INVALID_HANDLE"):
        kernel.launch((5,), (x, x, x, 1, 1.0), stream=0)
    lib.launch_rcs = [12345]
    with pytest.raises(launcher.CudaError, match="CUDA error 12345"):
        kernel.launch((5,), (x, x, x, 1, 1.0), stream=0)


def _binary_kernel(monkeypatch, source, lib):
    """A ``BinaryKernel`` on a stand-in libcuda (and a stand-in for Triton's launcher)."""
    path, _ = ensure_source(source)
    fn = import_kernel(source, path, interpret=False)
    binary, _ = ensure_binary(source, "cuda:90", path)
    fake = FakeCompiled()
    monkeypatch.setattr(loader, "compiled_kernel", lambda *a: fake)
    monkeypatch.setattr(loader.BinaryKernel, "_device_guard", lambda self, f, *a: f(*a))
    monkeypatch.setattr(loader, "current_stream", lambda index: 0x500 + index)

    def cuda_driver():
        if lib is None:
            raise OSError("libcuda.so.1: cannot open shared object file")
        return CudaDriver(lib)

    monkeypatch.setattr(launcher, "cuda_driver", cuda_driver)
    return loader.BinaryKernel(source, fn, binary, device_index=1), fake


def test_binary_kernel_launches_through_ctypes(cache_root, monkeypatch):
    from triton import knobs

    lib = FakeLib()
    kernel, fake = _binary_kernel(monkeypatch, middle(), lib)
    assert kernel.fallback is None and kernel.direct is not None
    lib.n_params = 5
    x, out = FakeTensor(0x1000), FakeTensor(0x2000)
    before = fuser.stats()["launches"]
    kernel((3,), x, 10, out)
    assert len(lib.launches) == 1 and not fake.calls
    dims, params = lib.launches[0]
    assert dims[-1] == 0x501  # the stream of the kernel's device
    assert params == [struct.pack("<Q", 0x1000), struct.pack("<i", 10) + bytes(4), struct.pack("<Q", 0x2000),
                      bytes(8), bytes(8)]  # fmt: skip
    # A launch hook set later: that launch goes through Triton's launcher, which calls it.
    seen = []
    knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        kernel((3,), x, 10, out)
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    assert len(lib.launches) == 1 and len(fake.calls) == 1
    assert fake.calls[0][-5:] == (x, 64, 10, 3, out)  # constexprs in place for Triton's launcher
    kernel((3,), x, 10, out)
    assert len(lib.launches) == 2
    assert fuser.stats()["launches"] - before == 3
    with pytest.raises(TypeError, match="takes 3 arguments"):
        kernel((1,), x, 10)


def test_binary_kernel_without_libcuda_uses_tritons_launcher(cache_root, monkeypatch):
    kernel, fake = _binary_kernel(monkeypatch, middle(), None)
    assert kernel.direct is None and "libcuda.so.1 cannot be loaded" in kernel.fallback
    x = FakeTensor(0x1000)
    kernel((3,), x, 10, x)
    assert len(fake.calls) == 1


def test_binary_kernel_env_chooses_tritons_launcher(cache_root, monkeypatch):
    monkeypatch.setenv("FUSER_TRITON_LAUNCHER", "1")
    lib = FakeLib()
    kernel, fake = _binary_kernel(monkeypatch, middle(), lib)
    assert kernel.direct is None and kernel.fallback == "FUSER_TRITON_LAUNCHER=1"
    assert "cuModuleLoadData" not in lib.calls


def test_kernel_with_tensor_descriptors_gets_global_scratch(cache_root, monkeypatch):
    # sm_90 keeps the descriptors a kernel makes in global scratch, scratch_size bytes per
    # program, at the address in the slot after the arguments; sm_80 lowers them to
    # pointers and needs none
    source = tile_copy()
    _, _, metadata80 = _binary(source, "cuda:80")
    assert not metadata80.get("global_scratch_size")
    _, cubin, metadata = _binary(source)
    size = metadata["global_scratch_size"]
    assert size >= 2 * 128 and fallback_reason(metadata, ["*fp32", "*fp32", "i32"]) is None
    lib = FakeLib()
    kernel = CudaKernel(CudaDriver(lib), cubin, metadata, source.signature, device_index=0)
    assert kernel.scratch_size == size
    lib.n_params = 5
    x, out = FakeTensor(0x1000), FakeTensor(0x2000)
    with pytest.raises(ValueError, match=f"needs {size} bytes of global scratch per program"):
        kernel.launch((4,), (x, out, 128), stream=0)
    assert not lib.launches
    kernel.launch((4,), (x, out, 128), stream=0, scratch=0x7000)
    ((_, params),) = lib.launches
    assert params[3:] == [struct.pack("<Q", 0x7000), bytes(8)]
    # The loader asks torch's allocator for every program's share, on the launch's device.
    asked = []

    def scratch_buffer(nbytes, device_index):
        asked.append((nbytes, device_index))
        return FakeTensor(0x9000)

    monkeypatch.setattr(loader, "scratch_buffer", scratch_buffer)
    lib = FakeLib()
    binary_kernel, fake = _binary_kernel(monkeypatch, source, lib)
    lib.n_params = 5
    binary_kernel((3, 2), x, out, 192)
    assert asked == [(6 * size, 1)] and not fake.calls
    ((dims, params),) = lib.launches
    assert dims[1:3] == (3, 2) and params[3:] == [struct.pack("<Q", 0x9000), bytes(8)]
    binary_kernel((0,), x, out, 0)  # an empty grid: nothing allocated, nothing launched
    assert len(asked) == 1 and len(lib.launches) == 1


def test_importing_the_launcher_is_light():
    """No torch, no Triton, no CUDA: those come when a GPU kernel is loaded."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import fuser.cache.launcher\n"
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")  # fmt: skip
    root = str(loader.__file__).rsplit("/fuser/", 1)[0]
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": root}
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["[]"], res.stdout
