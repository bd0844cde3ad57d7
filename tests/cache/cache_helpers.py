"""Small hand-written kernels for testing the cache without the rest of the pipeline."""

from __future__ import annotations

from pathlib import Path

from fuser.codegen.source import KernelSource

AXPY = """\
# test kernel {tag}
import triton
import triton.language as tl


@triton.jit
def {entry}(x, y, out, n, a, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    xv = tl.load(x + offs, mask=mask)
    yv = tl.load(y + offs, mask=mask)
    tl.store(out + offs, a * xv + yv, mask=mask)
"""

BROKEN = """\
import triton
import triton.language as tl


@triton.jit
def {entry}(x, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x + offs, tl.load(x + offs) + undefined_name)
"""


def axpy(tag: str = "a", entry: str = "axpy", block: int = 128, rule: str = "axpy_rule") -> KernelSource:
    """out = a * x + y over n fp32 elements; ``tag`` changes only a comment (a new key)."""
    return KernelSource(
        text=AXPY.format(tag=tag, entry=entry),
        entry=entry,
        signature=(("x", "*fp32"), ("y", "*fp32"), ("out", "*fp32"), ("n", "i32"), ("a", "fp32")),
        constexprs=(("BLOCK", block),),
        num_warps=4,
        num_stages=1,
        meta=(("rule", rule), ("kind", "test"), ("dtypes", "fp32")),
    )


def broken(entry: str = "broken") -> KernelSource:
    return KernelSource(
        text=BROKEN.format(entry=entry),
        entry=entry,
        signature=(("x", "*fp32"), ("n", "i32")),
        constexprs=(("BLOCK", 64),),
        num_warps=4,
        num_stages=1,
        meta=(("rule", "broken_rule"), ("kind", "test"), ("dtypes", "fp32")),
    )


def files_state(root: Path) -> dict:
    """(inode, mtime, bytes) of every file under ``root`` except locks."""
    return {
        p.relative_to(root): (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes())
        for p in root.rglob("*")
        if p.is_file() and p.suffix != ".lock"
    }


MIDDLE = """\
import triton
import triton.language as tl


@triton.jit
def scale(x, BLOCK: tl.constexpr, n, SCALE: tl.constexpr, out):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out + offs, tl.load(x + offs, mask=mask) * SCALE, mask=mask)
"""


def middle() -> KernelSource:
    """Constexprs between runtime parameters: launch arguments must interleave them."""
    return KernelSource(
        text=MIDDLE,
        entry="scale",
        signature=(("x", "*fp32"), ("n", "i32"), ("out", "*fp32")),
        constexprs=(("BLOCK", 64), ("SCALE", 3)),
        num_warps=2,
        num_stages=1,
        meta=(("rule", "scale_rule"), ("kind", "test"), ("dtypes", "fp32")),
    )
