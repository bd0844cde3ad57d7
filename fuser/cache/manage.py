"""Looking after the store: list entries, remove old ones, explain a key."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from fuser.cache import store
from fuser.cache.keys import CACHE_FORMAT, field_hash, preview

# A temp file this old was left by a writer that died.
STALE_TEMP_S = 3600.0


@dataclass(frozen=True)
class Listing:
    """One entry of the store: a kernel's source and the targets it is compiled for."""

    key: str
    folder: Path
    rule: str
    kernel: str
    dtypes: str
    targets: tuple[str, ...]
    size: int
    created: float
    problem: str = ""  # why the entry (or one of its binaries) does not verify
    manifest: dict = field(default_factory=dict, compare=False, repr=False)
    binaries: tuple[tuple[str, dict], ...] = field(default=(), compare=False, repr=False)


def _entry_folders() -> list[Path]:
    base = store.root() / "entries"
    if not base.is_dir():
        return []
    return sorted(d for shard in base.iterdir() if shard.is_dir() for d in shard.iterdir() if d.is_dir())


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def inspect(folder: Path) -> Listing:
    """Read an entry folder (without trusting it: damage is reported, not raised)."""
    problems = []
    try:
        manifest = store.read_manifest(folder) or {}
        if not manifest:
            problems.append("no manifest")
    except store.CorruptEntry as e:
        manifest, problems = {}, [str(e)]
    meta = manifest.get("meta", {})
    binaries = []
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        try:
            bm = store.read_manifest(sub)
        except store.CorruptEntry as e:
            problems.append(f"{sub.name}: {e}")
            continue
        if bm:
            binaries.append((bm.get("meta", {}).get("target", sub.name), bm))
    created = manifest.get("created") or folder.stat().st_mtime
    return Listing(
        key=folder.name,
        folder=folder,
        rule=str(meta.get("rule", "?")),
        kernel=str(meta.get("kernel", "?")),
        dtypes=str(meta.get("dtypes", "-")),
        targets=tuple(t for t, _ in binaries),
        size=_size(folder),
        created=float(created),
        problem="; ".join(problems),
        manifest=manifest,
        binaries=tuple(binaries),
    )


def list_entries() -> list[Listing]:
    """Every entry, by rule, kernel and dtypes."""
    return sorted((inspect(d) for d in _entry_folders()), key=lambda e: (e.rule, e.kernel, e.dtypes, e.key))


def clear(older_than_days: float | None = None) -> tuple[int, int]:
    """Remove entries (all, or those created more than ``older_than_days`` ago) and stale
    temp files; returns (entries removed, bytes freed). Lock files stay: removing one
    while another process waits on it would let two processes hold the same key."""
    now = time.time()
    removed = freed = 0
    for listing in list_entries():
        if older_than_days is None or now - listing.created > older_than_days * 86400:
            shutil.rmtree(listing.folder, ignore_errors=True)
            removed += 1
            freed += listing.size
            continue
        for tmp in listing.folder.rglob(".*.tmp"):
            if now - tmp.stat().st_mtime > STALE_TEMP_S:
                tmp.unlink(missing_ok=True)
    return removed, freed


def find(prefix: str) -> list[tuple[Listing, str | None]]:
    """Entries whose key, or one of whose binaries' keys, starts with ``prefix``:
    (entry, target of the matching binary or ``None`` for the entry itself)."""
    prefix = prefix.strip().lower()
    found = []
    for listing in list_entries():
        if listing.key.startswith(prefix):
            found.append((listing, None))
        for target, bm in listing.binaries:
            if str(bm.get("key", "")).startswith(prefix):
                found.append((listing, target))
    return found


def current_values() -> dict:
    """The key fields that come from this installation rather than from the kernel."""
    from fuser.cache.keys import compiler_env, fuser_version, triton_version

    return {"fuser": fuser_version(), "triton": triton_version(), "format": CACHE_FORMAT,
            "compiler_env": compiler_env()}  # fmt: skip


def explain_manifest(manifest: dict, here: dict) -> list[str]:
    """One line per key field: name, hash, value, and whether this installation agrees."""
    values = manifest.get("values", {})
    lines = []
    for name, h in manifest.get("fields", []):
        value = values.get(name, "<the generated source>" if name == "source" else "?")
        mark = ""
        if name in here:
            same = field_hash(here[name]) == h
            mark = "  (same here)" if same else f"  (DIFFERS here: {preview(here[name], 40)})"
        lines.append(f"  {name:<13} {h[:16]}  {preview(value)}{mark}")
    return lines


def explain(prefix: str) -> list[str]:
    """Lines describing the entry or binary whose key starts with ``prefix``. Raises
    ``KeyError`` when no key or more than one matches."""
    found = find(prefix)
    if not found:
        raise KeyError(f"no cache entry has a key starting with {prefix!r} (see `fuser cache ls`)")
    if len({(lst.key, t) for lst, t in found}) > 1:
        names = ", ".join(f"{lst.key[:16]}{'/' + t if t else ''}" for lst, t in found[:6])
        raise KeyError(f"{prefix!r} matches several keys ({names}); give more characters")
    listing, target = found[0]
    here = current_values()
    entry_here = {k: v for k, v in here.items() if k != "compiler_env"}
    lines = [
        f"entry {listing.key}",
        f"  rule {listing.rule}, kernel {listing.kernel}, dtypes {listing.dtypes}",
        f"  folder {listing.folder}",
    ]
    if listing.problem:
        lines.append(f"  DAMAGED: {listing.problem} (it will be rebuilt on next use)")
    lines.append("  key fields (name, hash, value):")
    lines += ["  " + ln for ln in explain_manifest(listing.manifest, entry_here)]
    for t, bm in listing.binaries:
        if target is not None and t != target:
            continue
        lines.append(f"binary {bm.get('key')} for {t}: the entry's fields, plus")
        extra = dict(bm, fields=[f for f in bm.get("fields", []) if f[0] in ("target", "compiler_env")])
        lines += ["  " + ln for ln in explain_manifest(extra, here)]
    lines.append("A kernel hits when every field hashes the same; any field that differs here makes a miss.")
    return lines
