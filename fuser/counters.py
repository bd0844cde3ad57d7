"""Process-wide counters, read with ``fuser.stats()``."""

from __future__ import annotations

from collections import Counter

_counts: Counter = Counter(
    {
        "compiles": 0,
        "launches": 0,
        "cache_hits": 0,
        "cache_misses": 0,
        "table_builds": 0,
        "full_checks": 0,
        "collectives": 0,
    }
)


def count(name: str, n: int = 1) -> None:
    _counts[name] += n


def stats() -> dict[str, int]:
    """A snapshot of fuser's counters: compiles, launches, cache hits and misses, table builds,
    full checks (optimizer steps that walked every parameter in Python), collectives (the
    all-reduces that combine reductions over DTensor shards)."""
    return dict(_counts)
