"""Write each kernel's source once under ``FUSER_CACHE_DIR`` and load it as a module.

Triton's JIT reads a kernel's source back from its file, so generated kernels must live
in real files. Files are content-addressed by ``KernelSource.digest`` and written
atomically (temp file in the same folder, then ``os.replace``).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

import torch
from triton import knobs

from fuser.codegen.source import KernelSource
from fuser.runtime import stats

_loaded: dict[str, object] = {}


def cache_dir() -> Path:
    """``$FUSER_CACHE_DIR``, else ``$XDG_CACHE_HOME/fuser``, else ``~/.cache/fuser``."""
    root = os.environ.get("FUSER_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fuser"


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class JitKernel:
    """A generated kernel loaded through Triton's JIT (and its interpreter on CPU)."""

    def __init__(self, source: KernelSource, fn):
        self.source = source
        self.fn = fn
        self._constexprs = dict(source.constexprs)

    def __call__(self, grid: tuple[int, ...], *args) -> None:
        self.fn[grid](*args, **self._constexprs, num_warps=self.source.num_warps,
                      num_stages=self.source.num_stages)
        stats.count("launches")


def load_kernel(source: KernelSource, device: torch.device | str = "cuda") -> JitKernel:
    """The launchable kernel for ``source`` on ``device``, written and imported on first use.

    CPU tensors run through Triton's interpreter: the module is imported with the
    interpreter switched on, whatever ``TRITON_INTERPRET`` says, so CPU and GPU kernels
    can live in one process.
    """
    interpret = torch.device(device).type == "cpu" or bool(knobs.runtime.interpret)
    key = source.digest + (":interpret" if interpret else "")
    kernel = _loaded.get(key)
    if kernel is not None:
        return kernel
    path = cache_dir() / "src" / key[:2] / f"{source.entry}_{key[:16]}.py"
    data = source.text.encode()
    if path.exists() and path.read_bytes() == data:
        stats.count("cache_hits")
    else:
        stats.count("cache_misses")
        _atomic_write(path, data)
    spec = importlib.util.spec_from_file_location(
        f"fuser_kernels.{path.stem}{'_interpret' if interpret else ''}", path)
    module = importlib.util.module_from_spec(spec)
    if interpret:
        with knobs.runtime.scope():
            knobs.runtime.interpret = True
            spec.loader.exec_module(module)
    else:
        spec.loader.exec_module(module)
    stats.count("compiles")
    kernel = JitKernel(source, getattr(module, source.entry))
    _loaded[key] = kernel
    return kernel
