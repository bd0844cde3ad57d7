"""Cache keys that explain themselves.

A kernel's entry is keyed by the hash of its fields: the rendered source, the launch
options, fuser's and Triton's versions and the cache format. Each compiled binary inside
an entry is keyed by the same fields plus the target and the environment variables that
change Triton's code generation. ``CacheKey.explain()`` prints one hash per field (as
Inductor's ``FxGraphHashDetails.debug_lines()`` does), so two keys that differ show which
field made the miss.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from fuser.codegen.source import KernelSource

# Bump when the layout of entries or the way binaries are produced changes.
CACHE_FORMAT = 1

_TARGET_FORMS = (
    re.compile(r"^(?:cuda:)?(?:sm_?)?(\d{2,3})a?$"),  # cuda:90, sm_90, sm90, 90, sm_90a
)


def parse_target(text: str) -> str:
    """Canonical target name (``cuda:90``) from ``cuda:90``, ``sm_90``, ``sm90`` or ``90``."""
    t = str(text).strip().lower()
    for form in _TARGET_FORMS:
        m = form.match(t)
        if m:
            return f"cuda:{int(m.group(1))}"
    raise ValueError(f"unknown target {text!r}: use cuda:<compute capability>, e.g. cuda:80 or cuda:90")


def gpu_target(target: str):
    """``triton.backends.compiler.GPUTarget`` of a canonical target name."""
    from triton.backends.compiler import GPUTarget

    backend, arch = parse_target(target).split(":")
    return GPUTarget(backend, int(arch), 32)


def target_dirname(target: str) -> str:
    """File-system name of a target: ``cuda:90`` -> ``cuda90``."""
    return parse_target(target).replace(":", "")


def fuser_version() -> str:
    import fuser

    return fuser.__version__


def triton_version() -> str:
    import triton

    return triton.__version__


def compiler_env() -> dict[str, str]:
    """Environment variables that change Triton's generated code (Triton's own list)."""
    from triton._C.libtriton import get_cache_invalidating_env_vars

    return dict(sorted(get_cache_invalidating_env_vars().items()))


def _sha(data: str) -> str:
    return hashlib.sha256(data.encode()).hexdigest()


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class CacheKey:
    """The fields a key is hashed from, each a JSON-able value, in a fixed order."""

    fields: tuple[tuple[str, object], ...]

    @property
    def digest(self) -> str:
        return _sha(_canonical([[name, field_hash(value)] for name, value in self.fields]))

    def field_hashes(self) -> list[tuple[str, str]]:
        return [(name, field_hash(value)) for name, value in self.fields]

    def as_json(self) -> dict:
        return {name: value for name, value in self.fields}

    @staticmethod
    def from_json(fields: dict) -> CacheKey:
        return CacheKey(tuple(fields.items()))

    def explain(self, current: CacheKey | None = None) -> list[str]:
        """One line per field: its hash and a short view of its value; with ``current``,
        fields whose hash differs from it are marked, to diagnose a miss."""
        now = dict(current.field_hashes()) if current is not None else {}
        lines = []
        for (name, value), (_, h) in zip(self.fields, self.field_hashes()):
            mark = ""
            if name in now:
                mark = "  (same here)" if now[name] == h else "  (DIFFERS here)"
            lines.append(f"{name:<16} {h[:16]}  {preview(value)}{mark}")
        return lines


def field_hash(value) -> str:
    """Hash of one field of a key (what ``cache explain`` prints beside the field)."""
    return _sha(value if isinstance(value, str) else _canonical(value))


def preview(value, width: int = 60) -> str:
    """One short line showing a field's value."""
    if isinstance(value, str) and "\n" in value:
        return f"<{len(value.splitlines())} lines, {len(value)} characters>"
    text = value if isinstance(value, str) else _canonical(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def launch_options(source: KernelSource) -> dict:
    """Everything besides the text that changes the compiled kernel or its launch."""
    return {
        "entry": source.entry,
        "signature": [list(x) for x in source.signature],
        "constexprs": [list(x) for x in source.constexprs],
        "num_warps": source.num_warps,
        "num_stages": source.num_stages,
        # (only where set, so the keys of every other kernel stay as they were)
        **({"max_registers": source.max_registers} if source.max_registers else {}),
    }


def entry_key(source: KernelSource) -> CacheKey:
    """Key of a kernel's entry (its source, and the binaries for every target)."""
    return CacheKey(
        (
            ("source", source.text),
            ("options", launch_options(source)),
            ("fuser", fuser_version()),
            ("triton", triton_version()),
            ("format", CACHE_FORMAT),
        )
    )


def binary_key(source: KernelSource, target: str) -> CacheKey:
    """Key of one compiled binary: the entry's fields plus the target and compiler env."""
    base = entry_key(source)
    return CacheKey((*base.fields, ("target", parse_target(target)), ("compiler_env", compiler_env())))
