"""Orthogonalised updates: Muon, which replaces each hidden matrix's momentum by its
orthogonal factor (Newton–Schulz), with AdamW for the parameters that are not matrices."""

from __future__ import annotations

import functools

import torch

import fuser
from fuser.optim.builtins._base import BuiltinOptimizer, Variants, check_betas, check_lr, check_nonneg
from fuser.rules.rule import Rule

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
    muon-optimizer 0.1.0's ``SingleDeviceMuon``; state key ``momentum_buffer``. N-D
    parameters are viewed as ``[shape[0], prod(rest)]``.

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
    ):
        check_lr(lr)
        check_nonneg(weight_decay=weight_decay, momentum=momentum)
        if not isinstance(ns_steps, int) or not 1 <= ns_steps <= 20:
            raise ValueError(f"ns_steps must be a whole number from 1 to 20, not {ns_steps!r}")
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps
        )
        self._init_builtin(params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static)

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
