"""``LossPlan`` -> ``KernelSource``: a loss epilogue inside the matmul that makes the logits.

The template (``templates/loss_matmul.py.jinja``) computes tiles ``hidden @ weight.T (+ bias)``
of ``[BM, BN]`` logits in fp32 registers with ``tl.dot`` and never stores them. Two kinds of
kernel come from one plan:

- a *sweep* per reduction pass: each program takes BM tokens and one contiguous share of the
  vocabulary tiles, reduces every tile per token (online max and sum of exponentials, sums,
  max with its first argmax) and writes its share's partials; the driver combines the shares
  in a fixed order, so results do not depend on scheduling;
- the *gradient* kernel: one program per tile recomputes the logits, forms
  ``scale * d loss / d logits`` from the combined per-token values in fp32 (the target term
  included) and stores it rounded once, for the two gradient matmuls.

The per-token values travel in the vocabulary-parallel layout of ``fuser.codegen.loss``
(``ShardLayout``: ``red`` holds ``z[y]`` then each reduction), so the loss itself is the
last kernel of that sequence, which reads ``red`` alone.

``Tiles`` is their block shape: ``Tiles.for_dtype`` the GPU defaults' fp32 step along H;
``tma``: tiles through tensor descriptors, the gradient and scaled kernels' programs
persistent; ``subtile``: the gradient kernel's output formed and stored a half tile at a
time. ``gradient_tiles`` gives the gradient kernel's default, by the functions its formula
calls and whether descriptors are TMA (``losses.api.descriptors_pay``). The scaled
schedule's per-token kernels (``templates/loss_scaled_tokens.py.jinja``) compute ``z[y]``
and ``a(z[y])``, combine the tiles' partials and form the gradient's terms; ``linear_sums``
takes sums linear in the logit as ``hidden . sum(W)``; ``scaled_exp_form`` finds the
schedule's form in a rule.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import sympy

from fuser.codegen.loss import (
    ARGMAX_COMBINE,
    LossNames,
    LossPrinter,
    comment_text,
    has_residue,
    indicator_lines,
    loss_entry,
    pass_context,
    red_loads,
    rule_context,
    shard_layout,
)
from fuser.codegen.render import MAX_COMBINE, SUM, SUM_COMBINE, environment, helpers_source, store_cast
from fuser.codegen.source import KernelSource
from fuser.ir.loss import IS_Y, Z_Y, Accumulator, LossPlan, Pass, Z, reduction_symbol
from fuser.rules.functions import ApproxTanh

TRITON_DTYPES = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}

COMMON_HEAD = (("x", None), ("w", None), ("bias", None), ("target", "*i64"), ("red", "*fp32"))
COMMON_TAIL = (
    ("hyper", "*fp32"),
    ("n_rows", "i32"),
    ("hid", "i32"),
    ("n_cols", "i32"),
    ("col_offset", "i64"),
    ("vocab_total", "i64"),
    ("ignore_index", "i64"),
)
SWEEP_ARGS = (("part", "*fp32"),)
SCALED_ARGS = (("ref", "*fp32"), ("part", "*fp32"), ("e", None), ("e_stride", "i32"))
TILE_SUMS_ARGS = (("part", "*fp32"),)
GRAD_ARGS = (
    ("scale", "*fp32"), ("scale_stride", "i32"), ("dz", None), ("dz_stride", "i32"), ("resid", "*fp32"),
)  # fmt: skip


@dataclass(frozen=True)
class Tiles:
    """Block shape and launch options of the matmul kernels. ``GROUP_M`` row blocks share
    weight tiles in the gradient kernel's order; ``even_k``: the hidden size is a multiple
    of ``BK`` (no masks along it); ``tma``: the gradient kernel's and the scaled kernel's
    programs are persistent and move their tiles through tensor descriptors (TMA on sm_90),
    which needs the hidden states, the weight and the output buffer 16-byte aligned with
    rows a multiple of 16 bytes (the sweeps keep pointer loads: through descriptors they ran
    no faster, H100); ``subtile``: the gradient kernel through descriptors forms and stores
    its output a half tile (``[bm, bn / 2]``) at a time; ``warp_specialize``: the persistent
    programs' tile loop through descriptors is Triton's ``tl.range(warp_specialize=True)``
    (sm_90: a producer warp group issues the tiles' loads, two consumer groups each take half
    of a tile's rows; Triton takes it with ``num_warps`` 4, which the check below asks for,
    and not for ``subtile``'s halves)."""

    bm: int = 128
    bn: int = 256
    bk: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    even_k: bool = True
    tma: bool = False
    subtile: bool = False
    warp_specialize: bool = False

    def __post_init__(self):
        for name in ("bm", "bn", "bk"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, not {v}")
        if self.warp_specialize and (self.num_warps != 4 or self.subtile):
            raise ValueError(
                "warp_specialize takes num_warps=4 (Triton's Hopper pass: a producer and two consumer "
                f"warp groups) and no subtile, not num_warps={self.num_warps}, subtile={self.subtile}"
            )

    def for_dtype(self, dtype: str) -> Tiles:
        """These tiles for inputs of ``dtype``: fp32 takes ``bk`` 16. Its pipeline buffers
        (``num_stages - 1`` of ``[bm + bn, bk]`` elements) then take 48 KiB for [128, 256]
        tiles, where ``bk`` 64 took 192 KiB, more than an A100 gives a block (163 KiB); and
        its ieee products ran 2.6x faster in the lean schedule (H100, fp32, forward and
        backward: T=4096, H=1024, V=32768, 93.2-93.7 -> 34.1-34.4 ms; ``bk`` 32: 34.8-35.3;
        ``benchmarks/results/loss_fp32_tiles_2026-11-27.md``)."""
        return replace(self, bk=16) if dtype == "fp32" else self

    def for_hidden(self, hid: int, aligned: bool = True) -> Tiles:
        """These tiles for hidden size ``hid``: ``even_k`` where ``hid`` is a multiple of
        ``bk`` and the inputs are ``aligned`` (16 bytes)."""
        even = hid % self.bk == 0 and aligned
        return self if even == self.even_k else Tiles(**{**self.__dict__, "even_k": even})


# The gradient kernel's tiles where the gradient calls a function besides exp (a softcap's tanh):
# its temporaries spill beside a [128, 256] tile (benchmarks/NOTES.md, "A softcap").
NARROW_GRAD = Tiles(bm=128, bn=128, bk=64, num_warps=8, num_stages=3)

# The pointer gradient kernel's tiles for the others: [256, 128] beat [128, 256] by 3-4 ms at
# llama8b, even at gist (benchmarks/NOTES.md, "tensor descriptors"; loss_kernels_2026-11-26.md).
TALL_GRAD = Tiles(bm=256, bn=128, bk=64, num_warps=8, num_stages=3)

# The same through tensor descriptors, persistent: [128, 256] is the fastest shape there
# (benchmarks/results/loss_kernels_2026-11-27.md).
WIDE_GRAD_TMA = Tiles(bm=128, bn=256, bk=64, num_warps=8, num_stages=3, tma=True)

# The same a half tile at a time, for gradients that also call approx_tanh: its temporaries
# then fit beside the [128, 256] tile (benchmarks/results/softcap_approx_2026-11-28.md).
WIDE_GRAD_TMA_SUBTILE = replace(WIDE_GRAD_TMA, subtile=True)


def warp_specialized(tiles: Tiles) -> Tiles:
    """``tiles`` with warp-specialised programs where Triton 3.6 makes them on sm_90: [128, 256]
    and [128, 128] tiles through descriptors, whole (not ``subtile``), 4 warps a group and
    GROUP_M 16; other tiles unchanged. Each tile's product and epilogue are the same operations, so the
    outputs are bit for bit the default's. H100, bf16, the kernels alone, medians of three
    alternating rounds (``benchmarks/results/loss_warp_specialized_2026-11-28.md``), ms: the
    scaled kernel on a chunk at T, H = 2304, 768: 1.121 -> 0.937; 8192, 2048: 3.626 -> 3.463;
    4096, 4096: 6.739 -> 6.845 (slower). The gradient kernel over 32768 tokens at H = 768:
    14.39 -> 13.58; 16384 at 2048: 14.89 -> 14.85; 8192 at 4096: 13.64 -> 13.88 (slower).
    The scaled kernel's [128, 128] tiles (a softcap's, ``SCALED_TILES_NARROW_TMA``), end to
    end at T, H = 32768, 768 (softcap=30, alternating processes): exact ``tanh`` 46.50-47.86
    -> 45.12-46.35 ms, ``approx_tanh`` 41.55-42.38 -> 41.35-42.63. The API takes them by
    hidden size (``fuser.runtime.loss.choice``)."""
    if tiles.tma and not tiles.subtile and tiles.bm == 128 and tiles.bn in (128, 256):
        return replace(tiles, warp_specialize=True, num_warps=4, group_m=16)
    return tiles


def tile_sums_pay(plan: LossPlan) -> bool:
    """Whether the lean forward of ``plan`` takes the tile-sums kernel (``render_loss_scaled``
    with ``store_e=False``) in place of its sweep: a plan of the scaled form whose pass calls
    no function besides ``exp`` and ``approx_tanh``. With a softcap's exact ``tanh`` the sweep
    stayed faster where it counts (H200, lean, T = 32768, H = 768: 60.6-61.8 ms against
    62.1-63.0 in [128, 128] tiles and 68.7-69.1 in [128, 256]; at T = 8192, H = 4096 the
    tile sums ran 60.5-62.5 against the sweep's 64.2-65.6; benchmarks/NOTES.md)."""
    if scaled_exp_form(plan) is None:
        return False
    (p,) = plan.passes
    exprs = [e for _, e in p.prologue + p.body] + [a.arg for a in p.accumulators]
    calls = {type(f).__name__ for e in exprs for f in e.atoms(sympy.Function)} - {"exp"}
    return calls <= {ApproxTanh.__name__}


def gradient_tiles(plan: LossPlan, tma: bool = False) -> Tiles:
    """The default block shape of ``plan``'s gradient kernel on a GPU; ``tma``: where tensor
    descriptors are TMA, for 16-bit inputs and rules whose gradient calls only ``exp`` (and
    ``approx_tanh``: ``WIDE_GRAD_TMA_SUBTILE``). Others keep pointer loads: with a softcap's
    exact tanh the [128, 128] kernel through descriptors was slower (H100, lean schedule:
    gist 68.0-68.4 against 65.3 ms, llama8b 62.9-63.3 against 63.4-63.7), and fp32 tiles
    through descriptors take 393 KB of shared memory (sm_90 has 227 KB)."""
    exprs = [e for _, e in plan.grad.body] + [plan.grad_value]
    calls = {type(f).__name__ for e in exprs for f in e.atoms(sympy.Function)} - {"exp"}
    wide = tma and plan.dtype != "fp32"
    if calls == {ApproxTanh.__name__} and wide:
        return WIDE_GRAD_TMA_SUBTILE
    if calls:
        return NARROW_GRAD.for_dtype(plan.dtype)
    return WIDE_GRAD_TMA if wide else TALL_GRAD.for_dtype(plan.dtype)


def _sum(x: str) -> str:
    return f"{SUM}({x}, 1, {SUM_COMBINE})"


def _max(x: str) -> str:
    return f"{SUM}({x}, 1, {MAX_COMBINE})"


def _accumulator_lines(acc: Accumulator, arg: str, col: int) -> tuple[list[str], list[str], list[str]]:
    """(init, update per tile, finish) of one reduction over a program's tiles; ``finish``
    stores the partial at column ``col`` of ``out`` (0 for rows that are not live)."""
    i = acc.index
    if acc.op == "logsumexp":
        # Online: the running max m and the sum s of exp(a - m), rescaled when m grows.
        # A row that has seen nothing holds m = -inf, s = 0 and a partial of -inf, which
        # the driver's logsumexp of the shares ignores; sm stands in 0 for m = -inf. Columns
        # past the vocabulary take a [1, BN] penalty, not a [BM, BN] mask: rows that are not
        # live sweep their (finite) logits, and their partial is stored as 0.
        return (
            [f'm{i} = tl.full((BM,), float("-inf"), tl.float32)', f"s{i} = tl.full((BM,), 0.0, tl.float32)"],
            [
                f'a{i} = {arg} + tl.where(lcols < n_cols, 0.0, float("-inf"))',
                f"nm{i} = tl.maximum(m{i}, {_max(f'a{i}')})",
                f'sm{i} = tl.where(nm{i} == float("-inf"), 0.0, nm{i})',
                f"s{i} = s{i} * tl.exp(m{i} - sm{i}) + {_sum(f'tl.exp(a{i} - sm{i}[:, None])')}",
                f"m{i} = nm{i}",
            ],
            [
                f'p{i} = tl.where(s{i} > 0.0, m{i} + tl.log(tl.where(s{i} > 0.0, s{i}, 1.0)), float("-inf"))',
                f"tl.store(out + {col}, tl.where(live_row, p{i}, 0.0), mask=row_ok)",
            ],
        )
    if acc.op == "sum":
        return (
            [f"acc{i} = tl.full((BM,), 0.0, tl.float32)"],
            [f"acc{i} += {_sum(f'tl.where(mask, {arg}, 0.0)')}"],
            [f"tl.store(out + {col}, tl.where(live_row, acc{i}, 0.0), mask=row_ok)"],
        )
    if acc.op == "max":
        # The first column holding the maximum: the first in a tile (ties to the left),
        # a later tile only when strictly greater. Positions in the tile are reduced (the
        # interpreter returns positions whatever index values it is given).
        return (
            [f'mx{i} = tl.full((BM,), float("-inf"), tl.float32)', f"am{i} = tl.full((BM,), 0, tl.int64)"],
            [
                f'a{i} = tl.where(mask, {arg}, float("-inf"))',
                f"tm{i}, ta{i} = {SUM}((a{i}, tl.broadcast_to(tl.arange(0, BN)[None, :], (BM, BN))), 1, "
                f"{ARGMAX_COMBINE})",
                f"am{i} = tl.where(tm{i} > mx{i}, ta{i} + t * BN + col_offset, am{i})",
                f"mx{i} = tl.maximum(mx{i}, tm{i})",
            ],
            [
                f"tl.store(out + {col}, tl.where(live_row, mx{i}, 0.0), mask=row_ok)",
                f"tl.store(out + {col + 1}, am{i}.to(tl.float32), mask=row_ok)",
            ],
        )
    raise ValueError(f"unknown reduction {acc.op!r}")


def _red_loads(plan: LossPlan, layout, passes: int) -> list[str]:
    """``z_y`` and the reductions of the first ``passes`` passes, per row, from ``red``:
    loaded as ``[BM]`` vectors, then made ``[BM, 1]`` columns (a column loaded as such takes
    the matmul tile's layout: one load per element of a thread's share of the tile)."""
    loads = red_loads(plan, layout, passes, "at", "tl.int64")
    names = [line.split(" = ", 1)[0] for line in loads]
    return loads + [f"{n} = {n}[:, None]" for n in names]


def _sweep_context(p: Pass, printer, layout, stage: int) -> dict:
    cols = {i: c for i, _, c in layout.part_cols[stage]}  # each partial's column of `part`
    return pass_context(p, printer, lambda acc, arg: _accumulator_lines(acc, arg, cols[acc.index]))


def _grad_context(plan: LossPlan, printer) -> dict:
    exprs = [e for _, e in plan.grad.body] + [plan.grad_value]
    body = []
    if any(IS_Y in e.free_symbols for e in exprs):
        # the target's column in this call's rows, 32-bit (-1 outside them): one 32-bit
        # compare per element where 64-bit columns took several (H100, the kernel alone:
        # gist 0.296-0.303 -> 0.283 ms a slice, llama8b 0.755-0.798 -> 0.712)
        body += [
            "y_local = y - col_offset",
            "y_local = tl.where((y_local >= 0) & (y_local < n_cols), y_local, -1).to(tl.int32)",
            "is_y = (lcols == y_local).to(tl.float32)",
        ]
    body += indicator_lines(exprs, printer)
    body += [f"{printer.names[s]} = {printer.doprint_expr(e)}" for s, e in plan.grad.body]
    target_lines, target_value = _at_target(plan, printer)
    return dict(
        epilogue=[f"{printer.names[s]} = {printer.doprint_expr(e)}" for s, e in plan.epilogue],
        grad_body=body,
        grad_value=printer.doprint_expr(plan.grad_value),
        store=store_cast("d", plan.dtype),
        residue=has_residue(plan),
        target_lines=target_lines,
        target_value=target_value,
        rounded=f"{store_cast('d_y', plan.dtype)}.to(tl.float32)",
    )


def _at_target(plan: LossPlan, printer) -> tuple[list[str], str]:
    """d loss / d logits at the target's column, per row (``[BM, 1]``): the gradient with
    its body inlined, ``z`` at ``z_y``, the target indicator 1 and each argmax indicator
    whether the target is the argmax. Returns (indicator lines, value)."""
    e = _inlined(plan.grad_value, plan.grad.body).subs({Z: Z_Y, IS_Y: 1})
    lines, subs = [], {}
    for s in sorted((s for s in e.free_symbols if s.name.startswith("is_max$")), key=lambda s: s.name):
        i = s.name.split("$")[1]
        at_y = sympy.Symbol(f"is_max_y${i}", real=True)
        subs[s] = at_y
        lines.append(f"{printer.names[at_y]} = (y == am{i}).to(tl.float32)")
    return lines, printer.doprint_expr(e.subs(subs))


def matmul_entry(plan: LossPlan, stage: int | None, tma: bool = False) -> str:
    if stage is not None:
        return loss_entry(plan) + f"_mm{stage}"
    return loss_entry(plan) + ("_mm_grad_tma" if tma else "_mm_grad")


@dataclass(frozen=True)
class ScaledExp:
    """A rule whose logit gradient factors as ``D(z) * A * exp(a(z) - r) + B * [z is the target]
    + C``, with ``r`` its one logsumexp of ``a(z)``, ``A``, ``B``, ``C`` per-token values
    (sympy, in ``z_y``, the reductions ``r$i``, ``vocab$`` and hyperparameters) and ``D``
    (``factor``) 1, or ``a'(z)`` where ``a`` is not linear (a softcap's ``1 - tanh**2``; then
    ``C`` is 0). Then the forward matmul can store ``E = D(z) * exp(a(z) - a(z_y))`` before
    ``r`` is known, and the gradient is ``s * E + B * [target] + C`` with ``s = A * exp(a(z_y)
    - r)`` per token: the gradient matmuls read ``E`` and apply ``s`` to their output rows
    (``grad_hidden``) or to ``hidden``'s rows (``grad_weight``)."""

    lse: int  # the logsumexp's reduction index
    arg: sympy.Expr  # a(z), in z and hyperparameters
    ref: sympy.Expr  # a(z_y)
    scale: sympy.Expr  # A
    target: sympy.Expr  # B
    const: sympy.Expr  # C
    factor: sympy.Expr = sympy.Integer(1)  # D(z), in z and hyperparameters


def _inlined(e: sympy.Expr, *definitions) -> sympy.Expr:
    """``e`` with the symbols of each ``(symbol, value)`` sequence replaced by their values
    (later definitions read earlier ones)."""
    for defs in definitions:
        for sym, value in reversed(defs):
            e = e.subs(sym, value)
    return e


def scaled_exp_form(plan: LossPlan) -> ScaledExp | None:
    """``plan``'s gradient in the form ``ScaledExp`` describes, or ``None``: it must have one
    reduction pass, of one logsumexp and any sums, and a gradient whose ``z``-dependence is
    the softmax term alone, or the softmax term times ``a'(z)`` with no constant term (a
    max, a second pass, or a softcap beside label smoothing's mean rule it out). The target
    term's coefficient is taken at ``z = z_y``, where it applies."""
    # (sympy's simplify takes seconds a call: the form is found once per process for the
    # parts of a plan it reads, which every dtype of a rule shares)
    return _scaled_exp_form(plan.passes, plan.grad_value, plan.grad.body, plan.epilogue)


@functools.cache
def _scaled_exp_form(passes, grad_value, grad_body, epilogue) -> ScaledExp | None:
    if len(passes) != 1:
        return None
    (p,) = passes
    lses = [a for a in p.accumulators if a.op == "logsumexp"]
    if len(lses) != 1 or any(a.op not in ("logsumexp", "sum") for a in p.accumulators):
        return None
    arg = _inlined(lses[0].arg, p.body, p.prologue)
    if Z not in arg.free_symbols:
        return None
    g = _inlined(grad_value, grad_body, epilogue)
    target = _tidy((g.subs(IS_Y, 1) - g.subs(IS_Y, 0)).subs(Z, Z_Y))
    rest = g.subs(IS_Y, 0)
    softmax = sympy.exp(arg - reduction_symbol(lses[0].index))
    factor = sympy.Integer(1)
    terms = _softmax_terms(rest, softmax)
    if terms is None:  # a(z) not linear: every term of the rest may carry a'(z)
        factor = sympy.diff(arg, Z)
        terms = _softmax_terms(sympy.simplify(rest / factor), softmax) if Z in factor.free_symbols else None
        if terms is not None and terms[1] != 0:  # (C * a'(z) would be a per-logit term)
            terms = None
    if terms is None or any(Z in e.free_symbols or IS_Y in e.free_symbols for e in (target, *terms)):
        return None
    return ScaledExp(lses[0].index, arg, arg.subs(Z, Z_Y), *terms[:1], target, terms[1], factor)


def _tidy(e: sympy.Expr) -> sympy.Expr:
    """``e`` simplified, unless that brings in functions ``e`` does not call (``1 - tanh**2``
    becomes ``cosh**-2``, which no kernel spells)."""
    s = sympy.simplify(e)
    kinds = lambda x: {type(f) for f in x.atoms(sympy.Function)}  # noqa: E731
    return s if kinds(s) <= kinds(e) else e


def _softmax_terms(rest: sympy.Expr, softmax: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr] | None:
    """``(A, C)`` with ``rest = A * softmax + C``, both free of ``z``, or ``None``."""
    ratio = sympy.diff(rest, Z) / sympy.diff(softmax, Z)
    if _varies_with(ratio, Z):  # (no form of A is free of z: simplify, seconds, cannot find one)
        return None
    scale = _tidy(ratio)
    if scale == 0 or Z in scale.free_symbols:
        return None
    const = _tidy(rest - scale * softmax)
    if Z in const.free_symbols:
        return None
    return scale, const


def _varies_with(e: sympy.Expr, x: sympy.Symbol) -> bool:
    """Whether ``e`` takes two values at two values of ``x``, every other symbol fixed (at
    values of its own, the same each call), in 30-digit arithmetic: then every expression
    equal to ``e`` has ``x`` in it. ``False`` says nothing (a value that is not a finite
    real number, a function evalf cannot evaluate, or equal values)."""
    others = sorted(e.free_symbols - {x}, key=lambda s: s.name)
    fixed = {s: sympy.Float(0.61 + 0.37 * i, 30) for i, s in enumerate(others)}
    values = []
    for at in ("0.29", "0.83"):
        v = e.xreplace({**fixed, x: sympy.Float(at, 30)}).evalf(30)
        if not (v.is_Number and v.is_finite and v.is_real):
            return False
        values.append(v)
    a, b = values
    return abs(a - b) > 1e-20 * max(abs(a), abs(b), 1)


def linear_sums(plan: LossPlan) -> dict[int, tuple[sympy.Expr, sympy.Expr]]:
    """The sums of a one-pass plan whose argument is linear in the logit, ``alpha * z +
    beta`` (``alpha``, ``beta`` per token): ``{reduction index: (alpha, beta)}``. Over the
    vocabulary such a sum is ``alpha * (hidden . sum of weight's rows) + beta * V``, with
    no reduction over the logits (the scaled schedule takes them so)."""
    (p,) = plan.passes
    out = {}
    for acc in p.accumulators:
        if acc.op != "sum":
            continue
        arg = sympy.expand(_inlined(acc.arg, p.body, p.prologue))
        alpha = sympy.simplify(sympy.diff(arg, Z))
        beta = sympy.simplify(arg.subs(Z, 0))
        per_element = {Z, IS_Y} | {s for s in arg.free_symbols if s.name.startswith("is_max$")}
        if alpha != 0 and not (alpha.free_symbols | beta.free_symbols) & per_element:
            out[acc.index] = (alpha, beta)
    return out


def scaled_part_columns(plan: LossPlan) -> tuple[int, dict[int, int]]:
    """The scaled kernel's partials per token and tile: ``(width, {reduction index: column})``.
    The logsumexp takes columns 0 (the sum of ``exp(a(z) - m)``) and 1 (the tile's max ``m``
    of ``a(z)``), each sum one column after them, but those ``linear_sums`` takes."""
    (p,) = plan.passes
    linear = linear_sums(plan)
    sums = [a.index for a in p.accumulators if a.op == "sum" and a.index not in linear]
    lse = next(a.index for a in p.accumulators if a.op == "logsumexp")
    return 2 + len(sums), {lse: 0, **{i: 2 + k for k, i in enumerate(sums)}}


def _scaled_context(plan: LossPlan, printer, store_e: bool = True) -> dict:
    """The scaled-exponential forward's lines: the pass's per-token and per-element values,
    ``ev`` (E, where ``store_e``) and each reduction's partials of the tile."""
    (p,) = plan.passes
    width, cols = scaled_part_columns(plan)
    form = scaled_exp_form(plan)
    finish, exp_lines = [], []
    for acc in p.accumulators:
        if acc.op == "logsumexp":
            shared, arg, factor = _arg_and_factor(acc.arg, p, form, printer)
            # (the columns past the vocabulary through a [1, BN] penalty rather than a
            # [BM, BN] mask; rows with no live target have r_ref = +inf, so E is 0 there)
            exp_lines = shared + [
                f'a_lse = {arg} + tl.where(lcols < n_cols, 0.0, float("-inf"))',
                f"t_max = {_max('a_lse')}",
                't_max = tl.where(t_max == float("-inf"), 0.0, t_max)',
                "u = tl.exp(a_lse - t_max[:, None])",
            ]
            if store_e:
                ev = "ev = u * tl.exp(t_max[:, None] - r_ref)"
                exp_lines.append(ev + (f" * ({factor})" if factor else ""))
            finish += [
                f"tl.store(out + {cols[acc.index]}, {_sum('u')}, mask=row_ok)",
                f"tl.store(out + {cols[acc.index] + 1}, t_max, mask=row_ok)",
            ]
        elif acc.index in cols:  # (a linear sum is none of the kernel's work)
            # (as for the logsumexp: rows with no live target sum finite values read by nothing)
            value = _sum(f"tl.where(lcols < n_cols, {printer.doprint_expr(acc.arg)}, 0.0)")
            finish.append(f"tl.store(out + {cols[acc.index]}, {value}, mask=row_ok)")
    context = pass_context(p, printer, lambda acc, arg: ([], [], []))
    return dict(
        prologue=context["prologue"],
        body=context["body"],
        exp_lines=exp_lines,
        finish=finish,
        part_width=width,
        store=store_cast("ev", plan.dtype),
        store_e=store_e,
    )


def _arg_and_factor(arg: sympy.Expr, p, form: ScaledExp, printer) -> tuple[list[str], str, str | None]:
    """The lines of what ``a(z)`` and its derivative ``D(z)`` share (a softcap's ``tanh``, once
    per logit), and the two printed; ``None`` for ``D`` where the form has none."""
    if form.factor == 1:
        return [], printer.doprint_expr(arg), None
    whole = _inlined(arg, p.body)  # (in z and the prologue's values)
    shared, (a, d) = sympy.cse([whole, sympy.diff(whole, Z)], symbols=sympy.numbered_symbols("sf$"))
    lines = [f"{printer.names[s]} = {printer.doprint_expr(e)}" for s, e in shared]
    return lines, printer.doprint_expr(a), printer.doprint_expr(d)


def render_loss_scaled(
    plan: LossPlan, tiles: Tiles = Tiles(), *, has_bias: bool = False, store_e: bool = True
) -> KernelSource:
    """The scaled-exponential forward kernel of a plan that ``scaled_exp_form`` accepts; with
    ``tiles.tma``, persistent programs moving tiles through tensor descriptors (x, the weight
    and ``e`` 16-byte aligned, rows a multiple of 16 bytes; on a GPU for 16-bit inputs: fp32
    tiles through descriptors overflow sm_90's shared memory). ``store_e=False``: the same
    kernel without ``E`` (no ``ref``, ``e`` or ``e_stride``), only each tile's partials: the
    lean schedule's forward for such a plan (``*_mm_tile_sums``)."""
    if scaled_exp_form(plan) is None:
        raise ValueError(f"loss rule {plan.name!r} has no scaled-exponential form (see scaled_exp_form)")
    layout = shard_layout(plan)
    printer = LossPrinter(LossNames(plan.hyper))
    kind = "_mm_scaled" if store_e else "_mm_tile_sums"
    entry = loss_entry(plan) + kind + ("_tma" if tiles.tma else "")
    context = dict(
        **rule_context(plan),
        entry=entry,
        red_width=layout.red_width,
        grad=False,
        scaled=True,
        tma=tiles.tma,
        loads=_red_loads(plan, layout, 0),
        dot_options=', input_precision="ieee"' if plan.dtype == "fp32" else "",
        **_scaled_context(plan, printer, store_e),
    )
    return _matmul_source(plan, context, entry, SCALED_ARGS if store_e else TILE_SUMS_ARGS, tiles, has_bias)


# Tokens per program of the scaled schedule's per-token kernel, and the vocabulary tiles it
# reads at a time; columns per program of its gradient-term kernels.
TOKEN_BLOCK = 32
TOKEN_TILES = 64
TERM_BLOCK = 256
# The most tokens of one target that one program of grad_weight's target term sums; a
# target with more is summed in pieces of this many, then the pieces in order.
TARGET_PIECE = 64
# Tokens per program of its z[y] kernel, and the hidden-dimension step.
PREPARE_ROWS = 16
PREPARE_STEP = 128


# The signatures of the scaled schedule's per-token and gradient-term kernels (None: the
# inputs' pointer type).
PREPARE_ARGS = (
    ("x", None), ("w", None), ("wsum", "*fp32"), ("target", "*i64"), ("red", "*fp32"), ("ref", "*fp32"),
    ("hyper", "*fp32"), ("n_rows", "i32"), ("hid", "i32"), ("vocab_total", "i64"),
)  # fmt: skip
TOKENS_ARGS = (
    ("part", "*fp32"), ("tiles_n", "i32"), ("n_rows", "i32"), ("red", "*fp32"), ("ref", "*fp32"),
    ("target", "*i64"), ("coef", "*fp32"), ("scale", "*fp32"), ("hyper", "*fp32"),
    ("vocab_total", "i64"), ("ignore_index", "i64"),
)  # fmt: skip
HIDDEN_TERMS_ARGS = (
    ("prod", "*fp32"), ("coef", "*fp32"), ("target", "*i64"), ("w", None), ("wsum", "*fp32"),
    ("gx", None), ("x", None), ("xs", None), ("hid", "i32"), ("vocab_total", "i64"),
)  # fmt: skip


def _run_args(out_dtype: str) -> tuple:
    return (
        ("starts", "*i64"), ("ends", "*i64"), ("slot", "*i64"), ("pieces", "*fp32"),
        ("out", TRITON_DTYPES[out_dtype]), ("pos0", "i32"), ("key0", "i64"), ("hid", "i32"),
        ("n_keys", "i64"),
    )  # fmt: skip


def _small_source(text: str, entry: str, dtype: str, args, constexprs, num_stages: int, meta) -> KernelSource:
    """One of the scaled schedule's kernels around its matmul (4 warps)."""
    ptr = TRITON_DTYPES[dtype]
    return KernelSource(
        text=text,
        entry=entry,
        signature=tuple((n, t or ptr) for n, t in args),
        constexprs=(*constexprs, ("INTERPRETED", False)),
        num_warps=4,
        num_stages=num_stages,
        meta=meta,
    )


def _tokens_context(plan: LossPlan, form: ScaledExp) -> dict:
    """What the per-token kernels' template reads besides their entries' names."""
    layout = shard_layout(plan)
    printer = LossPrinter(LossNames(plan.hyper))
    width, cols = scaled_part_columns(plan)
    exprs = dict(ref=form.ref, a=form.scale, b=form.target, c=form.const)
    return dict(
        kind="tokens",
        **rule_context(plan),
        part_width=width,
        red_width=layout.red_width,
        red_cols=layout.red_cols,
        lse=form.lse,
        lse_col=cols[form.lse],
        lse_red_col=layout.red_cols[form.lse],
        sums=[(i, c) for i, c in cols.items() if i != form.lse],
        linear=[
            (layout.red_cols[i], printer.doprint_expr(alpha), printer.doprint_expr(beta))
            for i, (alpha, beta) in sorted(linear_sums(plan).items())
        ],
        **{k: printer.doprint_expr(e) for k, e in exprs.items()},
        **{f"comment_{k}": comment_text(e) for k, e in exprs.items()},
        max_rows=lambda v: f"{SUM}({v}, 1, {MAX_COMBINE})",
        sum_rows=lambda v: f"{SUM}({v}, 1, {SUM_COMBINE})",
    )


def render_scaled_tokens(plan: LossPlan) -> tuple[KernelSource, KernelSource]:
    """The scaled schedule's per-token kernels of a plan that ``scaled_exp_form`` accepts:
    (prepare, tokens). ``prepare``, once per call: each token's ``z[y]`` and ``ref =
    a(z[y])`` (and the sums linear in ``z``: ``linear_sums``). ``tokens``, once per chunk:
    the tile partials combined into the chunk's reductions, and each token's ``s``, ``B``
    and ``C`` (times the gradient's scale) for the gradient matmuls and their terms."""
    form = scaled_exp_form(plan)
    if form is None:
        raise ValueError(f"loss rule {plan.name!r} has no scaled-exponential form (see scaled_exp_form)")
    entry, prepare_entry = loss_entry(plan) + "_scaled_tokens", loss_entry(plan) + "_scaled_prepare"
    text = (
        environment()
        .get_template("loss_scaled_tokens.py.jinja")
        .render(entry=entry, prepare_entry=prepare_entry, **_tokens_context(plan, form))
    )
    meta = (("rule", plan.name), ("kind", "loss-scaled-tokens"), ("dtypes", f"hidden:{plan.dtype}"))
    prepare = (("BT", PREPARE_ROWS), ("BK", PREPARE_STEP))
    tokens = (("BT", TOKEN_BLOCK), ("TB", TOKEN_TILES))
    return (
        _small_source(text, prepare_entry, plan.dtype, PREPARE_ARGS, prepare, 2, meta),
        _small_source(text, entry, plan.dtype, TOKENS_ARGS, tokens, 3, meta),
    )


def render_scaled_terms(dtype: str, *, has_target: bool, has_const: bool) -> tuple[KernelSource, ...]:
    """The scaled schedule's gradient-term kernels for ``dtype`` inputs (any rule):
    ``grad_hidden`` from the fp32 product ``E @ W`` and the per-token ``s``, ``B``, ``C`` (and
    ``s * hidden``, ``grad_weight``'s right operand); then ``grad_weight``'s target term,
    ``B * hidden`` into row ``y`` in fp32 (``render_target_rows``, ``B`` read from ``coef``'s
    second column)."""
    text = (
        environment()
        .get_template("loss_scaled_tokens.py.jinja")
        .render(kind="terms", dtype=dtype, helpers=helpers_source(), store=store_cast("v", dtype))
    )
    meta = (("kind", "loss-scaled-terms"), ("dtypes", f"hidden:{dtype}"))
    flags = (("BH", TERM_BLOCK), ("HAS_TARGET", has_target), ("HAS_CONST", has_const))
    return (
        _small_source(text, "scaled_hidden_grad", dtype, HIDDEN_TERMS_ARGS, flags, 1, meta),
        *render_target_rows(dtype, coef=(3, 1)),
    )


# Elements per program of ``grad_scale`` (8 warps: 16 a thread).
GRAD_SCALE_BLOCK = 4096


def render_grad_scale(src: str, dst: str) -> KernelSource:
    """The kernel that multiplies a gradient taken in forward by ``grad_output`` (an fp32
    device value) in backward: ``src`` elements in, ``dst`` out (in place where they are one
    tensor), rounded once, in one pass over memory."""
    text = (
        environment()
        .get_template("loss_grad_scale.py.jinja")
        .render(src=src, dst=dst, helpers=helpers_source(), store=store_cast("v", dst))
    )
    return KernelSource(
        text=text,
        entry="grad_scale",
        signature=(("src", TRITON_DTYPES[src]), ("go", "*fp32"), ("dst", TRITON_DTYPES[dst]), ("n", "i64")),
        constexprs=(("BLOCK", GRAD_SCALE_BLOCK), ("INTERPRETED", False)),
        num_warps=8,
        num_stages=1,
        meta=(("kind", "loss-grad-scale"), ("dtypes", f"in:{src},out:{dst}")),
    )


def _target_rows_text(dtype: str, out_dtype: str = "fp32", assign: bool = False) -> str:
    """The target-row kernels' module for ``dtype`` inputs and ``out_dtype`` rows (one
    rounding per row); ``assign``: each key's row is written, not added to."""
    return (
        environment()
        .get_template("loss_target_rows.py.jinja")
        .render(dtype=dtype, out_dtype=out_dtype, assign=assign, helpers=helpers_source(),
                store=store_cast("v", out_dtype))
    )  # fmt: skip


def render_target_rows(
    dtype: str, *, coef: tuple[int, int] = (1, 0), out_dtype: str = "fp32", assign: bool = False
) -> tuple[KernelSource, KernelSource]:
    """The two kernels that add ``c[t] * hidden[t]`` (``dtype`` inputs) to row ``key[t]`` of
    an ``out_dtype`` matrix (``assign``: write each key's sum there instead), with no atomics,
    over the tokens sorted by key (runs of one key in pieces of at most ``TARGET_PIECE``
    tokens, then each long run's pieces in order); token ``t``'s coefficient at
    ``coef[0] * t + coef[1]``."""
    text = _target_rows_text(dtype, out_dtype, assign)
    meta = (("kind", "loss-target-rows"), ("dtypes", f"hidden:{dtype},out:{out_dtype}"))
    runs = (("BH", TERM_BLOCK), ("L", TARGET_PIECE))
    head = (("x", None), ("coef", "*fp32"), ("key", "*i64"), ("order", "*i64"))
    return (
        _small_source(
            text, "target_rows_pieces", dtype, (*head, *_run_args(out_dtype)),
            (*runs, ("CS", coef[0]), ("CC", coef[1])), 3, meta,
        ),
        _small_source(
            text, "target_rows_runs", dtype, (("key", "*i64"), *_run_args(out_dtype)), runs, 3, meta
        ),
    )  # fmt: skip


def render_target_gather(dtype: str, *, coef: tuple[int, int] = (1, 0)) -> KernelSource:
    """The kernel that adds ``c[t] * weight[key[t]]`` (``dtype`` weight) to row ``t`` of an
    fp32 ``[T, H]`` matrix (no key: nothing), one program per (token, ``TERM_BLOCK`` columns)."""
    args = (
        ("w", None),
        ("coef", "*fp32"),
        ("key", "*i64"),
        ("out", "*fp32"),
        ("hid", "i32"),
        ("n_keys", "i64"),
    )
    meta = (("kind", "loss-target-rows"), ("dtypes", f"hidden:{dtype}"))
    flags = (("BH", TERM_BLOCK), ("CS", coef[0]), ("CC", coef[1]))
    return _small_source(_target_rows_text(dtype), "target_rows_gather", dtype, args, flags, 1, meta)


# The weight-gradient kernel's tiles: [128 vocabulary rows, 256 hidden columns], BK tokens
# a step, persistent programs (``render_weight_grad``).
WEIGHT_GRAD_TILES = Tiles(bm=128, bn=256, bk=64, group_m=8, num_warps=8, num_stages=3, tma=True)
WEIGHT_GRAD_FLATTEN = False
WEIGHT_GRAD_ARGS = (
    ("dz", None), ("dz_stride", "i32"), ("x", None), ("gw", None), ("flag", "*i8"), ("key0", "i64"),
    ("n_tok", "i32"), ("hid", "i32"), ("n_cols", "i32"),
)  # fmt: skip


def render_weight_grad(
    dtype: str, tiles: Tiles = WEIGHT_GRAD_TILES, flatten: bool = WEIGHT_GRAD_FLATTEN
) -> tuple[KernelSource, ...]:
    """The kernels that write a slice of a 16-bit ``grad_weight``, ``dz.T @ hidden`` with the
    target column's residue rows (``resid[t] * hidden[t]`` into row ``y_t``), accumulated in
    fp32 and rounded once: the target-row kernels, which write each target's residue row into
    ``grad_weight`` (rounded once to ``dtype``), then ``weight_grad_tma``
    (``templates/loss_weight_grad.py.jinja``), persistent programs whose tiles move through
    tensor descriptors and which add those rows to their product (``flatten``: the tile loop
    flattened with the token loop, so that the next tile's loads start under this one's
    epilogue; that takes one more stage of shared memory)."""
    if dtype not in ("bf16", "fp16"):
        raise ValueError(
            f"the weight-gradient kernel writes a 16-bit grad_weight (bf16 or fp16), not {dtype}"
        )
    text = (
        environment()
        .get_template("loss_weight_grad.py.jinja")
        .render(dtype=dtype, helpers=helpers_source(), store=store_cast("acc", dtype), flatten=flatten)
    )
    ptr = TRITON_DTYPES[dtype]
    kernel = KernelSource(
        text=text,
        entry="weight_grad_tma",
        signature=tuple((n, t or ptr) for n, t in WEIGHT_GRAD_ARGS),
        constexprs=(
            ("BM", tiles.bm),
            ("BN", tiles.bn),
            ("BK", tiles.bk),
            ("GROUP_M", tiles.group_m),
            ("INTERPRETED", False),
        ),  # fmt: skip
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        meta=(("kind", "loss-weight-grad"), ("dtypes", f"hidden:{dtype}")),
    )
    return (*render_target_rows(dtype, out_dtype=dtype, assign=True), kernel)


def _matmul_source(
    plan: LossPlan, context: dict, entry: str, args, tiles: Tiles, has_bias: bool
) -> KernelSource:
    """The ``KernelSource`` of one loss matmul kernel: the template rendered with ``context``,
    ``args`` (the kernel's own) between the common parameters."""
    text = (
        environment()
        .get_template("loss_matmul.py.jinja")
        .render(**context, warp_specialize=context["tma"] and tiles.warp_specialize)
    )
    ptr = TRITON_DTYPES[plan.dtype]
    middle = tuple((n, t or ptr) for n, t in args)
    return KernelSource(
        text=text,
        entry=entry,
        signature=tuple((n, t or ptr) for n, t in COMMON_HEAD) + middle + COMMON_TAIL,
        constexprs=(
            ("BM", tiles.bm),
            ("BN", tiles.bn),
            ("BK", tiles.bk),
            ("GROUP_M", tiles.group_m),
            ("EVEN_K", tiles.even_k),
            ("HAS_BIAS", has_bias),
            ("INTERPRETED", False),
        ),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        meta=(("rule", plan.name), ("kind", "loss-matmul"), ("dtypes", f"hidden:{plan.dtype}")),
    )


def render_loss_matmul(
    plan: LossPlan, tiles: Tiles = Tiles(), *, stage: int | None = None, has_bias: bool = False
) -> KernelSource:
    """The sweep kernel of pass ``stage`` (``0 .. len(plan.passes) - 1``), or with
    ``stage=None`` the gradient kernel; ``has_bias``: the logits add a bias row."""
    grad = stage is None
    if not grad and not 0 <= stage < len(plan.passes):
        raise ValueError(f"stage must be in [0, {len(plan.passes) - 1}], not {stage}")
    layout = shard_layout(plan)
    printer = LossPrinter(LossNames(plan.hyper))
    entry = matmul_entry(plan, stage, grad and tiles.tma)
    context = dict(
        **rule_context(plan),
        entry=entry,
        red_width=layout.red_width,
        grad=grad,
        scaled=False,
        n_passes=len(plan.passes),
        stage=stage,
        tma=grad and tiles.tma,
        subtile=grad and tiles.tma and tiles.subtile,
        # fp32 inputs multiply in fp32 (torch's default), not TF32
        dot_options=', input_precision="ieee"' if plan.dtype == "fp32" else "",
    )
    if grad:
        context.update(loads=_red_loads(plan, layout, len(plan.passes)), **_grad_context(plan, printer))
    else:
        context.update(
            loads=_red_loads(plan, layout, stage),
            part_width=layout.part_widths[stage],
            **_sweep_context(plan.passes[stage], printer, layout, stage),
        )
    return _matmul_source(plan, context, entry, GRAD_ARGS if grad else SWEEP_ARGS, tiles, has_bias)
