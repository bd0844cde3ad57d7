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


MIXED = """\
import triton
import triton.language as tl


@triton.jit
def mixed(ints, a1, A: tl.constexpr, a8, a16, a32, a64, u8, u32, u64, B: tl.constexpr, floats, f32, f64):
    tl.store(ints + 0, a1.to(tl.int64))
    tl.store(ints + 1, a8.to(tl.int64))
    tl.store(ints + 2, a16.to(tl.int64))
    tl.store(ints + 3, a32.to(tl.int64))
    tl.store(ints + 4, a64)
    tl.store(ints + 5, u8.to(tl.int64))
    tl.store(ints + 6, u32.to(tl.int64))
    tl.store(ints + 7, u64.to(tl.int64))
    tl.store(ints + 8, A * 100 + B)
    tl.store(floats + 0, f32.to(tl.float64))
    tl.store(floats + 1, f64)
"""

MIXED_SIGNATURE = (
    ("ints", "*i64"), ("a1", "i1"), ("a8", "i8"), ("a16", "i16"), ("a32", "i32"), ("a64", "i64"),
    ("u8", "u8"), ("u32", "u32"), ("u64", "u64"), ("floats", "*fp64"), ("f32", "fp32"), ("f64", "fp64"),
)  # fmt: skip


def mixed() -> KernelSource:
    """Every scalar type the ctypes launcher packs, constexprs between them; each value is
    written back (integers to ``ints[0:9]`` as int64, floats to ``floats[0:2]`` as fp64)."""
    return KernelSource(
        text=MIXED,
        entry="mixed",
        signature=MIXED_SIGNATURE,
        constexprs=(("A", 7), ("B", 3)),
        num_warps=1,
        num_stages=1,
        meta=(("rule", "mixed_rule"), ("kind", "test"), ("dtypes", "mixed")),
    )


TRANSPOSE = """\
import triton
import triton.language as tl


@triton.jit
def transpose(x, out, N: tl.constexpr):
    r = tl.arange(0, N)[:, None]
    c = tl.arange(0, N)[None, :]
    tl.store(out + r * N + c, tl.trans(tl.load(x + r * N + c)) * 2)
"""


def transpose(n: int = 128) -> KernelSource:
    """out = 2 * x.T for one n x n fp32 matrix; at n = 128 the kernel takes 64 KiB of
    shared memory (more than the 48 KiB a kernel gets without opting in)."""
    return KernelSource(
        text=TRANSPOSE,
        entry="transpose",
        signature=(("x", "*fp32"), ("out", "*fp32")),
        constexprs=(("N", n),),
        num_warps=4,
        num_stages=1,
        meta=(("rule", "transpose_rule"), ("kind", "test"), ("dtypes", "fp32")),
    )


TILE_COPY = """\
import triton
import triton.language as tl


@triton.jit
def tile_copy(x, out, n, B: tl.constexpr):
    # out[i:i+B, :B] = x[i:i+B, :B] through tensor descriptors (TMA on sm_90)
    src = tl.make_tensor_descriptor(x, shape=[n, B], strides=[B, 1], block_shape=[B, B])
    dst = tl.make_tensor_descriptor(out, shape=[n, B], strides=[B, 1], block_shape=[B, B])
    i = tl.program_id(0) * B
    dst.store([i, 0], src.load([i, 0]))
"""


def tile_copy() -> KernelSource:
    """A kernel that makes two tensor descriptors: on sm_90, global scratch per program."""
    return KernelSource(
        text=TILE_COPY,
        entry="tile_copy",
        signature=(("x", "*fp32"), ("out", "*fp32"), ("n", "i32")),
        constexprs=(("B", 32),),
        num_warps=4,
        num_stages=1,
        meta=(("rule", "tile_copy_rule"), ("kind", "test"), ("dtypes", "fp32")),
    )


class FakeCompiled:
    """Stands in for a loaded CompiledKernel: records what the launcher is called with."""

    function = object()
    packed_metadata = (2, 1, 0)

    def __init__(self):
        self.calls = []

    @property
    def run(self):
        return lambda *a: self.calls.append(a)

    def launch_metadata(self, grid, stream, *args):
        return ("meta", grid, stream, len(args))
