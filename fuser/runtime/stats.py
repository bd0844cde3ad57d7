"""The process-wide counters under their earlier name; they live in ``fuser.counters``, at
the bottom of the pipeline, so that the cache counts its hits too."""

from fuser.counters import count, stats

__all__ = ["count", "stats"]
