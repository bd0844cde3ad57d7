"""Rules, a model and data shared by the distributed tests (imported by the spawned ranks
as well as by the test process, so that both build exactly the same things)."""

from __future__ import annotations

import torch
from seeds import session_seed

import fuser

# LAMB on gradients clipped in the step by their global norm: a global reduction, then
# two per-tensor norms of which one reads the clipped gradient (three phases).
lamb_clip = fuser.rule(
    """
    c = g * minimum(1, max_norm / (global_norm(g) + 1e-6))
    m = beta1 * m + (1 - beta1) * c
    v = beta2 * v + (1 - beta2) * c**2
    u = m / (1 - beta1**step) / (sqrt(v / (1 - beta2**step)) + eps) + weight_decay * p
    p_norm = norm(p)
    u_norm = norm(u)
    trust = where(p_norm > 0, where(u_norm > 0, p_norm / u_norm, 1), 1)
    p = p - lr * trust * u
""",
    name="lamb_clip",
    hyper=dict(lr=0.02, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.01, max_norm=1.0),
    state=dict(m=0.0, v=0.0),
)

# Every other reduction, sums and maxes in the same phase, and numel.
centred = fuser.rule(
    """
    d = g - mean(g)
    ema = beta * ema + (1 - beta) * d
    r = amax(abs(g)) / (amax(abs(ema)) + eps)
    p = p - lr * r * ema / (norm(d) / sqrt(numel) + eps) - lr * weight_decay * (p - sum(p) / numel)
""",
    name="centred",
    hyper=dict(lr=0.05, beta=0.8, eps=1e-3, weight_decay=0.1),
    state=dict(ema=0.0),
)


def make_model() -> torch.nn.Module:
    """A tiny MLP with odd sizes: sharded on dim 0 over 2 ranks, the last weight (1, 3)
    and bias (1,) leave rank 1 empty shards."""
    torch.manual_seed(session_seed(7))
    return torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1)
    )


def batches(steps: int, size: int = 8):
    """``steps`` full (input, target) batches; rank r of w trains on ``chunk(w)[r]``."""
    gen = torch.Generator().manual_seed(session_seed(99))
    return [(torch.randn(size, 5, generator=gen), torch.randn(size, 1, generator=gen)) for _ in range(steps)]


def train(model, opt, data) -> None:
    for x, y in data:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def step_local_pieces(make_optimizer, got: dict):
    """The same optimizer over one rank's local pieces (``got["init"]``, stepped with
    ``got["grads"]``) as plain tensors in one process: (optimizer, its parameters, the
    index of each among the rank's parameters). Empty pieces are left out."""
    kept = [i for i, t in enumerate(got["init"]) if t.numel()]
    params = [got["init"][i].detach().clone().requires_grad_() for i in kept]
    opt = make_optimizer(params)
    for step_grads in got["grads"]:
        for p, i in zip(params, kept):
            p.grad = step_grads[i].clone()
        opt.step()
    return opt, params, kept


def make_compressed_optimizer(params):
    """AdamW with 8-bit states, and split masters for bf16 parameters."""
    return fuser.optim.AdamW(params, lr=0.01, weight_decay=0.1, state_dtype="q8", master_weights="bf16+int16")


def with_state(params):
    """A new ``make_compressed_optimizer`` whose states exist (one step at lr 0 from zero
    gradients): a template for torch.distributed.checkpoint to load into."""
    opt = make_compressed_optimizer(params)
    for p in params:
        p.grad = torch.zeros_like(p)
    for group in opt.param_groups:
        group["lr"] = 0.0
    opt.step()
    for group in opt.param_groups:
        group["lr"] = 0.01
    return opt


def local_copy(v):
    """A copy of this rank's part of ``v`` (a DTensor's local tensor), or ``v`` itself
    where it is not a tensor."""
    if not torch.is_tensor(v):
        return v
    return (v.to_local() if hasattr(v, "to_local") else v).clone()


def states_of(opt, params) -> list[dict]:
    """Each parameter's optimizer state, this rank's parts copied."""
    return [{k: local_copy(v) for k, v in opt.state[p].items()} for p in params]


def layout_data(layouts, steps: int, salt: int):
    """Fresh parameters and ``steps`` lists of gradients for ``layouts`` ((shape,
    placement, dtype) each), the same in every process of a run."""
    gen = torch.Generator().manual_seed(session_seed(salt))
    params = [torch.randn(shape, generator=gen).to(dtype) for shape, _, dtype in layouts]
    grads = [
        [torch.randn(shape, generator=gen).to(dtype) for shape, _, dtype in layouts] for _ in range(steps)
    ]
    return params, grads
