"""The store on CPU: precompile for sm_80/sm_90, hits, damage, relocation, versions."""

import json
import shutil

import pytest
from cache_helpers import axpy, broken, files_state

import fuser
from fuser.cache import CacheError, CompileError, precompile
from fuser.cache.entries import CacheWarning
from fuser.cache.keys import binary_key, entry_key

TARGETS = ["cuda:80", "cuda:90"]


def _binary_files(root, source, target):
    folder = next(root.rglob(entry_key(source).digest)) / target.replace(":", "")
    return folder / f"{source.entry}.cubin", folder / f"{source.entry}.json"


def test_precompile_writes_source_and_a_binary_per_target(cache_root):
    source = axpy()
    results = precompile([source], TARGETS)
    assert [(r.target, r.status) for r in results] == [("cuda:80", "compiled"), ("cuda:90", "compiled")]
    (src,) = cache_root.rglob(f"{source.entry}.py")
    assert src.read_text() == source.text
    for target in TARGETS:
        cubin, meta = _binary_files(cache_root, source, target)
        assert cubin.read_bytes()[:4] == b"\x7fELF"  # a CUDA binary is an ELF file
        md = json.loads(meta.read_text())
        assert md["target"]["arch"] == int(target.split(":")[1])
        assert md["name"] == source.entry
        assert md["num_warps"] == source.num_warps
    assert len({r.key for r in results}) == 2


def test_second_precompile_rewrites_nothing(cache_root):
    sources = [axpy("a"), axpy("b", entry="axpy2")]
    precompile(sources, TARGETS)
    before = files_state(cache_root)
    results = precompile(sources, TARGETS)
    assert {r.status for r in results} == {"hit"}
    assert files_state(cache_root) == before


def test_different_sources_get_different_entries(cache_root):
    precompile([axpy("a"), axpy("b")], ["cuda:90"])
    assert len(list(cache_root.rglob("axpy.py"))) == 2


@pytest.mark.parametrize("damage", ["truncate", "garbage", "delete", "empty_manifest", "manifest_garbage",
                                    "manifest_edit", "folder_is_file"])  # fmt: skip
def test_damaged_binary_is_detected_and_rebuilt(cache_root, damage):
    source = axpy()
    precompile([source], ["cuda:90"])
    cubin, meta = _binary_files(cache_root, source, "cuda:90")
    good = cubin.read_bytes()
    manifest = cubin.parent / "manifest.json"
    if damage == "truncate":
        cubin.write_bytes(good[: len(good) // 2])
    elif damage == "garbage":
        cubin.write_bytes(bytes(len(good)))
    elif damage == "delete":
        meta.unlink()
    elif damage == "empty_manifest":
        manifest.write_bytes(b"")
    elif damage == "manifest_garbage":
        manifest.write_bytes(b"\x00garbage{")
    elif damage == "manifest_edit":  # valid JSON whose checksum no longer matches
        m = json.loads(manifest.read_text())
        m["values"]["triton"] = "0.0.0"
        manifest.write_text(json.dumps(m))
    elif damage == "folder_is_file":
        shutil.rmtree(cubin.parent)
        cubin.parent.write_bytes(b"not a folder")
    with pytest.warns(CacheWarning, match="damaged"):
        (result,) = precompile([source], ["cuda:90"])
    assert result.status == "compiled"
    assert cubin.read_bytes() == good  # the same compiler gives the same binary
    (again,) = precompile([source], ["cuda:90"])
    assert again.status == "hit"


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_damaged_source_is_detected_and_rebuilt(cache_root, damage):
    source = axpy()
    precompile([source], ["cuda:90"])
    (path,) = cache_root.rglob(f"{source.entry}.py")
    path.write_text(source.text[:20] if damage == "truncate" else "import os\nos.system('echo owned')\n")
    with pytest.warns(CacheWarning):
        precompile([source], ["cuda:90"])
    assert path.read_text() == source.text


def test_copied_cache_still_hits(cache_root, tmp_path, monkeypatch):
    sources = [axpy("a"), axpy("b", entry="axpy2")]
    precompile(sources, TARGETS)
    moved = tmp_path / "elsewhere" / "fuser-cache"
    shutil.copytree(cache_root, moved)
    shutil.rmtree(cache_root)  # nothing may point back at the old place
    monkeypatch.setenv("FUSER_CACHE_DIR", str(moved))
    results = precompile(sources, TARGETS)
    assert {r.status for r in results} == {"hit"}
    assert not cache_root.exists()


@pytest.mark.parametrize("what", ["fuser", "triton"])
def test_version_change_is_a_miss(cache_root, monkeypatch, what):
    import triton

    source = axpy()
    (first,) = precompile([source], ["cuda:90"])
    module = fuser if what == "fuser" else triton
    monkeypatch.setattr(module, "__version__", module.__version__ + ".post1")
    (second,) = precompile([source], ["cuda:90"])
    assert second.status == "compiled"
    assert second.key != first.key
    monkeypatch.undo()
    monkeypatch.setenv("FUSER_CACHE_DIR", str(cache_root))
    (third,) = precompile([source], ["cuda:90"])
    assert (third.status, third.key) == ("hit", first.key)


def test_target_is_part_of_the_key(cache_root):
    source = axpy()
    assert binary_key(source, "cuda:80").digest != binary_key(source, "cuda:90").digest
    precompile([source], ["cuda:80"])
    (r,) = precompile([source], ["cuda:90"])
    assert r.status == "compiled"


def test_compile_error_names_kernel_and_target(cache_root):
    with pytest.raises(CompileError, match=r"broken.*cuda:90.*undefined_name"):
        precompile([broken()], ["cuda:90"])


def test_unknown_target_is_refused(cache_root):
    with pytest.raises(ValueError, match="cuda:80"):
        precompile([axpy()], ["tpu:4"])


def test_read_only_cache_serves_hits_and_explains_misses(cache_root):
    import os
    import stat

    if os.getuid() == 0:
        pytest.skip("root writes through read-only permissions")
    precompile([axpy()], ["cuda:90"])
    folders = [p for p in cache_root.rglob("*") if p.is_dir()] + [cache_root]
    for d in folders:
        d.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        (hit,) = precompile([axpy()], ["cuda:90"])
        assert hit.status == "hit"
        with pytest.raises(CacheError, match="cannot write"):
            precompile([axpy()], ["cuda:80"])
    finally:
        for d in folders:
            d.chmod(stat.S_IRWXU)


def test_lock_held_elsewhere_times_out_with_a_clear_error(cache_root, monkeypatch):
    from filelock import FileLock

    from fuser.cache import store

    source = axpy()
    key = binary_key(source, "cuda:90").digest
    monkeypatch.setattr(store, "LOCK_TIMEOUT_S", 0.2)
    precompile([source], ["cuda:80"])  # the entry exists; its cuda:90 binary does not
    holder = FileLock(str(store.lock_path(key)))
    holder.acquire()
    try:
        # A lock held by another open file: filelock's in-process reentrancy does not apply.
        with pytest.raises(CacheError, match=r"waited .* delete .*\.lock"):
            precompile([source], ["cuda:90"])
    finally:
        holder.release()


def test_hits_write_nothing_and_unwritable_misses_explain(cache_root, monkeypatch):
    """The same as above for any user: every write goes through ``atomic_write``."""
    from fuser.cache import store

    precompile([axpy()], ["cuda:90"])

    def refuse(path, data):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(store, "atomic_write", refuse)
    (hit,) = precompile([axpy()], ["cuda:90"])
    assert hit.status == "hit"
    with pytest.raises(CacheError, match="cannot write.*permission denied"):
        precompile([axpy()], ["cuda:80"])
