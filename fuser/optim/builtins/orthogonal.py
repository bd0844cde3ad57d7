"""Orthogonalised updates: Muon, which replaces each hidden matrix's momentum by its
orthogonal factor (Newton–Schulz), and NorMuon, which also normalises each row of that
factor by a running second moment; both with AdamW for the parameters that are not
matrices."""

from __future__ import annotations

import functools

import torch

import fuser
from fuser.optim.builtins._base import BuiltinOptimizer, Variants, check_betas, check_lr, check_nonneg
from fuser.rules.rule import Rule
from fuser.runtime.tables import is_batched

_MUON = """
    momentum_buffer = momentum * momentum_buffer + (1 - momentum) * g
    u = {update}
    p = p * (1 - lr * weight_decay) - lr * maximum(1, rows / cols) ** 0.5 * orthogonalize(u, steps={steps})
"""


def muon_rule(nesterov: bool = True, ns_steps: int = 5) -> Rule:
    """Muon (Jordan et al. 2024, muon-optimizer 0.1.0's ``muon_update``): momentum, its
    Nesterov mix with the gradient, orthogonalised by ``ns_steps`` Newton–Schulz steps,
    scaled by ``sqrt(max(1, rows / cols))``, with decoupled weight decay. One rule object
    per variant."""
    return _muon_rule(bool(nesterov), int(ns_steps))


@functools.cache
def _muon_rule(nesterov: bool, ns_steps: int) -> Rule:
    update = "g + momentum * (momentum_buffer - g)" if nesterov else "momentum_buffer"
    return fuser.rule(
        _MUON.format(update=update, steps=ns_steps),
        name="muon" if nesterov else "muon_heavy_ball",
        hyper=dict(lr=0.02, momentum=0.95, weight_decay=0.0),
        state=dict(momentum_buffer=0.0),
    )


# The auxiliary AdamW of muon-optimizer's MuonWithAuxAdam (its ``adam_update``).
muon_adamw = fuser.rule(
    """
    exp_avg = beta1 * exp_avg + (1 - beta1) * g
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g**2
    update = (exp_avg / (1 - beta1**step)) / (sqrt(exp_avg_sq / (1 - beta2**step)) + eps)
    p = p * (1 - lr * weight_decay) - lr * update
""",
    name="muon_adamw",
    hyper=dict(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-10, weight_decay=0.0),
    state=dict(exp_avg=0.0, exp_avg_sq=0.0),
)
muon = muon_rule()
muon_heavy_ball = muon_rule(nesterov=False)

# What a group with use_muon=False starts with (MuonWithAuxAdam's defaults).
_AUX_DEFAULTS = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)


def _variant(group: dict) -> tuple:
    if not group.get("use_muon", True):
        return (False,)
    return (True, bool(group.get("nesterov", True)), int(group.get("ns_steps", 5)))


class Muon(BuiltinOptimizer):
    """Muon (Keller Jordan et al. 2024): SGD momentum whose update, for each matrix, is
    replaced by its orthogonal factor, from ``ns_steps`` Newton–Schulz iterations in bf16
    (fp32 accumulation) batched over the matrices of each shape. Keywords and defaults of
    muon-optimizer 0.1.0's ``SingleDeviceMuon``; state key ``momentum_buffer``.

    ``view="flatten"`` (the default, the reference's for conv filters) orthogonalises an
    N-D parameter as the matrix ``[shape[0], prod(rest)]``; ``view="batched"`` (the
    keyword, or a param group's ``"view"`` key) each ``[shape[-2], shape[-1]]`` matrix of
    its leading dimensions on its own, with its own ``sqrt(max(1, rows / cols))``: expert
    weights ``[experts, out, in]``, orthogonalised expert by expert, their products
    batched with every other matrix of that shape.

    Param groups with ``use_muon=False`` are updated by AdamW as ``MuonWithAuxAdam``
    does (its defaults: ``lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0``, for
    the keys such a group leaves out; state keys ``exp_avg``, ``exp_avg_sq``): embeddings,
    the head, norms and biases. One ``step()`` runs both.
    """

    rule = muon
    variants = Variants("use_muon, nesterov, ns_steps", _variant, {}, per_group=True)

    def __init__(
        self,
        params,
        lr=0.02,
        weight_decay=0,
        momentum=0.95,
        *,
        nesterov=True,
        ns_steps=5,
        state_dtype=None,
        grad_attr="grad",
        stochastic_rounding=False,
        seed=0,
        static=False,
        master_weights=None,
        view="flatten",
    ):
        check_lr(lr)
        check_nonneg(weight_decay=weight_decay, momentum=momentum)
        if not isinstance(ns_steps, int) or not 1 <= ns_steps <= 20:
            raise ValueError(f"ns_steps must be a whole number from 1 to 20, not {ns_steps!r}")
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps
        )
        self._init_builtin(
            params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static, master_weights, view
        )

    def _rule_for(self, key: tuple) -> Rule:
        return muon_adamw if key == (False,) else muon_rule(key[1], key[2])

    def add_param_group(self, param_group: dict) -> None:
        if not param_group.get("use_muon", True):
            for k, v in _AUX_DEFAULTS.items():
                param_group.setdefault(k, v)
            param_group["betas"] = check_betas(param_group["betas"])
        else:
            params = param_group["params"]
            params = [params] if torch.is_tensor(params) else list(params)
            flat = [p for p in params if p.dim() < 2]
            if flat:
                raise ValueError(
                    f"Muon orthogonalises matrices, but a param group with use_muon=True holds a "
                    f"{flat[0].dim()}-D parameter of shape {tuple(flat[0].shape)}: put it in a group "
                    "with use_muon=False (AdamW)"
                )
        super().add_param_group(param_group)


# --- NorMuon (Li et al. 2025, pytorch-optimizer 4.1.0's NorMuon) ------------------------------
# Muon's orthogonal factor o, each row divided by the root of a running mean of its squared
# entries (one number per row), then rescaled: to o's Frobenius norm (preserve_norm, with
# Muon's shape factor on lr, or Moonlight's 0.2 * sqrt(max(rows, cols)) with
# use_adjusted_lr), or to RMS 0.2 (match_rms).
_NORMUON = """
    d_g = g - 2 * maximize * g
    d_g = d_g + (1 - weight_decouple) * weight_decay * p
    p = p * (1 - weight_decouple * weight_decay * lr)
    momentum_buffer = momentum * momentum_buffer + (1 - momentum) * d_g
    o = orthogonalize({update}, {ns})
    second_momentum_buffer = beta2 * second_momentum_buffer + (1 - beta2) * rowmean(o**2)
    de_nom = sqrt(second_momentum_buffer) + eps
    o_rows = rownorm(o)
    {scale}
    p = p - lr * scale * o / de_nom
"""
# The norms of o and of the normalised update o / de_nom from o's row norms: each row of
# the update is a row of o divided by one number.
_PRESERVE_NORM = """moonlight = 0.2 * sqrt(maximum(rows, cols))
    lr_ratio = where(use_adjusted_lr > 0, moonlight, maximum(1, rows / cols) ** 0.5)
    scale = lr_ratio * norm(o_rows) / (norm(o_rows / de_nom) + eps)"""
# (rows * cols: the matrix's size, numel in the flatten view, one matrix's in the batched.)
_MATCH_RMS = "scale = 0.2 * sqrt(rows * cols) / (norm(o_rows / de_nom) + eps)"

# Newton–Schulz coefficients by pytorch-optimizer's preset names: one (a, b, c) for every
# iteration. Its schedules of several tuples ("quintic", "polar_express") change the
# coefficients between iterations, which orthogonalize() does not.
NS_COEFFS = {"original": (3.4445, -4.7750, 2.0315)}


def coefficients(weights) -> tuple[float, float, float]:
    """One ``(a, b, c)`` from a preset name, a tuple, or a schedule of one tuple."""
    if isinstance(weights, str):
        if weights.lower() not in NS_COEFFS:
            raise ValueError(
                f"ns_coeffs={weights!r}: fuser runs one (a, b, c) for every Newton-Schulz step; "
                f"presets with one are {tuple(NS_COEFFS)}"
            )
        return NS_COEFFS[weights.lower()]
    if len(weights) == 3 and all(isinstance(w, (int, float)) for w in weights):
        return tuple(float(w) for w in weights)
    weights = list(weights)
    if len(weights) == 1 and len(weights[0]) == 3:
        return tuple(float(w) for w in weights[0])
    raise ValueError(
        f"ns_coeffs={weights!r}: fuser runs one (a, b, c) for every Newton-Schulz step, "
        "not a schedule of several"
    )


def normuon_rule(
    nesterov: bool = True,
    ns_steps: int = 5,
    coeffs: tuple = NS_COEFFS["original"],
    update_scale: str = "preserve_norm",
) -> Rule:
    """NorMuon (Li et al. 2025) as pytorch-optimizer 4.1.0 writes it: Muon's momentum and
    Newton–Schulz factor, a per-row second moment of that factor (``beta2``) dividing each
    row, rescaled by ``update_scale``; decoupled or L2 weight decay. One rule object per
    variant."""
    if update_scale not in ("preserve_norm", "match_rms"):
        raise ValueError(f"update_scale must be 'preserve_norm' or 'match_rms', not {update_scale!r}")
    return _normuon_rule(bool(nesterov), int(ns_steps), tuple(float(c) for c in coeffs), update_scale)


@functools.cache
def _normuon_rule(nesterov: bool, ns_steps: int, coeffs: tuple, update_scale: str) -> Rule:
    update = "d_g + momentum * (momentum_buffer - d_g)" if nesterov else "momentum_buffer"
    ns = f"steps={ns_steps}"
    if coeffs != NS_COEFFS["original"]:
        ns += ", a={!r}, b={!r}, c={!r}".format(*coeffs)
    preserve = update_scale == "preserve_norm"
    name = "normuon" + ("" if nesterov else "_heavy_ball") + ("" if preserve else "_match_rms")
    hyper = dict(
        lr=0.02, momentum=0.95, beta2=0.95, weight_decay=0.0, weight_decouple=1.0, eps=1e-10, maximize=0.0
    )
    if preserve:
        hyper["use_adjusted_lr"] = 0.0
    return fuser.rule(
        _NORMUON.format(update=update, ns=ns, scale=_PRESERVE_NORM if preserve else _MATCH_RMS),
        name=name,
        hyper=hyper,
        state=dict(momentum_buffer=0.0, second_momentum_buffer=0.0),
    )


# NorMuon's AdamW groups (its use_muon=False branch): bias-corrected Adam, decoupled or L2
# weight decay applied before the moments.
normuon_adamw = fuser.rule(
    """
    d_g = g - 2 * maximize * g
    d_g = d_g + (1 - weight_decouple) * weight_decay * p
    p = p * (1 - weight_decouple * weight_decay * lr)
    exp_avg = beta1 * exp_avg + (1 - beta1) * d_g
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * d_g**2
    de_nom = sqrt(exp_avg_sq) / sqrt(1 - beta2**step) + eps
    p = p - lr / (1 - beta1**step) * exp_avg / de_nom
""",
    name="normuon_adamw",
    hyper=dict(
        lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-10, weight_decay=0.0, weight_decouple=1.0, maximize=0.0
    ),
    state=dict(exp_avg=0.0, exp_avg_sq=0.0),
)
normuon = normuon_rule()
normuon_heavy_ball = normuon_rule(nesterov=False)
normuon_match_rms = normuon_rule(update_scale="match_rms")


def _normuon_variant(group: dict) -> tuple:
    if not group.get("use_muon", True):
        return (False,)
    return (
        True,
        bool(group["nesterov"]),
        int(group["ns_steps"]),
        coefficients(group["ns_coeffs"]),
        group["update_scale"],
    )


def _normuon_beta2(group: dict) -> float:
    """The row second moment's ``beta2`` of a NorMuon group, ``betas[1]`` of an AdamW group."""
    return group["beta2"] if group.get("use_muon", True) else check_betas(group["betas"])[1]


def _flag(keyword: str):
    return lambda group: float(bool(group[keyword]))


class NorMuon(BuiltinOptimizer):
    """NorMuon (Li et al. 2025, "NorMuon: Making Muon more efficient and scalable"): Muon's
    orthogonalised momentum with each row divided by the root of a running mean of its
    squares, rescaled to the orthogonal factor's norm (``update_scale="preserve_norm"``) or
    to RMS 0.2 (``"match_rms"``). Keywords, defaults, checks and state keys of
    pytorch-optimizer 4.1.0's ``NorMuon``: ``momentum_buffer`` and
    ``second_momentum_buffer`` (shape ``[rows, 1]``) in ``use_muon=True`` groups,
    ``exp_avg``, ``exp_avg_sq`` in ``use_muon=False`` (AdamW) groups, which take
    ``adamw_lr``, ``adamw_betas``, ``adamw_wd`` and ``adamw_eps`` for the keys they leave
    out. One ``step()`` runs both.

    ``view="flatten"`` (the default, the reference's) takes an N-D parameter as the matrix
    ``[shape[0], prod(rest)]``; ``view="batched"`` (the keyword, or a param group's
    ``"view"`` key) each ``[shape[-2], shape[-1]]`` matrix of its leading dimensions on
    its own (expert weights): its own orthogonal factor, row second moments
    (``second_momentum_buffer`` of shape ``[*lead, rows, 1]``) and norms.

    Differences from the reference: a group without ``use_muon`` is a NorMuon group (the
    reference refuses it) and must hold matrices; ``ns_coeffs`` is one ``(a, b, c)`` for every
    step (a tuple, a schedule of one, or ``"original"``); ``maximize`` is a param-group
    keyword; ``step`` is counted per parameter.
    """

    rule = normuon
    variants = Variants(
        "use_muon, nesterov, ns_steps, ns_coeffs, update_scale", _normuon_variant, {}, per_group=True
    )
    hyper_from = dict(
        beta2=_normuon_beta2,
        weight_decouple=_flag("weight_decouple"),
        use_adjusted_lr=_flag("use_adjusted_lr"),
    )

    def __init__(
        self,
        params,
        lr=2e-2,
        momentum=0.95,
        beta2=0.95,
        weight_decay=0.0,
        weight_decouple=True,
        nesterov=True,
        ns_steps=5,
        ns_coeffs="original",
        update_scale="preserve_norm",
        use_adjusted_lr=False,
        adamw_lr=3e-4,
        adamw_betas=(0.9, 0.95),
        adamw_wd=0.0,
        adamw_eps=1e-10,
        eps=1e-10,
        maximize=False,
        foreach=None,
        *,
        state_dtype=None,
        grad_attr="grad",
        stochastic_rounding=False,
        seed=0,
        static=False,
        master_weights=None,
        view="flatten",
    ):
        check_lr(lr)
        check_lr(adamw_lr)
        check_nonneg(weight_decay=weight_decay, adamw_wd=adamw_wd, adamw_eps=adamw_eps, eps=eps)
        for name, value in (("momentum", momentum), ("beta2", beta2)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in the range [0.0, 1.0), not {value}")
        if not isinstance(ns_steps, int) or not 1 <= ns_steps <= 20:
            raise ValueError(f"ns_steps must be a whole number from 1 to 20, not {ns_steps!r}")
        normuon_rule(update_scale=update_scale)  # checks update_scale
        coefficients(ns_coeffs)
        self._adamw_defaults = dict(
            lr=adamw_lr, betas=check_betas(adamw_betas), eps=adamw_eps, weight_decay=adamw_wd
        )
        defaults = dict(
            lr=lr,
            momentum=momentum,
            beta2=beta2,
            weight_decay=weight_decay,
            weight_decouple=weight_decouple,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_coeffs=ns_coeffs,
            update_scale=update_scale,
            use_adjusted_lr=use_adjusted_lr,
            eps=eps,
            maximize=maximize,
            foreach=foreach,
        )
        self._init_builtin(
            params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static, master_weights, view
        )

    def _rule_for(self, key: tuple) -> Rule:
        return normuon_adamw if key == (False,) else normuon_rule(*key[1:])

    def _reduced_shape(self, p: torch.Tensor, kind: str, view: str = "flatten") -> tuple[int, ...]:
        """The reference's ``second_momentum_buffer``: ``[shape[0], 1]``; batched,
        ``[*lead, rows, 1]``."""
        if is_batched(p.shape, view):
            return (*p.shape[:-1], 1)
        return (p.shape[0], 1)

    def add_param_group(self, param_group: dict) -> None:
        if not param_group.get("use_muon", True):
            for k, v in self._adamw_defaults.items():
                param_group.setdefault(k, v)
            param_group["betas"] = check_betas(param_group["betas"])
        else:
            params = param_group["params"]
            params = [params] if torch.is_tensor(params) else list(params)
            flat = [p for p in params if p.dim() < 2]
            if flat:
                raise ValueError(
                    f"NorMuon orthogonalises matrices, but a param group with use_muon=True holds a "
                    f"{flat[0].dim()}-D parameter of shape {tuple(flat[0].shape)}: put it in a group "
                    "with use_muon=False (AdamW)"
                )
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict) -> None:
        # The reference keeps maximize and foreach on the optimizer, not in its groups.
        groups = [{**self.defaults, **group} for group in state_dict["param_groups"]]
        super().load_state_dict({**state_dict, "param_groups": groups})
