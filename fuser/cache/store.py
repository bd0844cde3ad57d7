"""The on-disk store: paths, permission checks, atomic writes, manifests, locks.

Layout under ``FUSER_CACHE_DIR`` (all names relative, so a copied cache keeps hitting)::

    v1/entries/<k[:2]>/<k>/manifest.json     k: the entry key (source, options, versions)
                          <kernel>.py         the generated source
                          cuda90/manifest.json  one folder per target
                          cuda90/<kernel>.cubin
                          cuda90/<kernel>.json  Triton's metadata of the binary
    v1/locks/<key>.lock                       per-key lock for compile-if-missing

A manifest lists every file of its folder with its sha256 and size, and carries a
checksum of its own content; a folder counts only if its manifest and every file verify.
Files are written first, each atomically, and the manifest last. Only JSON and raw bytes
are ever read back: nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

from fuser.cache.keys import CACHE_FORMAT, CacheKey

MANIFEST = "manifest.json"
LOCK_TIMEOUT_S = 900.0


class CacheError(RuntimeError):
    """The cache cannot be used as configured (permissions, unwritable folder)."""


class CorruptEntry(Exception):
    """A folder of the store whose manifest or files fail verification."""


def cache_dir() -> Path:
    """``$FUSER_CACHE_DIR``, else ``$XDG_CACHE_HOME/fuser``, else ``~/.cache/fuser``."""
    root = os.environ.get("FUSER_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fuser"


def check_private(path: Path, st: os.stat_result | None = None) -> None:
    """Refuse a folder or file that other users can write: fuser executes the kernel
    sources it finds there, so whoever can write them can run code as you."""
    if os.name != "posix":
        return
    st = st or os.stat(path)
    uid = os.getuid()
    if st.st_uid not in (uid, 0):
        raise CacheError(
            f"fuser cache {path} is owned by uid {st.st_uid}, not by you (uid {uid}); fuser executes "
            f"the kernel sources stored there. Fix: set FUSER_CACHE_DIR to a folder you own, "
            f"or `chown -R {uid} {path}`"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheError(
            f"fuser cache {path} is writable by other users (mode {stat.filemode(st.st_mode)}); fuser "
            f"executes the kernel sources stored there. Fix: `chmod -R go-w {path}`, or set "
            f"FUSER_CACHE_DIR to a private folder"
        )


_checked_roots: set[str] = set()


def make_dirs(path: Path) -> None:
    """``mkdir -p`` with every created folder private (0700) whatever the umask."""
    missing = []
    while not path.exists():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            pass


def check_chain(folder: Path) -> None:
    """Check every existing folder from the store's root down to ``folder``."""
    top = root()
    rel = folder.relative_to(top)
    d = top
    for part in rel.parts:
        d = d / part
        try:
            st = os.stat(d)
        except FileNotFoundError:
            return
        check_private(d, st)


def root() -> Path:
    """The versioned root of the store, created private (0700) and checked."""
    base = cache_dir()
    top = base / f"v{CACHE_FORMAT}"
    key = str(top)
    if key not in _checked_roots:
        for d in (base, top):
            try:
                make_dirs(d)
            except OSError as e:
                raise CacheError(
                    f"cannot create the fuser cache folder {d}: {e}. Set FUSER_CACHE_DIR to a writable folder"
                ) from None
            check_private(d)
        _checked_roots.add(key)
    return top


def entry_dir(key: str) -> Path:
    return root() / "entries" / key[:2] / key


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to a temp file in the same folder, then rename it over ``path``."""
    make_dirs(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def write_folder(folder: Path, key: CacheKey, files: dict[str, bytes], meta: dict) -> None:
    """Write ``files`` and then the manifest that vouches for them."""
    for name, data in files.items():
        atomic_write(folder / name, data)
    body = {
        "format": CACHE_FORMAT,
        "key": key.digest,
        "fields": [[name, h] for name, h in key.field_hashes()],
        "values": {name: v for name, v in key.fields if name != "source"},
        "files": {name: {"sha256": _sha256(data), "size": len(data)} for name, data in files.items()},
        "meta": meta,
        "created": time.time(),
    }
    manifest = dict(body, checksum=_sha256(_canonical(body)))
    atomic_write(folder / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())


def read_private(path: Path) -> bytes:
    """The bytes of a cache file, once ``check_private`` accepts who owns it and who may write it."""
    with open(path, "rb") as f:
        check_private(path, os.fstat(f.fileno()))
        return f.read()


def read_manifest(folder: Path) -> dict | None:
    """The folder's verified manifest, ``None`` if there is none; ``CorruptEntry`` if it
    does not parse or its checksum fails."""
    path = folder / MANIFEST
    try:
        raw = read_private(path)
    except FileNotFoundError:
        return None
    except (IsADirectoryError, NotADirectoryError) as e:
        raise CorruptEntry(f"{path.name}: {e.strerror}") from None
    try:
        manifest = json.loads(raw)
        body = {k: v for k, v in manifest.items() if k != "checksum"}
        ok = isinstance(manifest.get("files"), dict) and manifest["checksum"] == _sha256(_canonical(body))
    except (ValueError, TypeError, KeyError, AttributeError):
        ok = False
    if not ok:
        raise CorruptEntry(f"{path.name} is damaged ({len(raw)} bytes)")
    return manifest


def read_folder(folder: Path, key: str) -> dict[str, bytes] | None:
    """Every file of a folder, each verified against the manifest; ``None`` when the folder
    has no manifest yet; ``CorruptEntry`` naming the first file that fails."""
    check_chain(folder)
    manifest = read_manifest(folder)
    if manifest is None:
        return None
    if manifest.get("key") != key:
        raise CorruptEntry(f"{MANIFEST} belongs to key {str(manifest.get('key'))[:16]}, not {key[:16]}")
    out = {}
    for name, want in manifest["files"].items():
        if "/" in name or name.startswith("."):
            raise CorruptEntry(f"{MANIFEST} names an unexpected file {name!r}")
        try:
            data = read_private(folder / name)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise CorruptEntry(f"{name} is missing") from None
        if len(data) != want.get("size") or _sha256(data) != want.get("sha256"):
            raise CorruptEntry(f"{name} fails its checksum ({len(data)} bytes, expected {want.get('size')})")
        out[name] = data
    return out


def discard(folder: Path, keep_dirs: bool = True) -> None:
    """Remove a damaged folder's files (its target subfolders stay when ``keep_dirs``)."""
    if not folder.exists():
        return
    if folder.is_file() or folder.is_symlink():
        folder.unlink()
        return
    for child in folder.iterdir():
        if child.is_dir() and not child.is_symlink():
            if not keep_dirs:
                shutil.rmtree(child)
        else:
            child.unlink()


def lock_path(key: str) -> Path:
    return root() / "locks" / f"{key}.lock"


def lock(key: str):
    """The inter-process lock of one key (a ``filelock.FileLock``, use it as a context)."""
    from filelock import FileLock

    path = lock_path(key)
    make_dirs(path.parent)
    return FileLock(str(path), timeout=LOCK_TIMEOUT_S, mode=0o600)
