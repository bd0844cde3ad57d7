"""The call of a compiled token rule (per-token inputs, or outputs other than ``("loss",)``):
its argument checks, then ``fuser.runtime.loss.tokens.TokenLoss``.

Such a rule runs in the ``chunks`` schedule with fp32 logits (``runtime.loss.tokens``);
``memory="auto"`` and ``"fast"`` pick it, as does the compile option ``schedule="auto"`` or
``"chunks"``, with or without ``process_group=`` (``ShardedTokens``); on one device ``"fast"``
keeps every token's logits from forward to backward (``TokenRun.keep``). ``memory="lean"`` runs
it in vocabulary chunks on one device (``VocabTokens``: no fp32 ``[V, H]`` buffer, no chunk
of every column's logits). The other schedules, ``memory="lean"`` with ``process_group=``
say they do not run yet before anything runs. Where the rows of a schedule's kernels hold a
slice of the vocabulary (``process_group=``, ``memory="lean"``), a rule's ``t[y]`` comes to
them as one more per-token input (``teacher_at_target``).
"""

from __future__ import annotations

import torch

from fuser.rules.loss import reads_teacher
from fuser.runtime.loss.tokens import ReducedTokenLoss, TokenLoss

# The schedules (compile option) and memory settings that run token rules.
TOKEN_SCHEDULES = ("auto", "chunks")
TOKEN_MEMORY = ("auto", "fast", "lean")


def split_keywords(rule, keywords: dict) -> tuple[dict, dict]:
    """(per-token inputs, hyperparameter overrides) of a call's keywords; raises
    ``TypeError`` naming every input the rule reads that the call did not give."""
    inputs = {n: keywords.pop(n) for n in rule.inputs if n in keywords}
    missing = [n for n in rule.inputs if n not in inputs]
    if missing:
        raise TypeError(
            f"{rule.name}() is missing the per-token input(s) {missing}: pass each by keyword as a "
            f"float tensor of target's shape (the rule's inputs: {', '.join(rule.inputs)})"
        )
    return inputs, keywords


def check_options(rule, schedule: str, memory: str, reduction, group=None) -> None:
    """Raise for an option a token rule's call does not take (nothing has run)."""
    if schedule not in TOKEN_SCHEDULES:
        raise ValueError(
            f"{rule.name} reads per-token inputs or returns several outputs, which the "
            f"{schedule!r} schedule does not run yet: compile it with schedule='auto' or 'chunks'"
        )
    if memory not in TOKEN_MEMORY:
        raise ValueError(f"memory must be one of {TOKEN_MEMORY}, not {memory!r}")
    if memory == "lean" and group is not None:
        raise ValueError(
            f"{rule.name} reads per-token inputs or returns several outputs, which memory='lean' with "
            "process_group= does not run yet: leave memory out (the chunks schedule) with process_group="
        )
    outputs = tuple(n for n, _ in rule.outputs)
    if outputs != ("loss",) and reduction not in (None, "none"):
        raise ValueError(
            f"{rule.name} returns the per-token outputs {outputs}, which take no reduction: leave "
            f"reduction out (or 'none') and reduce them in torch, not reduction={reduction!r}"
        )


def teacher_tensors(rule, hidden, weight, teacher_hidden, teacher_weight, teacher_bias, group):
    """The teacher's ``(hidden [T, H_t], weight, bias)`` of a call to a rule that reads ``t``
    (``None`` for one that does not), after raising ``TypeError`` for a teacher missing or
    given to a rule that reads none, and ``ValueError`` for shapes, devices or a
    ``process_group`` the call does not take."""
    given = [n for n, v in (("teacher_hidden", teacher_hidden), ("teacher_weight", teacher_weight),
                            ("teacher_bias", teacher_bias)) if v is not None]  # fmt: skip
    if not reads_teacher(rule):
        if given:
            raise TypeError(f"{rule.name}() got {', '.join(given)}, but the rule reads no teacher logit t")
        return None
    if teacher_hidden is None or teacher_weight is None:
        raise TypeError(
            f"{rule.name} reads the teacher's logits t: pass teacher_hidden= ([T, H_t], hidden's "
            "leading shape) and teacher_weight= ([V, H_t]), with teacher_bias= optional"
        )
    th, tw, tb = teacher_hidden, teacher_weight, teacher_bias
    lead, vocab = list(hidden.shape[:-1]), weight.shape[0]
    if th.dim() < 1 or list(th.shape[:-1]) != lead:
        raise ValueError(
            f"teacher_hidden must be [{', '.join(map(str, lead))}, H_t] (hidden's leading shape, then "
            f"the teacher's hidden size), not {list(th.shape)}"
        )
    if tw.dim() != 2 or list(tw.shape) != [vocab, th.shape[-1]]:
        raise ValueError(
            f"teacher_weight must be [V, H_t] = [{vocab}, {th.shape[-1]}] (weight's V, teacher_hidden's "
            f"last size), not {list(tw.shape)}"
        )
    if tb is not None and list(tb.shape) != [vocab]:
        raise ValueError(f"teacher_bias must be [{vocab}] (weight's V), not {list(tb.shape)}")
    if tw.dtype != th.dtype or (tb is not None and tb.dtype != th.dtype) or not th.dtype.is_floating_point:
        got = ", ".join(str(t.dtype) for t in (th, tw, tb) if t is not None)
        raise TypeError(
            f"teacher_hidden, teacher_weight and teacher_bias must share a float dtype, not {got}"
        )
    devices = {str(t.device) for t in (th, tw, tb) if t is not None}
    if devices != {str(hidden.device)}:
        raise ValueError(
            f"the teacher's tensors must be on hidden's device {hidden.device}, not {sorted(devices)}"
        )
    return th.reshape(-1, th.shape[-1]), tw, tb


# Tokens a block of ``teacher_at_target``'s fp32 products (their rows of the teacher's weight).
TARGET_ROWS = 1024


def teacher_at_target(teacher, target, ignore_index: int, col_offset: int = 0, group=None) -> torch.Tensor:
    """``t[y]`` of every token, fp32 ``[T]``: the teacher's hidden row times its weight's row at
    the target (plus its bias there), upcast and summed in fp32 as the logits are, ``TARGET_ROWS``
    tokens at a time; 0 where the target is ignored. ``teacher``'s weight may hold the columns
    ``[col_offset, col_offset + V_r)`` alone (a rank's slice): the ranks of ``group`` each give
    the tokens whose target they hold, summed across them."""
    th, tw, tb = teacher
    n, cols = target.shape[0], tw.shape[0]
    local = target - col_offset
    mine = (local >= 0) & (local < cols) & (target != ignore_index)
    rows = local.clamp(0, max(cols - 1, 0))
    out = torch.zeros(n, dtype=torch.float32, device=th.device)
    for s in range(0, n if cols else 0, TARGET_ROWS):
        e = min(s + TARGET_ROWS, n)
        out[s:e] = (th[s:e].float() * tw.index_select(0, rows[s:e]).float()).sum(-1)
    if tb is not None and cols:
        out += tb.float().index_select(0, rows)
    out = torch.where(mine, out, 0.0)
    if group is not None:
        torch.distributed.all_reduce(out, group=group)
    return out


def input_rows(rule, inputs: dict, target: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The per-token inputs as one fp32 ``[m, T]`` tensor (``T``: target's elements), after
    raising for one that is no float tensor of ``target``'s shape on its device."""
    rows = []
    for n in rule.inputs:
        t = inputs[n]
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            got = type(t).__name__ if not isinstance(t, torch.Tensor) else str(t.dtype)
            raise TypeError(f"per-token input {n!r} of {rule.name} must be a float tensor, not {got}")
        if t.shape != target.shape and not (t.dim() == 1 and t.numel() == target.numel()):
            raise ValueError(
                f"per-token input {n!r} of {rule.name} must have target's shape {list(target.shape)} "
                f"(or be flat [{target.numel()}]), not {list(t.shape)}"
            )
        if t.device != device:
            raise ValueError(f"per-token input {n!r} must be on the inputs' device {device}, not {t.device}")
        rows.append(t.detach().reshape(-1).float())
    if not rows:
        return torch.empty(0, target.numel(), dtype=torch.float32, device=device)
    return torch.stack(rows)


def run_token_rule(
    rule, x, weight, bias, y, inputs, shape, *, main_grad, want_grad, count_rows, make_run, teacher=None,
    reduction="none", eager=True,
):  # fmt: skip
    """The outputs of a token rule's call, fp32 of ``shape`` each (a tuple, in the rule's
    order), and the count of targets not ignored: rows whose target is ``ignore_index`` are
    left out of the kernels (``count_rows`` finds them, once per call, and checks the other
    targets) and get 0 in every output. ``make_run(count)``: the run for ``count`` rows.
    ``teacher``: the teacher's ``(hidden [T, H_t], weight, bias)`` for a rule that reads
    ``t`` (detached here: no gradient reaches them). ``reduction`` ``"mean"`` or ``"sum"``
    (a rule whose one output is ``loss``): the one-element tuple holds the reduced loss,
    with ``eager`` its gradients taken in forward (``ReducedTokenLoss``) where any are
    wanted."""
    n = y.shape[0]
    idx, count = count_rows(y)
    x, weight, bias, y, inputs, teacher = _live(idx, x, weight, bias, y, inputs, teacher)
    k = len(rule.outputs)
    if count == 0:  # (every target ignored: zeros that still reach the inputs in backward)
        zero = (x.sum() * 0 + weight.sum() * 0).float()
        outs = [zero.expand(0) for _ in range(k)]
    elif want_grad and eager and reduction != "none":
        run = make_run(count)
        loss = ReducedTokenLoss.apply(
            x, weight, bias, y, inputs, run, reduction, count, main_grad, *(teacher or ())
        )
        return (loss,), count
    else:
        run = make_run(count)
        outs = TokenLoss.apply(x, weight, bias, y, inputs, run, k, main_grad, want_grad, *(teacher or ()))
    if reduction != "none":  # (the kept rows' sum, as ReducedTokenLoss takes it)
        (loss,) = outs
        return (loss.sum() / max(count, 1) if reduction == "mean" else loss.sum(),), count
    result = []
    for o in outs:
        if idx is not None or count == 0:
            full = torch.zeros(n, dtype=torch.float32, device=x.device)
            o = full.index_copy(0, idx, o) if idx is not None else full + o.sum()
        result.append(o.reshape(shape))
    return tuple(result), count


def _live(idx, x, weight, bias, y, inputs, teacher) -> tuple:
    """The call's tensors at the rows ``idx`` (all for ``None``), contiguous, the teacher's
    detached."""
    if idx is not None:
        x, y, inputs = x.index_select(0, idx), y.index_select(0, idx), inputs.index_select(1, idx)
    if teacher is not None:
        th, tw, tb = teacher
        th = th if idx is None else th.index_select(0, idx)
        teacher = tuple(None if t is None else t.detach().contiguous() for t in (th, tw, tb))
    bias = bias.contiguous() if bias is not None else None
    return x.contiguous(), weight.contiguous(), bias, y, inputs.contiguous(), teacher
