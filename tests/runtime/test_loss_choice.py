"""The loss schedule's choice as a table: call -> plan, a pure function (no kernels).

Expected values are written from the rules README.md gives for ``memory="auto"`` (and the
sizes the schedules' docstrings state), not read back from ``choose``.
"""

from dataclasses import replace

import pytest

import fuser.losses
from fuser.codegen.loss_matmul import (
    NARROW_GRAD,
    TALL_GRAD,
    WEIGHT_GRAD_TILES,
    WIDE_GRAD_TMA,
    WIDE_GRAD_TMA_SUBTILE,
    Tiles,
    warp_specialized,
)
from fuser.ir.loss import lower_loss
from fuser.runtime.loss.choice import (
    INTERPRETER_TILES,
    SCALED_TILES,
    SCALED_TILES_NARROW_TMA,
    SCALED_TILES_TMA,
    LossCall,
    RuleForm,
    choose,
    rule_form,
    shard_chunk,
)

# Rule forms as the choice reads them (16-bit inputs): plain cross-entropy (scaled form, tile
# sums, [256, 128] gradient tiles or [128, 256] through descriptors), a softcap without label
# smoothing (scaled form whose E carries tanh': narrow; exact tanh: no tile sums), its
# approx_tanh variant, and a rule without the form (a softcap with label smoothing's mean).
CE = RuleForm("ce", True, False, True, True, TALL_GRAD, WIDE_GRAD_TMA)
SOFTCAP = RuleForm("softcap", True, True, False, True, NARROW_GRAD, NARROW_GRAD)
APPROX = RuleForm("approx", True, True, True, True, NARROW_GRAD, WIDE_GRAD_TMA_SUBTILE)
NO_FORM = RuleForm("smoothed_softcap", False, False, False, True, NARROW_GRAD, NARROW_GRAD)
CE_FP32 = RuleForm("ce", True, False, True, False, TALL_GRAD.for_dtype("fp32"), TALL_GRAD.for_dtype("fp32"))

GIST = dict(n_tokens=32768, hidden=768, vocab=128256)
H2048 = dict(n_tokens=16384, hidden=2048, vocab=128256)
LLAMA8B = dict(n_tokens=8192, hidden=4096, vocab=128256)
ODD_H = dict(n_tokens=32768, hidden=1001, vocab=128256)  # (rows of 2002 bytes: no descriptors)
H8192 = dict(n_tokens=8192, hidden=8192, vocab=256000)
SM80, SM90, SM100 = dict(capability=(8, 0)), dict(capability=(9, 0)), dict(capability=(10, 0))
CPU = dict(device="cpu", capability=None)


def call(shape=GIST, dtype="bf16", form=CE, **kw) -> LossCall:
    return LossCall(dtype=dtype, form=form, **{**shape, **SM90, **kw})


SCHEDULE_ROWS = [
    # bf16 on sm_90 or later with H up to 2048: scaled in place of chunks
    (call(), "scaled"),
    (call(**SM100), "scaled"),
    (call(H2048), "scaled"),
    (call(memory="fast"), "scaled"),
    (call(form=SOFTCAP), "scaled"),
    # ... not where it was not measured, nor at H = 4096 (whole or chunks stay), nor fp32
    (call(**SM80), "chunks"),
    (call(**CPU), "chunks"),
    (call(LLAMA8B), "chunks"),  # (whole's fp32 logits, 4 GiB, outweigh a chunk and the buffer)
    # ... but memory='fast' keeps them (within 6 GiB, without main_grad): whole
    (call(LLAMA8B, memory="fast"), "whole"),
    (call(LLAMA8B, memory="fast", **SM80), "whole"),
    (call(H2048, memory="fast", **SM80), "chunks"),  # (8 GiB of logits)
    (call(dict(n_tokens=2048, hidden=4096, vocab=128256), memory="fast"), "chunks"),  # (one chunk)
    (call(dtype="fp32", form=CE_FP32), "chunks"),
    # ... nor for calls it cannot run: no form, reduction='none', a bias
    (call(form=NO_FORM), "chunks"),
    (call(reduction="none"), "chunks"),
    (call(bias=True), "chunks"),
    # into main_grad: vocab, or the lean schedule for 16-bit inputs on sm_90 on with H up to 4096
    (call(main_grad=True), "fused"),
    (call(LLAMA8B, main_grad=True), "fused"),
    (call(dtype="fp16", main_grad=True), "fused"),
    (call(H8192, main_grad=True), "vocab"),
    (call(main_grad=True, **SM80), "vocab"),
    (call(main_grad=True, **CPU), "vocab"),
    # main_grad with memory='fast': the schedules of a call without it, but whole
    (call(main_grad=True, memory="fast"), "scaled"),
    (call(LLAMA8B, main_grad=True, memory="fast"), "chunks"),
    # fp16 (gradients in backward): lean in place of chunks on sm_90 with H up to 1024
    (call(dtype="fp16"), "fused"),
    (call(dtype="fp16", memory="fast"), "fused"),
    (call(H2048, dtype="fp16"), "chunks"),
    (call(dtype="fp16", **SM80), "chunks"),
    (call(dtype="fp16", **CPU), "chunks"),
    # memory='lean' runs the lean schedule anywhere; no gradients, or vocabulary-parallel: chunks
    (call(memory="lean", **CPU), "fused"),
    (call(memory="lean", vocab_parallel=True), "fused"),
    (call(want_grad=False), "chunks"),
    (call(LLAMA8B, want_grad=False, schedule="whole"), "chunks"),
    (call(vocab_parallel=True), "chunks"),
    # whole when every token's logits fit in what chunks would take; one chunk: the row kernel
    (call(dict(n_tokens=100, hidden=64, vocab=1000), chunk_size=50, **CPU), "whole"),
    (call(dict(n_tokens=100, hidden=64, vocab=1000), chunk_size=50, main_grad=True, **CPU), "whole"),
    (call(dict(n_tokens=100, hidden=64, vocab=1000), chunk_size=100, **CPU), "chunks"),
    # the compile option schedule names the schedule
    (call(LLAMA8B, schedule="chunks"), "chunks"),
    (call(schedule="vocab"), "vocab"),
    (call(schedule="scaled", main_grad=True), "scaled"),
    (call(schedule="fused", **CPU), "fused"),
]


@pytest.mark.parametrize("row, expected", SCHEDULE_ROWS)
def test_schedule_table(row, expected):
    assert choose(row).schedule == expected


REFUSALS = [
    (call(dtype="fp16", schedule="scaled"), "bf16 or fp32 inputs take it"),
    (call(form=NO_FORM, schedule="scaled"), "'smoothed_softcap' is not A * softmax"),
    (call(reduction="none", schedule="scaled"), "reduction='none'"),
    (call(bias=True, schedule="scaled"), "no bias"),
    (call(vocab_parallel=True, schedule="scaled"), "one device"),
    (call(vocab_parallel=True, schedule="whole"), "for one device"),
    (call(vocab_parallel=True, schedule="vocab", want_grad=False), "for one device"),
]


@pytest.mark.parametrize("row, message", REFUSALS)
def test_refusals(row, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*")):
        choose(row)


FORWARD_ROWS = [
    # gradients in forward: chunks and scaled, mean or sum, not fp16, main_grad only buffered
    (call(), True, False),
    (call(reduction="sum", **CPU), True, False),
    (call(vocab_parallel=True), True, False),
    (call(reduction="none"), False, False),
    (call(dtype="fp16", **CPU), False, False),
    (call(main_grad=True, memory="fast"), True, True),
    (call(main_grad=True, schedule="chunks"), False, False),
    (call(main_grad=True, schedule="scaled"), True, True),
    (call(LLAMA8B, main_grad=True, memory="fast"), True, True),
    (call(main_grad=True), False, False),  # (fused)
    (call(want_grad=False), False, False),
]


@pytest.mark.parametrize("row, in_forward, buffered", FORWARD_ROWS)
def test_gradients_in_forward(row, in_forward, buffered):
    plan = choose(row)
    assert (plan.in_forward, plan.buffered) == (in_forward, buffered)


WS_GRAD = warp_specialized(WIDE_GRAD_TMA)
WS_SUMS = warp_specialized(SCALED_TILES_TMA)
ODD = Tiles(bm=64, bn=64, bk=32)
ODD_TMA = Tiles(bm=64, bn=64, bk=32, num_warps=4, tma=True)


def uneven(t: Tiles) -> Tiles:
    return replace(t, even_k=False)


LEAN_ROWS = [
    # (call, sweeps, gradient kernel, tile sums, weight-gradient kernel): descriptors from
    # sm_90, warp-specialised on sm_90 only (gradient kernel H <= 1024, tile sums H <= 2048)
    (call(memory="lean"), Tiles(), WS_GRAD, WS_SUMS, WEIGHT_GRAD_TILES),
    (call(H2048, memory="lean"), Tiles(), WIDE_GRAD_TMA, WS_SUMS, WEIGHT_GRAD_TILES),
    (call(LLAMA8B, memory="lean"), Tiles(), WIDE_GRAD_TMA, SCALED_TILES_TMA, WEIGHT_GRAD_TILES),
    (call(memory="lean", **SM100), Tiles(), WIDE_GRAD_TMA, SCALED_TILES_TMA, WEIGHT_GRAD_TILES),
    (call(memory="lean", **SM80), Tiles(), TALL_GRAD, None, None),
    # a softcap: narrow pointer tiles and the sweep; approx_tanh: half tiles, not specialised
    (call(memory="lean", form=SOFTCAP), Tiles(), NARROW_GRAD, None, WEIGHT_GRAD_TILES),
    (call(memory="lean", form=APPROX), Tiles(), WIDE_GRAD_TMA_SUBTILE, WS_SUMS, WEIGHT_GRAD_TILES),
    # no tile sums with a bias or over ranks
    (call(memory="lean", bias=True), Tiles(), WS_GRAD, None, WEIGHT_GRAD_TILES),
    (call(memory="lean", vocab_parallel=True), Tiles(), WS_GRAD, None, WEIGHT_GRAD_TILES),
    # rows that are no 16-byte multiple, or unaligned inputs: no descriptors, masks along H
    (call(ODD_H, memory="lean"), uneven(Tiles()), uneven(TALL_GRAD), None, WEIGHT_GRAD_TILES),
    (call(memory="lean", aligned=False), uneven(Tiles()), uneven(TALL_GRAD), None, WEIGHT_GRAD_TILES),
    # fp32: BK 16, pointer loads, no tile sums, no residue
    (
        call(dtype="fp32", form=CE_FP32, memory="lean"),
        Tiles().for_dtype("fp32"),
        TALL_GRAD.for_dtype("fp32"),
        None,
        None,
    ),
    # the interpreter (CPU) and the compile option tiles: those tiles for every kernel
    (call(memory="lean", **CPU), INTERPRETER_TILES, INTERPRETER_TILES, INTERPRETER_TILES, None),
    (call(memory="lean", tiles=ODD), ODD, ODD, ODD, None),
    (call(memory="lean", tiles=ODD_TMA), ODD_TMA, ODD_TMA, ODD_TMA, ODD_TMA),
    (call(ODD_H, memory="lean", tiles=ODD_TMA, **CPU), *[uneven(replace(ODD_TMA, tma=False))] * 3, ODD_TMA),
]  # fmt: skip


@pytest.mark.parametrize("row, tiles, grad_tiles, tile_sums, weight_grad", LEAN_ROWS)
def test_lean_tiles(row, tiles, grad_tiles, tile_sums, weight_grad):
    plan = choose(row)
    assert plan.schedule == "fused" and plan.residue == row.form.residue
    assert (plan.tiles, plan.grad_tiles, plan.tile_sums, plan.weight_grad) == (
        tiles,
        grad_tiles,
        tile_sums,
        weight_grad,
    )


SCALED_ROWS = [
    (call(), WS_SUMS),
    (call(H2048), WS_SUMS),
    (call(LLAMA8B, schedule="scaled"), SCALED_TILES_TMA),
    (call(**SM100), SCALED_TILES_TMA),
    (call(schedule="scaled", **SM80), SCALED_TILES),
    (call(form=SOFTCAP), warp_specialized(SCALED_TILES_NARROW_TMA)),
    (call(dtype="fp32", form=CE_FP32, schedule="scaled"), SCALED_TILES.for_dtype("fp32")),
    (call(schedule="scaled", **CPU), INTERPRETER_TILES),
    (call(schedule="scaled", aligned=False), uneven(SCALED_TILES)),
]


@pytest.mark.parametrize("row, tiles", SCALED_ROWS)
def test_scaled_tiles(row, tiles):
    plan = choose(row)
    assert (plan.schedule, plan.tiles) == ("scaled", tiles)


def test_sizes_of_the_pieces():
    # chunks of logits: 2304 tokens at gist, 4096 at llama8b (chunk_rows' docstring); the
    # compile option chunk_size wins
    assert choose(call()).chunk == 2304 and choose(call(chunk_size=100)).chunk == 100
    whole = choose(call(LLAMA8B, schedule="whole"))
    assert whole.chunk == 2048  # (fp32 logits: 1 GiB // (128256 * 4) = 2093 -> 2048)
    # whole's backward slices: the fp32 logits and grad_hidden within 240 MiB, in blocks
    # of 2048 columns: (240 MiB - 4 * 8192 * 4096) // (8192 * 4) = 3584 -> 2048
    assert whole.cols == 2048
    # vocab: forward chunks of fp32 logits within 240 MiB (a multiple of 64: 245 -> 192),
    # slices of at least 256 columns when grad_hidden alone fills the budget
    vocab = choose(call(H8192, main_grad=True))
    assert (vocab.chunk, vocab.cols) == (192, 256)
    # the lean slices: (240 MiB - 4 * 32768 * 768) // (32768 * 2) = 2304, a multiple of 256
    assert choose(call(main_grad=True)).cols == 2304 and choose(call(memory="lean")).chunk is None
    # over ranks, chunks sized by the largest slice: (1 GiB - 4 * 64256 * 768 - 32768 * 768 * 2)
    # // (64256 * 4) = 3213 -> 3072 (fp32 logits)
    ranks = call(dict(GIST, vocab=64000), vocab_parallel=True)
    assert choose(ranks).chunk is None and shard_chunk(ranks, (64256, 64000)) == 3072
    assert shard_chunk(replace(ranks, chunk_size=512), (64256, 64000)) == 512


def test_residue_only_with_gradients():
    # the row kernel's run adds the target column's residue only where it takes gradients
    assert choose(call(**CPU)).residue and not choose(call(want_grad=False)).residue
    assert not choose(call(form=CE_FP32, dtype="fp32", **CPU)).residue


@pytest.mark.parametrize(
    "rule, scaled, narrow, tile_sums",
    [
        (fuser.losses.CROSS_ENTROPY, True, False, True),
        (fuser.losses.CROSS_ENTROPY_FULL, True, False, True),
        (fuser.losses.SOFTCAP_CROSS_ENTROPY_UNSMOOTHED, True, True, False),
        (fuser.losses.SOFTCAP_CROSS_ENTROPY_UNSMOOTHED_APPROX, True, True, True),
        (fuser.losses.SOFTCAP_CROSS_ENTROPY, False, False, False),
    ],
)
def test_rule_forms_of_the_built_ins(rule, scaled, narrow, tile_sums):
    # README: the scaled form (narrow with a softcap), the lean forward's tile sums for no
    # function but exp and approx_tanh; 16-bit gradient kernels write the residue, fp32 not
    form = rule_form(rule.name, lower_loss(rule, "bf16"))
    assert (form.scaled, form.narrow, form.tile_sums, form.residue) == (scaled, narrow, tile_sums, True)
    assert not rule_form(rule.name, lower_loss(rule, "fp32")).residue
