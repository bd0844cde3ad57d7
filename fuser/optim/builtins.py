"""Built-in optimizers, each written as a fuser rule.

Each class takes the same constructor keywords as its torch.optim counterpart (``betas=``
tuples included) and keeps the same ``state_dict`` keys, so checkpoints move both ways.
Keywords that change the shape of the update (``amsgrad``, ``nesterov``, ``centered``,
``momentum`` zero or not) pick a rule variant at construction and must agree across param
groups; the others are hyperparameters, one value per param group. Boolean keywords that
do not change the shape (``maximize``, ``decoupled_weight_decay``) are 0/1 hyperparameters:
``g - 2 * maximize * g`` is exactly ``g`` or ``-g``.

Optimizers torch does not have (Lion, AdEMAMix, Adan) follow their papers, with the
keywords and state keys of the authors' reference implementations.
"""

from __future__ import annotations

import dataclasses

import torch

import fuser
from fuser.optim.factory import FuserOptimizer, Options
from fuser.optim.factory import parse_options as _options
from fuser.rules.rule import Rule

# --- SGD (torch.optim.SGD) ---------------------------------------------------------------
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


# --- classes ------------------------------------------------------------------------------


def _flag(group: dict, key: str, default: bool = False) -> float:
    return float(bool(group.get(key, default)))


def _check_lr(lr) -> None:
    if torch.is_tensor(lr) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")


def _check_nonneg(**values) -> None:
    for name, v in values.items():
        if not 0.0 <= v:
            raise ValueError(f"Invalid {name} value: {v}")


def _check_betas(betas, n: int = 2) -> tuple:
    betas = tuple(float(b) for b in betas)
    if len(betas) != n:
        raise ValueError(f"betas must have {n} values, not {len(betas)}")
    for i, b in enumerate(betas):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b}")
    return betas


class _Builtin(FuserOptimizer):
    """Constructor plumbing shared by the built-ins.

    ``_structure(group)`` names the rule variant a param group needs; every group must
    need the same one (it is one compiled kernel), checked whenever groups are added or a
    state_dict replaces them.
    """

    def _structure(self, group: dict) -> tuple:
        return ()

    def _variant(self, structure: tuple) -> Rule:
        return type(self).rule

    def _init_builtin(
        self,
        params,
        defaults: dict,
        state_dtype,
        grad_attr="grad",
        stochastic_rounding=False,
        seed=0,
        static=False,
    ) -> None:
        """fuser's own keywords, on every built-in: ``state_dtype``, ``grad_attr``
        (``"main_grad"``), ``stochastic_rounding``, ``seed`` and ``static`` (see ``fuser.compile``)."""
        if defaults.get("differentiable"):
            raise ValueError("fuser optimizers are not differentiable")
        self._structure_key = None
        checked = _options(
            state_dtype=state_dtype,
            grad_attr=grad_attr,
            stochastic_rounding=stochastic_rounding,
            seed=seed,
            static=static,
        )
        options = dataclasses.replace(
            type(self).options,
            state_dtype=checked.state_dtype,
            grad_attr=checked.grad_attr,
            stochastic_rounding=checked.stochastic_rounding,
            seed=checked.seed,
            static=checked.static,
        )
        self._init_fuser(params, defaults, options=options)
        self.rule = self._variant(self._structure_key)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        key = self._structure(self.param_groups[-1])
        if self._structure_key is None:
            self._structure_key = key
        elif key != self._structure_key:
            self.param_groups.pop()
            raise ValueError(
                f"{type(self).__name__}: {self._structure_doc()} must be the same in every "
                "param group (it selects the compiled rule)"
            )

    def _structure_doc(self) -> str:
        return "the structural options"

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        keys = {self._structure(g) for g in self.param_groups}
        if len(keys) > 1:
            raise ValueError(
                f"{type(self).__name__}: the loaded param groups disagree on "
                f"{self._structure_doc()}, which must be the same in every group"
            )
        self._structure_key = keys.pop()
        self.rule = self._variant(self._structure_key)


class SGD(_Builtin):
    """Drop-in for ``torch.optim.SGD``: one fused launch per step over all parameters.

    torch keeps no ``step`` in SGD's state; fuser does (it tells the first step, which
    copies the gradient into the momentum buffer). A loaded momentum buffer without a step
    counts as one step taken, so it is decayed rather than replaced.
    """

    rule = sgd
    options = Options()

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
    ):
        _check_lr(lr)
        _check_nonneg(momentum=momentum, weight_decay=weight_decay)
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
        self._init_builtin(params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static)

    def _structure(self, group):
        with_momentum = group["momentum"] != 0
        return (with_momentum, with_momentum and bool(group.get("nesterov", False)))

    def _structure_doc(self):
        return "momentum (zero or not) and nesterov"

    def _variant(self, structure):
        with_momentum, nesterov = structure
        return sgd_nesterov if nesterov else sgd_momentum if with_momentum else sgd

    def _group_hyper(self, group):
        return dict(
            lr=group["lr"],
            momentum=group["momentum"],
            dampening=group["dampening"],
            weight_decay=group["weight_decay"],
            maximize=_flag(group, "maximize"),
        )

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        if not self._structure_key[0]:
            return
        for st in self.state.values():
            if st.get("momentum_buffer") is None:
                # No buffer (torch without momentum, or None): the next step starts one.
                st.pop("momentum_buffer", None)
                st.pop("step", None)
            elif "step" not in st:
                st["step"] = torch.tensor(1.0)


class Adam(_Builtin):
    """Drop-in for ``torch.optim.Adam`` (``amsgrad`` selects the rule; L2 weight decay
    unless ``decoupled_weight_decay``)."""

    rule = adam
    options = Options()

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
    ):
        _check_lr(lr)
        _check_nonneg(epsilon=eps, weight_decay=weight_decay)
        betas = _check_betas(betas)
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
        self._init_builtin(params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static)

    def _structure(self, group):
        return (bool(group.get("amsgrad", False)),)

    def _structure_doc(self):
        return "amsgrad"

    def _variant(self, structure):
        return adam_amsgrad if structure[0] else adam

    def _group_hyper(self, group):
        beta1, beta2 = group["betas"]
        return dict(
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            decoupled=_flag(group, "decoupled_weight_decay"),
            maximize=_flag(group, "maximize"),
        )


class AdamW(_Builtin):
    """Drop-in for ``torch.optim.AdamW``: one fused launch per step over all parameters."""

    rule = adamw
    options = Options()

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
    ):
        _check_lr(lr)
        _check_nonneg(epsilon=eps, weight_decay=weight_decay)
        betas = _check_betas(betas)
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
        self._init_builtin(params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static)

    def _structure(self, group):
        return (bool(group.get("amsgrad", False)),)

    def _structure_doc(self):
        return "amsgrad"

    def _variant(self, structure):
        return adamw_amsgrad if structure[0] else adamw

    def _group_hyper(self, group):
        beta1, beta2 = group["betas"]
        return dict(
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            maximize=_flag(group, "maximize"),
        )

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # as torch's AdamW: always decoupled
            group["decoupled_weight_decay"] = True


class Adagrad(_Builtin):
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
    ):
        _check_lr(lr)
        _check_nonneg(
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
        self._init_builtin(params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static)

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

    def _group_hyper(self, group):
        return dict(
            lr=group["lr"],
            lr_decay=group["lr_decay"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=_flag(group, "maximize"),
        )


class RMSprop(_Builtin):
    """Drop-in for ``torch.optim.RMSprop`` (``centered`` and ``momentum > 0`` select the rule)."""

    rule = rmsprop
    options = Options()

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
    ):
        _check_lr(lr)
        _check_nonneg(epsilon=eps, momentum=momentum, weight_decay=weight_decay, alpha=alpha)
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
        self._init_builtin(params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static)

    def _structure(self, group):
        return (bool(group.get("centered", False)), group["momentum"] > 0)

    def _structure_doc(self):
        return "centered and momentum (zero or not)"

    def _variant(self, structure):
        return {
            (False, False): rmsprop,
            (True, False): rmsprop_centered,
            (False, True): rmsprop_momentum,
            (True, True): rmsprop_centered_momentum,
        }[structure]

    def _group_hyper(self, group):
        return dict(
            lr=group["lr"],
            alpha=group["alpha"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            maximize=_flag(group, "maximize"),
        )


class NAdam(_Builtin):
    """Drop-in for ``torch.optim.NAdam``; ``mu_product`` is a 0-d float32 state as in torch."""

    rule = nadam
    options = Options()

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
    ):
        _check_lr(lr)
        _check_nonneg(epsilon=eps, weight_decay=weight_decay, momentum_decay=momentum_decay)
        betas = _check_betas(betas)
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
        self._init_builtin(params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static)

    def _group_hyper(self, group):
        beta1, beta2 = group["betas"]
        return dict(
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            momentum_decay=group["momentum_decay"],
            decoupled=_flag(group, "decoupled_weight_decay"),
            maximize=_flag(group, "maximize"),
        )


class RAdam(_Builtin):
    """Drop-in for ``torch.optim.RAdam``."""

    rule = radam
    options = Options()

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
    ):
        _check_lr(lr)
        _check_nonneg(epsilon=eps, weight_decay=weight_decay)
        betas = _check_betas(betas)
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
        self._init_builtin(params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static)

    def _group_hyper(self, group):
        beta1, beta2 = group["betas"]
        return dict(
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            decoupled=_flag(group, "decoupled_weight_decay"),
            maximize=_flag(group, "maximize"),
        )


class Lion(_Builtin):
    """Lion (Chen et al. 2023): the sign of an interpolated momentum, decoupled weight decay.
    State key ``exp_avg`` as in the authors' PyTorch implementation."""

    rule = lion
    options = Options()

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
    ):
        _check_lr(lr)
        _check_nonneg(weight_decay=weight_decay)
        betas = _check_betas(betas)
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize)
        self._init_builtin(params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static)

    def _group_hyper(self, group):
        beta1, beta2 = group["betas"]
        return dict(
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            maximize=_flag(group, "maximize"),
        )


class AdEMAMix(_Builtin):
    """AdEMAMix (Pagliardini et al. 2024): Adam plus a slow EMA of gradients weighted by
    ``alpha``. ``betas=(beta1, beta2, beta3)``; ``alpha_warmup`` / ``beta3_warmup`` (steps,
    None for none) ramp alpha linearly and beta3 linearly in half-life, as in the paper.
    Keywords and state keys (``exp_avg_fast``, ``exp_avg_slow``, ``exp_avg_sq``) follow the
    authors' implementation."""

    rule = ademamix
    options = Options()

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
    ):
        _check_lr(lr)
        _check_nonneg(epsilon=eps, weight_decay=weight_decay, alpha=alpha)
        betas = _check_betas(betas, 3)
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
        self._init_builtin(params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static)

    def _group_hyper(self, group):
        beta1, beta2, beta3 = group["betas"]
        return dict(
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            beta3=beta3,
            alpha=group["alpha"],
            alpha_warmup=float(group["alpha_warmup"] or 0),
            beta3_warmup=float(group["beta3_warmup"] or 0),
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            maximize=_flag(group, "maximize"),
        )


class Adan(_Builtin):
    """Adan (Xie et al. 2022): Nesterov momentum through an EMA of gradient differences.
    ``betas=(beta1, beta2, beta3)`` are EMA decay factors (0.98, 0.92, 0.99 by default, the
    paper's 0.02, 0.08, 0.01 as 1 - beta); ``no_prox=False`` applies weight decay as the
    paper's proximal step. State keys ``exp_avg``, ``exp_avg_sq``, ``exp_avg_diff`` and
    ``pre_grad`` (the previous gradient). ``max_grad_norm > 0`` clips all gradients by
    their global norm inside the step, as the authors' implementation does."""

    rule = adan
    options = Options()

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
    ):
        _check_lr(lr)
        _check_nonneg(epsilon=eps, weight_decay=weight_decay)
        betas = _check_betas(betas, 3)
        _check_nonneg(max_grad_norm=max_grad_norm)
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
        self._init_builtin(params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static)

    def _structure(self, group):
        return (group.get("max_grad_norm", 0.0) > 0,)

    def _structure_doc(self):
        return "max_grad_norm (zero or not)"

    def _variant(self, structure):
        return adan_clipped if structure[0] else adan

    def _group_hyper(self, group):
        beta1, beta2, beta3 = group["betas"]
        hyper = dict(
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            beta3=beta3,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            no_prox=_flag(group, "no_prox"),
            maximize=_flag(group, "maximize"),
        )
        if self._structure_key and self._structure_key[0]:
            hyper["max_grad_norm"] = group["max_grad_norm"]
        return hyper


class LAMB(_Builtin):
    """LAMB (You et al. 2020): Adam's direction with decoupled weight decay, scaled per
    tensor by the trust ratio ``||p|| / ||update||``. State keys ``exp_avg``, ``exp_avg_sq``."""

    rule = lamb
    options = Options()

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
    ):
        _check_lr(lr)
        _check_nonneg(epsilon=eps, weight_decay=weight_decay)
        betas = _check_betas(betas)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize)
        self._init_builtin(params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static)

    def _group_hyper(self, group):
        beta1, beta2 = group["betas"]
        return dict(
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            maximize=_flag(group, "maximize"),
        )


class LARS(_Builtin):
    """LARS (You et al. 2017): SGD with momentum whose rate is scaled per tensor by
    ``trust_coefficient * ||p|| / (||g|| + weight_decay * ||p||)``. State key
    ``momentum_buffer``. Exclude biases and norms by giving them their own param group with
    ``trust_coefficient`` and ``weight_decay`` as you want them."""

    rule = lars
    options = Options()

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
    ):
        _check_lr(lr)
        _check_nonneg(
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
        self._init_builtin(params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static)

    def _group_hyper(self, group):
        return dict(
            lr=group["lr"],
            momentum=group["momentum"],
            dampening=group["dampening"],
            weight_decay=group["weight_decay"],
            trust_coefficient=group["trust_coefficient"],
            maximize=_flag(group, "maximize"),
        )
