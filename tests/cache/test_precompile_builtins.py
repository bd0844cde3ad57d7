"""Every built-in rule precompiles for sm_80 and sm_90 through the real pipeline, and a
second run is all hits.

The whole sweep (58 rules, a few hundred kernels a target) takes over half an hour of one
core, so each run compiles a slice of the rules chosen by the session seed (``sweep``): for
each target a sixteenth of the optimizer rules, and one loss rule for one of the targets;
any 34 consecutive seeds compile every rule for both; ``make test-all`` compiles them all.
The kernels of each built-in optimizer through ``fuser.optim.kernel_sources`` (fp32 and
bf16) are among those its precompile compiles (fp32, bf16 and fp16 parameters), so this
sweep also checks that each built-in's step kernels compile."""

import importlib
import json
import re

import pytest
from cache_helpers import files_state

import fuser
from fuser import cli
from fuser.clitools import BUILTIN_MODULES
from fuser.codegen.loss_matmul import tile_sums_pay
from fuser.ir.loss import lower_loss
from fuser.rules.loss import is_token_rule


def _builtin_rules():
    rules = []
    for name in BUILTIN_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        rules += [v for v in vars(module).values() if isinstance(v, fuser.Rule)]
    return rules


def _rows(out: str) -> list[list[str]]:
    lines = out.strip().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("rule "))
    return [re.split(r"\s{2,}", ln.strip()) for ln in lines[start + 1 : -1]]


# Shared memory a block may opt into: A100 (sm_80), H100 (sm_90).
SHARED_LIMIT = {80: 166912, 90: 232448}
RUNS = 16  # optimizer rules: 41, two or three a run for each target
LOSS_RUNS = 34  # (loss rule, target) pairs: 34, one a run (a cross-entropy rule compiles ~50 s of kernels)


def test_builtins_flag_collects_every_builtin_rule():
    found, errors = cli.clitools.collect([], True, lambda note: None)
    assert not errors and {f.rule.name for f in found} == {r.name for r in _builtin_rules()}


@pytest.mark.slow
@pytest.mark.parametrize("capability", [80, 90])  # (two tests: a parallel run takes them apart)
def test_builtins_precompile_for_sm80_and_sm90(capability, cache_root, capsys, monkeypatch, sweep):
    everything = _builtin_rules()
    assert everything, "no built-in rules found"
    # (loss rules render and compile many more kernels each: they are a sweep of their own,
    # one a run, so that every run's slice costs about the same)
    by_kind = lambda kind: sorted((r for r in everything if r.kind == kind), key=lambda r: r.name)  # noqa: E731
    optim = by_kind("optim")
    half = len(optim) // 2 if capability == 90 else 0  # the two targets take different rules a run
    rules = sweep(optim[half:] + optim[:half], RUNS)
    # a loss rule for one target a run: every (rule, target) pair within LOSS_RUNS runs
    rules += [
        r for r, c in sweep([(r, c) for r in by_kind("loss") for c in (80, 90)], LOSS_RUNS) if c == capability
    ]
    assert {r.kind for r in everything} == {"optim", "loss"}
    found, _ = cli.clitools.collect([], True, lambda note: None)
    names = {r.name for r in rules}
    chosen = [f for f in found if f.rule.name in names]
    monkeypatch.setattr(cli.clitools, "collect", lambda targets, builtins, note: (chosen, []))
    args = ["precompile", "--builtins", "--target", f"cuda:{capability}"]
    assert cli.main(args) == 0, capsys.readouterr().err
    rows = _rows(capsys.readouterr().out)
    assert {r[0] for r in rows} == {r.name for r in rules}
    assert {r[5] for r in rows} == {"compiled"}
    for rule in rules:
        # each dtype plan of each kernel, for the target
        mine = [r for r in rows if r[0] == rule.name]
        staged = [k for k in {r[1] for r in mine} if re.search(r"_loss_rows_vp\d+$", k)]
        last = max(staged, key=lambda k: int(k.rsplit("vp", 1)[1])) if staged else None
        sums = rule.kind == "loss" and tile_sums_pay(lower_loss(rule, "bf16"))
        token = rule.kind == "loss" and is_token_rule(rule)  # (its kernels: fp32 logits, every dtype)
        assert {r[2] for r in mine} == {f"cuda:{capability}"}
        for kernel in {r[1] for r in mine}:  # fp32, bf16, fp16 parameters (or logits, hidden)
            shown = {r[3] for r in mine if r[1] == kernel}
            # matrix kernels (bf16 whatever the parameters): one row per variant, under
            # the first rule that launches them; a loss's gradient and scaled kernels through
            # tensor descriptors (and the lean forward's tile sums), its weight-gradient
            # kernel and the residue's gather into grad_hidden: 16-bit inputs only; the
            # target-row kernels: fp32 rows from 16-bit inputs (the target column's residue),
            # from fp32 ones too (the scaled schedule's target term), and 16-bit rows from
            # 16-bit inputs (the residue's rows written into a 16-bit grad_weight); the
            # gradients' scaling by grad_output: two for bf16 (fp32 in, bf16 in place)
            only16 = kernel.endswith(("_mm_grad_tma", "_mm_scaled_tma", "_mm_tile_sums_tma")) or kernel in (
                "weight_grad_tma",
                "target_rows_gather",
                "grad_scale",
            )
            expected = {4} if kernel in ("ns_gram", "ns_poly") else {2} if only16 else {3}
            # the scaled schedule's kernels: not for fp16 inputs, which it refuses (its per-token
            # kernels are, where the lean schedule's forward takes the tile sums)
            per_token = kernel.endswith(("_scaled_prepare", "_scaled_tokens"))
            if "_mm_scaled" in kernel or kernel == "scaled_hidden_grad" or (per_token and not sums):
                expected = {n - 1 for n in expected}
            if kernel in ("target_rows_pieces", "target_rows_runs"):
                rows16 = {"hidden:bf16,out:bf16", "hidden:fp16,out:fp16"}
                fp32 = {"hidden:bf16,out:fp32", "hidden:fp16,out:fp32"}
                assert fp32 <= shown <= fp32 | rows16 | {"hidden:fp32,out:fp32"}, (kernel, shown)
                expected = {len(shown)}
            # the row kernel and the staged sequence on fp32 logits, which calls of every dtype
            # launch; each dtype's own last staged kernel (fused and scaled, on the reductions)
            fp32_logits = kernel.endswith("_loss_rows") or (kernel in staged and kernel != last)
            # (a token rule's kernels take fp32 logits; the residue's, 16-bit inputs: memory="lean")
            residue = kernel.startswith("target_rows")
            expected = {1} if (token and not residue) or fp32_logits else expected
            assert len(shown) in expected, (kernel, shown)
    for cubin in cache_root.rglob("*.cubin"):
        assert cubin.read_bytes()[:4] == b"\x7fELF"
        # the shared memory it asks for fits the target's GPUs (A100, H100)
        shared = json.loads(cubin.with_suffix(".json").read_text())["shared"]
        assert shared <= SHARED_LIMIT[capability], (cubin.name, shared)

    before = files_state(cache_root)
    assert cli.main(args) == 0
    again = _rows(capsys.readouterr().out)
    assert len(again) == len(rows) and {r[5] for r in again} == {"hit"}
    assert files_state(cache_root) == before
