"""The Adam family: bias-corrected moving averages of the gradient and of its square.
Adam, AdamW, NAdam and RAdam as torch.optim has them; AdEMAMix and Adan after their papers.
"""

from __future__ import annotations

import fuser
from fuser.optim.builtins._base import (
    BuiltinOptimizer,
    Variants,
    check_betas,
    check_lr,
    check_nonneg,
    flag,
    steps,
)

# --- Adam and AdamW (torch.optim.Adam / AdamW) -----------------------------------------------
# Adam's weight decay is L2 (added to the gradient) unless decoupled_weight_decay is set.
_ADAM_HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=0.0, maximize=0.0)

adam = fuser.rule(
    """
    d = g - 2 * maximize * g + (1 - decoupled) * weight_decay * p
    p = p * (1 - decoupled * lr * weight_decay)
    exp_avg = beta1 * exp_avg + (1 - beta1) * d
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * d**2
    p = p - lr / (1 - beta1**step) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2**step) + eps)
""",
    name="adam",
    hyper=_ADAM_HYPER,
    state=dict(exp_avg=0.0, exp_avg_sq=0.0),
)

adam_amsgrad = fuser.rule(
    """
    d = g - 2 * maximize * g + (1 - decoupled) * weight_decay * p
    p = p * (1 - decoupled * lr * weight_decay)
    exp_avg = beta1 * exp_avg + (1 - beta1) * d
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * d**2
    max_exp_avg_sq = maximum(max_exp_avg_sq, exp_avg_sq)
    p = p - lr / (1 - beta1**step) * exp_avg / (sqrt(max_exp_avg_sq) / sqrt(1 - beta2**step) + eps)
""",
    name="adam_amsgrad",
    hyper=_ADAM_HYPER,
    state=dict(exp_avg=0.0, exp_avg_sq=0.0, max_exp_avg_sq=0.0),
)

# AdamW (Loshchilov & Hutter), in torch's formulation: decoupled decay, then the
# bias-corrected Adam step. `maximize` flips the gradient.
adamw = fuser.rule(
    """
    d = g - 2 * maximize * g
    exp_avg = beta1 * exp_avg + (1 - beta1) * d
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * d**2
    p = p * (1 - lr * weight_decay)
    p = p - lr / (1 - beta1**step) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2**step) + eps)
""",
    name="adamw",
    hyper=dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2, maximize=0.0),
    state=dict(exp_avg=0.0, exp_avg_sq=0.0),
)

adamw_amsgrad = fuser.rule(
    """
    d = g - 2 * maximize * g
    exp_avg = beta1 * exp_avg + (1 - beta1) * d
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * d**2
    max_exp_avg_sq = maximum(max_exp_avg_sq, exp_avg_sq)
    p = p * (1 - lr * weight_decay)
    p = p - lr / (1 - beta1**step) * exp_avg / (sqrt(max_exp_avg_sq) / sqrt(1 - beta2**step) + eps)
""",
    name="adamw_amsgrad",
    hyper=dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2, maximize=0.0),
    state=dict(exp_avg=0.0, exp_avg_sq=0.0, max_exp_avg_sq=0.0),
)


def _amsgrad_key(group: dict) -> tuple:
    return (bool(group.get("amsgrad", False)),)


class Adam(BuiltinOptimizer):
    """Drop-in for ``torch.optim.Adam`` (``amsgrad`` selects the rule; L2 weight decay
    unless ``decoupled_weight_decay``)."""

    rule = adam
    variants = Variants("amsgrad", _amsgrad_key, {(False,): adam, (True,): adam_amsgrad})
    hyper_from = dict(decoupled=flag("decoupled_weight_decay"))

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0,
        amsgrad=False,
        *,
        foreach=None,
        maximize=False,
        capturable=False,
        differentiable=False,
        fused=None,
        decoupled_weight_decay=False,
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
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        self._init_builtin(
            params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static, master_weights
        )


class AdamW(BuiltinOptimizer):
    """Drop-in for ``torch.optim.AdamW``: one fused launch per step over all parameters."""

    rule = adamw
    variants = Variants("amsgrad", _amsgrad_key, {(False,): adamw, (True,): adamw_amsgrad})

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        amsgrad=False,
        *,
        maximize=False,
        foreach=None,
        capturable=False,
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
        check_nonneg(epsilon=eps, weight_decay=weight_decay)
        betas = check_betas(betas)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            decoupled_weight_decay=True,
        )
        self._init_builtin(
            params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static, master_weights
        )

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # as torch's AdamW: always decoupled
            group["decoupled_weight_decay"] = True


# --- NAdam (torch.optim.NAdam) -------------------------------------------------------------
# mu_product, the running product of the momentum schedule, reads no per-element value:
# fuser keeps it as one number per tensor, like torch's 0-d state.
nadam = fuser.rule(
    """
    d = g - 2 * maximize * g + (1 - decoupled) * weight_decay * p
    p = p * (1 - decoupled * lr * weight_decay)
    mu = beta1 * (1 - 0.5 * 0.96**(step * momentum_decay))
    mu_next = beta1 * (1 - 0.5 * 0.96**((step + 1) * momentum_decay))
    mu_product = mu_product * mu
    exp_avg = beta1 * exp_avg + (1 - beta1) * d
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * d**2
    denom = sqrt(exp_avg_sq / (1 - beta2**step)) + eps
    p = p - lr * (1 - mu) / (1 - mu_product) * d / denom
    p = p - lr * mu_next / (1 - mu_product * mu_next) * exp_avg / denom
""",
    name="nadam",
    hyper=dict(
        lr=2e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        momentum_decay=4e-3,
        decoupled=0.0,
        maximize=0.0,
    ),
    state=dict(mu_product=1.0, exp_avg=0.0, exp_avg_sq=0.0),
)


class NAdam(BuiltinOptimizer):
    """Drop-in for ``torch.optim.NAdam``; ``mu_product`` is a 0-d float32 state as in torch."""

    rule = nadam
    hyper_from = dict(decoupled=flag("decoupled_weight_decay"))

    def __init__(
        self,
        params,
        lr=2e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0,
        momentum_decay=4e-3,
        decoupled_weight_decay=False,
        *,
        foreach=None,
        maximize=False,
        capturable=False,
        differentiable=False,
        state_dtype=None,
        grad_attr="grad",
        stochastic_rounding=False,
        seed=0,
        static=False,
        master_weights=None,
    ):
        check_lr(lr)
        check_nonneg(epsilon=eps, weight_decay=weight_decay, momentum_decay=momentum_decay)
        betas = check_betas(betas)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            momentum_decay=momentum_decay,
            decoupled_weight_decay=decoupled_weight_decay,
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
        )
        self._init_builtin(
            params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static, master_weights
        )


# --- RAdam (torch.optim.RAdam) -------------------------------------------------------------
# torch branches on rho_t > 5 per step. `rectified` is that branch as 0 or 1, and `rect`
# is 0 when it is off, so both are computed once per step in fp64 and the per-element
# factor is exactly rect * adaptive lr (on) or exactly 1 (off).
radam = fuser.rule(
    """
    d = g - 2 * maximize * g + (1 - decoupled) * weight_decay * p
    p = p * (1 - decoupled * lr * weight_decay)
    exp_avg = beta1 * exp_avg + (1 - beta1) * d
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * d**2
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * step * beta2**step / bias_correction2
    rectified = where(rho_t > 5, 1, 0)
    rect = where(rho_t > 5, sqrt(maximum((rho_t - 4) * (rho_t - 2) * rho_inf, 0)
                                / ((rho_inf - 4) * (rho_inf - 2) * rho_t)), 0)
    adaptive = sqrt(bias_correction2) / (sqrt(exp_avg_sq) + eps)
    p = p - lr / bias_correction1 * exp_avg * (rect * adaptive + (1 - rectified))
""",
    name="radam",
    hyper=dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=0.0, maximize=0.0),
    state=dict(exp_avg=0.0, exp_avg_sq=0.0),
)


class RAdam(BuiltinOptimizer):
    """Drop-in for ``torch.optim.RAdam``."""

    rule = radam
    hyper_from = dict(decoupled=flag("decoupled_weight_decay"))

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0,
        decoupled_weight_decay=False,
        *,
        foreach=None,
        maximize=False,
        capturable=False,
        differentiable=False,
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
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            decoupled_weight_decay=decoupled_weight_decay,
            differentiable=differentiable,
        )
        self._init_builtin(
            params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static, master_weights
        )


# --- AdEMAMix (Pagliardini et al. 2024, "The AdEMAMix Optimizer", Alg. 1) ------------------
# Warmups: alpha_t = min(t alpha / T_alpha, alpha) and beta3_t interpolates linearly in
# 1/log(beta) (the EMA's half-life) from beta1 to beta3 over T_beta3 steps. A warmup of 0
# means none; `maximum(T, 1)` only keeps the unused branch finite then.
ademamix = fuser.rule(
    """
    d = g - 2 * maximize * g
    a = step / maximum(alpha_warmup, 1)
    alpha_t = where(step < alpha_warmup, minimum(a * alpha, alpha), alpha)
    b = step / maximum(beta3_warmup, 1)
    beta3_t = where(step < beta3_warmup,
                    minimum(exp(log(beta1) * log(beta3) / ((1 - b) * log(beta3) + b * log(beta1))), beta3),
                    beta3)
    exp_avg_fast = beta1 * exp_avg_fast + (1 - beta1) * d
    exp_avg_slow = beta3_t * exp_avg_slow + (1 - beta3_t) * d
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * d**2
    denom = sqrt(exp_avg_sq / (1 - beta2**step)) + eps
    p = p * (1 - lr * weight_decay) - lr * (exp_avg_fast / (1 - beta1**step) + alpha_t * exp_avg_slow) / denom
""",
    name="ademamix",
    hyper=dict(
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        beta3=0.9999,
        alpha=2.0,
        alpha_warmup=0.0,
        beta3_warmup=0.0,
        eps=1e-8,
        weight_decay=0.0,
        maximize=0.0,
    ),
    state=dict(exp_avg_fast=0.0, exp_avg_slow=0.0, exp_avg_sq=0.0),
)


class AdEMAMix(BuiltinOptimizer):
    """AdEMAMix (Pagliardini et al. 2024): Adam plus a slow EMA of gradients weighted by
    ``alpha``. ``betas=(beta1, beta2, beta3)``; ``alpha_warmup`` / ``beta3_warmup`` (steps,
    None for none) ramp alpha linearly and beta3 linearly in half-life, as in the paper.
    Keywords and state keys (``exp_avg_fast``, ``exp_avg_slow``, ``exp_avg_sq``) follow the
    authors' implementation."""

    rule = ademamix
    hyper_from = dict(alpha_warmup=steps("alpha_warmup"), beta3_warmup=steps("beta3_warmup"))

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999, 0.9999),
        alpha=2.0,
        beta3_warmup=None,
        alpha_warmup=None,
        eps=1e-8,
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
        check_nonneg(epsilon=eps, weight_decay=weight_decay, alpha=alpha)
        betas = check_betas(betas, 3)
        for name, warmup in (("beta3_warmup", beta3_warmup), ("alpha_warmup", alpha_warmup)):
            if warmup is not None and not warmup >= 0:
                raise ValueError(f"Invalid {name} value: {warmup}")
        if beta3_warmup and betas[0] == 0.0:
            raise ValueError("beta3_warmup ramps beta3 from beta1, which must then be > 0")
        defaults = dict(
            lr=lr,
            betas=betas,
            alpha=alpha,
            beta3_warmup=beta3_warmup,
            alpha_warmup=alpha_warmup,
            eps=eps,
            weight_decay=weight_decay,
            maximize=maximize,
        )
        self._init_builtin(
            params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static, master_weights
        )


# --- Adan (Xie et al. 2022, "Adan: Adaptive Nesterov Momentum Algorithm", Alg. 1) -----------
# With the reference implementation's conventions: betas are the EMAs' decay factors
# (the paper's 1 - beta), the moments start at zero with Adam's bias corrections, and the
# gradient difference is 0 on the first step. `pre_grad` is the previous gradient. The
# paper's proximal decay divides by 1 + lr*wd; no_prox=1 multiplies by 1 - lr*wd instead.
adan = fuser.rule(
    """
    d = g - 2 * maximize * g
    diff = where(step == 1, 0, d - pre_grad)
    exp_avg = beta1 * exp_avg + (1 - beta1) * d
    exp_avg_diff = beta2 * exp_avg_diff + (1 - beta2) * diff
    exp_avg_sq = beta3 * exp_avg_sq + (1 - beta3) * (d + beta2 * diff)**2
    denom = sqrt(exp_avg_sq / (1 - beta3**step)) + eps
    update = (exp_avg / (1 - beta1**step) + beta2 * exp_avg_diff / (1 - beta2**step)) / denom
    p = (p * (1 - no_prox * lr * weight_decay) - lr * update) / (1 + (1 - no_prox) * lr * weight_decay)
    pre_grad = d
""",
    name="adan",
    hyper=dict(
        lr=1e-3, beta1=0.98, beta2=0.92, beta3=0.99, eps=1e-8, weight_decay=0.0, no_prox=0.0, maximize=0.0
    ),
    state=dict(exp_avg=0.0, exp_avg_sq=0.0, exp_avg_diff=0.0, pre_grad=0.0),
)

# Adan with the authors' global gradient clipping (max_grad_norm > 0): every gradient is
# scaled by min(1, max_grad_norm / (||all gradients|| + eps)) inside the step.
adan_clipped = fuser.rule(
    adan.text.replace(
        "d = g - 2 * maximize * g",
        "d = (g - 2 * maximize * g) * minimum(1, max_grad_norm / (global_norm(g) + eps))",
    ),
    name="adan_clipped",
    hyper={**dict(adan.hyper), "max_grad_norm": 1.0},
    state=dict(adan.state),
)


class Adan(BuiltinOptimizer):
    """Adan (Xie et al. 2022): Nesterov momentum through an EMA of gradient differences.
    ``betas=(beta1, beta2, beta3)`` are EMA decay factors (0.98, 0.92, 0.99 by default, the
    paper's 0.02, 0.08, 0.01 as 1 - beta); ``no_prox=False`` applies weight decay as the
    paper's proximal step. State keys ``exp_avg``, ``exp_avg_sq``, ``exp_avg_diff`` and
    ``pre_grad`` (the previous gradient). ``max_grad_norm > 0`` clips all gradients by
    their global norm inside the step, as the authors' implementation does."""

    rule = adan
    variants = Variants(
        "max_grad_norm (zero or not)",
        lambda group: (group.get("max_grad_norm", 0.0) > 0,),
        {(False,): adan, (True,): adan_clipped},
    )
    hyper_from = dict(no_prox=flag("no_prox"))

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.98, 0.92, 0.99),
        eps=1e-8,
        weight_decay=0.0,
        max_grad_norm=0.0,
        no_prox=False,
        *,
        maximize=False,
        foreach=None,
        fused=None,
        state_dtype=None,
        grad_attr="grad",
        stochastic_rounding=False,
        seed=0,
        static=False,
        master_weights=None,
    ):
        check_lr(lr)
        check_nonneg(epsilon=eps, weight_decay=weight_decay)
        betas = check_betas(betas, 3)
        check_nonneg(max_grad_norm=max_grad_norm)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            no_prox=no_prox,
            maximize=maximize,
            foreach=foreach,
            fused=fused,
        )
        self._init_builtin(
            params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static, master_weights
        )
