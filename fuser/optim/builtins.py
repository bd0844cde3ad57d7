"""Built-in optimizers, each written as a fuser rule.

Each class takes the same constructor keywords as its torch.optim counterpart (``betas=``
tuples included) and keeps the same ``state_dict`` keys, so checkpoints move both ways.
Keywords that change the shape of the update (``amsgrad``) pick a rule variant at
construction; the others are hyperparameters, one value per param group.
"""

from __future__ import annotations

import fuser
from fuser.optim.factory import FuserOptimizer, Options

# AdamW (Loshchilov & Hutter), in torch's formulation: decoupled decay, then the
# bias-corrected Adam step. `maximize` flips the gradient.
adamw = fuser.rule("""
    d = g - 2 * maximize * g
    exp_avg = beta1 * exp_avg + (1 - beta1) * d
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * d**2
    p = p * (1 - lr * weight_decay)
    p = p - lr / (1 - beta1**step) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2**step) + eps)
""", name="adamw", hyper=dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2, maximize=0.0),
    state=dict(exp_avg=0.0, exp_avg_sq=0.0))

adamw_amsgrad = fuser.rule("""
    d = g - 2 * maximize * g
    exp_avg = beta1 * exp_avg + (1 - beta1) * d
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * d**2
    max_exp_avg_sq = maximum(max_exp_avg_sq, exp_avg_sq)
    p = p * (1 - lr * weight_decay)
    p = p - lr / (1 - beta1**step) * exp_avg / (sqrt(max_exp_avg_sq) / sqrt(1 - beta2**step) + eps)
""", name="adamw_amsgrad",
    hyper=dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2, maximize=0.0),
    state=dict(exp_avg=0.0, exp_avg_sq=0.0, max_exp_avg_sq=0.0))


def _check_structural(opt: FuserOptimizer, key: str) -> None:
    """Options that select the rule must agree across param groups."""
    values = {bool(g.get(key, opt.defaults[key])) for g in opt.param_groups}
    if len(values) > 1:
        raise ValueError(f"{type(opt).__name__}: {key} must be the same in every param group "
                         "(it selects the compiled rule)")


class AdamW(FuserOptimizer):
    """Drop-in for ``torch.optim.AdamW``: one fused launch per step over all parameters."""

    rule = adamw
    options = Options()

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, state_dtype=None):
        if not 0.0 <= float(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid beta parameters: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if differentiable:
            raise ValueError("fuser optimizers are not differentiable")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize, foreach=foreach, capturable=capturable,
                        differentiable=False, fused=fused)
        options = Options(state_dtype=_state_dtype_name(state_dtype))
        self._init_fuser(params, defaults, rule=adamw_amsgrad if amsgrad else adamw, options=options)
        _check_structural(self, "amsgrad")

    def _group_hyper(self, group):
        beta1, beta2 = group["betas"]
        return dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], maximize=float(bool(group["maximize"])))


def _state_dtype_name(state_dtype):
    from fuser.optim.factory import _options

    return _options(state_dtype=state_dtype).state_dtype
