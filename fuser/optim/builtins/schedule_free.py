"""Schedule-free AdamW (Defazio et al. 2024): no learning-rate schedule, an average of the
iterates instead. Training steps the interpolation ``y`` between the average ``x`` and the
base sequence ``z``; ``eval()`` moves the parameters to ``x`` and ``train()`` back."""

from __future__ import annotations

import torch

import fuser
from fuser.optim.builtins._base import BuiltinOptimizer, check_betas, check_lr, check_nonneg

# pytorch-optimizer 4.1.0's ScheduleFreeAdamW step (ams_bound=False): `weight_sum` and
# `lr_max` are per-tensor scalar states that every tensor shares (the reference keeps them
# in the param group).
schedule_free_adamw = fuser.rule(
    """
    d = g - 2 * maximize * g
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * d**2
    u = d / (sqrt(exp_avg_sq / (1 - beta2**step) + 1e-15) + eps) + weight_decay * p
    lr_t = lr * where(step < warmup_steps, step / maximum(warmup_steps, 1), 1)
    lr_max = maximum(lr_t, lr_max)
    weight = step**r * lr_max**weight_lr_power
    weight_sum = weight_sum + weight
    ckp = where(weight_sum != 0, weight / weight_sum, 0)
    ckp = where(decoupling_c > 0, minimum(1, ckp * (1 - beta1) * decoupling_c), ckp)
    p = p + ckp * (z - p)
    p = p + lr_t * (beta1 * (1 - ckp) - 1) * u
    z = z - lr_t * u
""",
    name="schedule_free_adamw",
    hyper=dict(
        lr=2.5e-3,
        beta1=0.9,
        beta2=0.999,
        weight_decay=0.0,
        r=0.0,
        weight_lr_power=2.0,
        warmup_steps=0.0,
        decoupling_c=0.0,
        eps=1e-8,
        maximize=0.0,
    ),
    state=dict(exp_avg_sq=0.0, z="p", lr_max=-1.0, weight_sum=0.0),
)


class ScheduleFreeAdamW(BuiltinOptimizer):
    """Schedule-free AdamW with pytorch-optimizer 4.1.0's keywords, defaults and state keys
    (``z``, ``exp_avg_sq``; ``lr_max`` and ``weight_sum`` per tensor rather than per group).
    Its parameters hold the training point ``y`` after ``train()`` (the start) and the
    average ``x`` after ``eval()``; ``step()`` needs train mode and says so otherwise (the
    reference steps from whatever the parameters hold). ``ams_bound`` is not supported."""

    rule = schedule_free_adamw

    def __init__(
        self,
        params,
        lr=2.5e-3,
        betas=(0.9, 0.999),
        weight_decay=0.0,
        r=0.0,
        weight_lr_power=2.0,
        warmup_steps=0,
        decoupling_c=0,
        ams_bound=False,
        eps=1e-8,
        maximize=False,
        foreach=None,
        *,
        state_dtype=None,
        grad_attr="grad",
        stochastic_rounding=False,
        seed=0,
        static=False,
        master_weights=None,
    ):
        check_lr(lr)
        betas = check_betas(betas)
        if not 0.0 < betas[0]:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]} (schedule-free needs beta1 > 0)")
        check_nonneg(decoupling_c=decoupling_c, weight_decay=weight_decay, epsilon=eps)
        if ams_bound:
            raise NotImplementedError("ScheduleFreeAdamW(ams_bound=True) is not supported by fuser")
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, r=r, weight_lr_power=weight_lr_power,
                        warmup_steps=warmup_steps, decoupling_c=decoupling_c, eps=eps, maximize=maximize,
                        train_mode=True)  # fmt: skip
        self._init_builtin(
            params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static, master_weights
        )

    def eval(self) -> None:
        """Move every parameter to the average ``x`` (for evaluation and checkpoints)."""
        self._move(train=False)

    def train(self) -> None:
        """Move every parameter back to the training point ``y``."""
        self._move(train=True)

    def _move(self, train: bool) -> None:
        with torch.no_grad():
            for group in self.param_groups:
                if group["train_mode"] == train:
                    continue
                beta1 = group["betas"][0]
                weight = 1.0 - beta1 if train else 1.0 - 1.0 / beta1
                pairs = [(p, self.state[p]["z"]) for p in group["params"] if "z" in self.state.get(p, {})]
                for p, z in pairs:
                    p.lerp_(z.to(p.dtype), weight)
                group["train_mode"] = train

    def step(self, closure=None):
        if not all(group["train_mode"] for group in self.param_groups):
            raise RuntimeError(
                "ScheduleFreeAdamW.step() in eval mode: its parameters hold the average; "
                "call optimizer.train() before training steps"
            )
        return BuiltinOptimizer.step(self, closure)

    step.hooked = True  # as the base's: torch.optim.Optimizer does not wrap it again
