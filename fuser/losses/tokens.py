"""The call of a compiled token rule (per-token inputs, or outputs other than ``("loss",)``):
its argument checks, then ``fuser.runtime.loss.tokens.TokenLoss``.

Such a rule runs in the ``chunks`` schedule with fp32 logits (``runtime.loss.tokens``);
``memory="auto"`` and ``"fast"`` pick it, as does the compile option ``schedule="auto"`` or
``"chunks"``, with or without ``process_group=`` (``ShardedTokens``). The other schedules
and ``memory="lean"`` do not take such rules yet and say so before anything runs.
"""

from __future__ import annotations

import torch

from fuser.runtime.loss.tokens import TokenLoss

# The schedules (compile option) and memory settings that run token rules.
TOKEN_SCHEDULES = ("auto", "chunks")
TOKEN_MEMORY = ("auto", "fast")


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


def check_options(rule, schedule: str, memory: str, reduction) -> None:
    """Raise for an option a token rule's call does not take (nothing has run)."""
    if schedule not in TOKEN_SCHEDULES:
        raise ValueError(
            f"{rule.name} reads per-token inputs or returns several outputs, which the "
            f"{schedule!r} schedule does not run yet: compile it with schedule='auto' or 'chunks'"
        )
    if memory not in TOKEN_MEMORY:
        raise ValueError(
            f"{rule.name} reads per-token inputs or returns several outputs, which memory={memory!r} "
            "does not run yet: memory='auto' or 'fast' run it in the chunks schedule (fp32 logits)"
        )
    outputs = tuple(n for n, _ in rule.outputs)
    if outputs != ("loss",) and reduction not in (None, "none"):
        raise ValueError(
            f"{rule.name} returns the per-token outputs {outputs}, which take no reduction: leave "
            f"reduction out (or 'none') and reduce them in torch, not reduction={reduction!r}"
        )


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


def run_token_rule(rule, x, weight, bias, y, inputs, shape, *, main_grad, want_grad, count_rows, make_run):
    """The outputs of a token rule's call, fp32 of ``shape`` each (a tuple, in the rule's
    order), and the count of targets not ignored: rows whose target is ``ignore_index`` are
    left out of the kernels (``count_rows`` finds them, once per call, and checks the other
    targets) and get 0 in every output. ``make_run(count)``: the run for ``count`` rows."""
    n = y.shape[0]
    idx, count = count_rows(y)
    if idx is not None:
        x, y, inputs = x.index_select(0, idx), y.index_select(0, idx), inputs.index_select(1, idx)
    x, weight = x.contiguous(), weight.contiguous()
    bias = bias.contiguous() if bias is not None else None
    k = len(rule.outputs)
    if count == 0:  # (every target ignored: zeros that still reach the inputs in backward)
        zero = (x.sum() * 0 + weight.sum() * 0).float()
        outs = [zero.expand(0) for _ in range(k)]
    else:
        outs = TokenLoss.apply(
            x, weight, bias, y, inputs.contiguous(), make_run(count), k, main_grad, want_grad
        )
    result = []
    for o in outs:
        if idx is not None or count == 0:
            full = torch.zeros(n, dtype=torch.float32, device=x.device)
            o = full.index_copy(0, idx, o) if idx is not None else full + o.sum()
        result.append(o.reshape(shape))
    return tuple(result), count
