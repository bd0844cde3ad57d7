"""Compile-if-missing: each entry's source and per-target binaries, built at most once.

Readers verify without locking; a miss or a damaged folder takes the key's file lock,
looks again (another process may have just written it), and only then builds. So
concurrent processes never compile the same key twice, and never read a half-written
folder (the manifest is written last).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from fuser.cache import store
from fuser.cache.keys import binary_key, entry_key, parse_target, target_dirname
from fuser.codegen.source import KernelSource


class CacheWarning(UserWarning):
    """A damaged cache entry was discarded and rebuilt."""


@dataclass(frozen=True)
class Binary:
    """A verified compiled kernel in the store."""

    folder: Path
    key: str
    target: str
    cubin: str  # file names inside ``folder``
    metadata: str


@dataclass(frozen=True)
class Result:
    """What ``precompile`` did for one kernel and target."""

    source: KernelSource
    target: str
    key: str
    status: str  # "hit" or "compiled"
    seconds: float
    binary: Path  # the stored cubin


def source_file(source: KernelSource) -> str:
    return f"{source.entry}.py"


def _verified(folder: Path, key: str) -> dict[str, bytes] | None:
    """The folder's files, or ``None`` when missing or damaged (damage is warned about)."""
    try:
        return store.read_folder(folder, key)
    except store.CorruptEntry as e:
        warnings.warn(
            f"fuser cache entry {folder} is damaged ({e}); discarding and rebuilding it",
            CacheWarning,
            stacklevel=3,
        )
        return None


def _get_or_build(folder: Path, key: str, build) -> tuple[dict[str, bytes], bool]:
    """(files, hit): the verified files of ``folder``, built under the key's lock if needed."""
    files = _verified(folder, key)
    if files is not None:
        return files, True
    from filelock import Timeout  # here: a hit needs no lock, and the import costs ~0.07 s

    try:
        with store.lock(key):
            try:
                files = store.read_folder(folder, key)
            except store.CorruptEntry:
                store.discard(folder)
                files = None
            if files is not None:
                return files, True
            build()
            files = store.read_folder(folder, key)
    except Timeout:
        raise store.CacheError(
            f"waited {store.LOCK_TIMEOUT_S:.0f} s for another process to build {folder}; if none is "
            f"running, delete {store.lock_path(key)}"
        ) from None
    except PermissionError as e:
        raise store.CacheError(
            f"cannot write to the fuser cache ({e.filename or folder}: permission denied); set "
            "FUSER_CACHE_DIR to a folder you can write, or precompile into this one"
        ) from None
    return files, False


def ensure_source(source: KernelSource) -> tuple[Path, bool]:
    """(path of the source file, served from disk?) for ``source``, writing it if needed."""
    key = entry_key(source)
    folder = store.entry_dir(key.digest)
    meta = {**dict(source.meta), "kernel": source.entry}
    name = source_file(source)

    def build():
        store.write_folder(folder, key, {name: source.text.encode()}, meta)

    _, hit = _get_or_build(folder, key.digest, build)
    return folder / name, hit


def _binary_folder(source: KernelSource, target: str) -> tuple[Path, str]:
    """(folder, key) of the binary of ``source`` for a canonical ``target``."""
    folder = store.entry_dir(entry_key(source).digest) / target_dirname(target)
    return folder, binary_key(source, target).digest


def stored_binary(source: KernelSource, target: str) -> Binary | None:
    """The verified binary of ``source`` for ``target`` that ``load_kernel`` would load
    without compiling, or ``None`` when it is missing or damaged. Writes nothing."""
    target = parse_target(target)
    folder, key = _binary_folder(source, target)
    try:
        if store.read_folder(folder, key) is None:
            return None
    except store.CorruptEntry:
        return None
    return Binary(folder, key, target, f"{source.entry}.cubin", f"{source.entry}.json")


def ensure_binary(source: KernelSource, target: str, path: Path) -> tuple[Binary, bool]:
    """(binary, served from disk?) of ``source`` for ``target``, compiling the source file
    at ``path`` (from ``ensure_source``) if needed."""
    from fuser.cache.aot import compile_binary

    target = parse_target(target)
    folder, digest = _binary_folder(source, target)
    cubin, metadata = f"{source.entry}.cubin", f"{source.entry}.json"
    meta = {**dict(source.meta), "kernel": source.entry, "target": target}

    def build():
        binary, md = compile_binary(source, path, target)
        store.write_folder(folder, binary_key(source, target), {cubin: binary, metadata: md}, meta)

    _, hit = _get_or_build(folder, digest, build)
    return Binary(folder, digest, target, cubin, metadata), hit


def precompile(sources: list[KernelSource], targets=("cuda:80", "cuda:90"), on_result=None) -> list[Result]:
    """Write each kernel's source and compile it for every target, on any machine (no GPU
    needed). Returns one ``Result`` per (source, target); ``on_result(result)`` is called
    as each finishes. Raises ``CompileError`` for a kernel Triton rejects."""
    targets = [parse_target(t) for t in targets]
    results = []
    for source in sources:
        path, _ = ensure_source(source)
        for target in targets:
            t0 = time.perf_counter()
            binary, hit = ensure_binary(source, target, path)
            seconds = time.perf_counter() - t0
            status = "hit" if hit else "compiled"
            result = Result(source, target, binary.key, status, seconds, binary.folder / binary.cubin)
            results.append(result)
            if on_result is not None:
                on_result(result)
    return results
