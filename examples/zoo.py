"""A zoo of optimizers from pytorch-optimizer 4.1.0, each written as a fuser rule with the
public API alone.

``ZOO`` maps a name to a :class:`ZooEntry`: the rule, the pytorch_optimizer class it
reproduces (``pytorch_optimizer.load_optimizer(reference)``), and one configuration given
twice, as the reference's constructor keywords and as the compiled rule's keywords, so that
both optimizers follow the same trajectory. Each rule's defaults are its reference's
defaults; ``doc`` says which keywords of the reference the rule covers (the others keep
their defaults). ``NOT_EXPRESSIBLE`` lists the optimizers of that package that the rule
language cannot reproduce exactly, with the missing primitive.

``python examples/zoo.py`` runs every rule a few steps on a small model and prints a table
(on CPU through Triton's interpreter when there is no GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import fuser


@dataclass(frozen=True)
class ZooEntry:
    """One optimizer of the zoo.

    ``fuser.compile(rule)(params, **hyper)`` and
    ``pytorch_optimizer.load_optimizer(reference)(params, **reference_kwargs)`` are the same
    optimizer (on the parameter shapes ``shapes``, when set: the test's own otherwise);
    ``states`` maps a state of the rule to the reference's state key holding the
    same tensor (or per-tensor scalar). ``fuser_bug``, when set, names the fuser bug that
    stops the rule from running today. ``reference_group`` holds the keys of the one param
    group the reference is given, for references that take groups only (``use_muon``).
    ``rtol`` bounds the relative error of the parameters: 1e-6, except where bf16
    Newton–Schulz sets it (both sides orthogonalise in bf16); ``states`` agree to 1e-6.
    ``ns_states`` are states computed from a Newton–Schulz result, which agree to twice
    bf16's Newton–Schulz error.
    ``state_rtol`` bounds the states' (1e-6 unless a decomposition's fp32 error sets it).
    ``steps``, when set, is the number of steps the test compares (its own otherwise).
    ``basis_states``, when set, names the reference's list of factors whose fp32 eigenbases
    the rule keeps (SOAP's ``GG``): both bounds then widen where a factor's eigenvalues lie
    close (an eigenvector's error grows as one over the gap, Davis-Kahan)."""

    rule: fuser.Rule
    reference: str
    reference_kwargs: dict
    hyper: dict
    states: dict = field(default_factory=dict)
    doc: str = ""
    fuser_bug: str = ""
    shapes: tuple = ()
    reference_group: dict = field(default_factory=dict)
    rtol: float = 1e-6
    ns_states: dict = field(default_factory=dict)
    state_rtol: float = 1e-6
    steps: int = 0
    basis_states: str = ""


ZOO: dict[str, ZooEntry] = {}


def _add(
    name,
    text,
    *,
    defaults,
    state,
    reference=None,
    reference_kwargs,
    hyper,
    states=None,
    doc,
    fuser_bug="",
    shapes=(),
    reference_group=None,
    rtol=1e-6,
    ns_states=None,
    state_rtol=1e-6,
    steps=0,
    basis_states="",
):
    ZOO[name] = ZooEntry(
        rule=fuser.rule(text, name=name, hyper=defaults, state=state),
        reference=reference or name,
        reference_kwargs=reference_kwargs,
        hyper=hyper,
        states=states or {},
        doc=doc,
        fuser_bug=fuser_bug,
        shapes=shapes,
        reference_group=reference_group or {},
        rtol=rtol,
        ns_states=ns_states or {},
        state_rtol=state_rtol,
        steps=steps,
        basis_states=basis_states,
    )


# --- Adam relatives -------------------------------------------------------------------------

_add(
    "adabelief",
    """
    p = p * (1 - lr * weight_decay)
    exp_avg = beta1 * exp_avg + (1 - beta1) * g
    exp_avg_var = beta2 * exp_avg_var + (1 - beta2) * (g - exp_avg)**2 + eps
    p = p - lr / (1 - beta1**step) * exp_avg / (sqrt(exp_avg_var) / sqrt(1 - beta2**step) + eps)
    """,
    defaults=dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-16),
    state=dict(exp_avg=0.0, exp_avg_var=0.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1),
    hyper=dict(lr=1e-2, beta1=0.8, beta2=0.99, weight_decay=0.1),
    states=dict(exp_avg="exp_avg", exp_avg_var="exp_avg_var"),
    doc="AdaBelief(lr, betas, weight_decay, eps); weight_decouple=True, fixed_decay=False, "
    "rectify=False, ams_bound=False as by default.",
)

_ADABOUND = """
    p = p * (1 - lr * weight_decay)
    exp_avg = beta1 * exp_avg + (1 - beta1) * g
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g**2
    step_size = lr * sqrt(1 - beta2**step) / (1 - beta1**step)
    lower = final_lr * (1 - 1 / (gamma * step + 1))
    upper = final_lr * (1 + 1 / (gamma * step))
    p = p - clamp(step_size / (sqrt({v} + 1e-15) + eps), lower, upper) * exp_avg
    """
_ADABOUND_DEFAULTS = dict(
    lr=1e-3, final_lr=0.1, beta1=0.9, beta2=0.999, gamma=1e-3, weight_decay=0.0, eps=1e-8
)
_add(
    "adabound",
    _ADABOUND.format(v="exp_avg_sq"),
    defaults=_ADABOUND_DEFAULTS,
    state=dict(exp_avg=0.0, exp_avg_sq=0.0),
    reference_kwargs=dict(lr=1e-2, final_lr=0.05, betas=(0.8, 0.99), gamma=0.1, weight_decay=0.1),
    hyper=dict(lr=1e-2, final_lr=0.05, beta1=0.8, beta2=0.99, gamma=0.1, weight_decay=0.1),
    states=dict(exp_avg="exp_avg", exp_avg_sq="exp_avg_sq"),
    doc="AdaBound(lr, final_lr, betas, gamma, weight_decay, eps) with a constant learning rate "
    "(the reference scales final_lr by lr / initial lr under a scheduler); decoupled decay.",
)
_add(
    "amsbound",
    "\n    max_exp_avg_sq = maximum(max_exp_avg_sq, beta2 * exp_avg_sq + (1 - beta2) * g**2)"
    + _ADABOUND.format(v="max_exp_avg_sq"),
    reference="adabound",
    defaults=_ADABOUND_DEFAULTS,
    state=dict(exp_avg=0.0, exp_avg_sq=0.0, max_exp_avg_sq=0.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.8, 0.99), gamma=0.1, weight_decay=0.1, ams_bound=True),
    hyper=dict(lr=1e-2, beta1=0.8, beta2=0.99, gamma=0.1, weight_decay=0.1),
    states=dict(exp_avg="exp_avg", exp_avg_sq="exp_avg_sq", max_exp_avg_sq="max_exp_avg_sq"),
    doc="AdaBound(..., ams_bound=True): AMSBound, otherwise as adabound.",
)

_add(
    "adamod",
    """
    p = p * (1 - lr * weight_decay)
    exp_avg = beta1 * exp_avg + (1 - beta1) * g
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g**2
    u = lr * sqrt(1 - beta2**step) / (1 - beta1**step) / (sqrt(exp_avg_sq) + eps)
    exp_avg_lr = beta3 * exp_avg_lr + (1 - beta3) * u
    p = p - minimum(u, exp_avg_lr) * exp_avg
    """,
    defaults=dict(lr=1e-3, beta1=0.9, beta2=0.99, beta3=0.9999, weight_decay=0.0, eps=1e-8),
    state=dict(exp_avg=0.0, exp_avg_sq=0.0, exp_avg_lr=0.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.8, 0.95, 0.7), weight_decay=0.1),
    hyper=dict(lr=1e-2, beta1=0.8, beta2=0.95, beta3=0.7, weight_decay=0.1),
    states=dict(exp_avg="exp_avg", exp_avg_sq="exp_avg_sq", exp_avg_lr="exp_avg_lr"),
    doc="AdaMod(lr, betas, weight_decay, eps); decoupled decay as by default.",
)

_add(
    "adan",
    """
    diff = where(step > 1, g - previous_grad, 0)
    exp_avg = beta1 * exp_avg + (1 - beta1) * g
    exp_avg_diff = beta2 * exp_avg_diff + (1 - beta2) * diff
    n = g + beta2 * diff
    exp_avg_sq = beta3 * exp_avg_sq + (1 - beta3) * n**2
    de_nom = sqrt(exp_avg_sq) / sqrt(1 - beta3**step) + eps
    p = p - lr / (1 - beta1**step) * exp_avg / de_nom - lr * beta2 / (1 - beta2**step) * exp_avg_diff / de_nom
    p = p / (1 + lr * weight_decay)
    previous_grad = g
    """,
    defaults=dict(lr=1e-3, beta1=0.98, beta2=0.92, beta3=0.99, weight_decay=0.0, eps=1e-8),
    state=dict(exp_avg=0.0, exp_avg_diff=0.0, exp_avg_sq=0.0, previous_grad=0.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.9, 0.8, 0.95), weight_decay=0.1),
    hyper=dict(lr=1e-2, beta1=0.9, beta2=0.8, beta3=0.95, weight_decay=0.1),
    states=dict(exp_avg="exp_avg", exp_avg_diff="exp_avg_diff", exp_avg_sq="exp_avg_sq"),
    doc="Adan(lr, betas, weight_decay, eps) with weight_decouple=False and max_grad_norm=0 as by "
    "default (the reference keeps -g in previous_grad; the rule keeps g).",
)

_add(
    "adopt",
    """
    d = g + weight_decay * p
    normed = clamp(d / maximum(sqrt(exp_avg_sq), eps), -step**0.25, step**0.25)
    exp_avg = where(step > 1, beta1 * exp_avg + (1 - beta1) * normed, exp_avg)
    p = where(step > 1, p - lr * exp_avg, p)
    exp_avg_sq = where(step > 1, beta2 * exp_avg_sq + (1 - beta2) * d**2, exp_avg_sq + d**2)
    """,
    defaults=dict(lr=1e-3, beta1=0.9, beta2=0.9999, weight_decay=0.0, eps=1e-6),
    state=dict(exp_avg=0.0, exp_avg_sq=0.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1),
    hyper=dict(lr=1e-2, beta1=0.8, beta2=0.99, weight_decay=0.1),
    states=dict(exp_avg="exp_avg", exp_avg_sq="exp_avg_sq"),
    doc="ADOPT(lr, betas, weight_decay, eps) with the default clip_lambda step**0.25 and "
    "coupled (L2) weight decay as by default.",
)

_add(
    "aggmo",
    """
    d = g + weight_decay * p
    m1 = beta1 * m1 + d
    m2 = beta2 * m2 + d
    m3 = beta3 * m3 + d
    p = p - lr / 3 * (m1 + m2 + m3)
    """,
    defaults=dict(lr=1e-3, beta1=0.0, beta2=0.9, beta3=0.99, weight_decay=0.0),
    state=dict(m1=0.0, m2=0.0, m3=0.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.0, 0.7, 0.9), weight_decay=0.1),
    hyper=dict(lr=1e-2, beta1=0.0, beta2=0.7, beta3=0.9, weight_decay=0.1),
    doc="AggMo(lr, betas, weight_decay) with three betas and coupled decay as by default.",
)

_add(
    "diffgrad",
    """
    p = p * (1 - lr * weight_decay)
    exp_avg = beta1 * exp_avg + (1 - beta1) * g
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g**2
    dfc = sigmoid(abs(previous_grad - g)) * exp_avg
    p = p - lr * sqrt(1 - beta2**step) / (1 - beta1**step) * dfc / (sqrt(exp_avg_sq + 1e-15) + eps)
    previous_grad = g
    """,
    defaults=dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8),
    state=dict(exp_avg=0.0, exp_avg_sq=0.0, previous_grad=0.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1),
    hyper=dict(lr=1e-2, beta1=0.8, beta2=0.99, weight_decay=0.1),
    states=dict(exp_avg="exp_avg", exp_avg_sq="exp_avg_sq", previous_grad="previous_grad"),
    doc="DiffGrad(lr, betas, weight_decay, eps); decoupled decay, rectify=False, ams_bound=False.",
)

_add(
    "laprop",
    """
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g**2
    exp_avg_lr_1 = beta1 * exp_avg_lr_1 + (1 - beta1) * lr
    de_nom = (sqrt(exp_avg_sq + 1e-15) + eps) / sqrt(1 - beta2**step)
    exp_avg = beta1 * exp_avg + (1 - beta1) * lr * g / de_nom
    p = p - exp_avg / (exp_avg_lr_1 / lr)
    p = p * (1 - lr * weight_decay)
    """,
    defaults=dict(lr=4e-4, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-15),
    state=dict(exp_avg=0.0, exp_avg_sq=0.0, exp_avg_lr_1=0.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1),
    hyper=dict(lr=1e-2, beta1=0.8, beta2=0.99, weight_decay=0.1),
    states=dict(exp_avg="exp_avg", exp_avg_sq="exp_avg_sq", exp_avg_lr_1="exp_avg_lr_1"),
    doc="LaProp(lr, betas, weight_decay, eps) with centered=False, ams_bound=False; decoupled "
    "decay after the step. exp_avg_lr_1 is a per-tensor scalar, so lr schedules match too.",
)

_add(
    "madgrad",
    """
    d = g + weight_decay * p
    lam = (lr + eps) * sqrt(step)
    grad_sum_sq = grad_sum_sq + lam * d**2
    s = s + lam * d
    z = x0 - s / (grad_sum_sq**(1 / 3) + eps)
    p = p + (1 - momentum) * (z - p)
    """,
    defaults=dict(lr=1e-3, momentum=0.9, weight_decay=0.0, eps=1e-6),
    state=dict(grad_sum_sq=0.0, s=0.0, x0="p"),
    reference_kwargs=dict(lr=1e-2, momentum=0.8, weight_decay=0.1),
    hyper=dict(lr=1e-2, momentum=0.8, weight_decay=0.1),
    states=dict(grad_sum_sq="grad_sum_sq", s="s", x0="x0"),
    doc="MADGRAD(lr, momentum > 0, weight_decay, eps) with lr > 0 and coupled decay "
    "(weight_decouple=False) as by default; one param group (the reference counts steps "
    "for the whole optimizer).",
)

_add(
    "novograd",
    """
    grads_ema = where(step > 1, beta2 * grads_ema + (1 - beta2) * sum(g**2), sum(g**2))
    d = g / (sqrt(grads_ema) + eps) + weight_decay * p
    moments = where(step > 1, beta1 * moments + d, d)
    p = p - lr * moments
    """,
    defaults=dict(lr=1e-3, beta1=0.95, beta2=0.98, weight_decay=0.0, eps=1e-8),
    state=dict(grads_ema=0.0, moments=0.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1),
    hyper=dict(lr=1e-2, beta1=0.8, beta2=0.9, weight_decay=0.1),
    states=dict(grads_ema="grads_ema", moments="moments"),
    doc="NovoGrad(lr, betas, weight_decay, eps) with coupled decay, grad_averaging=False, "
    "adam_debias=False as by default.",
)

_add(
    "qhadam",
    """
    d = g + weight_decay * p
    beta1_weight = beta1 * beta1_weight + 1
    beta2_weight = beta2 * beta2_weight + 1
    exp_avg = exp_avg + (d - exp_avg) / beta1_weight
    exp_avg_sq = exp_avg_sq + (d**2 - exp_avg_sq) / beta2_weight
    num = nu1 * exp_avg + (1 - nu1) * d
    p = p - lr * num / (sqrt(nu2 * exp_avg_sq + (1 - nu2) * d**2) + eps)
    """,
    defaults=dict(lr=1e-3, beta1=0.9, beta2=0.999, nu1=1.0, nu2=1.0, weight_decay=0.0, eps=1e-8),
    state=dict(exp_avg=0.0, exp_avg_sq=0.0, beta1_weight=0.0, beta2_weight=0.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.8, 0.99), nus=(0.7, 0.9), weight_decay=0.1),
    hyper=dict(lr=1e-2, beta1=0.8, beta2=0.99, nu1=0.7, nu2=0.9, weight_decay=0.1),
    states=dict(exp_avg="exp_avg", exp_avg_sq="exp_avg_sq"),
    doc="QHAdam(lr, betas, nus, weight_decay, eps) with coupled decay as by default.",
)

_add(
    "stableadamw",
    """
    beta1_comp = 1 - (beta1**step - beta1) / (beta1**step - 1)
    beta2_hat = (beta2**step - beta2) / (beta2**step - 1)
    exp_avg = exp_avg + beta1_comp * (g - exp_avg)
    exp_avg_sq = beta2_hat * exp_avg_sq + (1 - beta2_hat) * g**2
    rms = maximum(sqrt(mean(g**2 / maximum(exp_avg_sq, eps**2))), 1)
    p = p * (1 - weight_decay * lr / rms)
    p = p - lr / rms * exp_avg / (sqrt(exp_avg_sq) + eps)
    """,
    defaults=dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=1e-2, eps=1e-8),
    state=dict(exp_avg=0.0, exp_avg_sq=0.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1),
    hyper=dict(lr=1e-2, beta1=0.8, beta2=0.95, weight_decay=0.1),
    states=dict(exp_avg="exp_avg", exp_avg_sq="exp_avg_sq"),
    doc="StableAdamW(lr, betas, weight_decay, eps) with decoupled decay as by default, for fp32 "
    "(and bf16) parameters; kahan_sum only acts on 16-bit parameters.",
)

_add(
    "tiger",
    """
    p = p * (1 - lr * weight_decay)
    exp_avg = beta * exp_avg + (1 - beta) * g
    p = p - lr * sign(exp_avg)
    """,
    defaults=dict(lr=1e-3, beta=0.965, weight_decay=0.01),
    state=dict(exp_avg=0.0),
    reference_kwargs=dict(lr=1e-2, beta=0.9, weight_decay=0.1),
    hyper=dict(lr=1e-2, beta=0.9, weight_decay=0.1),
    states=dict(exp_avg="exp_avg"),
    doc="Tiger(lr, beta, weight_decay) with decoupled decay as by default.",
)

_ADEMAMIX = """
    d = g + weight_decay * p
    exp_avg = beta1 * exp_avg + (1 - beta1) * d
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * d**2
    exp_avg_slow = beta3_t * exp_avg_slow + (1 - beta3_t) * d
    de_nom = sqrt(exp_avg_sq) / sqrt(1 - beta2**step) + eps
    p = p - lr * (exp_avg / (1 - beta1**step) + alpha_t * exp_avg_slow) / de_nom
    """
_ADEMAMIX_DEFAULTS = dict(
    lr=1e-3, beta1=0.9, beta2=0.999, beta3=0.9999, alpha=5.0, weight_decay=0.0, eps=1e-8
)
_add(
    "ademamix",
    "\n    alpha_t = alpha\n    beta3_t = beta3" + _ADEMAMIX,
    defaults=_ADEMAMIX_DEFAULTS,
    state=dict(exp_avg=0.0, exp_avg_sq=0.0, exp_avg_slow=0.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.8, 0.95, 0.99), alpha=3.0, weight_decay=0.1),
    hyper=dict(lr=1e-2, beta1=0.8, beta2=0.95, beta3=0.99, alpha=3.0, weight_decay=0.1),
    states=dict(exp_avg="exp_avg", exp_avg_sq="exp_avg_sq", exp_avg_slow="exp_avg_slow"),
    doc="AdEMAMix(lr, betas, alpha, weight_decay, eps) with t_alpha_beta3=None and coupled decay "
    "as by default.",
)
_add(
    "ademamix_scheduled",
    """
    alpha_t = minimum(step * alpha / t_alpha_beta3, alpha)
    r = step / t_alpha_beta3
    beta3_t = minimum(exp(log(beta1) * log(beta3) / ((1 - r) * log(beta3) + r * log(beta1))), beta3)
    """
    + _ADEMAMIX,
    reference="ademamix",
    defaults=dict(_ADEMAMIX_DEFAULTS, t_alpha_beta3=1e4),
    state=dict(exp_avg=0.0, exp_avg_sq=0.0, exp_avg_slow=0.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.8, 0.95, 0.99), alpha=3.0, t_alpha_beta3=4.0),
    hyper=dict(lr=1e-2, beta1=0.8, beta2=0.95, beta3=0.99, alpha=3.0, t_alpha_beta3=4.0),
    states=dict(exp_avg="exp_avg", exp_avg_sq="exp_avg_sq", exp_avg_slow="exp_avg_slow"),
    doc="AdEMAMix(..., t_alpha_beta3=T): alpha and beta3 warmed up over T steps.",
)

_add(
    "mars",
    """
    c = g + gamma * beta1 / (1 - beta1) * (g - last_grad)
    c = c / maximum(norm(c), 1)
    exp_avg = beta1 * exp_avg + (1 - beta1) * c
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * c**2
    de_nom = (sqrt(exp_avg_sq + 1e-15) + eps) / sqrt(1 - beta2**step) * (1 - beta1**step)
    p = p * (1 - lr * weight_decay)
    p = p - lr * exp_avg / de_nom
    last_grad = g
    """,
    defaults=dict(lr=3e-3, beta1=0.95, beta2=0.99, gamma=0.025, weight_decay=0.0, eps=1e-8),
    state=dict(exp_avg=0.0, exp_avg_sq=0.0, last_grad=0.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.8, 0.95), gamma=0.1, weight_decay=0.1, optimize_1d=True),
    hyper=dict(lr=1e-2, beta1=0.8, beta2=0.95, gamma=0.1, weight_decay=0.1),
    states=dict(exp_avg="exp_avg", exp_avg_sq="exp_avg_sq", last_grad="last_grad"),
    doc="MARS(lr, betas, gamma, weight_decay, eps, optimize_1d=True) with mars_type='adamw': "
    "every tensor takes the MARS-AdamW step (optimize_1d=False gives 1-D tensors a plain "
    "AdamW step with their own lr_1d, betas_1d and weight_decay_1d).",
)

_add(
    "schedulefreeadamw",
    """
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g**2
    d = g / (sqrt(exp_avg_sq / (1 - beta2**step) + 1e-15) + eps) + weight_decay * p
    lr_t = lr * where(step < warmup_steps, step / maximum(warmup_steps, 1), 1)
    lr_max = maximum(lr_t, lr_max)
    weight = step**r * lr_max**weight_lr_power
    weight_sum = weight_sum + weight
    ckp = where(weight_sum != 0, weight / weight_sum, 0)
    ckp = where(decoupling_c > 0, minimum(1, ckp * (1 - beta1) * decoupling_c), ckp)
    p = p + ckp * (z - p)
    p = p + lr_t * (beta1 * (1 - ckp) - 1) * d
    z = z - lr_t * d
    """,
    defaults=dict(
        lr=2.5e-3,
        beta1=0.9,
        beta2=0.999,
        weight_decay=0.0,
        r=0.0,
        weight_lr_power=2.0,
        warmup_steps=0.0,
        decoupling_c=0.0,
        eps=1e-8,
    ),
    state=dict(exp_avg_sq=0.0, z="p", lr_max=-1.0, weight_sum=0.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1, r=0.5, warmup_steps=3),
    hyper=dict(lr=1e-2, beta1=0.8, beta2=0.95, weight_decay=0.1, r=0.5, warmup_steps=3),
    states=dict(exp_avg_sq="exp_avg_sq", z="z"),
    doc="ScheduleFreeAdamW(lr, betas, weight_decay, r, weight_lr_power, warmup_steps, "
    "decoupling_c, eps) with ams_bound=False: the training step, in train mode. A rule "
    "compiled alone has no eval()/train(); fuser.optim.ScheduleFreeAdamW is this rule with "
    "them (p moved to the average and back).",
)


# --- sign methods, layer-wise scaling, SGD relatives ----------------------------------------

_add(
    "lion",
    """
    p = p * (1 - lr * weight_decay)
    update = sign(beta1 * exp_avg + (1 - beta1) * g)
    exp_avg = beta2 * exp_avg + (1 - beta2) * g
    p = p - lr * update
    """,
    defaults=dict(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.0),
    state=dict(exp_avg=0.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1),
    hyper=dict(lr=1e-2, beta1=0.8, beta2=0.95, weight_decay=0.1),
    states=dict(exp_avg="exp_avg"),
    doc="Lion(lr, betas, weight_decay) with decoupled decay as by default.",
)

_add(
    "signsgd",
    """
    p = p * (1 - lr * weight_decay)
    momentum_buffer = momentum * momentum_buffer + (1 - momentum) * g
    p = p - lr * sign(momentum_buffer)
    """,
    defaults=dict(lr=1e-3, momentum=0.9, weight_decay=0.0),
    state=dict(momentum_buffer=0.0),
    reference_kwargs=dict(lr=1e-2, momentum=0.8, weight_decay=0.1),
    hyper=dict(lr=1e-2, momentum=0.8, weight_decay=0.1),
    states=dict(momentum_buffer="momentum_buffer"),
    doc="SignSGD(lr, momentum, weight_decay) with decoupled decay as by default (signum; "
    "momentum=0 gives plain signSGD).",
)

_add(
    "lamb",
    """
    p = p * (1 - lr * weight_decay)
    exp_avg = beta1 * exp_avg + (1 - beta1) * g
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g**2
    update = exp_avg / (sqrt(exp_avg_sq) + eps)
    weight_norm = minimum(norm(p), 10)
    adam_norm = norm(update)
    trust_ratio = where(weight_norm != 0 and adam_norm != 0, weight_norm / (adam_norm + eps), 1)
    p = p - lr / (1 - beta1**step) * trust_ratio * update
    """,
    defaults=dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-6),
    state=dict(exp_avg=0.0, exp_avg_sq=0.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1),
    hyper=dict(lr=1e-2, beta1=0.8, beta2=0.95, weight_decay=0.1),
    states=dict(exp_avg="exp_avg", exp_avg_sq="exp_avg_sq"),
    doc="Lamb(lr, betas, weight_decay, eps) with decoupled decay, grad_averaging=True, "
    "rectify=False, adam=False, pre_norm=False as by default (max_grad_norm only acts "
    "with pre_norm).",
)

_add(
    "fromage",
    """
    p_norm = norm(p)
    g_norm = norm(g)
    p = (p - lr * where(p_norm > 0 and g_norm > 0, p_norm / g_norm, 1) * g) / sqrt(1 + lr**2)
    """,
    defaults=dict(lr=1e-2),
    state=dict(),
    reference_kwargs=dict(lr=0.05),
    hyper=dict(lr=0.05),
    doc="Fromage(lr) with p_bound=None as by default.",
)

_add(
    "lars",
    """
    d = g - 2 * maximize * g
    p_norm = norm(p)
    den = norm(d) + weight_decay * p_norm
    trust = where(p_norm > 0 and den > 0, trust_coefficient * p_norm / den, 1)
    d = where(ndim > 1, (d + weight_decay * p) * trust, d)
    momentum_buffer = momentum * momentum_buffer + (1 - dampening) * d
    p = p - lr * where(momentum > 0, where(nesterov > 0, d + momentum * momentum_buffer, momentum_buffer), d)
    """,
    defaults=dict(
        lr=1e-3,
        weight_decay=0.0,
        momentum=0.9,
        dampening=0.0,
        trust_coefficient=1e-3,
        nesterov=0.0,
        maximize=0.0,
    ),
    state=dict(momentum_buffer=0.0),
    reference_kwargs=dict(lr=0.1, weight_decay=0.1, momentum=0.8, dampening=0.2, trust_coefficient=0.5),
    hyper=dict(lr=0.1, weight_decay=0.1, momentum=0.8, dampening=0.2, trust_coefficient=0.5),
    states=dict(momentum_buffer="momentum_buffer"),
    doc="LARS(lr, weight_decay, momentum, dampening, trust_coefficient, nesterov and maximize as "
    "0/1): on tensors of 2 or more dimensions the gradient plus decay scaled by the trust "
    "ratio trust_coefficient * |p| / (|g| + weight_decay * |p|) (1 where either norm is 0), "
    "plain SGD on scalars and vectors; momentum without the first step's copy, as the "
    "reference. The zoo compares the heavy-ball form; nesterov and maximize were compared by hand.",
)

_add(
    "sgdw",
    """
    p = p * (1 - lr * weight_decay)
    momentum_buffer = where(step > 1, momentum * momentum_buffer + (1 - dampening) * g, g)
    p = p - lr * where(nesterov > 0, g + momentum * momentum_buffer, momentum_buffer)
    """,
    defaults=dict(lr=1e-4, momentum=0.0, weight_decay=0.0, dampening=0.0, nesterov=0.0),
    state=dict(momentum_buffer=0.0),
    reference_kwargs=dict(lr=1e-2, momentum=0.9, dampening=0.2, weight_decay=0.1),
    hyper=dict(lr=1e-2, momentum=0.9, dampening=0.2, weight_decay=0.1),
    states=dict(momentum_buffer="momentum_buffer"),
    doc="SGDW(lr, momentum, dampening, weight_decay, nesterov as 0/1) with decoupled decay as by default.",
)

_add(
    "qhm",
    """
    d = g + weight_decay * p
    momentum_buffer = momentum * momentum_buffer + (1 - momentum) * d
    p = p - lr * (nu * momentum_buffer + (1 - nu) * d)
    """,
    defaults=dict(lr=1e-3, momentum=0.0, nu=1.0, weight_decay=0.0),
    state=dict(momentum_buffer=0.0),
    reference_kwargs=dict(lr=1e-2, momentum=0.9, nu=0.7, weight_decay=0.1),
    hyper=dict(lr=1e-2, momentum=0.9, nu=0.7, weight_decay=0.1),
    states=dict(momentum_buffer="momentum_buffer"),
    doc="QHM(lr, momentum, nu, weight_decay) with coupled decay as by default.",
)

_add(
    "pid",
    """
    d = g + weight_decay * p
    i_buffer = momentum * i_buffer + (1 - dampening) * d
    d_buffer = momentum * d_buffer + where(step > 1, (1 - momentum) * (d - grad_buffer), 0)
    grad_buffer = d
    p = p - lr * (d + integral * i_buffer + derivative * d_buffer)
    """,
    defaults=dict(lr=1e-3, momentum=0.0, dampening=0.0, derivative=10.0, integral=5.0, weight_decay=0.0),
    state=dict(i_buffer=0.0, d_buffer=0.0, grad_buffer=0.0),
    reference_kwargs=dict(
        lr=1e-2, momentum=0.9, dampening=0.1, derivative=3.0, integral=2.0, weight_decay=0.1
    ),
    hyper=dict(lr=1e-2, momentum=0.9, dampening=0.1, derivative=3.0, integral=2.0, weight_decay=0.1),
    states=dict(i_buffer="i_buffer", d_buffer="d_buffer", grad_buffer="grad_buffer"),
    doc="PID(lr, momentum > 0, dampening, derivative, integral, weight_decay) with coupled "
    "decay as by default (momentum=0 is plain SGD).",
)

# --- more adaptive methods --------------------------------------------------------------------

_add(
    "yogi",
    """
    p = p * (1 - lr * weight_decay)
    exp_avg = beta1 * exp_avg + (1 - beta1) * g
    exp_avg_sq = exp_avg_sq - (1 - beta2) * sign(exp_avg_sq - g**2) * g**2
    p = p - lr / (1 - beta1**step) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2**step) + eps)
    """,
    defaults=dict(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-3),
    state=dict(exp_avg=1e-6, exp_avg_sq=1e-6),
    reference_kwargs=dict(lr=3e-2, betas=(0.8, 0.95), weight_decay=0.1),
    hyper=dict(lr=3e-2, beta1=0.8, beta2=0.95, weight_decay=0.1),
    states=dict(exp_avg="exp_avg", exp_avg_sq="exp_avg_sq"),
    doc="Yogi(lr, betas, weight_decay, eps) with initial_accumulator=1e-6 (the states' start) "
    "and decoupled decay as by default.",
)

_add(
    "adamax",
    """
    d = g + weight_decay * p
    exp_avg = beta1 * exp_avg + (1 - beta1) * d
    exp_inf = maximum(beta2 * exp_inf, abs(d) + eps)
    p = p - lr / (1 - beta1**step) * exp_avg / exp_inf
    """,
    defaults=dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8),
    state=dict(exp_avg=0.0, exp_inf=0.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1),
    hyper=dict(lr=1e-2, beta1=0.8, beta2=0.95, weight_decay=0.1),
    states=dict(exp_avg="exp_avg", exp_inf="exp_inf"),
    doc="AdaMax(lr, betas, weight_decay, eps) with coupled decay as by default.",
)

# RAdam's rectified step size (pytorch-optimizer's get_rectify_step_size, then divided by
# 1 - beta1**step): rt is -1 below the threshold unless degenerated_to_sgd.
_RECTIFY = """
    n_sma_max = 2 / (1 - beta2) - 1
    beta2_t = beta2**step
    n_sma = n_sma_max - 2 * step * beta2_t / (1 - beta2_t)
    rt = sqrt((1 - beta2_t) * (n_sma - 4) / (n_sma_max - 4) * (n_sma - 2) / n_sma * n_sma_max
              / (n_sma_max - 2))
    rt = where(n_sma >= n_sma_threshold, rt, where(degenerated_to_sgd > 0, 1, -1))
    step_size = lr * rt / (1 - beta1**step)
"""
_add(
    "radam",
    _RECTIFY
    + """    p = where(n_sma >= n_sma_threshold or step_size > 0, p * (1 - lr * weight_decay), p)
    exp_avg = beta1 * exp_avg + (1 - beta1) * g
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g**2
    sgd_size = where(step_size > 0, step_size, 0)
    p = p - where(n_sma >= n_sma_threshold, step_size / (sqrt(exp_avg_sq) + eps), sgd_size) * exp_avg
    """,
    defaults=dict(
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        weight_decay=0.0,
        n_sma_threshold=5.0,
        degenerated_to_sgd=0.0,
        eps=1e-8,
    ),
    state=dict(exp_avg=0.0, exp_avg_sq=0.0),
    reference_kwargs=dict(
        lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1, n_sma_threshold=4, degenerated_to_sgd=True
    ),
    hyper=dict(lr=1e-2, beta1=0.8, beta2=0.95, weight_decay=0.1, n_sma_threshold=4, degenerated_to_sgd=1),
    states=dict(exp_avg="exp_avg", exp_avg_sq="exp_avg_sq"),
    doc="RAdam(lr, betas, weight_decay, n_sma_threshold, degenerated_to_sgd as 0/1, eps) with "
    "decoupled decay as by default.",
)

# Ranger: RAdam with gradient centralisation and lookahead. Unlike RAdam's, its update below
# the threshold is not skipped: with degenerated_to_sgd=False (rt = -1) it adds
# lr / (1 - beta1**step) * exp_avg, as the reference does. It centralises gradients of
# more than one dimension (more than 3 with gc_conv_only).
_RANGER = (
    """
    gs = (1 - 2 * maximize) * g
    gs = where(use_gc > 0 and ndim > 1 + 2 * gc_conv_only, gs - rowmean(gs), gs)
    p = p * (1 - weight_decouple * weight_decay * where(fixed_decay > 0, 1, lr))
    gs = gs + (1 - weight_decouple) * weight_decay * p
    exp_avg = exp_avg + (1 - beta1) * (gs - exp_avg)
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * gs**2
"""
    + _RECTIFY
    + """    p = p - step_size * where(n_sma >= n_sma_threshold, exp_avg / (sqrt(exp_avg_sq) + eps), exp_avg)
    slow_buffer = where(every(k), slow_buffer + alpha * (p - slow_buffer), slow_buffer)
    p = where(every(k), slow_buffer, p)
    """
)
_RANGER_DEFAULTS = dict(
    lr=1e-3,
    beta1=0.95,
    beta2=0.999,
    alpha=0.5,
    k=6.0,
    n_sma_threshold=5.0,
    degenerated_to_sgd=0.0,
    weight_decay=0.0,
    weight_decouple=1.0,
    fixed_decay=0.0,
    use_gc=1.0,
    gc_conv_only=0.0,
    eps=1e-5,
    maximize=0.0,
)
_RANGER_DOC = (
    "Ranger(lr, betas, alpha, k, n_sma_threshold, degenerated_to_sgd, weight_decay, "
    "weight_decouple, fixed_decay, use_gc, gc_conv_only, eps, maximize; the flags as 0/1) with "
    "adanorm off: RAdam's rectified step, gradient centralisation of tensors of more than one "
    "dimension (more than 3 with gc_conv_only; the gradient minus its mean over all dimensions "
    "but the first, rowmean of the 2-D view) and lookahead every k steps (slow_buffer, a copy "
    "of the starting parameter, moves alpha of the way to the parameter, which then takes its "
    "value). The test runs 8 "
    "steps, so that steps 5 to 8 are rectified (n_sma >= 4 from step 5 at beta2=0.99) and "
    "lookahead runs twice; fixed_decay=True, use_gc=False, gc_conv_only=True (on a 4-D tensor) "
    "and a [1, 6] tensor were compared by hand, not by the "
    "zoo test. "
)
_add(
    "ranger",
    _RANGER,
    defaults=_RANGER_DEFAULTS,
    state=dict(exp_avg=0.0, exp_avg_sq=0.0, slow_buffer="p"),
    reference_kwargs=dict(lr=1e-2, betas=(0.8, 0.99), alpha=0.6, k=3, n_sma_threshold=4, weight_decay=0.1),
    hyper=dict(lr=1e-2, beta1=0.8, beta2=0.99, alpha=0.6, k=3, n_sma_threshold=4, weight_decay=0.1),
    states=dict(exp_avg="exp_avg", exp_avg_sq="exp_avg_sq", slow_buffer="slow_buffer"),
    steps=8,
    doc=_RANGER_DOC + "Here decoupled decay and degenerated_to_sgd=False, whose steps before "
    "the threshold add lr / (1 - beta1**step) * exp_avg, as the reference's do.",
)
_add(
    "ranger_sgd",
    _RANGER,
    reference="ranger",
    defaults=_RANGER_DEFAULTS,
    state=dict(exp_avg=0.0, exp_avg_sq=0.0, slow_buffer="p"),
    reference_kwargs=dict(
        lr=1e-2,
        betas=(0.8, 0.99),
        alpha=0.6,
        k=3,
        n_sma_threshold=4,
        degenerated_to_sgd=True,
        weight_decay=0.1,
        weight_decouple=False,
        maximize=True,
    ),
    hyper=dict(
        lr=1e-2,
        beta1=0.8,
        beta2=0.99,
        alpha=0.6,
        k=3,
        n_sma_threshold=4,
        degenerated_to_sgd=1,
        weight_decay=0.1,
        weight_decouple=0,
        maximize=1,
    ),
    states=dict(exp_avg="exp_avg", exp_avg_sq="exp_avg_sq", slow_buffer="slow_buffer"),
    steps=8,
    doc=_RANGER_DOC + "Here coupled decay (added to the centralised gradient), "
    "degenerated_to_sgd=True (SGD steps with momentum before the threshold) and maximize=True.",
)

# --- torch.optim classes that pytorch_optimizer lists ------------------------------------------

_add(
    "adamw",
    """
    p = p * (1 - lr * weight_decay)
    exp_avg = beta1 * exp_avg + (1 - beta1) * g
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g**2
    p = p - lr / (1 - beta1**step) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2**step) + eps)
    """,
    defaults=dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=1e-2, eps=1e-8),
    state=dict(exp_avg=0.0, exp_avg_sq=0.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1),
    hyper=dict(lr=1e-2, beta1=0.8, beta2=0.95, weight_decay=0.1),
    states=dict(exp_avg="exp_avg", exp_avg_sq="exp_avg_sq"),
    doc="torch.optim.AdamW(lr, betas, eps, weight_decay) with amsgrad=False.",
)

_add(
    "nadam",
    """
    d = g + weight_decay * p
    mu = beta1 * (1 - 0.5 * 0.96**(step * momentum_decay))
    mu_next = beta1 * (1 - 0.5 * 0.96**((step + 1) * momentum_decay))
    mu_product = mu_product * mu
    exp_avg = beta1 * exp_avg + (1 - beta1) * d
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * d**2
    de_nom = sqrt(exp_avg_sq / (1 - beta2**step)) + eps
    p = p - lr * (1 - mu) / (1 - mu_product) * d / de_nom
    p = p - lr * mu_next / (1 - mu_product * mu_next) * exp_avg / de_nom
    """,
    defaults=dict(lr=2e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, momentum_decay=4e-3, eps=1e-8),
    state=dict(exp_avg=0.0, exp_avg_sq=0.0, mu_product=1.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1, momentum_decay=0.1),
    hyper=dict(lr=1e-2, beta1=0.8, beta2=0.95, weight_decay=0.1, momentum_decay=0.1),
    states=dict(exp_avg="exp_avg", exp_avg_sq="exp_avg_sq", mu_product="mu_product"),
    doc="torch.optim.NAdam(lr, betas, eps, weight_decay, momentum_decay) with decoupled_weight_decay=False.",
)

_add(
    "rmsprop",
    """
    square_avg = alpha * square_avg + (1 - alpha) * g**2
    grad_avg = alpha * grad_avg + (1 - alpha) * g
    momentum_buffer = momentum * momentum_buffer + g / (sqrt(square_avg - grad_avg**2) + eps)
    p = p - lr * momentum_buffer
    """,
    defaults=dict(lr=1e-2, alpha=0.99, momentum=0.0, eps=1e-8),
    state=dict(square_avg=0.0, grad_avg=0.0, momentum_buffer=0.0),
    reference_kwargs=dict(lr=1e-2, alpha=0.9, momentum=0.8, centered=True),
    hyper=dict(lr=1e-2, alpha=0.9, momentum=0.8),
    states=dict(square_avg="square_avg", grad_avg="grad_avg", momentum_buffer="momentum_buffer"),
    doc="torch.optim.RMSprop(lr, alpha, eps, momentum, centered=True) with weight_decay=0.",
)

_add(
    "sgd",
    """
    d = g + weight_decay * p
    momentum_buffer = where(step > 1, momentum * momentum_buffer + (1 - dampening) * d, d)
    p = p - lr * where(nesterov > 0, d + momentum * momentum_buffer, momentum_buffer)
    """,
    defaults=dict(lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=0.0),
    state=dict(momentum_buffer=0.0),
    reference_kwargs=dict(lr=1e-2, momentum=0.9, weight_decay=0.1, nesterov=True),
    hyper=dict(lr=1e-2, momentum=0.9, weight_decay=0.1, nesterov=1),
    states=dict(momentum_buffer="momentum_buffer"),
    doc="torch.optim.SGD(lr, momentum, dampening, weight_decay, nesterov as 0/1).",
)


# --- positive-negative momentum, norms and smoothing -------------------------------------------

_add(
    "pnm",
    """
    p = p * (1 - lr * weight_decay)
    odd = 1 - odd
    pos_momentum = where(odd > 0, beta1**2 * pos_momentum + (1 - beta1**2) * g, pos_momentum)
    neg_momentum = where(odd > 0, neg_momentum, beta1**2 * neg_momentum + (1 - beta1**2) * g)
    new = where(odd > 0, pos_momentum, neg_momentum)
    old = where(odd > 0, neg_momentum, pos_momentum)
    p = p - lr * ((1 + beta2) * new - beta2 * old) / sqrt((1 + beta2)**2 + beta2**2)
    """,
    defaults=dict(lr=1e-3, beta1=0.9, beta2=1.0, weight_decay=0.0),
    state=dict(pos_momentum=0.0, neg_momentum=0.0, odd=0.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1),
    hyper=dict(lr=1e-2, beta1=0.8, beta2=0.9, weight_decay=0.1),
    states=dict(pos_momentum="pos_momentum", neg_momentum="neg_momentum"),
    doc="PNM(lr, betas, weight_decay) with decoupled decay as by default; the two momenta "
    "take turns (odd steps update pos_momentum); `odd` is a per-tensor scalar flag.",
)

_add(
    "adapnm",
    """
    p = p * (1 - lr * weight_decay)
    odd = 1 - odd
    exp_avg = where(odd > 0, beta1**2 * exp_avg + (1 - beta1**2) * g, exp_avg)
    neg_exp_avg = where(odd > 0, neg_exp_avg, beta1**2 * neg_exp_avg + (1 - beta1**2) * g)
    new = where(odd > 0, exp_avg, neg_exp_avg)
    old = where(odd > 0, neg_exp_avg, exp_avg)
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g**2
    max_exp_avg_sq = maximum(max_exp_avg_sq, exp_avg_sq)
    de_nom = (sqrt(max_exp_avg_sq + 1e-15) + eps) / sqrt(1 - beta2**step)
    pn_momentum = ((1 + beta3) * new - beta3 * old) / sqrt((1 + beta3)**2 + beta3**2)
    p = p - lr / (1 - beta1**step) * pn_momentum / de_nom
    """,
    defaults=dict(lr=1e-3, beta1=0.9, beta2=0.999, beta3=1.0, weight_decay=0.0, eps=1e-8),
    state=dict(exp_avg=0.0, neg_exp_avg=0.0, exp_avg_sq=0.0, max_exp_avg_sq=0.0, odd=0.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.8, 0.95, 0.9), weight_decay=0.1),
    hyper=dict(lr=1e-2, beta1=0.8, beta2=0.95, beta3=0.9, weight_decay=0.1),
    states=dict(exp_avg="exp_avg", neg_exp_avg="neg_exp_avg", exp_avg_sq="exp_avg_sq"),
    doc="AdaPNM(lr, betas, weight_decay, eps) with ams_bound=True and decoupled decay as by default.",
)

_add(
    "adanorm",
    """
    p = p * (1 - lr * weight_decay)
    grad_norm = norm(g)
    exp_grad_norm = r * exp_grad_norm + (1 - r) * grad_norm
    s_grad = where(grad_norm > 0 and exp_grad_norm > grad_norm, g * exp_grad_norm / grad_norm, g)
    exp_avg = beta1 * exp_avg + (1 - beta1) * s_grad
    exp_avg_var = beta2 * exp_avg_var + (1 - beta2) * g**2
    de_nom = (sqrt(exp_avg_var + 1e-15) + eps) / sqrt(1 - beta2**step)
    p = p - lr / (1 - beta1**step) * exp_avg / de_nom
    """,
    defaults=dict(lr=1e-3, beta1=0.9, beta2=0.99, r=0.95, weight_decay=0.0, eps=1e-8),
    state=dict(exp_avg=0.0, exp_avg_var=0.0, exp_grad_norm=0.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.8, 0.95), r=0.9, weight_decay=0.1),
    hyper=dict(lr=1e-2, beta1=0.8, beta2=0.95, r=0.9, weight_decay=0.1),
    states=dict(exp_avg="exp_avg", exp_avg_var="exp_avg_var", exp_grad_norm="exp_grad_norm"),
    doc="AdaNorm(lr, betas, r, weight_decay, eps) with ams_bound=False and decoupled decay as "
    "by default; exp_grad_norm is a per-tensor scalar.",
)

_add(
    "adasmooth",
    """
    d = g + weight_decay * p
    p_diff = p - prev_param
    s = s + p_diff
    n = n + abs(p_diff)
    c = abs(s) / (n + eps) * (beta2 - beta1) + (1 - beta2)
    exp_avg_sq = exp_avg_sq + c**2 * (d**2 - exp_avg_sq)
    prev_param = p
    p = p - lr * d / sqrt(exp_avg_sq + eps)
    """,
    defaults=dict(lr=1e-3, beta1=0.5, beta2=0.99, weight_decay=0.0, eps=1e-6),
    state=dict(prev_param="p", s=0.0, n=0.0, exp_avg_sq=0.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.4, 0.9), weight_decay=0.1),
    hyper=dict(lr=1e-2, beta1=0.4, beta2=0.9, weight_decay=0.1),
    # s, n and exp_avg_sq follow p - prev_param, a difference of two fp32 parameters whose
    # relative error is |p| / |p - prev_param| times fp32's (up to ~1e-5 at lr=1e-2).
    states=dict(prev_param="prev_param"),
    doc="AdaSmooth(lr, betas, weight_decay, eps) with coupled decay as by default, as its "
    "default (foreach) path computes it: prev_param is the parameter before the step.",
)

_add(
    "padam",
    """
    d = g + weight_decay * p
    exp_avg = beta1 * exp_avg + (1 - beta1) * d
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * d**2
    p = p - lr * sqrt(1 - beta2**step) / (1 - beta1**step) * exp_avg / (sqrt(exp_avg_sq) + eps)**(2 * partial)
    """,
    defaults=dict(lr=0.1, beta1=0.9, beta2=0.999, partial=0.25, weight_decay=0.0, eps=1e-8),
    state=dict(exp_avg=0.0, exp_avg_sq=0.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.8, 0.95), partial=0.2, weight_decay=0.1),
    hyper=dict(lr=1e-2, beta1=0.8, beta2=0.95, partial=0.2, weight_decay=0.1),
    states=dict(exp_avg="exp_avg", exp_avg_sq="exp_avg_sq"),
    doc="PAdam(lr, betas, partial, weight_decay, eps) with coupled decay as by default.",
)

_add(
    "accsgd",
    """
    d = g + weight_decay * p
    large_lr = lr * kappa / constant
    beta = xi * constant**2 / kappa
    zeta = constant / (constant + beta)
    momentum_buffer = ((1 / beta - 1) * momentum_buffer - large_lr * d + p) * beta
    p = p - lr * d
    p = p + (1 - zeta) * (momentum_buffer - p)
    """,
    defaults=dict(lr=1e-3, kappa=1000.0, xi=10.0, constant=0.7, weight_decay=0.0),
    state=dict(momentum_buffer="p"),
    reference_kwargs=dict(lr=1e-2, kappa=100.0, xi=5.0, constant=0.5, weight_decay=0.1),
    hyper=dict(lr=1e-2, kappa=100.0, xi=5.0, constant=0.5, weight_decay=0.1),
    states=dict(momentum_buffer="momentum_buffer"),
    doc="AccSGD(lr, kappa, xi, constant, weight_decay) with coupled decay as by default.",
)

_add(
    "kate",
    """
    p = p * (1 - lr * weight_decay)
    b_sq = b**2 + g**2 + eps
    m = sqrt(m**2 + delta * g**2 + g**2 / b_sq)
    p = p - lr * m * g / b_sq
    b = sqrt(b_sq)
    """,
    defaults=dict(lr=1e-3, delta=0.0, weight_decay=0.0, eps=1e-8),
    state=dict(m=0.0, b=0.0),
    reference_kwargs=dict(lr=1e-2, delta=0.1, weight_decay=0.1),
    hyper=dict(lr=1e-2, delta=0.1, weight_decay=0.1),
    states=dict(m="m", b="b"),
    doc="Kate(lr, delta, weight_decay, eps) with decoupled decay as by default.",
)

_add(
    "grams",
    """
    exp_avg = beta1 * exp_avg + (1 - beta1) * g
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g**2
    update = abs(exp_avg / (1 - beta1**step) / (sqrt(exp_avg_sq) / sqrt(1 - beta2**step) + eps)) * sign(g)
    p = p * (1 - lr * weight_decay)
    p = p - lr * update
    """,
    defaults=dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-6),
    state=dict(exp_avg=0.0, exp_avg_sq=0.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1),
    hyper=dict(lr=1e-2, beta1=0.8, beta2=0.95, weight_decay=0.1),
    states=dict(exp_avg="exp_avg", exp_avg_sq="exp_avg_sq"),
    doc="Grams(lr, betas, weight_decay, eps) with decoupled decay as by default.",
)

# --- statistics over all tensors (global reductions) -------------------------------------------

_add(
    "avagrad",
    """
    p = p * (1 - lr * weight_decay)
    exp_avg = beta1 * exp_avg + (1 - beta1) * g
    root = sqrt(exp_avg_sq)
    de_nom = root / sqrt(1 - beta2**(step - 1)) + eps
    p = where(step > 1, p - gamma * lr / (1 - beta1**step) * exp_avg / de_nom, p)
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g**2
    gamma = global_norm(1) / global_norm(1 / (root / sqrt(1 - beta2**step) + eps))
    """,
    defaults=dict(lr=0.1, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=0.1),
    state=dict(exp_avg=0.0, exp_avg_sq=0.0, gamma=0.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1, eps=0.05),
    hyper=dict(lr=1e-2, beta1=0.8, beta2=0.95, weight_decay=0.1, eps=0.05),
    states=dict(exp_avg="exp_avg", exp_avg_sq="exp_avg_sq"),
    doc="AvaGrad(lr, betas, weight_decay, eps) with decoupled decay as by default, one param "
    "group (gamma, the step size's scale, is taken over every tensor the step updates).",
)

_add(
    "prodigy",
    """
    d_lr = d * lr
    d_numerator = beta3 * d_numerator + (d / d0) * d_lr * global_sum(g * (p0 - p))
    exp_avg = beta1 * exp_avg + d * (1 - beta1) * g
    exp_avg_sq = beta2 * exp_avg_sq + d * d * (1 - beta2) * g**2
    s = beta3 * s + (d / d0) * d_lr * g
    d_new = maximum(d, d_coef * d_numerator / global_sum(abs(s)))
    p = p * (1 - d_lr * weight_decay)
    p = p - d_lr * exp_avg / (sqrt(exp_avg_sq) + d_new * eps)
    d = d_new
    """,
    defaults=dict(
        lr=1.0, beta1=0.9, beta2=0.999, beta3=0.999**0.5, d0=1e-6, d_coef=1.0, weight_decay=0.0, eps=1e-8
    ),
    state=dict(exp_avg=0.0, exp_avg_sq=0.0, s=0.0, p0="p", d=1e-6, d_numerator=0.0),
    reference_kwargs=dict(lr=1.0, betas=(0.9, 0.99), beta3=0.95, d0=1e-6, weight_decay=0.1),
    hyper=dict(lr=1.0, beta1=0.9, beta2=0.99, beta3=0.95, d0=1e-6, weight_decay=0.1),
    states=dict(exp_avg="exp_avg", exp_avg_sq="exp_avg_sq", s="s"),
    doc="Prodigy(lr, betas, beta3, d0, d_coef, weight_decay) with its defaults growth_rate=inf "
    "(so d is the running maximum of its estimate), bias_correction=False, safeguard_warmup=False "
    "and decoupled decay; d and d_numerator are per-tensor states that every tensor shares, fed "
    "by global_sum over every tensor (the reference keeps them in the param group). The state d "
    "starts at d0's default (1e-6).",
)

_add(
    "dadaptadam",
    """
    d_lr = d * lr
    num = numerator_weighted + (1 - sqrt(beta2)) * (
        d_lr * global_sum(g * s / (sqrt(exp_avg_sq) + eps)) - numerator_weighted
    )
    exp_avg = beta1 * exp_avg + d_lr * (1 - beta1) * g
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g**2
    s = sqrt(beta2) * s + d_lr * (1 - sqrt(beta2)) * g
    d_new = maximum(d, num / ((1 - sqrt(beta2)) * global_sum(abs(s))))
    p = p * (1 - d_lr * weight_decay) - exp_avg / (sqrt(exp_avg_sq) + eps)
    numerator_weighted = num
    d = d_new
    """,
    defaults=dict(lr=1.0, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8),
    state=dict(exp_avg=0.0, exp_avg_sq=0.0, s=0.0, d=1e-6, numerator_weighted=0.0),
    reference_kwargs=dict(lr=1.0, betas=(0.8, 0.95), weight_decay=0.1, weight_decouple=True),
    hyper=dict(lr=1.0, beta1=0.8, beta2=0.95, weight_decay=0.1),
    states=dict(exp_avg="exp_avg", exp_avg_sq="exp_avg_sq", s="s"),
    doc="DAdaptAdam(lr, betas, weight_decay) with weight_decouple=True and its defaults "
    "d0=1e-6 (the state d's start), growth_rate=inf, bias_correction=False: d grows to the "
    "running maximum of its estimate, from dot products and L1 norms over every tensor "
    "(global_sum); d and numerator_weighted are per-tensor states that every tensor shares.",
)

_add(
    "dadaptsgd",
    """
    d = where(step == 1, d0, d)
    g0_norm = where(step == 1, global_norm(g), g0_norm)
    d_lr = d * lr / g0_norm
    gw = g + weight_decay * p
    num = numerator_weighted + d_lr * global_sum(gw * s)
    s = s + d_lr * gw
    d_new = maximum(d, 2 * num / sqrt(global_sum(s**2)))
    z = x0 - s
    p = p + (1 - momentum) * (z - p)
    numerator_weighted = num
    d = d_new
    """,
    defaults=dict(lr=1.0, d0=1e-6, momentum=0.9, weight_decay=0.0),
    state=dict(s=0.0, x0="p", z="p", d=0.0, numerator_weighted=0.0, g0_norm=1.0),
    reference_kwargs=dict(lr=0.8, momentum=0.8, d0=0.1, weight_decay=1.5),
    hyper=dict(lr=0.8, momentum=0.8, d0=0.1, weight_decay=1.5),
    states=dict(s="s", x0="x0", z="z"),
    doc="DAdaptSGD(lr, momentum, d0, weight_decay) with coupled decay (weight_decouple=False, "
    "fixed_decay=False) and growth_rate=inf as by default, one param group: the step size is "
    "d * lr / g0_norm, g0_norm the global gradient norm of the first step, and d (d0 at the "
    "first step) grows to the running maximum of 2 * numerator_weighted / ||s||, a dot product "
    "and a norm over every tensor (global_sum); d, numerator_weighted and g0_norm are "
    "per-tensor states that every tensor shares (the reference keeps them in the param group).",
)

_add(
    "dadaptadagrad",
    """
    d = where(step == 1, d0, d)
    d_lr = d * lr
    gw = g + weight_decay * p
    old_sq = global_sum(sk**2 / (sqrt(alpha_k) + eps))
    old_l1 = global_sum(abs(sk))
    alpha_k = alpha_k + gw**2
    de_nom = sqrt(alpha_k) + eps
    gsq_weighted = gsq_weighted + d_lr * d_lr * global_sum(gw**2 / de_nom)
    sk = sk + d_lr * gw
    sk_sq_weighted = sk_sq_weighted + (global_sum(sk**2 / de_nom) - old_sq)
    sk_l1 = sk_l1 + (global_sum(abs(sk)) - old_l1)
    d = maximum(d, (sk_sq_weighted - gsq_weighted) / sk_l1)
    z = x0 - sk / de_nom
    p = p + (1 - momentum) * (z - p)
    """,
    defaults=dict(lr=1.0, d0=1e-6, momentum=0.0, weight_decay=0.0, eps=0.0),
    state=dict(alpha_k=1e-6, sk=0.0, x0="p", d=0.0, gsq_weighted=0.0, sk_sq_weighted=0.0, sk_l1=0.0),
    reference_kwargs=dict(lr=5.0, momentum=0.5, d0=0.01, weight_decay=1.0, eps=1e-8),
    hyper=dict(lr=5.0, momentum=0.5, d0=0.01, weight_decay=1.0, eps=1e-8),
    states=dict(alpha_k="alpha_k", sk="sk", x0="x0"),
    doc="DAdaptAdaGrad(lr, momentum, d0, weight_decay, eps) with coupled decay "
    "(weight_decouple=False) and growth_rate=inf as by default, dense gradients, one param "
    "group: d (d0 at the first step) grows to the running maximum of "
    "(sk_sq_weighted - gsq_weighted) / sk_l1, running sums over every tensor (global_sum) "
    "that, like d, are per-tensor states every tensor shares (the reference keeps them in the "
    "param group); sk_sq_weighted and sk_l1 are updated by their change, as the reference does.",
)

_add(
    "dadaptlion",
    """
    d = where(step == 1, d0, d)
    d_lr = d * lr
    gw = g + weight_decay * p
    update = sign(exp_avg + (1 - beta1) * (gw - exp_avg))
    num = numerator_weighted + (1 - sqrt(beta2)) * (d_lr * global_sum(update * s) - numerator_weighted)
    p = p - d_lr * update
    exp_avg = beta2 * exp_avg + (1 - beta2) * d_lr * gw
    s = sqrt(beta2) * s + (1 - sqrt(beta2)) * d_lr * update
    d_new = maximum(d, num / ((1 - sqrt(beta2)) * global_sum(abs(s))))
    numerator_weighted = num
    d = d_new
    """,
    defaults=dict(lr=1.0, d0=1e-6, beta1=0.9, beta2=0.999, weight_decay=0.0),
    state=dict(exp_avg=0.0, s=0.0, d=0.0, numerator_weighted=0.0),
    reference_kwargs=dict(lr=5.0, betas=(0.8, 0.95), d0=0.003, weight_decay=1.0),
    hyper=dict(lr=5.0, d0=0.003, beta1=0.8, beta2=0.95, weight_decay=1.0),
    states=dict(exp_avg="exp_avg", s="s"),
    doc="DAdaptLion(lr, betas, d0, weight_decay) with coupled decay (weight_decouple=False) as "
    "by default, one param group: d (d0 at the first step) grows to the running maximum of "
    "its estimate, a dot product and an L1 norm over every tensor (global_sum); d and "
    "numerator_weighted are per-tensor states that every tensor shares (the reference keeps "
    "them in the param group).",
)

_add(
    "dadaptadan",
    """
    d = where(step == 1, d0, d)
    d_lr = d * lr
    grad_diff = where(step > 1, previous_grad + g, 0)
    exp_avg = beta1 * exp_avg + d_lr * (1 - beta1) * g
    exp_avg_diff = beta2 * exp_avg_diff + d_lr * (1 - beta2) * grad_diff
    diff_sq = (beta2 * grad_diff + g)**2
    exp_avg_sq = beta3 * exp_avg_sq + (1 - beta3) * diff_sq * diff_sq
    de_nom = sqrt(exp_avg_sq) + eps
    s = beta3 * s + d_lr * (1 - beta3) * g
    gsq_weighted = beta3 * gsq_weighted + d_lr * d_lr * (1 - beta3) * global_sum(g**2 / de_nom)
    d_new = maximum(d, (global_sum(s**2 / de_nom) / (1 - beta3) - gsq_weighted) / global_sum(abs(s)))
    p = (p - exp_avg / de_nom - beta2 * exp_avg_diff / de_nom) / (1 + d_lr * weight_decay)
    previous_grad = -g
    d = d_new
    """,
    defaults=dict(lr=1.0, d0=1e-6, beta1=0.98, beta2=0.92, beta3=0.99, weight_decay=0.0, eps=1e-8),
    state=dict(
        exp_avg=0.0, exp_avg_sq=0.0, exp_avg_diff=0.0, s=0.0, previous_grad=0.0, d=0.0, gsq_weighted=0.0
    ),
    reference_kwargs=dict(lr=0.5, betas=(0.9, 0.8, 0.95), d0=0.01, weight_decay=0.1),
    hyper=dict(lr=0.5, d0=0.01, beta1=0.9, beta2=0.8, beta3=0.95, weight_decay=0.1),
    states=dict(
        exp_avg="exp_avg",
        exp_avg_sq="exp_avg_sq",
        exp_avg_diff="exp_avg_diff",
        s="s",
        previous_grad="previous_grad",
    ),
    doc="DAdaptAdan(lr, betas, d0, weight_decay, eps) with coupled decay "
    "(weight_decouple=False: the parameter is divided by 1 + d * lr * weight_decay) and "
    "growth_rate=inf as by default, one param group: d (d0 at the first step) grows to the "
    "running maximum of its estimate, from weighted sums and an L1 norm over every tensor "
    "(global_sum); d and gsq_weighted are per-tensor states that every tensor shares (the "
    "reference keeps them in the param group). As the reference does, exp_avg_sq averages the "
    "fourth power of beta2 * (g - previous g) + g.",
)

_add(
    "adai",
    """
    d = g + weight_decay * p
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * d**2
    exp_avg_sq_hat = exp_avg_sq / (1 - beta2**step)
    mean_hat = maximum((global_norm(sqrt(exp_avg_sq_hat)) / global_norm(1))**2, eps)
    beta1 = clamp(1 - (exp_avg_sq_hat / mean_hat)**(1 / (3 - 2 * dampening)) * beta0, 0, 1 - eps)
    beta1_prod = beta1_prod * beta1
    exp_avg = beta1 * exp_avg + (1 - beta1)**dampening * d
    p = p - lr * beta0**(1 - dampening) * exp_avg / (1 - beta1_prod)
    """,
    defaults=dict(lr=1e-3, beta0=0.1, beta2=0.99, weight_decay=0.0, dampening=1.0, eps=1e-3),
    state=dict(exp_avg=0.0, exp_avg_sq=0.0, beta1_prod=1.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.2, 0.95), weight_decay=0.1, dampening=0.8),
    hyper=dict(lr=1e-2, beta0=0.2, beta2=0.95, weight_decay=0.1, dampening=0.8),
    states=dict(exp_avg="exp_avg", exp_avg_sq="exp_avg_sq", beta1_prod="beta1_prod"),
    doc="Adai(lr, betas, weight_decay, dampening, eps) with coupled decay and "
    "stable_weight_decay=False as by default, one param group (the mean of exp_avg_sq is "
    "taken over every tensor the step updates).",
)

# AliG (Berrada et al. 2020): the step size is the closure's loss over the squared gradient
# norm of every tensor, capped at max_lr; the reference's max_lr=None (no cap) is any
# negative max_lr here, a value the reference refuses.
_ALIG = """
    gs = (1 - 2 * maximize) * g
    step_size = loss / (global_sum(g**2) + 1e-6)
    step_size = where(max_lr >= 0, minimum(step_size, max_lr), step_size)
    p = p - step_size * gs
    momentum_buffer = momentum * momentum_buffer - where(adjusted_momentum > 0, 1, step_size) * gs
    p = p + where(adjusted_momentum > 0, step_size, 1) * momentum * momentum_buffer
    """
_ALIG_DEFAULTS = dict(max_lr=-1.0, momentum=0.0, adjusted_momentum=0.0, maximize=0.0)
_ALIG_DOC = (
    "AliG(max_lr, momentum, adjusted_momentum, maximize; the flags as 0/1) with "
    "projection_fn=None as by default: the step size loss / (sum of every gradient's squared "
    "norm + 1e-6), the reference's get_global_gradient_norm being that sum of squares, capped "
    "at max_lr, with max_lr < 0 for the reference's max_lr=None (no cap); the loss is the "
    "value of the step's closure, which both optimizers need. "
)
_add(
    "alig",
    _ALIG,
    defaults=_ALIG_DEFAULTS,
    state=dict(momentum_buffer=0.0),
    reference_kwargs=dict(momentum=0.8),
    hyper=dict(momentum=0.8),
    states=dict(momentum_buffer="momentum_buffer"),
    doc=_ALIG_DOC + "Here uncapped, with the default momentum (adjusted_momentum=False): "
    "the buffer holds momentum * buffer - step_size * g and adds momentum times itself.",
)
_add(
    "alig_adjusted",
    _ALIG,
    reference="alig",
    defaults=_ALIG_DEFAULTS,
    state=dict(momentum_buffer=0.0),
    reference_kwargs=dict(max_lr=0.005, momentum=0.8, adjusted_momentum=True, maximize=True),
    hyper=dict(max_lr=0.005, momentum=0.8, adjusted_momentum=1.0, maximize=1.0),
    states=dict(momentum_buffer="momentum_buffer"),
    doc=_ALIG_DOC + "Here with adjusted_momentum=True (the buffer holds momentum * buffer - g "
    "and adds step_size * momentum times itself), maximize=True and a max_lr that caps about "
    "70% of the test's steps (the uncapped ones check the branch that takes the loss).",
)

# --- Factored second moments (rows and columns of each tensor's 2-D view) ------------------

_add(
    "came",
    """
    sq = g**2 + eps1
    exp_avg_sq_row = beta2 * exp_avg_sq_row + (1 - beta2) * rowmean(sq)
    exp_avg_sq_col = beta2 * exp_avg_sq_col + (1 - beta2) * colmean(sq)
    v = where(rows > 1, exp_avg_sq_row * exp_avg_sq_col / mean(exp_avg_sq_row), exp_avg_sq_col)
    p = p * (1 - lr * weight_decay)
    u = g * rsqrt(v)
    u = u / maximum(norm(u) / sqrt(numel) / clip_threshold, 1)
    exp_avg = exp_avg + (1 - beta1) * (u - exp_avg)
    res = (u - exp_avg)**2 + eps2
    exp_avg_res_row = beta3 * exp_avg_res_row + (1 - beta3) * rowmean(res)
    exp_avg_res_col = beta3 * exp_avg_res_col + (1 - beta3) * colmean(res)
    res_v = exp_avg_res_row * exp_avg_res_col / mean(exp_avg_res_row)
    p = p - lr * where(rows > 1, rsqrt(res_v), 1) * exp_avg
    """,
    defaults=dict(
        lr=2e-4,
        beta1=0.9,
        beta2=0.999,
        beta3=0.9999,
        weight_decay=0.0,
        clip_threshold=1.0,
        eps1=1e-30,
        eps2=1e-16,
    ),
    state=dict(exp_avg=0.0, exp_avg_sq_row=0.0, exp_avg_sq_col=0.0, exp_avg_res_row=0.0, exp_avg_res_col=0.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.8, 0.9, 0.95), weight_decay=0.1, clip_threshold=0.5),
    hyper=dict(lr=1e-2, beta1=0.8, beta2=0.9, beta3=0.95, weight_decay=0.1, clip_threshold=0.5),
    states=dict(
        exp_avg="exp_avg",
        exp_avg_sq_row="exp_avg_sq_row",
        exp_avg_sq_col="exp_avg_sq_col",
        exp_avg_res_row="exp_avg_res_row",
        exp_avg_res_col="exp_avg_res_col",
    ),
    shapes=((7, 13), (9, 257)),
    doc="CAME(lr, betas, weight_decay, clip_threshold, eps1, eps2) with decoupled decay "
    "(weight_decouple=True, fixed_decay=False, ams_bound=False as by default). 2-D "
    "parameters here (the states both keep); 1-D ones follow the reference's unfactored "
    "exp_avg_sq as exp_avg_sq_col (one row). Tensors of more than 2 dimensions are factored "
    "over [shape[0], prod(rest)], the reference's over its last two dimensions. "
    "fuser.optim.CAME is this rule with every keyword.",
)

_add(
    "nero",
    """
    c = p - where(rows > 1, rowmean(p), 0)
    p = where(step == 1 and rows > 1, c / (rownorm(c) + eps), p)
    scale = where(step == 1, sum(where(rows > 1, rownorm(p), abs(p))) / numel, scale)
    g_norm = where(rows > 1, rownorm(g), abs(g))
    exp_avg_sq = beta * exp_avg_sq + (1 - beta) * g_norm**2
    p = p - lr * scale * g / (sqrt(exp_avg_sq / (1 - beta**step)) + eps)
    c = p - where(rows > 1, rowmean(p), 0)
    p = where(rows > 1, c / (rownorm(c) + eps), p)
    """,
    defaults=dict(lr=1e-2, beta=0.999, eps=1e-8),
    state=dict(exp_avg_sq=0.0, scale=0.0),
    reference_kwargs=dict(lr=2e-2, beta=0.9),
    hyper=dict(lr=2e-2, beta=0.9),
    states=dict(scale="scale"),
    shapes=((7, 13), (29,), (3, 5, 4), (16, 2)),
    doc="Nero(lr, beta, eps) with constraints=True as by default: tensors of 2 or more "
    "dimensions (with more than one row) are projected to zero-mean, unit-norm rows at the "
    "first step and after each; 1-D tensors take per-element norms. exp_avg_sq is kept per "
    "element (the reference keeps one number per row of a matrix).",
)

# AdamP and SGDP (Heo et al. 2021) remove the radial part of the update of a scale-invariant
# weight: where the gradient's cosine similarity with the parameter is below delta / sqrt(n),
# per channel (rows of the 2-D view, every row below delta / sqrt(cols)) first, else over the
# whole tensor (delta / sqrt(numel)), u loses its component along p's unit rows (or p's unit
# tensor), and weight decay is scaled by wd_ratio. The reference projects tensors of 2 or
# more dimensions only; ``rows > 1`` stands for that here.
_PROJECTION = """
    cos_row = rowsum(g * p) / (maximum(rownorm(g), eps) * maximum(rownorm(p), eps))
    cos_all = sum(g * p) / (maximum(norm(g), eps) * maximum(norm(p), eps))
    channel = where(rows > 1 and amax(abs(cos_row)) < delta / sqrt(cols), 1, 0)
    layer = where(rows > 1 and abs(cos_all) < delta / sqrt(numel), 1, 0)
    p_row = p / (rownorm(p) + eps)
    p_all = p / (norm(p) + eps)
    u = where(channel > 0, u - p_row * rowsum(p_row * u), where(layer > 0, u - p_all * sum(p_all * u), u))
    ratio = where(channel > 0 or layer > 0, wd_ratio, 1)
    """
_PROJECTION_DOC = (
    " The projection is tested with delta=1.5 (the default 0.1 seldom projects random "
    "gradients: the layer test passes on about 8% of steps and the channel test never), on "
    "shapes chosen so that each run takes the channel branch, the layer branch and "
    "(almost always) neither: (2, 40) mostly per channel, (40, 10) mostly per tensor. "
    "Tensors of 2 or more dimensions are told from 1-D ones by rows > 1: a tensor whose "
    "first dimension is 1 (shape (1, n)) is projected by the reference and not by the rule. "
    "The cosine similarity is the gradient's with the parameter, as the reference's."
)
_PROJECTION_SHAPES = ((7, 13), (29,), (3, 5, 4), (2, 40), (40, 10))

_add(
    "adamp",
    """
    exp_avg = exp_avg + (1 - beta1) * (g - exp_avg)
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g**2
    u = exp_avg * sqrt(1 - beta2**step) / (sqrt(exp_avg_sq) + eps)
    """
    + _PROJECTION
    + """
    p = p * (1 - lr * weight_decay * ratio) - lr / (1 - beta1**step) * u
    """,
    defaults=dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, delta=0.1, wd_ratio=0.1, eps=1e-8),
    state=dict(exp_avg=0.0, exp_avg_sq=0.0),
    reference_kwargs=dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1, delta=1.5, wd_ratio=0.3),
    hyper=dict(lr=1e-2, beta1=0.8, beta2=0.95, weight_decay=0.1, delta=1.5, wd_ratio=0.3),
    states=dict(exp_avg="exp_avg", exp_avg_sq="exp_avg_sq"),
    shapes=_PROJECTION_SHAPES,
    doc="AdamP(lr, betas, weight_decay, delta, wd_ratio, eps) with decoupled decay "
    "(weight_decouple=True, fixed_decay=False as by default), nesterov=False, "
    "maximize=False, and the default adam_debias=False, use_gc=False, adanorm=False, "
    "cautious=False. Not covered: nesterov, fixed_decay, weight_decouple=False (whose "
    "decay the reference adds to the gradient after the update is formed), and those "
    "extra keywords." + _PROJECTION_DOC,
)

_add(
    "sgdp",
    """
    momentum_buffer = momentum * momentum_buffer + (1 - dampening) * g
    u = momentum_buffer
    """
    + _PROJECTION
    + """
    p = p * (1 - lr * weight_decay * ratio / (1 - momentum)) - lr * u
    """,
    defaults=dict(lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, delta=0.1, wd_ratio=0.1, eps=1e-8),
    state=dict(momentum_buffer=0.0),
    reference_kwargs=dict(lr=1e-2, momentum=0.8, dampening=0.1, weight_decay=0.1, delta=1.5, wd_ratio=0.3),
    hyper=dict(lr=1e-2, momentum=0.8, dampening=0.1, weight_decay=0.1, delta=1.5, wd_ratio=0.3),
    states=dict(momentum_buffer="momentum"),
    shapes=_PROJECTION_SHAPES,
    doc="SGDP(lr, momentum, dampening, weight_decay, delta, wd_ratio, eps) with decoupled "
    "decay (weight_decouple=True, fixed_decay=False as by default; the decay is scaled by "
    "wd_ratio / (1 - momentum) on projected tensors and 1 / (1 - momentum) on others, as "
    "the reference's), nesterov=False, maximize=False. Not covered: nesterov, fixed_decay, "
    "weight_decouple=False." + _PROJECTION_DOC,
)

# SM3 (Anil et al. 2019) keeps one accumulator per cover set: for a matrix one per row and
# one per column (the reference's accumulator_0 of shape [rows, 1] and accumulator_1 of
# shape [1, cols]), for a vector one per element (the column state of its one row).
_SM3 = """
    nu = where(beta > 0, beta, 1) * where(rows > 1, minimum(acc_row, acc_col), acc_col) + (1 - beta) * g**2
    acc_row = where(beta > 0, maximum(acc_row, rowamax(nu)), rowamax(nu))
    acc_col = where(beta > 0, maximum(acc_col, colamax(nu)), colamax(nu))
    u = g * rsqrt(nu + eps)
    m = momentum_buffer + (1 - momentum) * (u - momentum_buffer)
    momentum_buffer = where(momentum > 0, m, momentum_buffer)
    p = p - lr * where(momentum > 0, momentum_buffer, u)
    """
_SM3_DEFAULTS = dict(lr=1e-1, momentum=0.0, beta=0.0, eps=1e-30)
_SM3_STATE = dict(acc_row=0.0, acc_col=0.0, momentum_buffer=0.0)
_add(
    "sm3",
    _SM3,
    defaults=_SM3_DEFAULTS,
    state=_SM3_STATE,
    reference_kwargs=dict(lr=5e-2, momentum=0.9),
    hyper=dict(lr=5e-2, momentum=0.9),
    states=dict(momentum_buffer="momentum_buffer"),
    shapes=((7, 13), (29,), (1, 9), (16, 1)),
    doc="SM3(lr, momentum, beta, eps) for dense 1-D and 2-D parameters. beta=0 (the default) "
    "adds g**2 to the smallest covering accumulator (SM3-II); beta > 0 (sm3_beta) keeps the "
    "running maximum of beta * acc + (1 - beta) * g**2; the update is g * rsqrt(nu + eps). "
    "momentum=0 (the default) steps without momentum and leaves momentum_buffer zeros, as the "
    "reference does. A matrix's accumulator_0 and accumulator_1 are acc_row "
    "and acc_col (compared in sm3_beta), a vector's accumulator_0 is acc_col (acc_row is "
    "then unused). Not covered: tensors of more than 2 dimensions (the reference keeps one "
    "accumulator per dimension, the rule one per row and per column of [shape[0], "
    "prod(rest)]), 0-D tensors, sparse gradients and maximize=True.",
)
_add(
    "sm3_beta",
    _SM3,
    reference="sm3",
    defaults=_SM3_DEFAULTS,
    state=_SM3_STATE,
    reference_kwargs=dict(lr=5e-2, momentum=0.8, beta=0.9, eps=1e-8),
    hyper=dict(lr=5e-2, momentum=0.8, beta=0.9, eps=1e-8),
    states=dict(acc_row="accumulator_0", acc_col="accumulator_1", momentum_buffer="momentum_buffer"),
    shapes=((7, 13), (1, 9), (16, 1)),
    doc="SM3(..., beta > 0) on matrices, its accumulators compared; otherwise as sm3.",
)

# pytorch-optimizer's AdaFactor (BigVision's variant, not torch.optim.Adafactor's): eps1
# added to g**2 before the means, beta2_t = min(beta2, 1 - step**decay_rate), the factored
# estimate rsqrt(row / mean(row)) * rsqrt(col) without a floor, the update clipped to RMS
# clip_threshold and scaled by the step size, then momentum of it (betas=(None, beta2) is
# beta1=0). A vector is the reference's unfactored exp_avg_sq, kept as exp_avg_sq_col.
_ADAFACTOR = """
    step_size = where(relative_step > 0, minimum(where(warmup_init > 0, 1e-6 * step, 1e-2), rsqrt(step)), lr)
    alpha = where(scale_parameter > 0, maximum(eps2, norm(p) / sqrt(numel)) * step_size, step_size)
    d_g = g + (1 - weight_decouple) * weight_decay * p
    p = p * (1 - weight_decouple * weight_decay * where(fixed_decay > 0, 1, alpha))
    w = 1 - minimum(beta2, 1 - step**decay_rate)
    sq = d_g**2 + eps1
    exp_avg_sq_row = exp_avg_sq_row + w * (rowmean(sq) - exp_avg_sq_row)
    exp_avg_sq_col = exp_avg_sq_col + w * (colmean(sq) - exp_avg_sq_col)
    v = where(rows > 1, exp_avg_sq_row * exp_avg_sq_col / mean(exp_avg_sq_row), exp_avg_sq_col)
    u = d_g * rsqrt(v)
    u = alpha * u / maximum(norm(u) / sqrt(numel) / clip_threshold, 1)
    exp_avg = exp_avg + (1 - beta1) * (u - exp_avg)
    p = p - exp_avg
    """
_ADAFACTOR_DEFAULTS = dict(
    lr=1e-3,
    beta1=0.9,
    beta2=0.999,
    decay_rate=-0.8,
    weight_decay=0.0,
    weight_decouple=1.0,
    fixed_decay=0.0,
    clip_threshold=1.0,
    scale_parameter=1.0,
    relative_step=1.0,
    warmup_init=0.0,
    eps1=1e-30,
    eps2=1e-3,
)
_ADAFACTOR_STATE = dict(exp_avg=0.0, exp_avg_sq_row=0.0, exp_avg_sq_col=0.0)
_add(
    "adafactor",
    _ADAFACTOR,
    defaults=_ADAFACTOR_DEFAULTS,
    state=_ADAFACTOR_STATE,
    reference_kwargs=dict(
        betas=(0.8, 0.6), weight_decay=0.1, clip_threshold=0.5, momentum_dtype=torch.float64
    ),
    hyper=dict(beta1=0.8, beta2=0.6, weight_decay=0.1, clip_threshold=0.5),
    states=dict(exp_avg="exp_avg"),
    shapes=((7, 13), (29,), (1, 9), (16, 1)),
    doc="AdaFactor(lr, betas, decay_rate, weight_decay, clip_threshold, eps1, eps2, and "
    "weight_decouple, fixed_decay, scale_parameter, relative_step, warmup_init as 0/1) for "
    "1-D and 2-D parameters; betas=(None, beta2) is beta1=0 (the reference then keeps no "
    "exp_avg). Defaults as the reference's: relative_step=True (step size min(1e-2, "
    "1/sqrt(step)), lr unused; min(1e-6 * step, 1/sqrt(step)) with warmup_init=True, "
    "adafactor_warmup), scale_parameter=True (the step size times max(eps2, RMS(p)) of p "
    "before decay), beta1=0.9 momentum of the clipped, scaled update, decoupled decay, eps1 "
    "added to g**2 before the row and column means and no eps in the inverse root. Pinned: "
    "ams_bound=False, maximize=False, and the reference's momentum_dtype set to the "
    "parameters' dtype (its default keeps exp_avg in bf16, which the rule does not; its "
    "unused RMS state is not kept). A matrix's exp_avg_sq_row and exp_avg_sq_col are the "
    "reference's (compared in adafactor_lr), a vector's exp_avg_sq is exp_avg_sq_col. Not "
    "covered: tensors of more than 2 dimensions (factored over [shape[0], prod(rest)], the "
    "reference's over its last two dimensions).",
)
_add(
    "adafactor_warmup",
    _ADAFACTOR,
    reference="adafactor",
    defaults=_ADAFACTOR_DEFAULTS,
    state=_ADAFACTOR_STATE,
    reference_kwargs=dict(warmup_init=True, weight_decay=0.1, fixed_decay=True, momentum_dtype=torch.float64),
    hyper=dict(warmup_init=1.0, weight_decay=0.1, fixed_decay=1.0),
    states=dict(exp_avg="exp_avg"),
    shapes=((7, 13), (29,), (16, 1)),
    doc="AdaFactor(..., warmup_init=True, fixed_decay=True): relative steps warmed up from "
    "1e-6 * step, decay not scaled by the step size; otherwise as adafactor.",
)
_add(
    "adafactor_lr",
    _ADAFACTOR,
    reference="adafactor",
    defaults=_ADAFACTOR_DEFAULTS,
    state=_ADAFACTOR_STATE,
    reference_kwargs=dict(
        lr=1e-2,
        relative_step=False,
        scale_parameter=False,
        betas=(None, 0.95),
        decay_rate=-0.5,
        weight_decay=0.1,
        weight_decouple=False,
        clip_threshold=2.0,
        eps1=1e-20,
    ),
    hyper=dict(
        lr=1e-2,
        relative_step=0.0,
        scale_parameter=0.0,
        beta1=0.0,
        beta2=0.95,
        decay_rate=-0.5,
        weight_decay=0.1,
        weight_decouple=0.0,
        clip_threshold=2.0,
        eps1=1e-20,
    ),
    states=dict(exp_avg_sq_row="exp_avg_sq_row", exp_avg_sq_col="exp_avg_sq_col"),
    shapes=((7, 13), (1, 9), (16, 1)),
    doc="AdaFactor(lr, relative_step=False, scale_parameter=False, betas=(None, beta2), "
    "weight_decouple=False) on matrices, the factored moments compared: a fixed lr, coupled "
    "decay, no momentum; otherwise as adafactor.",
)

# --- Matrix functions (Newton–Schulz on each tensor's 2-D view) ------------------------------
# The references take param groups with use_muon=True (their AdamW groups are
# fuser.optim.Muon / NorMuon's). Matrices only: the references view a 1-D tensor as a
# column, the rule language as a row. The tests run the references' Newton–Schulz in
# float64; fuser's bf16 products differ from it by bf16's Newton–Schulz error (1-5% of the
# update on these small matrices), on five steps that move p by a tenth of |p| at these
# learning rates: 3e-3 on parameters.
_MATRICES = ((16, 24), (24, 16), (40, 8), (7, 13), (5, 3, 4))
_NS_RTOL = 3e-3

_add(
    "muon",
    """
    p = p * (1 - lr * weight_decay)
    momentum_buffer = momentum * momentum_buffer + (1 - momentum) * g
    o = orthogonalize(g + momentum * (momentum_buffer - g))
    p = p - lr * maximum(1, rows / cols) ** 0.5 * o
    """,
    defaults=dict(lr=2e-2, momentum=0.95, weight_decay=0.0),
    state=dict(momentum_buffer=0.0),
    reference_kwargs=dict(lr=2e-2, momentum=0.9, weight_decay=0.1),
    reference_group=dict(use_muon=True),
    hyper=dict(lr=2e-2, momentum=0.9, weight_decay=0.1),
    states=dict(momentum_buffer="momentum_buffer"),
    shapes=_MATRICES,
    rtol=_NS_RTOL,
    doc="Muon(lr, momentum, weight_decay) for a use_muon=True group of matrices, with "
    "nesterov=True, ns_steps=5, ns_coeffs='original', use_adjusted_lr=False and decoupled "
    "decay as by default. fuser.optim.Muon is this rule with its AdamW groups.",
)

_add(
    "adamuon",
    """
    p = p * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * g
    o = orthogonalize(m)
    v = beta2 * v + (1 - beta2) * o**2
    u = o / (sqrt(v / (1 - beta2**step)) + eps)
    u_norm = norm(rownorm(u)) + eps
    p = p - lr * 0.2 * sqrt(maximum(rows, cols)) * sqrt(minimum(rows, cols)) / u_norm * u
    """,
    defaults=dict(lr=2e-2, beta1=0.9, beta2=0.95, weight_decay=0.0, eps=1e-10),
    state=dict(m=0.0, v=0.0),
    reference_kwargs=dict(lr=2e-2, betas=(0.8, 0.9), weight_decay=0.1),
    reference_group=dict(use_muon=True),
    hyper=dict(lr=2e-2, beta1=0.8, beta2=0.9, weight_decay=0.1),
    states=dict(m="m"),
    ns_states=dict(v="v"),
    shapes=_MATRICES,
    rtol=_NS_RTOL,
    doc="AdaMuon(lr, betas, weight_decay, eps) for a use_muon=True group of matrices, with "
    "ns_steps=5, ns_coeffs='original', use_adjusted_lr=True (Moonlight's 0.2 * "
    "sqrt(max(rows, cols))) and decoupled decay as by default.",
)

_add(
    "normuon",
    """
    p = p * (1 - lr * weight_decay)
    momentum_buffer = momentum * momentum_buffer + (1 - momentum) * g
    o = orthogonalize(g + momentum * (momentum_buffer - g))
    second_momentum_buffer = beta2 * second_momentum_buffer + (1 - beta2) * rowmean(o**2)
    de_nom = sqrt(second_momentum_buffer) + eps
    o_rows = rownorm(o)
    scale = maximum(1, rows / cols) ** 0.5 * norm(o_rows) / (norm(o_rows / de_nom) + eps)
    p = p - lr * scale * o / de_nom
    """,
    defaults=dict(lr=2e-2, momentum=0.95, beta2=0.95, weight_decay=0.0, eps=1e-10),
    state=dict(momentum_buffer=0.0, second_momentum_buffer=0.0),
    reference_kwargs=dict(lr=2e-2, momentum=0.9, beta2=0.9, weight_decay=0.1),
    reference_group=dict(use_muon=True),
    hyper=dict(lr=2e-2, momentum=0.9, beta2=0.9, weight_decay=0.1),
    states=dict(momentum_buffer="momentum_buffer"),
    ns_states=dict(second_momentum_buffer="second_momentum_buffer"),
    shapes=_MATRICES,
    rtol=_NS_RTOL,
    doc="NorMuon(lr, momentum, beta2, weight_decay, eps) for a use_muon=True group of "
    "matrices, with nesterov=True, ns_steps=5, update_scale='preserve_norm', "
    "use_adjusted_lr=False and decoupled decay as by default. fuser.optim.NorMuon is this "
    "rule with every keyword and its AdamW groups.",
)

# SCION and SCIONLight take plain parameter lists (no use_muon groups). Their default LMO
# (norm_type=AUTO) goes by shape: the spectral one (Newton–Schulz times sqrt(d_out / d_in))
# on 2-D tensors, BiasRMS on 1-D ones. The rule tells them apart by
# rows, so a matrix of one row is not covered; nor are 3-D and 4-D tensors, whose
# SpectralConv scale sqrt(d_out / d_in) / kernel volume needs shape[1] (the rule language
# sees shape[0] and prod(rest)).
_SCION_LMO = """
    spectral = (rows / cols) ** 0.5 * orthogonalize({d})
    bias_rms = {d} / (sqrt(mean({d}**2)) + 1e-8)
    p = p - lr * scale * where(rows > 1, spectral, bias_rms)
    """
_SCION_SHAPES = tuple(s for s in _MATRICES if len(s) == 2) + ((29,),)
_SCION_DOC = (
    "norm_type=LMONorm.AUTO, norm_kwargs={{}}, constraint=False, weight_decouple=True and "
    "maximize=False as by default: matrices take the spectral LMO (Newton–Schulz, num_steps=5, times "
    "sqrt(rows / cols)), 1-D tensors BiasRMS (d / (rms(d) + 1e-8)). Not covered: AUTO's "
    "spectral LMO on a matrix of one row (the rule sees it as a 1-D tensor) and its "
    "SpectralConv on 3-D and 4-D tensors (its scale needs shape[1]); constraint=True; the "
    "other norm types.{more}"
)

_add(
    "scion",
    """
    p = p * (1 - lr * weight_decay)
    d = d + momentum * (g - d)
    """
    + _SCION_LMO.format(d="d"),
    defaults=dict(lr=1e-3, momentum=0.1, scale=1.0, weight_decay=0.0),
    state=dict(d=0.0),
    reference_kwargs=dict(lr=2e-2, momentum=0.5, scale=2.0, weight_decay=0.1),
    hyper=dict(lr=2e-2, momentum=0.5, scale=2.0, weight_decay=0.1),
    states=dict(d="d"),
    shapes=_SCION_SHAPES,
    rtol=_NS_RTOL,
    doc="SCION(lr, momentum, scale, weight_decay) with " + _SCION_DOC.format(more=""),
)

_add(
    "scionlight",
    """
    p = p * (1 - lr * weight_decay)
    grad_buffer = (1 - momentum) * grad_buffer + g
    """
    + _SCION_LMO.format(d="grad_buffer"),
    defaults=dict(lr=1e-3, momentum=0.1, scale=1.0, weight_decay=0.0),
    state=dict(grad_buffer=0.0),
    reference_kwargs=dict(lr=2e-2, momentum=1.0, scale=2.0, weight_decay=0.1),
    hyper=dict(lr=2e-2, momentum=1.0, scale=2.0, weight_decay=0.1),
    shapes=_SCION_SHAPES,
    rtol=_NS_RTOL,
    doc="SCIONLight(lr, momentum, scale, weight_decay) with "
    + _SCION_DOC.format(
        more=" SCIONLight keeps its momentum in p.grad (scaled by 1 - momentum after each "
        "step, for a caller that does not zero gradients); the rule keeps that buffer as the "
        "state grad_buffer, for a caller that does. The zoo test replaces p.grad every step, "
        "so it compares momentum=1 (no carry-over); "
        "test_scionlight_keeps_momentum_in_the_gradient_buffer compares momentum < 1 "
        "against gradients accumulated into p.grad."
    ),
)

# --- Matrix-preconditioned --------------------------------------------------------------------

_SOAP_REFRESH = "(step > 1) and (mod(step - 1, precondition_frequency) == 0)"
_SOAP = """
    gp = transpose(QL) @ g @ QR
    m1 = beta1 * m + (1 - beta1) * g
    v1 = beta2 * v + (1 - beta2) * gp**2
    u = QL @ ((transpose(QL) @ m1 @ QR) / (sqrt(v1) + eps)) @ transpose(QR)
    s = maximum(step - 1, 1)
    step_size = lr * sqrt(1 - beta2**s) / (1 - beta1**s)
    p = where(step == 1, p, (p - step_size * u) * (1 - lr * weight_decay))
    m = where(step == 1, m, m1)
    L = shampoo_beta * L + (1 - shampoo_beta) * g @ transpose(g)
    R = shampoo_beta * R + (1 - shampoo_beta) * transpose(g) @ g
    PL = where(REFRESH, sort_perm(diag(transpose(QL) @ L @ QL)), eye(rows))
    PR = where(REFRESH, sort_perm(diag(transpose(QR) @ R @ QR)), eye(cols))
    v = where(step == 1, v, transpose(PL) @ v1 @ PR)
    QL = where(step == 1, eigh(L + 1e-30 * eye(rows)), where(REFRESH, qr(L @ QL @ PL), QL))
    QR = where(step == 1, eigh(R + 1e-30 * eye(cols)), where(REFRESH, qr(R @ QR @ PR), QR))
    """.replace("REFRESH", _SOAP_REFRESH)

_add(
    "soap",
    _SOAP,
    defaults=dict(
        lr=3e-3,
        beta1=0.95,
        beta2=0.95,
        shampoo_beta=0.95,
        weight_decay=0.01,
        precondition_frequency=10.0,
        eps=1e-8,
    ),
    state=dict(m=0.0, v=0.0, L="zeros(rows, rows)", R="zeros(cols, cols)", QL="eye(rows)", QR="eye(cols)"),
    reference_kwargs=dict(
        lr=1e-2,
        betas=(0.9, 0.8),
        shampoo_beta=0.7,
        weight_decay=0.1,
        precondition_frequency=2,
        max_precondition_dim=6,
    ),
    hyper=dict(
        lr=1e-2,
        beta1=0.9,
        beta2=0.8,
        shampoo_beta=0.7,
        weight_decay=0.1,
        precondition_frequency=2.0,
        max_matrix_dim=6,
    ),
    states=dict(m="exp_avg", v="exp_avg_sq"),
    # fp32 eigh and QR of the factors against the reference's float64: the second moment
    # (in the eigenbasis) and the parameters within 1e-5, more where eigenvalues lie close.
    state_rtol=1e-5,
    basis_states="GG",
    # Every factor full rank from the first gradient on (an eigenbasis of a singular factor is
    # not unique there): square, or the long side over the dimension limit.
    shapes=((7, 5), (5, 7), (5, 5), (3, 8)),
    rtol=1e-5,
    doc="SOAP(lr, betas, shampoo_beta, weight_decay, precondition_frequency, eps) on 2-D parameters: "
    "Adam in the eigenbasis of Shampoo's factors L and R (matrix states), eigh on the first step, a QR "
    "power iteration every precondition_frequency steps with the columns sorted by estimated eigenvalue "
    "(sort_perm) and the second moment permuted with them. correct_bias=True, normalize_gradient=False, "
    "merge_dims=False as by default; max_precondition_dim is the optimizer's max_matrix_dim. "
    "The reference's factors of 1-D and 3-D tensors (none, or one per "
    "dimension) differ from the rule's 2-D view, so the zoo gives it matrices only (soap_dims keeps "
    "one factor per dimension).",
)

# SOAP on tensors of any order: one factor per dimension (the reference's merge_dims=False).
_SOAP_DIMS = """
    gp = modes(g, transpose(Q))
    m1 = beta1 * m + (1 - beta1) * g
    v1 = beta2 * v + (1 - beta2) * gp**2
    u = modes(modes(m1, transpose(Q)) / (sqrt(v1) + eps), Q)
    s = maximum(step - 1, 1)
    step_size = lr * sqrt(1 - beta2**s) / (1 - beta1**s)
    p = where(step == 1, p, (p - step_size * u) * (1 - lr * weight_decay))
    m = where(step == 1, m, m1)
    F = shampoo_beta * F + (1 - shampoo_beta) * gram(g)
    P = where(REFRESH, sort_perm(diag(transpose(Q) @ F @ Q)), eye_dims())
    v = where(step == 1, v, modes(v1, transpose(P)))
    Q = where(step == 1, eigh(F + 1e-30 * eye_dims()), where(REFRESH, qr(F @ Q @ P), Q))
    """.replace("REFRESH", _SOAP_REFRESH)

_add(
    "soap_dims",
    _SOAP_DIMS,
    reference="soap",
    defaults=dict(ZOO["soap"].rule.hyper),
    state=dict(m=0.0, v=0.0, F="zeros(dims)", Q="eye(dims)"),
    reference_kwargs=ZOO["soap"].reference_kwargs,
    hyper=ZOO["soap"].hyper,
    states=dict(m="exp_avg", v="exp_avg_sq"),
    state_rtol=1e-5,
    basis_states="GG",
    # Every factor full rank from the first gradient on (each dimension at most the product
    # of the others: a matrix square), orders 2 to 4, a dimension of 8 over the limit.
    shapes=((4, 3, 5), (3, 8, 2), (5, 5), (2, 3, 2, 3)),
    rtol=1e-5,
    doc="SOAP as above on tensors of any order: one factor per dimension ('zeros(dims)', gram, "
    "modes), each dimension's basis sorted and refreshed as the 2-D rule's; the reference's "
    "merge_dims=False and precondition_1d=False (the zoo gives it no 1-D tensor: the rule "
    "would keep a factor there).",
)

_SHAMPOO_REFRESH = "mod(step, preconditioning_compute_steps) == 0"
_SHAMPOO = """
    gs = (1 - 2 * maximize) * g
    gm = gs + momentum * (where(step == 1, g, momentum_buffer) - gs)
    gd = gm + (1 - weight_decouple) * weight_decay * p
    L = where(step == 1, matrix_eps * eye(rows), L) + gd @ transpose(gd)
    R = where(step == 1, matrix_eps * eye(cols), R) + transpose(gd) @ gd
    PL = where(REFRESH, inv_root(L, 4), PL)
    PR = where(REFRESH, inv_root(R, 4), PR)
    momentum_buffer = PL @ gd @ PR
    p = p * (1 - weight_decouple * weight_decay * where(fixed_decay > 0, 1, lr)) - lr * momentum_buffer
    """.replace("REFRESH", _SHAMPOO_REFRESH)

_add(
    "shampoo",
    _SHAMPOO,
    defaults=dict(
        lr=1e-3,
        momentum=0.0,
        weight_decay=0.0,
        weight_decouple=0.0,
        fixed_decay=0.0,
        preconditioning_compute_steps=1.0,
        matrix_eps=1e-6,
        maximize=0.0,
    ),
    # The inverse roots start at zero, as the reference's: no step before the first refresh.
    state=dict(
        momentum_buffer=0.0,
        L="zeros(rows, rows)",
        R="zeros(cols, cols)",
        PL="zeros(rows, rows)",
        PR="zeros(cols, cols)",
    ),
    reference_kwargs=dict(
        lr=1e-1, momentum=0.5, weight_decay=0.1, preconditioning_compute_steps=2, matrix_eps=1.0
    ),
    hyper=dict(lr=1e-1, momentum=0.5, weight_decay=0.1, preconditioning_compute_steps=2.0, matrix_eps=1.0),
    states=dict(L="pre_cond_0", R="pre_cond_1"),
    # 2-D parameters only (below). matrix_eps=1 keeps the factors' condition numbers small at
    # the refreshes (steps 2 and 4, two and four gradients in): the rule's inverse roots are
    # fp32 eigh, the reference's float64 SVD, the same function of a positive-definite
    # matrix, so they differ by fp32's rounding times that conditioning. Over 900 seeds the
    # parameters agreed to 1.2e-7 at worst and L, R to 1.7e-7 (the default rtol, 1e-6,
    # holds); PL, PR and momentum_buffer (an inverse root's fp32 error, 1.4e-6 at worst) are
    # not compared. With matrix_eps=1e-6, 7 x 13's 13 x 13 factor two gradients in is nearly
    # singular, and fp32 puts the parameters 1.5e-5 and momentum_buffer 2e-4 from float64.
    shapes=((7, 13), (13, 7), (5, 5), (6, 4)),
    doc="Shampoo(lr, momentum, weight_decay, weight_decouple, fixed_decay, "
    "preconditioning_compute_steps, matrix_eps, maximize; the flags as 0/1) on 2-D parameters: "
    "factors L = matrix_eps * I + sum of G G^T and R = matrix_eps * I + sum of G^T G of the "
    "gradient G after momentum and weight decay (matrix states, the reference's pre_cond_0 and "
    "pre_cond_1), their inverse 4th roots (the reference's SVD, the rule's eigh: the same for "
    "these positive-definite factors) refreshed when step % preconditioning_compute_steps == 0 "
    "and zero before the first refresh, the update PL @ G @ PR, which is also the momentum "
    "buffer that the next gradient is lerped towards (the first towards the gradient itself, "
    "before maximize negates it, as the reference's clone does). The zoo compares momentum, "
    "coupled weight decay, the refresh interval and matrix_eps; decoupled and fixed decay and "
    "maximize were compared by hand, not by the zoo test. The reference's 1-D tensors have one "
    "[n, n] factor and root 2 (the rule's view [1, n] gives them two, root 4: telling them "
    "from a [1, n] matrix needs the number of dimensions), and an N-D tensor one factor per "
    "dimension with root 2N, so the zoo gives it matrices only; a side over max_matrix_dim "
    "(8192) has no factor in the rule, the reference has no limit.",
)

_SCALABLE_SHAMPOO = """
    gs = (1 - 2 * maximize) * g
    L0 = where(step == 1, matrix_eps * eye(rows), L)
    R0 = where(step == 1, matrix_eps * eye(cols), R)
    L = where(mod(step, statistics_compute_steps) == 0, beta2 * L0 + (1 - beta2) * gs @ transpose(gs), L0)
    R = where(mod(step, statistics_compute_steps) == 0, beta2 * R0 + (1 - beta2) * transpose(gs) @ gs, R0)
    PL = where(mod(step, preconditioning_compute_steps) == 0, inv_root(L, 4), PL)
    PR = where(mod(step, preconditioning_compute_steps) == 0, inv_root(R, 4), PR)
    graft_stat = where(graft_type == 2, graft_stat + gs**2,
                       where(graft_type == 3, beta2 * graft_stat + (1 - beta2) * gs**2, graft_stat))
    graft_dir = where((graft_type == 2) or (graft_type == 3), gs / (sqrt(graft_stat) + diagonal_eps),
                      where(graft_type == 4, sign(gs), gs))
    mult = where(decoupled_learning_rate > 0, 1, lr)
    shampoo = (PL @ gs @ PR) * mult
    scale = where(graft_type == 0, 1, norm(mult * graft_dir) / (norm(shampoo) + 1e-16))
    graft_grad = mult * graft_dir + (1 - decoupled_weight_decay) * weight_decay * p
    shampoo_grad = shampoo * scale + (1 - decoupled_weight_decay) * weight_decay * p
    wm = where(moving_average_for_momentum > 0, 1 - beta1, 1)
    momentum = beta1 * momentum + wm * shampoo_grad
    graft_momentum = beta1 * graft_momentum + wm * graft_grad
    mu = where(step >= start_preconditioning_step, momentum, graft_momentum)
    nest = beta1 * mu + wm * where(step >= start_preconditioning_step, shampoo_grad, graft_grad)
    upd = where(nesterov > 0, nest, mu)
    p = p * (1 - decoupled_weight_decay * lr * weight_decay) - where(decoupled_learning_rate > 0, lr, 1) * upd
    """

_add(
    "scalableshampoo",
    _SCALABLE_SHAMPOO,
    defaults=dict(
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        moving_average_for_momentum=0.0,
        weight_decay=0.0,
        decoupled_weight_decay=0.0,
        decoupled_learning_rate=1.0,
        start_preconditioning_step=25.0,
        preconditioning_compute_steps=1000.0,
        statistics_compute_steps=1.0,
        graft_type=1.0,
        nesterov=1.0,
        diagonal_eps=1e-10,
        matrix_eps=1e-6,
        maximize=0.0,
    ),
    state=dict(
        momentum=0.0,
        graft_momentum=0.0,
        graft_stat=0.0,
        L="zeros(rows, rows)",
        R="zeros(cols, cols)",
        PL="eye(rows)",
        PR="eye(cols)",
    ),
    reference_kwargs=dict(
        lr=3e-2,
        betas=(0.8, 0.9),
        weight_decay=0.1,
        start_preconditioning_step=3,
        preconditioning_compute_steps=2,
        graft_type=3,
        matrix_eps=1.0,
        shape_interpretation=False,
        use_svd=True,
    ),
    hyper=dict(
        lr=3e-2,
        beta1=0.8,
        beta2=0.9,
        weight_decay=0.1,
        start_preconditioning_step=3.0,
        preconditioning_compute_steps=2.0,
        graft_type=3.0,
        matrix_eps=1.0,
    ),
    # As Shampoo's: fp32 eigh against float64 SVD, matrix_eps=1 for well-conditioned
    # factors at the refreshes (steps 2 and 4). Over 200 seeds the parameters agreed to
    # 2.5e-7 at worst (the default rtol, 1e-6, holds); momentum, fed by the inverse roots,
    # reached 8e-7 and is not compared.
    shapes=((7, 13), (13, 7), (5, 5), (6, 4)),
    doc="ScalableShampoo(lr, betas, moving_average_for_momentum, weight_decay, "
    "decoupled_weight_decay, decoupled_learning_rate, start_preconditioning_step, "
    "preconditioning_compute_steps, statistics_compute_steps, graft_type (0-4), nesterov, "
    "diagonal_eps, matrix_eps, maximize; the flags as 0/1) with use_svd=True and "
    "shape_interpretation=False, on 2-D parameters whose sides are at most block_size (512): "
    "statistics beta2 * L + (1 - beta2) * G G^T from matrix_eps * I, "
    "inverse 4th roots every preconditioning_compute_steps (the identity before), the update "
    "grafted to the norm of the SGD, AdaGrad, RMSProp or sign graft, momentum (graft "
    "momentum before start_preconditioning_step) and Nesterov. The zoo compares the RMSProp "
    "graft with coupled decay and Nesterov; the other grafts, nesterov=False, the moving "
    "average, decoupled decay and learning rate, statistics_compute_steps and maximize were "
    "compared by hand (one seed each, 6e-7 or less). Not covered: the default use_svd=False, "
    "whose coupled Schur-Newton iteration stops at a residual of 1e-3 and adds a ridge of "
    "matrix_eps times a random power-iteration estimate of the largest eigenvalue. In "
    "float64, against use_svd=True after five steps of this configuration, its parameters "
    "are 1.5-5% apart (the ridge is then the largest eigenvalue itself); with "
    "matrix_eps=1e-6, 3e-6 to 4e-5, and 2e-4 to 3% on a 64 x 32 tensor whose 64 x 64 factor "
    "is nearly singular two gradients in (3 seeds). The rule language has no coupled "
    "Schur-Newton inverse root. Not covered either: the default shape_interpretation=True "
    "(merging small dimensions: a tensor of at most block_size elements becomes 1-D and is "
    "not preconditioned) and splitting sides over block_size into blocks, each with its own "
    "factors (no blocks in the rule language); pre_conditioner_type other than ALL and "
    "inverse_exponent_override (the root is a literal 4); 1-D tensors, which the reference "
    "grafts only and the rule's view [1, n] preconditions; N-D tensors (a factor per "
    "dimension, root 2N); and a tensor with a side over 8192, which the reference leaves "
    "whole to the graft and the rule preconditions on its other side.",
)

# Kron's preconditioner refresh: a counter of the steps since the last one reaches
# 1 / prob (the reference's update_counter, one number per tensor here).
_KRON_UPDATE = "(prob > 0) and ((update_counter + 1) * prob >= 1)"
# The lines both factor forms share: momentum, the fit's target, the refresh probability
# and the balancing of the left and right factors {L} and {R}.
_KRON_PRELUDE = """
    tiny = 1.1754943508222875e-38  # the reference's eps (bfloat16's smallest normal)
    gs = (1 - 2 * maximize) * g
    gd = gs + (1 - weight_decouple) * weight_decay * p
    momentum_buffer = momentum * momentum_buffer + (1 - momentum) * gd
    m = momentum_buffer / (1 - momentum**step)
    target = momentum_into_precondition_update * m + (1 - momentum_into_precondition_update) * gd
    prob = clamp(update_prob_max * exp(-update_prob_decay * (step - 1 - update_prob_flat_start)),
                 update_prob_min, update_prob_max)
    nl = amax(abs({L}))
    nr = amax(abs({R}))
    V = randn()
    coin = rand_step()
    {L} = where(UPDATE and (coin < balance_prob), {L} * (sqrt(nl * nr) / nl), {L})
    {R} = where(UPDATE and (coin < balance_prob), {R} * (sqrt(nl * nr) / nr), {R})
"""
# Their common end: the refresh counter, the update {u} clipped to an RMS of 1.1, weight decay.
_KRON_CLOSE = """    update_counter = where(UPDATE, 0, update_counter + 1)
    u = {u}
    u = u * minimum(1.1 / (sqrt(mean(u**2)) + 1e-6), 1)
    p = p - lr * (u + weight_decouple * weight_decay * p)
    """
_KRON = (
    _KRON_PRELUDE.format(L="QL", R="QR")
    + """    A = QL @ target @ transpose(QR)
    B = transpose(solve_lower(transpose(QR), transpose(solve_lower(transpose(QL), V))))
    AL = A @ transpose(A)
    BL = B @ transpose(B)
    SL = (AL + BL) / amax(abs(AL + BL))
    xl = SL @ (SL @ argmax_onehot(diag(SL @ SL)))
    boundl = amax(abs(AL + BL)) * norm(SL @ xl) / norm(xl)
    QL = where(UPDATE, QL - triu(precondition_lr * (AL - BL)) / (boundl + tiny) @ QL, QL)
    AR = transpose(A) @ A
    BR = transpose(B) @ B
    SR = (AR + BR) / amax(abs(AR + BR))
    xr = SR @ (SR @ argmax_onehot(diag(SR @ SR)))
    boundr = amax(abs(AR + BR)) * norm(SR @ xr) / norm(xr)
    QR = where(UPDATE, QR - triu(precondition_lr * (AR - BR)) / (boundr + tiny) @ QR, QR)
"""
    + _KRON_CLOSE.format(u="transpose(QL) @ QL @ m @ transpose(QR) @ QR")
).replace("UPDATE", _KRON_UPDATE)

_add(
    "kron",
    _KRON,
    defaults=dict(
        lr=1e-3,
        momentum=0.9,
        weight_decay=0.0,
        weight_decouple=1.0,
        update_prob_max=1.0,
        update_prob_min=0.03,
        update_prob_decay=0.001,
        update_prob_flat_start=500.0,
        momentum_into_precondition_update=1.0,
        precondition_lr=0.1,
        balance_prob=0.01,
        maximize=0.0,
    ),
    state=dict(momentum_buffer=0.0, update_counter=0.0, QL="eye(rows)", QR="eye(cols)"),
    reference_kwargs=dict(
        lr=0.1,
        momentum=0.8,
        weight_decay=0.1,
        pre_conditioner_update_probability=0.5,
        balance_prob=1.0,
        precondition_dtype=torch.float64,
    ),
    reference_group=dict(precondition_lr=0.2),
    hyper=dict(
        lr=0.1,
        momentum=0.8,
        weight_decay=0.1,
        update_prob_max=0.5,
        update_prob_min=0.5,
        balance_prob=1.0,
        precondition_lr=0.2,
    ),
    states=dict(momentum_buffer="momentum_buffer", QL=("Q", 0), QR=("Q", 1)),
    shapes=((7, 5), (5, 7), (4, 4)),
    doc="Kron (PSGD with Kronecker-factored preconditioners: lr, momentum, weight_decay, "
    "weight_decouple, pre_conditioner_update_probability, momentum_into_precondition_update, "
    "balance_prob, maximize; the flags as 0/1) on 2-D parameters, each with two upper "
    "triangular factors QL and QR (matrix states, the reference's Q) as by default "
    "(max_size_triangular=8192, min_ndim_triangular=2, memory_save_mode=None). Debiased "
    "momentum; on a refresh step the Lie-group fit of the factors to the probe V = randn() "
    "(triangular solves for QL^-T V QR^-1, a step of precondition_lr, a param-group key of the "
    "reference, normalised by the reference's two-step power-iteration bound started from the "
    "column of largest norm, argmax_onehot); the update QL^T QL M QR^T QR clipped to an RMS of "
    "1.1, then decoupled weight decay. The refresh follows the reference's deterministic counter: "
    "a refresh when the steps since the last reach 1 / prob, prob = clamp(update_prob_max * "
    "exp(-update_prob_decay * (step - 1 - update_prob_flat_start)), update_prob_min, "
    "update_prob_max), the reference's default schedule, a fixed probability q being "
    "update_prob_max = update_prob_min = q (the reference computes the schedule in fp32, the rule "
    "in fp64: a step where 1 / prob is within fp32 rounding of a whole number may refresh one step "
    "apart). The counter is a state, one number per tensor, the same for every tensor (all step "
    "alike), so the fit runs on refresh steps only. A refresh step balances with probability "
    "balance_prob, as in the reference, from rand_step() (one draw per step, the same for every "
    "tensor) where the reference draws from np.random. "
    "Balancing scales QL and QR by reciprocal numbers, which leaves the preconditioner, and so the "
    "parameters, unchanged to rounding: the zoo compares balance_prob=1 (and 0) with the factors, "
    "the default 0.01 on the parameters only. The reference's probes are torch.randn_like on "
    "torch's generator; the zoo test gives it the rule's own probes, rebuilt in float64 from the "
    "documented generator, and precondition_dtype=torch.float64. memory_save_mode='all_diag' is "
    "the entry kron_all_diag. Not covered: 'one_diag' and 'smart_one_diag' (a diagonal factor on "
    "the longer side, a triangular one on the other), a side over max_size_triangular (diagonal "
    "in the reference; a side over the optimizer's max_matrix_dim has no factor in the rule), 1-D "
    "and N-D tensors (one factor per dimension in the reference): the entry kron_dims, with "
    "diagonal_dims, covers those; mu_dtype and precondition_init_scale (1).",
)

# memory_save_mode="all_diag": each factor a diagonal, one number per row (column) of the
# tensor, fitted by the same step with sums over the other side.
_KRON_ALL_DIAG = (
    _KRON_PRELUDE.format(L="dl", R="dr")
    + """    A = dl * target * dr
    B = V / dl / dr
    al = rowsum(A**2)
    bl = rowsum(B**2)
    ar = colsum(A**2)
    br = colsum(B**2)
    dl = where(UPDATE, dl - precondition_lr * (al - bl) * dl / (amax(abs(al + bl)) + tiny), dl)
    dr = where(UPDATE, dr - precondition_lr * (ar - br) * dr / (amax(abs(ar + br)) + tiny), dr)
"""
    + _KRON_CLOSE.format(u="dl**2 * m * dr**2")
).replace("UPDATE", _KRON_UPDATE)

_add(
    "kron_all_diag",
    _KRON_ALL_DIAG,
    reference="kron",
    defaults=dict(ZOO["kron"].rule.hyper),
    state=dict(momentum_buffer=0.0, update_counter=0.0, dl=1.0, dr=1.0),
    reference_kwargs={**ZOO["kron"].reference_kwargs, "memory_save_mode": "all_diag"},
    reference_group=ZOO["kron"].reference_group,
    hyper=ZOO["kron"].hyper,
    states=dict(momentum_buffer="momentum_buffer", dl=("Q", 0), dr=("Q", 1)),
    shapes=ZOO["kron"].shapes,
    doc="Kron as the kron entry, with memory_save_mode='all_diag': the factors are diagonals dl "
    "and dr (a state per row and one per column, the reference's Q), fitted to the probe by "
    "dl - precondition_lr * (rowsum(A**2) - rowsum(B**2)) * dl / amax(rowsum(A**2) + rowsum(B**2)) "
    "with A = dl * M * dr and B = V / (dl * dr) (and the same by columns), the update "
    "dl**2 * M * dr**2. Balancing, the refresh counter, clipping and weight decay are the kron "
    "entry's.",
)

# N-D tensors: one triangular factor per dimension (the reference's Q list), with Q_i^-T
# applied along each dimension by solve_modes_lower and the factors balanced to their
# geometric mean (prod_dims).
_KRON_DIMS = (
    _KRON_PRELUDE.split("    nl = ")[0]
    + """    nq = amax(abs(Q))
    V = randn()
    coin = rand_step()
    Q = where(UPDATE and (coin < balance_prob), Q * (prod_dims(nq) ** (1 / ndim) / nq), Q)
    A = modes(target, Q)
    B = solve_modes_lower(transpose(Q), V)
    T1 = gram(A)
    T2 = gram(B)
    S = (T1 + T2) / amax(abs(T1 + T2))
    x = S @ (S @ argmax_onehot(diag(S @ S)))
    bound = amax(abs(T1 + T2)) * norm(S @ x) / norm(x)
    Q = where(UPDATE, Q - triu(precondition_lr * (T1 - T2)) / (bound + tiny) @ Q, Q)
"""
    + _KRON_CLOSE.format(u="modes(modes(m, Q), transpose(Q))")
).replace("UPDATE", _KRON_UPDATE)
# (the reference decays tensors of two or more dimensions only)
_KRON_DIMS = "\n    wd = where(ndim >= 2, weight_decay, 0)" + _KRON_DIMS.replace("weight_decay * p", "wd * p")

_add(
    "kron_dims",
    _KRON_DIMS,
    reference="kron",
    defaults=dict(ZOO["kron"].rule.hyper),
    state=dict(momentum_buffer=0.0, update_counter=0.0, Q="eye(dims)"),
    reference_kwargs=ZOO["kron"].reference_kwargs,
    reference_group=ZOO["kron"].reference_group,
    hyper=ZOO["kron"].hyper,
    states={"momentum_buffer": "momentum_buffer", **{f"Q[{i}]": ("Q", i) for i in range(3)}},
    shapes=((3, 4, 5), (2, 3, 4), (4, 4, 2)),
    doc="Kron as the kron entry on 3-D tensors, one upper triangular factor per dimension "
    "('eye(dims)', the reference's Q list): A = modes(M, Q), B = solve_modes_lower(transpose(Q), V) "
    "(V ×ᵢ Qᵢ⁻ᵀ), each factor fitted to gram(A) and gram(B) with the same bound, the update "
    "modes(modes(M, Q), transpose(Q)) (M ×ᵢ QᵢᵀQᵢ), the factors balanced to the geometric mean "
    "of their largest entries, prod_dims(amax(abs(Q))) ** (1 / ndim), weight decay for tensors of "
    "two or more dimensions only. The reference's diagonal factors (sizes 1, over "
    "max_size_triangular, 1-D tensors, memory_save_mode) are the optimizer's diagonal_dims: the "
    "same rule, its values of those dimensions diagonal matrices (tests/optim/test_zoo.py).",
)

NOT_EXPRESSIBLE: dict[str, str] = {
    "adammini": "needs the parameter's name: its blocks (per head, per embedding row, per "
    "tensor) are chosen from names; rowmean and mean cover per-row and per-tensor blocks",
    "distributedmuon": "needs matrix functions: Newton-Schulz over gathered shards",
    "muonclip": "needs matrix functions: Newton-Schulz, and the attention logits for QK-clip",
    "spectralsphere": "needs matrix functions: spectral-norm projection of 2-D parameters",
    "galore": "needs matrix functions: SVD low-rank projection of 2-D gradients",
    "fira": "needs matrix functions: GaLore's SVD projection plus a norm-based residual",
    "lorarite": "needs matrix functions: LoRA factor pairs and their QR/unmagnified bases",
    "ranger21": "needs row reductions: adaptive gradient clipping by unit-wise norms and "
    "gradient centralisation",
    "adashift": "needs a gradient history: a queue of the last keep_num gradients and a "
    "caller-given reduce_func",
    "adahessian": "needs Hessian-vector products: a second backward with create_graph",
    "sophiah": "needs Hessian-vector products: Hutchinson estimates from a second backward",
    "lbfgs": "needs a closure, line search and a history of vectors with dot products across all tensors",
    "bsam": "needs a closure: a perturbed second forward and backward each step",
    "lomo": "needs the model's backward: LOMO updates inside backward hooks",
    "adalomo": "needs the model's backward and row/column reductions (factored moments)",
}


def coverage_table() -> str:
    """The optimizers of pytorch-optimizer 4.1.0 that ``ZOO`` reproduces and those in
    ``NOT_EXPRESSIBLE`` with what each still needs, as markdown."""
    names = sorted({entry.reference for entry in ZOO.values()})
    lines = [
        f"Expressible ({len(names)}): " + ", ".join(f"`{n}`" for n in names) + ".",
        "",
        "| not expressible | missing |",
        "| --- | --- |",
    ]
    lines += [f"| `{name}` | {why} |" for name, why in sorted(NOT_EXPRESSIBLE.items())]
    return "\n".join(lines)


def _demo(steps: int = 3) -> None:
    """Runs every rule (fp32) and its reference (a float64 copy of the model) a few steps on
    a small model and prints the loss before and after and how far apart the parameters end
    (relative error; the two models' gradients differ by their own precision, so this is a
    sanity check, tests/optim/test_zoo.py is the exact comparison)."""
    import copy
    import warnings

    import pytorch_optimizer

    # Masked lanes of the interpreter evaluate log() on padding zeros.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    x = torch.randn(64, 9)
    y = torch.sin(x.sum(1, keepdim=True))
    print(f"{'rule':<20}{'pytorch_optimizer':<20}{'loss':>20}{'rel. error':>12}")
    for name, entry in ZOO.items():
        if entry.fuser_bug:
            print(f"{name:<20}{entry.reference:<20}{'(waits on a fuser bug)':>32}")
            continue
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.Tanh(), torch.nn.Linear(17, 1))
        ref_model = copy.deepcopy(model).double()
        model = model.to(device)
        opt = fuser.compile(entry.rule)(model.parameters(), **entry.hyper)
        ref = pytorch_optimizer.load_optimizer(entry.reference)(
            ref_model.parameters(), **entry.reference_kwargs
        )
        losses = []
        for _ in range(steps):
            for m, o, xx, yy in (
                (model, opt, x.to(device), y.to(device)),
                (ref_model, ref, x.double(), y.double()),
            ):
                loss = torch.nn.functional.mse_loss(m(xx), yy)
                o.zero_grad()
                loss.backward()
                o.step(lambda loss=loss: loss.item())  # (AliG's step size is the loss's)
                if m is model:
                    losses.append(loss.item())
        err = max(
            ((p.detach().double().cpu() - q.detach()).norm() / q.detach().norm()).item()
            for p, q in zip(model.parameters(), ref_model.parameters())
        )
        print(f"{name:<20}{entry.reference:<20}{losses[0]:>9.4f} -> {losses[-1]:<8.4f}{err:>12.1e}")
    print(f"{len(ZOO)} rules; {len(NOT_EXPRESSIBLE)} optimizers of pytorch_optimizer are not expressible:")
    for name, why in NOT_EXPRESSIBLE.items():
        print(f"  {name}: {why}")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--table"]:
        print(coverage_table())
    else:
        _demo()
