"""A cache that others can write is refused: fuser executes the sources it holds."""

import os
import stat

import pytest
from cache_helpers import axpy

from fuser.cache import CacheError, precompile
from fuser.cache import store as store_mod

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o775, 0o722])
def test_root_writable_by_others_is_refused(cache_root, mode):
    cache_root.mkdir()
    cache_root.chmod(mode)
    with pytest.raises(CacheError, match=r"writable by other users.*chmod -R go-w"):
        precompile([axpy()], ["cuda:90"])


def test_private_root_is_accepted_whatever_the_umask(cache_root):
    old = os.umask(0o002)
    try:
        precompile([axpy()], ["cuda:90"])
    finally:
        os.umask(old)
    for p in cache_root.rglob("*"):
        assert not p.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH), p


@pytest.mark.parametrize("which", ["entry_folder", "source_file", "binary_file", "shard_folder"])
def test_writable_part_inside_is_refused(cache_root, monkeypatch, which):
    source = axpy()
    precompile([source], ["cuda:90"])
    (src,) = cache_root.rglob(f"{source.entry}.py")
    target = {
        "entry_folder": src.parent,
        "source_file": src,
        "binary_file": src.parent / "cuda90" / f"{source.entry}.cubin",
        "shard_folder": src.parent.parent,
    }[which]
    target.chmod(target.stat().st_mode | stat.S_IWOTH)
    monkeypatch.setattr(store_mod, "_checked_roots", set())
    with pytest.raises(CacheError, match=str(target.name)):
        precompile([source], ["cuda:90"])


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give the folder to someone else")
def test_root_owned_by_someone_else_is_refused(cache_root):
    cache_root.mkdir(mode=0o700)
    os.chown(cache_root, 4321, 4321)
    with pytest.raises(CacheError, match="owned by uid 4321"):
        precompile([axpy()], ["cuda:90"])
