from pathlib import Path

import pytest
from childenv import child_env

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    """A fresh, private FUSER_CACHE_DIR, and no kernels remembered by this process."""
    from fuser.cache import loader, store

    root = tmp_path / "cache"
    monkeypatch.setenv("FUSER_CACHE_DIR", str(root))
    monkeypatch.setattr(store, "_checked_roots", set())
    monkeypatch.setattr(loader, "_loaded", {})
    return root


@pytest.fixture
def subprocess_env(cache_root):
    """Environment for a child Python that imports fuser and the test kernels."""
    return child_env(cache=cache_root, path=(HERE,))
