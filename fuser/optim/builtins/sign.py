"""Sign-based updates: Lion, which steps every coordinate by the same magnitude."""

from __future__ import annotations

import fuser
from fuser.optim.builtins._base import BuiltinOptimizer, check_betas, check_lr, check_nonneg

# --- Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Alg. 2) -----
lion = fuser.rule(
    """
    d = g - 2 * maximize * g
    update = sign(beta1 * exp_avg + (1 - beta1) * d)
    p = p * (1 - lr * weight_decay) - lr * update
    exp_avg = beta2 * exp_avg + (1 - beta2) * d
""",
    name="lion",
    hyper=dict(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.0, maximize=0.0),
    state=dict(exp_avg=0.0),
)


class Lion(BuiltinOptimizer):
    """Lion (Chen et al. 2023): the sign of an interpolated momentum, decoupled weight decay.
    State key ``exp_avg`` as in the authors' PyTorch implementation."""

    rule = lion

    def __init__(
        self,
        params,
        lr=1e-4,
        betas=(0.9, 0.99),
        weight_decay=0.0,
        *,
        maximize=False,
        state_dtype=None,
        grad_attr="grad",
        stochastic_rounding=False,
        seed=0,
        static=False,
        master_weights=None,
    ):
        check_lr(lr)
        check_nonneg(weight_decay=weight_decay)
        betas = check_betas(betas)
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize)
        self._init_builtin(
            params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static, master_weights
        )
