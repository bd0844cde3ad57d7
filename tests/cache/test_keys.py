"""Keys: each field changes the key, and explain names the field that differs."""

import dataclasses

import pytest
from cache_helpers import axpy

import fuser
from fuser.cache.keys import binary_key, entry_key, parse_target


def test_same_source_same_key():
    assert entry_key(axpy()).digest == entry_key(axpy()).digest
    assert binary_key(axpy(), "cuda:90").digest == binary_key(axpy(), "sm_90").digest


@pytest.mark.parametrize(
    "change",
    [
        dict(text=axpy().text + "\n# one more line\n"),
        dict(num_warps=8),
        dict(num_stages=2),
        dict(constexprs=(("BLOCK", 256),)),
        dict(signature=(("x", "*fp16"), ("y", "*fp32"), ("out", "*fp32"), ("n", "i32"), ("a", "fp32"))),
    ],
)
def test_each_kernel_field_changes_the_key(change):
    base = axpy()
    other = dataclasses.replace(base, **change)
    assert entry_key(other).digest != entry_key(base).digest
    assert binary_key(other, "cuda:90").digest != binary_key(base, "cuda:90").digest


def test_meta_is_not_part_of_the_key():
    base = axpy()
    assert entry_key(dataclasses.replace(base, meta=())).digest == entry_key(base).digest


def test_versions_change_the_key(monkeypatch):
    import triton

    base = entry_key(axpy()).digest
    monkeypatch.setattr(fuser, "__version__", "9.9.9")
    assert entry_key(axpy()).digest != base
    monkeypatch.undo()
    monkeypatch.setattr(triton, "__version__", "9.9.9")
    assert entry_key(axpy()).digest != base


def test_explain_marks_the_differing_field(monkeypatch):
    old = binary_key(axpy(), "cuda:90")
    monkeypatch.setattr(fuser, "__version__", "9.9.9")
    new = binary_key(axpy(), "cuda:90")
    lines = {ln.split()[0]: ln for ln in old.explain(new)}
    assert "DIFFERS" in lines["fuser"]
    for name in ("source", "options", "triton", "target"):
        assert "same here" in lines[name]


@pytest.mark.parametrize("text", ["cuda:90", "sm_90", "sm90", "90", "CUDA:90", "sm_90a"])
def test_target_forms(text):
    assert parse_target(text) == "cuda:90"


@pytest.mark.parametrize("text", ["", "cuda", "hip:gfx942", "sm_x", "cuda:9"])
def test_bad_targets(text):
    with pytest.raises(ValueError):
        parse_target(text)
