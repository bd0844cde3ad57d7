"""Rendered kernels remembered on disk, so a process whose kernels are cached skips sympy.

Lowering and rendering a rule costs ~0.1-0.2 s of sympy work; the cache key of a compiled
kernel is its rendered source, so without this every process would pay it before its
first step. An entry maps a fingerprint of everything rendering reads (the rule's
outputs, the dtype plan and options, fuser's own lowering and rendering code and
templates) to the rendered sources and the step's layout. Entries are JSON with a
checksum; a damaged one is ignored and rewritten.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from fuser.cache.store import CacheError, CorruptEntry, atomic_write, check_chain, read_private, root

_PACKAGE = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=4)
def code_fingerprint(templates: Path) -> str:
    """Hash of the code that turns rules into sources and of the templates in ``templates``
    (codegen's folder, which codegen names: the cache sits below it and imports none of it)."""
    h = hashlib.sha256()
    files = [
        *sorted((_PACKAGE / "rules").glob("*.py")),
        *sorted((_PACKAGE / "ir").glob("*.py")),
        *sorted((_PACKAGE / "codegen").glob("*.py")),
        *sorted(templates.glob("*.jinja")),
    ]
    for path in files:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def fingerprint(*parts, templates: Path) -> str:
    """The key of a rendering: everything it read (``parts``), and the code and templates."""
    h = hashlib.sha256(code_fingerprint(templates).encode())
    h.update(json.dumps(parts, sort_keys=True, default=str).encode())
    return h.hexdigest()


def _path(key: str) -> Path:
    return root() / "rendered" / key[:2] / f"{key}.json"


def load(key: str) -> dict | None:
    """The payload stored under ``key``, or None (missing, damaged, or unreadable)."""
    try:
        path = _path(key)
        check_chain(path.parent)
        raw = read_private(path)
        entry = json.loads(raw)
        payload = entry["payload"]
        if entry["checksum"] != _digest(payload):
            return None
        return payload
    except (OSError, ValueError, KeyError, TypeError, CorruptEntry, CacheError):
        return None


def store(key: str, payload: dict) -> None:
    try:
        atomic_write(_path(key), json.dumps({"payload": payload, "checksum": _digest(payload)}).encode())
    except (OSError, CacheError):
        pass  # a cache that cannot be written costs time, never correctness


def _digest(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
