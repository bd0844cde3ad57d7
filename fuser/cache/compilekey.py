"""Triton's cache key for fuser's own compiles, without hashing Triton's source tree.

``triton.compile`` names its file-cache entry by ``get_cache_key``, which starts with
``triton_key()``: a hash of every file of Triton's compiler, backends and language and of
its ``libtriton`` library, computed once per process (~0.65 s on an H100 host, ~0.3 s on
the 2-core CPU machine). fuser compiles into a temporary Triton cache of its own
(``aot.compile_function``) and keys its store by the kernel's source, options, target,
compiler environment and fuser's and Triton's versions (``keys.binary_key``), so Triton's
key need only be unique within that folder. ``cheap_cache_key`` makes the key of one
``ASTSource`` from Triton's version and fuser's key instead, keeping Triton's backend,
options and environment parts; the key of every other source is Triton's own.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

_lock = threading.Lock()
_keys: dict[int, tuple[object, str]] = {}  # id(ASTSource) -> (the source, fuser's key)
_users = 0
_installed = None  # (the wrapper, the function it wraps) while any compile uses it


def _wrap(original):
    def get_cache_key(src, backend, backend_options, env_vars):
        entry = _keys.get(id(src))
        if entry is None or entry[0] is not src:
            return original(src, backend, backend_options, env_vars)
        return fuser_cache_key(entry[1], backend, backend_options, env_vars)

    return get_cache_key


def fuser_cache_key(key: str, backend, backend_options, env_vars) -> str:
    """Triton's ``get_cache_key`` with ``triton_key()`` and ``src.hash()`` replaced by
    Triton's version and fuser's ``key``."""
    import triton

    env = str(sorted(env_vars.items()))
    return f"fuser-{triton.__version__}-{key}-{backend.hash()}-{backend_options.hash()}-{env}"


@contextmanager
def cheap_cache_key(src, key: str):
    """Within the block, ``triton.compile(src, ...)`` keys ``src`` by ``key`` (fuser's
    binary key). Thread-safe: ``triton.compiler.compiler.get_cache_key`` is wrapped while
    any thread is inside the block and restored when the last one leaves (unless someone
    replaced it meanwhile), also on an exception."""
    import triton.compiler.compiler as compiler

    global _users, _installed
    with _lock:
        if _users == 0:
            _installed = (_wrap(compiler.get_cache_key), compiler.get_cache_key)
            compiler.get_cache_key = _installed[0]
        _users += 1
        _keys[id(src)] = (src, key)
    try:
        yield
    finally:
        with _lock:
            _keys.pop(id(src), None)
            _users -= 1
            if _users == 0:
                wrapper, original = _installed
                if compiler.get_cache_key is wrapper:
                    compiler.get_cache_key = original
                _installed = None
