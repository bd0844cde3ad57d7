"""Vocabulary-parallel losses on CPU: the session's 2 gloo ranks (ranks.py), each holding an
uneven slice of the vocabulary, against a single-process unsharded run of the same rule.

Each worker runs every case twice: sharded (its weight/bias rows, ``process_group=``) and
unsharded (the whole weight, no group). The loss, the gradient of ``hidden`` and the
gradients of its weight and bias rows must match. Shapes are tiny (the kernels run through
Triton's interpreter); ``chunk_size`` and ``block`` are small so several token chunks and
several vocabulary blocks per shard are crossed.
"""

from __future__ import annotations

import pytest
import torch
from ranks import run_ranks
from seeds import session_seed

WORLD = 2
T, H, V = 11, 8, 37
SPLITS = [(20, 17), (37, 0)]  # uneven shards, rank order; a rank may hold no rows
TIMEOUT_S = 240

# A user rule with `max` and `sum` (a stable log-sum-exp written by hand, plus a margin term
# read at the argmax), and one whose first sweep reads z[y] (a multi-class hinge).
MAX_SUM = """
m = max(z)
lse = m + log(sum(exp(z - m)))
loss = lse - z[y] + margin * (m - z[y]) + 0.01 * mean(z)**2
"""
HINGE = """
loss = sum(maximum(0, 1 + z - z[y])) - 1
"""
# A logsumexp whose argument reads an earlier mean: a second sweep and derived reductions.
NESTED = """
m = mean(z)
z = z * z / (1 + m * m) + log1p(exp(-abs(z)))
loss = logsumexp(z) - z[y]
"""


def _cases():
    import fuser
    import fuser.losses

    small = dict(chunk_size=4, block=16)  # 3 token chunks; 2 vocabulary blocks per shard
    max_sum = fuser.compile(fuser.loss(MAX_SUM, name="vp_max_sum", hyper=dict(margin=0.3)), **small)
    hinge = fuser.compile(fuser.loss(HINGE, name="vp_hinge"), **small)
    nested = fuser.compile(fuser.loss(NESTED, name="vp_nested"), **small)
    ce_full = fuser.compile(fuser.losses.CROSS_ENTROPY_FULL, **small)
    entropy = fuser.compile(fuser.losses.ENTROPY_REGULARIZED_CROSS_ENTROPY, **small)
    return [
        ("ce-mean", fuser.losses.cross_entropy, dict(reduction="mean"), True),
        (
            "ce-smooth-zloss-sum",
            fuser.losses.cross_entropy,
            dict(reduction="sum", label_smoothing=0.1, z_loss=1e-3),
            True,
        ),
        (
            "ce-main-grad",
            fuser.losses.cross_entropy,
            dict(reduction="mean", accumulate_into="main_grad"),
            True,
        ),
        # memory="fast": the gradients taken in forward, the weight's added into main_grad in backward
        (
            "ce-main-grad-fast",
            fuser.losses.cross_entropy,
            dict(reduction="mean", accumulate_into="main_grad", memory="fast"),
            True,
        ),
        ("ce-smooth-temp-none", ce_full, dict(reduction="none", label_smoothing=0.2, temperature=1.5), False),
        ("entropy-mean", entropy, dict(reduction="mean", entropy_coef=0.05), True),
        ("max-sum-mean", max_sum, dict(reduction="mean"), True),
        ("max-sum-none", max_sum, dict(reduction="none", margin=0.5), False),
        ("hinge-sum", hinge, dict(reduction="sum"), False),
        ("nested-mean", nested, dict(reduction="mean"), True),
        # the lean schedule: the rule in the matmul kernels over each rank's rows
        ("lean-ce-smooth-zloss-none", fuser.losses.cross_entropy,
         dict(reduction="none", label_smoothing=0.1, z_loss=1e-3, memory="lean"), True),
        ("lean-ce-main-grad", fuser.losses.cross_entropy,
         dict(reduction="mean", accumulate_into="main_grad", memory="lean"), False),
        ("lean-max-sum-mean", max_sum, dict(reduction="mean", memory="lean"), True),
        ("lean-nested-sum", nested, dict(reduction="sum", memory="lean"), False),
    ]  # fmt: skip


def _run(f, hidden, weight, bias, target, kw, group=None):
    x = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    if kw.get("accumulate_into") == "main_grad":
        w.main_grad = torch.full(w.shape, 0.25)
    b = bias.clone().requires_grad_() if bias is not None else None
    extra = {} if group is None else dict(process_group=group)
    out = f(x, w, target, b, **kw, **extra)
    go = torch.linspace(0.5, 1.5, out.numel()).reshape(out.shape)
    (out * go).sum().backward()
    gw = w.main_grad - 0.25 if kw.get("accumulate_into") == "main_grad" else w.grad
    return out.detach(), x.grad, gw, (b.grad if b is not None else None)


def _close(a, b, what, tol=2e-5):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    if b.numel() == 0:  # the gradient of a rank that holds no rows
        return
    scale = b.abs().max().clamp(min=1e-6)
    err = (a.double() - b.double()).abs().max()
    assert torch.isfinite(a).all(), f"{what}: non-finite"
    assert err <= tol * scale, f"{what}: max error {err:.3e} > {tol:.0e} * {scale:.3e}"


def _worker(rank: int, world: int, split: tuple[int, int]) -> list[str]:
    import torch.distributed as dist

    g = torch.Generator().manual_seed(session_seed())
    hidden = torch.randn(T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.7
    bias = torch.randn(V, generator=g) * 0.5
    target = torch.randint(0, V, (T,), generator=g)
    target[::4] = -100
    target[1] = min(split[0], V - 1)  # the first column of rank 1
    target[2] = split[0] - 1  # the last column of rank 0
    lo = sum(split[:rank])
    hi = lo + split[rank]
    cases = _cases()
    for name, f, kw, with_bias in cases:
        b = bias if with_bias else None
        ref = _run(f, hidden, weight, b, target, kw)
        got = _run(
            f, hidden, weight[lo:hi], b[lo:hi] if b is not None else None, target, kw, dist.group.WORLD
        )
        _close(got[0], ref[0], f"{name}: loss")
        _close(got[1], ref[1], f"{name}: grad hidden")
        _close(got[2], ref[2][lo:hi], f"{name}: grad weight shard")
        if b is not None:
            _close(got[3], ref[3][lo:hi], f"{name}: grad bias shard")
    return [name for name, *_ in cases]


@pytest.mark.parametrize("split", SPLITS)
def test_vocab_parallel_matches_unsharded(split):
    # (the session's gloo ranks, tests/distributed/ranks.py: a rank's failed check is the failure)
    checked = run_ranks(_worker, split, world=WORLD, timeout=TIMEOUT_S)
    assert checked[0] and all(names == checked[0] for names in checked), checked


def test_process_group_needs_initialized_distributed():
    import torch.distributed as dist

    import fuser.losses

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    h, w, t = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2])
    with pytest.raises(RuntimeError, match="torch.distributed"):
        fuser.losses.cross_entropy(h, w, t, process_group=object())
