"""Kernels on disk: rendered sources are written once, loaded, and launched."""

from fuser.cache.store import cache_dir, load_kernel

__all__ = ["cache_dir", "load_kernel"]
