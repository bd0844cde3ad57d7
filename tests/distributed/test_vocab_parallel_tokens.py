"""Token rules vocabulary-parallel on CPU (2 gloo processes, uneven vocabulary slices):
``token_logprobs(entropy=True)`` and a rule with per-token inputs, a bias and a ``max``
against the same call on the whole vocabulary in one process: every output, the gradient of
``hidden`` and each rank's rows of the weight and bias gradients, for fp32 and bf16 inputs;
and a distillation loss reading a teacher head (its rows sliced as the student's)."""

from __future__ import annotations

import pytest
import torch
from ranks import run_ranks

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch was built without gloo", allow_module_level=True)

from seeds import session_seed  # noqa: E402

T, H, V = 11, 8, 37
SPLITS = [(20, 17), (37, 0)]  # rank order; a rank may hold no rows
WEIGHTED = """
    lse = logsumexp(z)
    logp = (z[y] - lse) * w
    gap = max(z) - lse + shift
"""


def _call(f, hidden, weight, bias, target, kw, group=None):
    x = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    b = bias.clone().requires_grad_() if bias is not None else None
    extra = {} if group is None else dict(process_group=group)
    outs = f(x, w, target, **({} if b is None else dict(bias=b)), **kw, **extra)
    outs = (outs,) if isinstance(outs, torch.Tensor) else outs  # (a reduced loss)
    upstream = [torch.linspace(0.5, 1.5, T), torch.linspace(-1.0, 0.7, T)]
    sum(o * g for o, g in zip(outs, upstream)).sum().backward()
    return [o.detach() for o in outs], x.grad, w.grad, b.grad if b is not None else None


def _error(a, b) -> float:
    if b.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-6))


def worker(rank, world, split):
    import fuser
    import fuser.losses

    g = torch.Generator().manual_seed(session_seed(4711))
    hidden = torch.randn(T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.7
    bias = torch.randn(V, generator=g) * 0.5
    target = torch.randint(0, V, (T,), generator=g)
    target[::4] = -100
    target[1] = min(split[0], V - 1)  # the first column of rank 1
    target[2] = split[0] - 1  # the last column of rank 0
    w_in = torch.rand(T, generator=g) + 0.5
    lo, hi = sum(split[:rank]), sum(split[: rank + 1])
    small = dict(chunk_size=4, block=16)
    logprobs = fuser.compile(fuser.losses.TOKEN_LOGPROBS_ENTROPY, **small)
    weighted = fuser.compile(
        fuser.loss(
            WEIGHTED, name="vp_weighted", hyper=dict(shift=0.1), inputs=("w",), outputs=("logp", "gap")
        ),
        **small,
    )
    cases = [
        ("token_logprobs", logprobs, dict(temperature=0.8), None, torch.float32),
        ("weighted", weighted, dict(w=w_in, shift=0.3), bias, torch.float32),
        # (bf16: each rank rounds its share of grad_hidden before the sum, so the gradients
        # agree within bf16's rounding, the outputs within fp32's)
        ("bf16 token_logprobs", logprobs, dict(), None, torch.bfloat16),
    ]
    # A teacher head of another hidden size, its weight and bias sliced as the student's.
    tx, tw, tb = (
        torch.randn(T, 6, generator=g),
        torch.randn(V, 6, generator=g) * 0.5,
        torch.randn(V, generator=g),
    )
    jsd = fuser.compile(fuser.losses.DISTILL_JSD, **small)
    teacher = dict(teacher_hidden=tx, teacher_weight=tw, teacher_bias=tb, beta=0.3, hard_weight=0.4)
    cases.append(("distill_jsd", jsd, teacher, None, torch.float32))
    # t[y] reaches each rank's kernels as a per-token input, summed from the rank holding y.
    at_target = fuser.compile(
        fuser.loss("lse_t = logsumexp(t)\nce = exp(t[y] - lse_t) * (logsumexp(z) - z[y])", name="vp_t_y",
                   outputs=("ce",)),
        **small,
    )  # fmt: skip
    heads = dict(teacher_hidden=tx, teacher_weight=tw, teacher_bias=tb)
    cases.append(("teacher t[y]", at_target, heads, bias, torch.float32))
    errors = {}
    for name, f, kw, b, dtype in cases:
        h, wt = hidden.to(dtype), weight.to(dtype)
        ref = _call(f, h, wt, b, target, kw)
        if "teacher_weight" in kw:
            kw = dict(kw, teacher_weight=tw[lo:hi], teacher_bias=tb[lo:hi])
        got = _call(f, h, wt[lo:hi], b[lo:hi] if b is not None else None, target, kw, dist.group.WORLD)
        for i, (o, r) in enumerate(zip(got[0], ref[0])):
            errors[f"{name}: output {i}"] = _error(o, r)
        errors[f"{name}: grad hidden"] = _error(got[1], ref[1])
        errors[f"{name}: grad weight rows"] = _error(got[2], ref[2][lo:hi])
        if b is not None:
            errors[f"{name}: grad bias rows"] = _error(got[3], ref[3][lo:hi])
    return errors


@pytest.mark.parametrize("split", SPLITS)
def test_token_rules_vocab_parallel_match_one_process(split):
    for rank, errors in enumerate(run_ranks(worker, split, timeout=240)):
        bound = {k: 2e-2 if k.startswith("bf16") and "grad" in k else 2e-5 for k in errors}
        bad = {k: v for k, v in errors.items() if not v <= bound[k]}
        assert not bad, f"rank {rank}: {bad}"
