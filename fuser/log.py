"""The ``fuser`` logger. ``FUSER_LOG=info`` (or ``debug``, ``warning``) prints what fuser
does that costs time: compilations, cache misses, table rebuilds."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("fuser")


def configure_from_env() -> None:
    level = os.environ.get("FUSER_LOG", "").strip().upper()
    if not level:
        return
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError(f"FUSER_LOG must be debug, info, warning or error, not {level.lower()!r}")
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("fuser %(levelname)s: %(message)s"))
        logger.addHandler(handler)
