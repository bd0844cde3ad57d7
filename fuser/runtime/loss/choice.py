"""Which schedule a loss call runs, and its pieces: ``choose(LossCall) -> SchedulePlan``.

A pure function of what a call is (its sizes, dtype, device kind and capability, keywords,
the compile options and the rule's form), with no tensor or device query: the front end
(``fuser.losses.api``) describes the call, asks ``choose``, and builds the run the plan
names. The thresholds say where a choice was measured; ``benchmarks/NOTES.md`` and
``benchmarks/results/`` hold the times.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fuser.codegen.loss import DEFAULT_BLOCK, has_residue
from fuser.codegen.loss_matmul import (
    WEIGHT_GRAD_TILES,
    Tiles,
    gradient_tiles,
    scaled_exp_form,
    tile_sums_pay,
    warp_specialized,
)
from fuser.ir.loss import LossPlan
from fuser.runtime.loss.chunked import LOGIT_SIZE, chunk_rows
from fuser.runtime.loss.fused import slice_cols
from fuser.runtime.loss.staged import MAIN_GRAD_BUDGET, forward_rows, vocab_cols

SCHEDULES = ("auto", "chunks", "whole", "vocab", "fused", "scaled")

# Tiles of the matmul kernels in Triton's interpreter (CPU tensors): small, so that the
# small tensors of tests cross several tiles in every direction.
INTERPRETER_TILES = Tiles(bm=16, bn=32, bk=16, group_m=2, num_warps=4, num_stages=1)

# The scaled kernel on a GPU: row blocks in groups of 16, faster than 8 (H100;
# NOTES.md, "Linear + cross-entropy: the gradient kernel's stores, and a scaled schedule").
SCALED_TILES = Tiles(group_m=16)
# The same, persistent through tensor descriptors (sm_90 on, 16-bit inputs; NOTES.md, "The
# scaled schedule's kernel through tensor descriptors").
SCALED_TILES_TMA = Tiles(group_m=16, tma=True)
# A form whose E carries a'(z) (a softcap's tanh): [128, 256] fp32 tiles spill its
# temporaries, [128, 128] do not (NOTES.md, "A softcap through the scaled schedule").
SCALED_TILES_NARROW = Tiles(bn=128, group_m=16)
SCALED_TILES_NARROW_TMA = Tiles(bn=128, group_m=16, tma=True)
# The inputs the scaled schedule takes: fp16 would overflow E and round gradients taken in
# forward to 0 (``scaled_refusal``; NOTES.md, "GPU tests of the loss after the fp16 changes").
SCALED_DTYPES = ("fp32", "bf16")
# auto takes the scaled schedule over chunks for bf16 on sm_90 on up to this H; at 4096 cuBLAS's
# logits matmul is faster (NOTES.md, "The scaled schedule's per-token work ...; auto picks it").
SCALED_MAX_HIDDEN = 2048
# auto takes the lean schedule over vocab into main_grad for 16-bit inputs on sm_90 on up to
# this H, the largest measured (H200; results/loss_tile_sums_2026-11-28.md, NOTES.md "the lean
# forward through the tile-sums kernel").
LEAN_MAIN_GRAD_MAX_HIDDEN = 4096
# auto takes the lean schedule over chunks for fp16 (gradients in backward) on sm_90 on up to
# this H, where it was measured (H200; results/loss_fp16_2026-11-28.jsonl).
LEAN_FP16_MAX_HIDDEN = 1024
# memory="fast" takes whole over chunks (no main_grad) where every token's fp32 logits take
# at most this: T=8192, H=4096, V=128256 in bf16, 44.81 ms at 4.96 GiB of extra peak against
# chunks' 47.69 at 3.03 (H200; results/loss_2026-12-03_whole.md).
FAST_WHOLE_BUDGET = 6 * 1024**3
# sm_90 takes warp-specialised programs for the scaled kernel and the lean gradient kernel up
# to these H; above, they were slower (H100; results/loss_warp_specialized_2026-11-28.md).
SCALED_WARP_SPECIALIZED_MAX_HIDDEN = 2048
GRAD_WARP_SPECIALIZED_MAX_HIDDEN = 1024


@dataclass(frozen=True)
class RuleForm:
    """What the choice reads of a rule lowered for one dtype (``rule_form``)."""

    name: str
    scaled: bool  # its gradient has the scaled-exponential form (``scaled_exp_form``)
    narrow: bool  # that form's E carries a'(z), a(z) not linear (a softcap)
    tile_sums: bool  # the lean forward takes the tile-sums kernel (``tile_sums_pay``)
    residue: bool  # the gradient kernels write the target column's residue (``has_residue``)
    grad_tiles: Tiles  # the lean gradient kernel's GPU tiles (``gradient_tiles``)
    grad_tiles_tma: Tiles  # the same where tensor descriptors are TMA


def rule_form(name: str, plan: LossPlan) -> RuleForm:
    """The facts ``choose`` reads of a rule's ``plan`` (``lower_loss(rule, dtype)``)."""
    form = scaled_exp_form(plan)
    return RuleForm(
        name=name,
        scaled=form is not None,
        narrow=form is not None and form.factor != 1,
        tile_sums=tile_sums_pay(plan),
        residue=has_residue(plan),
        grad_tiles=gradient_tiles(plan, False),
        grad_tiles_tma=gradient_tiles(plan, True),
    )


@dataclass(frozen=True)
class LossCall:
    """One call of a compiled loss as the choice sees it. ``n_tokens``: the rows not ignored;
    ``capability``: a CUDA device's (major, minor), else ``None``; ``main_grad``: into
    ``weight.main_grad`` with a weight that takes a gradient; ``aligned``: hidden and weight
    start at 16-byte addresses as the matmul kernels read them (contiguous); ``schedule``,
    ``chunk_size``, ``block`` and ``tiles``: the compile options."""

    dtype: str
    n_tokens: int
    hidden: int
    vocab: int
    form: RuleForm
    device: str = "cuda"
    capability: tuple[int, int] | None = (9, 0)
    reduction: str = "mean"
    bias: bool = False
    main_grad: bool = False
    want_grad: bool = True
    vocab_parallel: bool = False
    memory: str = "auto"
    schedule: str = "auto"
    chunk_size: int | None = None
    block: int = DEFAULT_BLOCK
    tiles: Tiles | None = None
    aligned: bool = True

    @property
    def element_size(self) -> int:
        return 4 if self.dtype == "fp32" else 2

    @property
    def gpu(self) -> bool:
        """A CUDA device and no compile option ``tiles``: the GPU defaults are chosen."""
        return self.tiles is None and self.device == "cuda"

    @property
    def rows_16(self) -> bool:
        """What tensor descriptors need: aligned inputs whose rows are 16-byte multiples."""
        return self.aligned and self.hidden * self.element_size % 16 == 0


@dataclass(frozen=True)
class SchedulePlan:
    """The run a call gets. ``schedule``: ``chunks`` (the row kernel; with ``vocab_parallel``,
    the staged sequence over ranks), ``whole``, ``vocab``, ``fused`` or ``scaled``;
    ``in_forward``: ``LinearLoss`` takes the gradients in forward; ``buffered``: into
    ``main_grad`` through an fp32 buffer that backward adds; ``chunk``: tokens per chunk (``None``
    for ``fused``, and for vocabulary-parallel chunks: ``shard_chunk``); ``cols``: vocabulary
    rows per backward slice (``whole``, ``vocab``, ``fused``); ``tiles``: the lean sweeps'
    or the scaled kernel's, ``grad_tiles`` the lean gradient kernel's, ``tile_sums`` the lean
    forward's tile-sums kernel's (``None``: the sweeps run); ``residue``: the run adds the
    target column's residue, with ``weight_grad`` the tiles of the kernel that writes a
    16-bit ``grad_weight`` with it (``None``: fp32 blocks of cuBLAS's products)."""

    schedule: str
    in_forward: bool = False
    buffered: bool = False
    chunk: int | None = None
    cols: int | None = None
    tiles: Tiles | None = None
    grad_tiles: Tiles | None = None
    tile_sums: Tiles | None = None
    residue: bool = False
    weight_grad: Tiles | None = None


def choose(call: LossCall) -> SchedulePlan:
    """The plan of ``call``; a ``ValueError`` where the compile option ``schedule`` cannot
    run it (``scaled``: ``scaled_refusal``; ``whole`` and ``vocab`` on one device only)."""
    name = _schedule(call)
    if call.vocab_parallel and name not in ("chunks", "fused"):
        raise ValueError(
            f"schedule={call.schedule!r} is for one device; a vocabulary-parallel loss "
            "(process_group=) runs in chunks of tokens, or with memory='lean' in the matmul kernels"
        )
    if not call.want_grad and name != "fused":
        name = "chunks"  # (without gradients every schedule's forward is the row kernel's)
    buffered = call.main_grad and _buffers_main_grad(call)
    in_forward = (
        call.want_grad
        and call.reduction != "none"
        and (buffered or not call.main_grad)
        and call.dtype != "fp16"  # (chunked.py's docstring says why)
        and name in ("chunks", "scaled")
    )
    plan = SchedulePlan(name, in_forward, buffered, residue=call.form.residue and call.want_grad)
    if name == "fused":
        return _fused(call, replace(plan, residue=call.form.residue))
    if name == "scaled":
        chunk = _chunk(call, call.element_size)  # (its E is stored in the inputs' dtype)
        return _scaled(call, replace(plan, chunk=chunk, residue=call.form.residue))
    if call.vocab_parallel:
        return replace(plan, residue=call.form.residue, weight_grad=_weight_grad(call))
    chunk = _chunk(call)
    if name == "chunks":
        return replace(plan, chunk=chunk, weight_grad=_weight_grad(call))
    if name == "vocab":
        chunk = min(chunk, forward_rows(call.vocab, LOGIT_SIZE))
    cols = vocab_cols(call.n_tokens, call.hidden, LOGIT_SIZE, call.block)
    return replace(plan, chunk=chunk, cols=cols, weight_grad=_weight_grad(call))


def shard_chunk(call: LossCall, sizes: tuple[int, ...]) -> int:
    """Tokens per chunk of a vocabulary-parallel call whose ranks hold ``sizes`` columns:
    sized by the largest slice, so that every rank runs as many chunks (each has its
    collectives)."""
    return call.chunk_size or chunk_rows(call.n_tokens, call.hidden, max(sizes), call.element_size)


def _schedule(call: LossCall) -> str:
    """The compile option ``schedule`` (``scaled`` only where ``scaled_refusal`` has nothing
    against it), or the one ``memory`` names, or (auto) chunks with ``vocab_parallel`` or
    without gradients, else ``choose_schedule``'s pick by memory, with ``scaled`` in place of
    chunks where it pays, and ``fused`` in place of vocab (into ``main_grad``) or of chunks
    (fp16), where those were measured faster (``measured_faster``); ``memory="fast"`` takes
    ``whole`` over the chunks left where its logits fit (``_fast_whole``)."""
    if call.schedule == "scaled":
        why = scaled_refusal(call)
        if why:
            raise ValueError(f"schedule='scaled' cannot run this call: {why}")
    if call.schedule != "auto":
        return call.schedule
    if call.memory == "lean":
        return "fused"
    if call.vocab_parallel or not call.want_grad:
        return "chunks"
    chosen = choose_schedule(
        call.n_tokens,
        call.hidden,
        call.vocab,
        LOGIT_SIZE,
        chunk=_chunk(call),
        main_grad=call.main_grad and call.memory == "auto",
        weight_fp32=call.dtype == "fp32",
    )
    if chosen == "vocab" and measured_faster(call, LEAN_MAIN_GRAD_MAX_HIDDEN):
        return "fused"
    if chosen == "chunks" and measured_faster(call, SCALED_MAX_HIDDEN) and not scaled_refusal(call):
        return "scaled"
    if chosen == "chunks" and call.dtype == "fp16" and measured_faster(call, LEAN_FP16_MAX_HIDDEN):
        # (fp16 takes its gradients in backward, where chunks computes the logits twice, as
        # the lean schedule does, and also writes them)
        return "fused"
    if chosen == "chunks" and call.memory == "fast" and not call.main_grad and _fast_whole(call):
        return "whole"
    return chosen


def _fast_whole(call: LossCall) -> bool:
    """Whether ``memory="fast"`` keeps every token's fp32 logits (``whole``) where ``chunks``
    was chosen: more than one chunk, and logits within ``FAST_WHOLE_BUDGET``."""
    whole = call.n_tokens * call.vocab * LOGIT_SIZE
    return call.n_tokens > _chunk(call) and whole <= FAST_WHOLE_BUDGET


def choose_schedule(
    n_tokens: int,
    hidden: int,
    vocab: int,
    logit_size: int,
    *,
    chunk: int,
    main_grad: bool,
    weight_fp32: bool,
) -> str:
    """``"whole"``, ``"vocab"`` or ``"chunks"`` (the row kernel's) for a call that needs
    gradients: whole when every token's logits (``logit_size`` bytes each) take no more
    memory than the other schedule would (``main_grad``: ``MAIN_GRAD_BUDGET``; otherwise a
    chunk of logits plus, for a low-precision weight, the fp32 ``[V, H]`` accumulator).
    When every token fits in one chunk, the row kernel does in one launch what whole does
    in two, with the same matmuls and memory, so chunks is chosen."""
    whole = n_tokens * vocab * logit_size
    one_chunk = n_tokens <= chunk
    if main_grad:
        if whole > MAIN_GRAD_BUDGET:
            return "vocab"
        return "chunks" if one_chunk else "whole"
    if one_chunk:
        return "chunks"
    chunked = min(chunk, n_tokens) * vocab * logit_size + (0 if weight_fp32 else 4 * vocab * hidden)
    return "whole" if whole <= chunked else "chunks"


def _buffers_main_grad(call: LossCall) -> bool:
    """Whether a call into ``main_grad`` may take its gradients in forward (``chunks``,
    ``scaled``): with ``memory="fast"`` (one logits matmul per chunk, at the fp32 ``[V, H]``
    buffer's memory), or ``schedule="scaled"``, which takes them there; otherwise
    ``main_grad`` gets them in backward, with no buffer."""
    return call.memory == "fast" or call.schedule == "scaled"


def scaled_refusal(call: LossCall) -> str | None:
    """Why the scaled schedule cannot run ``call``, or ``None``."""
    if not call.form.scaled:
        return (
            f"the gradient of loss rule {call.form.name!r} is not A * softmax + B * [target] + C per token, "
            "nor a'(z) * (A * softmax + B * [target]) for the logsumexp's argument a(z)"
        )
    if call.dtype not in SCALED_DTYPES:  # (fp16)
        return (
            "fp16 holds its E = exp(a(z) - a(z[y])) only below 65504 (a logit 11 above the target's) "
            "and rounds a gradient taken in forward, before any loss scale, below 6e-8 to 0: "
            "bf16 or fp32 inputs take it"
        )
    if call.reduction == "none":
        return "reduction='none' scales each token's gradient in backward; it takes the gradient in forward"
    if call.main_grad and not _buffers_main_grad(call):
        return "accumulate_into='main_grad' takes the gradient in backward (memory='fast' buffers it)"
    if call.vocab_parallel:
        return "it runs on one device (no process_group)"
    if call.bias:
        return "it takes no bias"
    return None


def measured_faster(call: LossCall, max_hidden: int) -> bool:
    """16-bit inputs on a GPU whose kernels take tensor descriptors (``descriptors_pay``),
    with H up to ``max_hidden``: where ``auto``'s matmul-kernel schedules were measured
    faster than the cuBLAS ones."""
    return (
        call.device == "cuda"
        and call.element_size == 2
        and call.hidden <= max_hidden
        and descriptors_pay(call.capability)
    )


def descriptors_pay(capability: tuple[int, int]) -> bool:
    """Whether tensor descriptors pay on a GPU of ``capability``: from sm_90 they are TMA, and
    the lean gradient kernel, the scaled and tile-sums kernels and the 16-bit weight
    gradient's take them (NOTES.md, "Lean schedule: the gradient kernel through tensor
    descriptors"); before, Triton lowers them to pointer loads, and the kernels keep their own."""
    return capability[0] >= 9


def warp_specialization_pays(capability: tuple[int, int]) -> bool:
    """Whether the matmul kernels' warp-specialised programs (``warp_specialized``) are taken:
    on sm_90, where Triton 3.6 makes them and where they were measured (Blackwell's warp
    specialisation is another pass, not measured)."""
    return capability[0] == 9


def specialized(tiles: Tiles, call: LossCall, max_hidden: int) -> Tiles:
    """A GPU call's ``tiles``, warp-specialised (where they allow it) on sm_90 with H up to
    ``max_hidden``."""
    if call.hidden <= max_hidden and warp_specialization_pays(call.capability):
        return warp_specialized(tiles)
    return tiles


def scaled_tiles(dtype: str, tma: bool, narrow: bool = False) -> Tiles:
    """The scaled kernel's tiles on a GPU; ``tma``: where tensor descriptors are TMA, taken
    for 16-bit inputs (fp32 tiles through descriptors overflow sm_90's shared memory);
    ``narrow``: for a form whose ``E`` carries ``a'(z)`` (``SCALED_TILES_NARROW``)."""
    if tma and dtype != "fp32":
        return SCALED_TILES_NARROW_TMA if narrow else SCALED_TILES_TMA
    return (SCALED_TILES_NARROW if narrow else SCALED_TILES).for_dtype(dtype)


def _chunk(call: LossCall, logit_size: int = LOGIT_SIZE) -> int:
    """Tokens per chunk: ``chunk_rows`` at ``logit_size`` bytes a logit (fp32 logits; the
    scaled schedule's ``E`` in the inputs' dtype), or the compile option ``chunk_size``."""
    es = call.element_size
    return call.chunk_size or chunk_rows(call.n_tokens, call.hidden, call.vocab, es, logit_size)


def _option_tiles(call: LossCall, tma_ok: bool) -> Tiles:
    """The compile option ``tiles`` (else the interpreter's), through descriptors only where
    the inputs allow them (``tma_ok``)."""
    tiles = call.tiles or INTERPRETER_TILES
    return replace(tiles, tma=False) if tiles.tma and not tma_ok else tiles


def _fused(call: LossCall, plan: SchedulePlan) -> SchedulePlan:
    """The lean schedule's tiles (the sweeps keep pointer loads: through descriptors they
    ran no faster, H100), slices and forward kernel."""
    if call.gpu:
        tiles = Tiles().for_dtype(call.dtype)
        tma = call.rows_16 and descriptors_pay(call.capability)
        grad_tiles = call.form.grad_tiles_tma if tma else call.form.grad_tiles
        grad_tiles = specialized(grad_tiles, call, GRAD_WARP_SPECIALIZED_MAX_HIDDEN)
    else:
        tiles = grad_tiles = _option_tiles(call, call.rows_16)
    tiles, grad_tiles = (t.for_hidden(call.hidden, call.aligned) for t in (tiles, grad_tiles))
    cols = slice_cols(
        call.n_tokens, call.hidden, call.element_size, max(tiles.bn, grad_tiles.bn), MAIN_GRAD_BUDGET
    )
    sums = _tile_sums(call) if not call.vocab_parallel and not call.bias else None
    return replace(
        plan, cols=cols, tiles=tiles, grad_tiles=grad_tiles, tile_sums=sums, weight_grad=_weight_grad(call)
    )


def _tile_sums(call: LossCall) -> Tiles | None:
    """The lean forward's tile-sums kernel's tiles, where the rule's form takes it
    (``tile_sums_pay``): in Triton's interpreter, and on a GPU whose descriptors are TMA for
    16-bit inputs they can address (``fuser.runtime.loss.fused`` has the times). Else
    ``None``: the sweeps run."""
    if not call.form.tile_sums:
        return None
    if call.gpu:
        if not (call.element_size == 2 and call.rows_16 and descriptors_pay(call.capability)):
            return None
        tiles = specialized(scaled_tiles(call.dtype, True), call, SCALED_WARP_SPECIALIZED_MAX_HIDDEN)
    else:
        tiles = _option_tiles(call, call.rows_16)
    return tiles.for_hidden(call.hidden, call.aligned)


def _scaled(call: LossCall, plan: SchedulePlan) -> SchedulePlan:
    """The scaled kernel's tiles: narrow for a form whose ``E`` carries ``a'(z)``."""
    if call.gpu:
        tma = call.rows_16 and descriptors_pay(call.capability)
        tiles = scaled_tiles(call.dtype, tma, call.form.narrow)
        tiles = specialized(tiles, call, SCALED_WARP_SPECIALIZED_MAX_HIDDEN)
    else:
        tiles = _option_tiles(call, call.rows_16)
    return replace(plan, tiles=tiles.for_hidden(call.hidden, call.aligned), weight_grad=_weight_grad(call))


def _weight_grad(call: LossCall) -> Tiles | None:
    """A 16-bit ``grad_weight`` takes the residue's rows in the weight-gradient kernel where
    tensor descriptors pay or the compile option ``tiles`` asks for them (``tma``); else
    (``None``) through fp32 blocks of cuBLAS's products (``residue.SliceTerms``)."""
    if not call.form.residue:
        return None
    if call.gpu and descriptors_pay(call.capability):
        return WEIGHT_GRAD_TILES
    if call.tiles is not None and call.tiles.tma:
        return call.tiles
    return None
