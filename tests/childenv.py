"""The environment of a child process a test starts: an explicit, clean one.

A child inherits nothing from the worker that runs the test but what is listed here: the
system's own variables (``PATH``, ``HOME``, locale, OpenBLAS's processor settings), the
test's seeds, a cache folder, and what the caller adds. Variables that earlier tests, or
the packages they imported, left in ``os.environ`` never reach it, and Triton's own file
cache is a private folder unless the caller names one, so two tests (or two workers) never
read each other's half-written Triton kernels."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
SYSTEM = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR", "TERM", "SHELL",
          "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH")  # fmt: skip
SEEDS = ("FUSER_TEST_SEED", "FUSER_TEST_CASE_SEED", "FUSER_TEST_ALL")


def child_env(*, cache: str | os.PathLike | None = None, triton_cache: str | os.PathLike | None = None,
              path: tuple = (), **extra: str) -> dict[str, str]:  # fmt: skip
    """A clean environment for a child Python that imports fuser from this checkout (and the
    test helpers, and ``path``): FUSER_CACHE_DIR is ``cache`` (default: this process's),
    TRITON_CACHE_DIR ``triton_cache`` (default: a new private folder); ``extra`` is added
    last (a value of ``None`` removes a name)."""
    env = {k: os.environ[k] for k in SYSTEM + SEEDS if k in os.environ}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (REPO, TESTS, *path))
    env["FUSER_CACHE_DIR"] = str(cache or os.environ["FUSER_CACHE_DIR"])
    env["TRITON_CACHE_DIR"] = str(triton_cache or tempfile.mkdtemp(prefix="triton-cache-"))
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = str(v)
    return env
