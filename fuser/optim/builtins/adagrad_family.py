"""Adagrad and RMSprop (torch.optim): the step divided by the root of a running sum
(Adagrad) or a running mean (RMSprop) of squared gradients."""

from __future__ import annotations

import torch

import fuser
from fuser.optim.builtins._base import BuiltinOptimizer, Variants, check_lr, check_nonneg
from fuser.optim.factory import Options

# --- Adagrad (torch.optim.Adagrad) ---------------------------------------------------------
# The accumulator is torch's `sum` (a reserved name in rules: the reduction), stored under
# that key; it starts at each group's initial_accumulator_value, set by the constructor.
adagrad = fuser.rule(
    """
    d = g - 2 * maximize * g + weight_decay * p
    state_sum = state_sum + d**2
    p = p - lr / (1 + (step - 1) * lr_decay) * d / (sqrt(state_sum) + eps)
""",
    name="adagrad",
    hyper=dict(lr=1e-2, lr_decay=0.0, weight_decay=0.0, eps=1e-10, maximize=0.0),
    state=dict(state_sum=0.0),
)


class Adagrad(BuiltinOptimizer):
    """Drop-in for ``torch.optim.Adagrad`` (dense gradients). Like torch, the constructor
    creates each parameter's ``sum`` (at its group's ``initial_accumulator_value``) and
    ``step``."""

    rule = adagrad
    options = Options(state_keys=(("state_sum", "sum"),))

    def __init__(
        self,
        params,
        lr=1e-2,
        lr_decay=0,
        weight_decay=0,
        initial_accumulator_value=0,
        eps=1e-10,
        foreach=None,
        *,
        maximize=False,
        differentiable=False,
        fused=None,
        state_dtype=None,
        grad_attr="grad",
        stochastic_rounding=False,
        seed=0,
        static=False,
        master_weights=None,
    ):
        check_lr(lr)
        check_nonneg(
            lr_decay=lr_decay,
            weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value,
            epsilon=eps,
        )
        defaults = dict(
            lr=lr,
            lr_decay=lr_decay,
            eps=eps,
            weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value,
            foreach=foreach,
            maximize=maximize,
            differentiable=differentiable,
            fused=fused,
        )
        self._init_builtin(
            params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static, master_weights
        )

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            st = self.state[p]
            if "sum" not in st:
                st["step"] = torch.tensor(0.0)
                st["sum"] = torch.full_like(
                    p,
                    group["initial_accumulator_value"],
                    dtype=self._state_dtype(p),
                    memory_format=torch.preserve_format,
                )


# --- RMSprop (torch.optim.RMSprop) ---------------------------------------------------------
_RMSPROP_HYPER = dict(lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, maximize=0.0)

rmsprop = fuser.rule(
    """
    d = g - 2 * maximize * g + weight_decay * p
    square_avg = alpha * square_avg + (1 - alpha) * d**2
    p = p - lr * d / (sqrt(square_avg) + eps)
""",
    name="rmsprop",
    hyper=_RMSPROP_HYPER,
    state=dict(square_avg=0.0),
)

rmsprop_centered = fuser.rule(
    """
    d = g - 2 * maximize * g + weight_decay * p
    square_avg = alpha * square_avg + (1 - alpha) * d**2
    grad_avg = alpha * grad_avg + (1 - alpha) * d
    p = p - lr * d / (sqrt(square_avg - grad_avg**2) + eps)
""",
    name="rmsprop_centered",
    hyper=_RMSPROP_HYPER,
    state=dict(square_avg=0.0, grad_avg=0.0),
)

rmsprop_momentum = fuser.rule(
    """
    d = g - 2 * maximize * g + weight_decay * p
    square_avg = alpha * square_avg + (1 - alpha) * d**2
    momentum_buffer = momentum * momentum_buffer + d / (sqrt(square_avg) + eps)
    p = p - lr * momentum_buffer
""",
    name="rmsprop_momentum",
    hyper=_RMSPROP_HYPER,
    state=dict(square_avg=0.0, momentum_buffer=0.0),
)

rmsprop_centered_momentum = fuser.rule(
    """
    d = g - 2 * maximize * g + weight_decay * p
    square_avg = alpha * square_avg + (1 - alpha) * d**2
    grad_avg = alpha * grad_avg + (1 - alpha) * d
    momentum_buffer = momentum * momentum_buffer + d / (sqrt(square_avg - grad_avg**2) + eps)
    p = p - lr * momentum_buffer
""",
    name="rmsprop_centered_momentum",
    hyper=_RMSPROP_HYPER,
    state=dict(square_avg=0.0, grad_avg=0.0, momentum_buffer=0.0),
)


def _rmsprop_key(group: dict) -> tuple:
    return (bool(group.get("centered", False)), group["momentum"] > 0)


class RMSprop(BuiltinOptimizer):
    """Drop-in for ``torch.optim.RMSprop`` (``centered`` and ``momentum > 0`` select the rule)."""

    rule = rmsprop
    variants = Variants(
        "centered and momentum (zero or not)",
        _rmsprop_key,
        {
            (False, False): rmsprop,
            (True, False): rmsprop_centered,
            (False, True): rmsprop_momentum,
            (True, True): rmsprop_centered_momentum,
        },
    )

    def __init__(
        self,
        params,
        lr=1e-2,
        alpha=0.99,
        eps=1e-8,
        weight_decay=0,
        momentum=0,
        centered=False,
        capturable=False,
        foreach=None,
        maximize=False,
        differentiable=False,
        *,
        state_dtype=None,
        grad_attr="grad",
        stochastic_rounding=False,
        seed=0,
        static=False,
        master_weights=None,
    ):
        check_lr(lr)
        check_nonneg(epsilon=eps, momentum=momentum, weight_decay=weight_decay, alpha=alpha)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            alpha=alpha,
            eps=eps,
            centered=centered,
            weight_decay=weight_decay,
            capturable=capturable,
            foreach=foreach,
            maximize=maximize,
            differentiable=differentiable,
        )
        self._init_builtin(
            params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static, master_weights
        )
