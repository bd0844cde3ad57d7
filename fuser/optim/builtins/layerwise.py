"""Layer-wise trust ratios: LAMB and LARS scale each tensor's step by the ratio of its
norm to its update's (per-tensor norms, so two launches a step)."""

from __future__ import annotations

import fuser
from fuser.optim.builtins._base import BuiltinOptimizer, check_betas, check_lr, check_nonneg

# --- LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning", Alg. 2) -----------
# Adam's bias-corrected direction plus decoupled decay, scaled per tensor by the trust
# ratio ||p|| / ||u|| (1 when either norm is 0). Two launches: the norms, then the update.
lamb = fuser.rule(
    """
    d = g - 2 * maximize * g
    exp_avg = beta1 * exp_avg + (1 - beta1) * d
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * d**2
    u = (exp_avg / (1 - beta1**step)) / (sqrt(exp_avg_sq / (1 - beta2**step)) + eps) + weight_decay * p
    p_norm = norm(p)
    u_norm = norm(u)
    trust = where(p_norm > 0, where(u_norm > 0, p_norm / u_norm, 1), 1)
    p = p - lr * trust * u
""",
    name="lamb",
    hyper=dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.0, maximize=0.0),
    state=dict(exp_avg=0.0, exp_avg_sq=0.0),
)


class LAMB(BuiltinOptimizer):
    """LAMB (You et al. 2020): Adam's direction with decoupled weight decay, scaled per
    tensor by the trust ratio ``||p|| / ||update||``. State keys ``exp_avg``, ``exp_avg_sq``."""

    rule = lamb

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-6,
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
        check_nonneg(epsilon=eps, weight_decay=weight_decay)
        betas = check_betas(betas)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize)
        self._init_builtin(
            params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static, master_weights
        )


# --- LARS (You et al. 2017, "Large Batch Training of Convolutional Networks", Alg. 1) -------
# Layer-wise rate trust_coefficient * ||p|| / (||g|| + wd ||p||) (1 when a norm is 0) on
# the decayed gradient, then heavy-ball momentum with lr applied outside the buffer (as
# torch's SGD does, so lr schedules act on the step, not on the buffer).
lars = fuser.rule(
    """
    d = g - 2 * maximize * g
    p_norm = norm(p)
    denom = norm(d) + weight_decay * p_norm
    trust = where(p_norm > 0, where(denom > 0, trust_coefficient * p_norm / denom, 1), 1)
    momentum_buffer = momentum * momentum_buffer + (1 - dampening) * trust * (d + weight_decay * p)
    p = p - lr * momentum_buffer
""",
    name="lars",
    hyper=dict(lr=1e-3, momentum=0.9, dampening=0.0, weight_decay=0.0, trust_coefficient=1e-3, maximize=0.0),
    state=dict(momentum_buffer=0.0),
)


class LARS(BuiltinOptimizer):
    """LARS (You et al. 2017): SGD with momentum whose rate is scaled per tensor by
    ``trust_coefficient * ||p|| / (||g|| + weight_decay * ||p||)``. State key
    ``momentum_buffer``. Exclude biases and norms by giving them their own param group with
    ``trust_coefficient`` and ``weight_decay`` as you want them."""

    rule = lars

    def __init__(
        self,
        params,
        lr=1e-3,
        momentum=0.9,
        dampening=0.0,
        weight_decay=0.0,
        trust_coefficient=1e-3,
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
        check_nonneg(
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
        )
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            maximize=maximize,
        )
        self._init_builtin(
            params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static, master_weights
        )
