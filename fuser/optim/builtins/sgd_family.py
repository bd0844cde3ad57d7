"""SGD (torch.optim.SGD): plain, with heavy-ball momentum, or with Nesterov momentum."""

from __future__ import annotations

import torch

import fuser
from fuser.optim.builtins._base import BuiltinOptimizer, Variants, check_lr, check_nonneg

# torch's first step copies the gradient into the momentum buffer; later steps decay it.
_SGD_HYPER = dict(lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, maximize=0.0)

sgd = fuser.rule(
    """
    d = g - 2 * maximize * g + weight_decay * p
    p = p - lr * d
""",
    name="sgd",
    hyper=_SGD_HYPER,
)

sgd_momentum = fuser.rule(
    """
    d = g - 2 * maximize * g + weight_decay * p
    momentum_buffer = where(step == 1, d, momentum * momentum_buffer + (1 - dampening) * d)
    p = p - lr * momentum_buffer
""",
    name="sgd_momentum",
    hyper=_SGD_HYPER,
    state=dict(momentum_buffer=0.0),
)

sgd_nesterov = fuser.rule(
    """
    d = g - 2 * maximize * g + weight_decay * p
    momentum_buffer = where(step == 1, d, momentum * momentum_buffer + (1 - dampening) * d)
    p = p - lr * (d + momentum * momentum_buffer)
""",
    name="sgd_nesterov",
    hyper=_SGD_HYPER,
    state=dict(momentum_buffer=0.0),
)


def _sgd_key(group: dict) -> tuple:
    with_momentum = group["momentum"] != 0
    return (with_momentum, with_momentum and bool(group.get("nesterov", False)))


class SGD(BuiltinOptimizer):
    """Drop-in for ``torch.optim.SGD``: one fused launch per step over all parameters.

    torch keeps no ``step`` in SGD's state; fuser does (it tells the first step, which
    copies the gradient into the momentum buffer). A loaded momentum buffer without a step
    counts as one step taken, so it is decayed rather than replaced.
    """

    rule = sgd
    variants = Variants(
        "momentum (zero or not) and nesterov",
        _sgd_key,
        {(False, False): sgd, (True, False): sgd_momentum, (True, True): sgd_nesterov},
    )

    def __init__(
        self,
        params,
        lr=1e-3,
        momentum=0,
        dampening=0,
        weight_decay=0,
        nesterov=False,
        *,
        maximize=False,
        foreach=None,
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
        check_nonneg(momentum=momentum, weight_decay=weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
            foreach=foreach,
            differentiable=differentiable,
            fused=fused,
        )
        self._init_builtin(
            params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static, master_weights
        )

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        if self.rule is sgd:
            return
        for st in self.state.values():
            if st.get("momentum_buffer") is None:
                # No buffer (torch without momentum, or None): the next step starts one.
                st.pop("momentum_buffer", None)
                st.pop("step", None)
            elif "step" not in st:
                st["step"] = torch.tensor(1.0)
