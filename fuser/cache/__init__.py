"""Kernels on disk: content-addressed entries, ahead-of-time compilation, loading.

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
