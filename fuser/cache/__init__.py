"""Kernels on disk: content-addressed entries, ahead-of-time compilation, loading.

Keys (``keys``, ``compilekey``), the atomic on-disk store (``store``, ``entries``),
ahead-of-time compiles (``aot``, with ``worker`` / ``worker_main`` for interpreted
processes; ``aot`` refuses a kernel whose LLVM IR the bundled NVPTX backend miscompiles,
``packed_thread_shift``), loading a ``KernelSource`` as a launchable kernel (``loader``;
``launcher``: stored cubins launched through the CUDA driver, with each program's global
scratch for kernels that make tensor descriptors) and the memo of rendered sources
(``rendered``, which receives the template folder from its caller).

load_kernel(source, device)    # launchable kernel(grid, *args), from the store if there
precompile(sources, targets)   # write sources and compile binaries, no GPU needed
stored_binary(source, target)  # the binary load_kernel would find, or None (writes nothing)
"""

from fuser.cache.entries import CacheWarning, Result, precompile, stored_binary
from fuser.cache.errors import CompileError
from fuser.cache.keys import binary_key, entry_key, parse_target
from fuser.cache.loader import load_kernel
from fuser.cache.store import CacheError, cache_dir

__all__ = [
    "CacheError",
    "CacheWarning",
    "CompileError",
    "Result",
    "binary_key",
    "cache_dir",
    "entry_key",
    "load_kernel",
    "parse_target",
    "precompile",
    "stored_binary",
]
