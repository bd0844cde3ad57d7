"""Kernels of the matrix functions: the symmetric products of ``orthogonalize``.

The template (``templates/matrix.py.jinja``) holds two kernels over a stack of matrices
of one shape, one program per tile on or above the diagonal of each result (which stores
the tile and its mirror):

- ``ns_gram``: ``A = X X^T`` (``X^T X`` for a tall matrix), and the trace of each
  diagonal tile of ``A`` in fp32;
- ``ns_poly``: ``B = a I + b A + c A A``, with the first iteration's normalisation by the
  Frobenius norm folded in (``||X||_F^2`` is the trace of ``A``: the sum of the tiles').

The iteration's third product, ``B X``, is a general one: the runtime runs it as a batched
``torch.bmm``. Each kernel has a variant per shape-independent option (``TALL``, ``FIRST``,
``EVEN``: the shape is a multiple of the tiles, no masks), so ``matrix_kernel_sources``
lists them all for ahead-of-time compilation. ``MatrixTiles`` is their block shape.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from fuser.codegen.render import environment, helpers_source
from fuser.codegen.source import KernelSource


@dataclass(frozen=True)
class MatrixTiles:
    """Block shape and launch options of the matrix kernels: ``bm`` x ``bm`` result tiles,
    ``bk`` wide slices of the inner dimension (``bk`` divides ``bm``)."""

    bm: int = 128
    bk: int = 64
    num_warps: int = 8
    num_stages: int = 4

    def __post_init__(self):
        for name in ("bm", "bk"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, not {v}")
        if self.bm % self.bk:
            raise ValueError(f"bk ({self.bk}) must divide bm ({self.bm})")

    def even(self, m: int, k: int) -> bool:
        """Whether an [m, k] matrix (and its [m, m] products) needs no masks."""
        return m % self.bm == 0 and k % self.bk == 0


# The H100's fastest of the block shapes tried (benchmarks/NOTES.md); small tiles for the
# interpreter, which runs every program's tile as numpy arrays.
GPU_MATRIX_TILES = MatrixTiles()
INTERPRETER_MATRIX_TILES = MatrixTiles(bm=32, bk=32, num_warps=4, num_stages=1)


@functools.cache
def _text() -> str:
    return environment().get_template("matrix.py.jinja").render(helpers=helpers_source())


def _source(entry: str, signature: tuple, options: tuple, tiles: MatrixTiles, what: str) -> KernelSource:
    # ``what`` is the ``dtypes`` column of ``fuser cache ls`` and ``fuser precompile``
    return KernelSource(
        text=_text(),
        entry=entry,
        signature=signature,
        constexprs=(("BM", tiles.bm), ("BK", tiles.bk), *options, ("INTERPRETED", False)),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        meta=(("rule", "orthogonalize"), ("kind", "matrix"), ("dtypes", what)),
    )


def render_gram(tiles: MatrixTiles, *, tall: bool, even: bool) -> KernelSource:
    """``A = X X^T`` (``X^T X`` with ``tall``) of each bf16 matrix of a stack."""
    signature = (("x", "*bf16"), ("out", "*bf16"), ("trace", "*fp32"), ("m", "i32"), ("k", "i32"))
    what = "bf16" + (" tall" if tall else "") + ("" if even else " masked")
    return _source("ns_gram", signature, (("TALL", tall), ("EVEN", even)), tiles, what)


def render_poly(tiles: MatrixTiles, *, first: bool, even: bool) -> KernelSource:
    """``a I + b A + c A A`` of each symmetric bf16 matrix of a stack (``first``: of the
    unnormalised matrix's ``A``, scaled as the normalised one's would be)."""
    signature = (("a_mat", "*bf16"), ("out", "*bf16"), ("trace", "*fp32"), ("m", "i32"), ("ca", "fp32"),
                 ("cb", "fp32"), ("cc", "fp32"), ("eps", "fp32"))  # fmt: skip
    what = "bf16" + (" first" if first else "") + ("" if even else " masked")
    return _source("ns_poly", signature, (("FIRST", first), ("EVEN", even)), tiles, what)


def matrix_kernel_sources(tiles: MatrixTiles = GPU_MATRIX_TILES) -> list[KernelSource]:
    """Every variant of the matrix kernels with ``tiles``: what a rule with a matrix
    function may launch on a GPU, whatever its shapes."""
    flags = (False, True)
    return [render_gram(tiles, tall=t, even=e) for t in flags for e in flags] + [
        render_poly(tiles, first=f, even=e) for f in flags for e in flags
    ]
