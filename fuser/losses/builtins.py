"""Built-in loss epilogues, each an ordinary fuser rule, and their user-facing callables."""

from __future__ import annotations

import functools

import torch

from fuser.losses.api import CompiledLoss
from fuser.rules.loss import loss

# Cross-entropy, as torch.nn.functional.cross_entropy computes it. Label smoothing spreads
# `label_smoothing` of the target's mass uniformly: (1 - ls) * (lse - z[y]) + ls * (lse - mean(z)).
CROSS_ENTROPY = loss(
    """
    loss = logsumexp(z) - z[y]
""",
    name="cross_entropy",
)

CROSS_ENTROPY_FULL = loss(
    """
    z = z / temperature
    lse = logsumexp(z)
    loss = lse - (1 - label_smoothing) * z[y] - label_smoothing * mean(z) + z_loss * lse**2
""",
    name="cross_entropy_full",
    hyper=dict(label_smoothing=0.0, z_loss=0.0, temperature=1.0),
)

# Logit soft-capping (Gemma 2's final_logit_softcapping) before the temperature.
_SOFTCAP = """
    z = softcap * tanh(z / softcap)
    z = z / temperature
    lse = logsumexp(z)
    loss = lse - (1 - label_smoothing) * z[y] - label_smoothing * mean(z) + z_loss * lse**2
"""
SOFTCAP_CROSS_ENTROPY = loss(
    _SOFTCAP,
    name="softcap_cross_entropy",
    hyper=dict(softcap=30.0, label_smoothing=0.0, z_loss=0.0, temperature=1.0),
)

# The same without label smoothing (what `cross_entropy(softcap=...)` runs when
# `label_smoothing` is 0): its logit gradient is then the softmax term and the target term,
# each times the cap's derivative, which the scaled schedule takes (label smoothing's mean
# of the capped logits would add a term per logit).
_SOFTCAP_UNSMOOTHED = """
    z = softcap * tanh(z / softcap)
    z = z / temperature
    lse = logsumexp(z)
    loss = lse - z[y] + z_loss * lse**2
"""
SOFTCAP_CROSS_ENTROPY_UNSMOOTHED = loss(
    _SOFTCAP_UNSMOOTHED,
    name="softcap_cross_entropy_unsmoothed",
    hyper=dict(softcap=30.0, z_loss=0.0, temperature=1.0),
)

# Both with the cap's tanh through the GPU's one-instruction approximation (`approx_tanh`):
# what `cross_entropy(softcap=..., approx_tanh=True)` runs.
SOFTCAP_CROSS_ENTROPY_APPROX = loss(
    _SOFTCAP.replace("tanh(", "approx_tanh("),
    name="softcap_cross_entropy_approx",
    hyper=dict(softcap=30.0, label_smoothing=0.0, z_loss=0.0, temperature=1.0),
)
SOFTCAP_CROSS_ENTROPY_UNSMOOTHED_APPROX = loss(
    _SOFTCAP_UNSMOOTHED.replace("tanh(", "approx_tanh("),
    name="softcap_cross_entropy_unsmoothed_approx",
    hyper=dict(softcap=30.0, z_loss=0.0, temperature=1.0),
)

# Cross-entropy minus `entropy_coef` times the entropy of softmax(z / temperature): the
# entropy bonus of policy-gradient RL, in one fused pass (the entropy needs the lse first).
ENTROPY_REGULARIZED_CROSS_ENTROPY = loss(
    """
    z = z / temperature
    lse = logsumexp(z)
    entropy = lse - sum(exp(z - lse) * z)
    loss = lse - z[y] - entropy_coef * entropy
""",
    name="entropy_regularized_cross_entropy",
    hyper=dict(entropy_coef=0.01, temperature=1.0),
)

# Per-token log-probabilities of the targets under softmax(z / temperature) (optionally of
# the soft-capped logits) and the entropy of that distribution, for RL objectives. Both hold
# by construction in fp32: lse >= max(z) >= z, so each entropy term p * (lse - z) is >= 0 and
# (with the same rounding of z[y] as of the logits it reduces) z[y] - lse <= 0; the `where`
# keeps the sign should a soft cap's rounding at the target differ by an ulp. No term is
# 0 * (-inf): the logits are finite.
_LOGPROBS = """\
    z = z / temperature
    lse = logsumexp(z)
    d = z[y] - lse
    logp = where(d < 0, d, 0)
"""
_ENTROPY = """\
    entropy = sum(exp(z - lse) * (lse - z))
"""
_CAP = """\
    z = softcap * tanh(z / softcap)
"""
TOKEN_LOGPROBS = loss(_LOGPROBS, name="token_logprobs", hyper=dict(temperature=1.0), outputs=("logp",))
TOKEN_LOGPROBS_ENTROPY = loss(
    _LOGPROBS + _ENTROPY,
    name="token_logprobs_entropy",
    hyper=dict(temperature=1.0),
    outputs=("logp", "entropy"),
)
SOFTCAP_TOKEN_LOGPROBS = loss(
    _CAP + _LOGPROBS,
    name="softcap_token_logprobs",
    hyper=dict(softcap=30.0, temperature=1.0),
    outputs=("logp",),
)
SOFTCAP_TOKEN_LOGPROBS_ENTROPY = loss(
    _CAP + _LOGPROBS + _ENTROPY,
    name="softcap_token_logprobs_entropy",
    hyper=dict(softcap=30.0, temperature=1.0),
    outputs=("logp", "entropy"),
)

# Distillation: a divergence between softmax(t / temperature) of the teacher's logits and
# softmax(z / temperature) of the student's, summed over the vocabulary, plus `hard_weight`
# times the cross-entropy of the student's raw logits on the target (as Liger's
# LigerFusedLinearJSDLoss weighs its hard loss; no temperature**2 factor, as there).
_DISTILL = """\
    s = z / temperature
    u = t / temperature
    lse_s = logsumexp(s)
    lse_t = logsumexp(u)
"""
_HARD = """\
    loss = soft + hard_weight * (logsumexp(z) - z[y])
"""
_KL = "    soft = sum(exp(u - lse_t) * (u - lse_t - s + lse_s))\n"
_REVERSE_KL = "    soft = sum(exp(s - lse_s) * (s - lse_s - u + lse_t))\n"
# The generalised JSD of GKD (Agarwal et al. 2024) for 0 < beta < 1, as Liger's:
# beta * KL(p_t || m) + (1 - beta) * KL(p_s || m) with m = beta * p_t + (1 - beta) * p_s.
# log m from the probabilities, with fp32's smallest normal added: where both underflow, m
# does too and each term is 0 * finite; every exp of a log-probability is at most 1.
# (beta = 0 and 1 are forward and reverse KL in Liger's convention: distill() runs those.)
_JSD = """\
    ls = s - lse_s
    lt = u - lse_t
    ps = exp(ls)
    pt = exp(lt)
    lm = log(beta * pt + (1 - beta) * ps + 1.1754943508222875e-38)
    soft = beta * sum(pt * (lt - lm)) + (1 - beta) * sum(ps * (ls - lm))
"""
DISTILL_KL = loss(_DISTILL + _KL + _HARD, name="distill_kl", hyper=dict(temperature=1.0, hard_weight=0.0))
DISTILL_REVERSE_KL = loss(
    _DISTILL + _REVERSE_KL + _HARD, name="distill_reverse_kl", hyper=dict(temperature=1.0, hard_weight=0.0)
)
DISTILL_JSD = loss(
    _DISTILL + _JSD + _HARD, name="distill_jsd", hyper=dict(beta=0.5, temperature=1.0, hard_weight=0.0)
)
# Without the hard loss (hard_weight=0, distill's default): one vocabulary sweep fewer
# (no logsumexp(z) of the raw logits) and no exp of it in the gradient; module-level names,
# so that `fuser precompile --builtins` finds them.
_SOFT = "    loss = soft\n"
DISTILL_KL_SOFT = loss(_DISTILL + _KL + _SOFT, name="distill_kl_soft", hyper=dict(temperature=1.0))
DISTILL_REVERSE_KL_SOFT = loss(
    _DISTILL + _REVERSE_KL + _SOFT, name="distill_reverse_kl_soft", hyper=dict(temperature=1.0)
)
DISTILL_JSD_SOFT = loss(
    _DISTILL + _JSD + _SOFT, name="distill_jsd_soft", hyper=dict(beta=0.5, temperature=1.0)
)
DISTILL_SOFT = {"kl": DISTILL_KL_SOFT, "reverse_kl": DISTILL_REVERSE_KL_SOFT, "jsd": DISTILL_JSD_SOFT}

RULES = (
    CROSS_ENTROPY,
    CROSS_ENTROPY_FULL,
    SOFTCAP_CROSS_ENTROPY,
    SOFTCAP_CROSS_ENTROPY_UNSMOOTHED,
    SOFTCAP_CROSS_ENTROPY_APPROX,
    SOFTCAP_CROSS_ENTROPY_UNSMOOTHED_APPROX,
    ENTROPY_REGULARIZED_CROSS_ENTROPY,
    TOKEN_LOGPROBS,
    TOKEN_LOGPROBS_ENTROPY,
    SOFTCAP_TOKEN_LOGPROBS,
    SOFTCAP_TOKEN_LOGPROBS_ENTROPY,
    DISTILL_JSD,
    DISTILL_KL,
    DISTILL_REVERSE_KL,
    *DISTILL_SOFT.values(),
)


@functools.cache
def _compiled(name: str) -> CompiledLoss:
    return CompiledLoss(next(r for r in RULES if r.name == name))


def cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    temperature: float = 1.0,
    accumulate_into: str | None = None,
    process_group=None,
    memory: str = "auto",
    approx_tanh: bool = False,
) -> torch.Tensor:
    """Fused ``cross_entropy(hidden @ weight.T + bias, target)`` with autograd, never holding
    the full logits: ``torch.nn.functional.linear_cross_entropy`` where the two overlap.

    ``label_smoothing`` as in torch; ``z_loss`` adds ``z_loss * logsumexp(z)**2`` per token;
    ``softcap`` applies ``softcap * tanh(z / softcap)`` to the logits, then ``temperature``
    divides them. Plain cross-entropy runs the leanest kernel, and a softcap without label
    smoothing a rule of its own (``SOFTCAP_CROSS_ENTROPY_UNSMOOTHED``), which the scaled
    schedule takes. ``approx_tanh=True`` computes the softcap's ``tanh`` with the GPU's
    one-instruction approximation (``fuser.approx_tanh``: relative error within 2**-10.987);
    the default is the exact ``tanh``. With
    ``process_group``, ``weight`` and ``bias`` are this rank's slice of the vocabulary;
    ``memory="lean"`` keeps no logits in memory (see ``CompiledLoss`` for both). A target
    outside ``[0, V)`` that is not ``ignore_index`` (``V``: the global vocabulary with
    ``process_group``) raises a ``ValueError`` naming its position and value before anything
    runs, where ``torch.nn.functional.cross_entropy`` raises an ``IndexError``.
    """
    _check_options(label_smoothing, temperature, softcap, approx_tanh)
    common = dict(
        ignore_index=ignore_index,
        reduction=reduction,
        accumulate_into=accumulate_into,
        process_group=process_group,
        memory=memory,
    )
    extras = dict(label_smoothing=label_smoothing, z_loss=z_loss, temperature=temperature)
    if softcap is not None:
        approx = "_approx" if approx_tanh else ""
        if label_smoothing == 0.0:
            hyper = dict(softcap=softcap, z_loss=z_loss, temperature=temperature)
            return _compiled("softcap_cross_entropy_unsmoothed" + approx)(
                hidden, weight, target, bias, **hyper, **common
            )
        f = _compiled("softcap_cross_entropy" + approx)
        return f(hidden, weight, target, bias, softcap=softcap, **common, **extras)
    if label_smoothing == 0.0 and z_loss == 0.0 and temperature == 1.0:
        return _compiled("cross_entropy")(hidden, weight, target, bias, **common)
    return _compiled("cross_entropy_full")(hidden, weight, target, bias, **common, **extras)


def _check_options(label_smoothing: float, temperature: float, softcap: float | None, approx_tanh: bool):
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], not {label_smoothing}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, not {temperature}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be positive, not {softcap}")
    if approx_tanh and softcap is None:
        raise ValueError(
            "approx_tanh applies to a softcap's tanh: pass softcap= as well, or drop approx_tanh"
        )


def entropy_regularized_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    entropy_coef: float = 0.01,
    temperature: float = 1.0,
    accumulate_into: str | None = None,
    process_group=None,
    memory: str = "auto",
) -> torch.Tensor:
    """Fused ``cross_entropy(z, target) - entropy_coef * entropy(softmax(z))`` per token, with
    ``z = (hidden @ weight.T + bias) / temperature``. Targets are checked as
    ``cross_entropy``'s are."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, not {temperature}")
    return _compiled("entropy_regularized_cross_entropy")(
        hidden,
        weight,
        target,
        bias,
        ignore_index=ignore_index,
        reduction=reduction,
        accumulate_into=accumulate_into,
        process_group=process_group,
        memory=memory,
        entropy_coef=entropy_coef,
        temperature=temperature,
    )


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    ignore_index: int = -100,
    softcap: float | None = None,
    process_group=None,
    memory: str = "auto",
):
    """Per-token ``log softmax(z / temperature)[target]`` of ``z = hidden @ weight.T`` (after
    ``softcap * tanh(z / softcap)`` with ``softcap``), fp32 of ``target``'s shape, 0 where
    ``target`` is ``ignore_index``; with ``entropy=True`` also the entropy of
    ``softmax(z / temperature)`` per token: ``(logp, entropy)``. Both are differentiable (a
    gradient for either, both or one of them), hold no full logits (but under
    ``memory="fast"``, below), and come from
    logits accumulated and kept in fp32 whatever the inputs' dtype: ``logp <= 0`` and
    ``entropy >= 0`` hold in fp32. With ``process_group``, ``weight`` is this rank's slice of
    the vocabulary (as ``cross_entropy`` takes it) and every rank gets every token's values;
    targets are checked as ``cross_entropy``'s are. ``memory="lean"`` (one device) keeps each
    token's reductions from forward and recomputes the logits in backward one slice of
    vocabulary rows at a time: no fp32 ``[V, H]`` buffer and no chunk of every column's
    logits, one more logits product. ``memory="fast"`` (one device) keeps every token's fp32
    logits (``T × V × 4`` bytes) from forward to backward, which computes none again.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, not {temperature}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, not {softcap}")
    if not isinstance(entropy, bool):
        raise TypeError(f"entropy must be True or False, not {entropy!r}")
    name = ("softcap_" if softcap is not None else "") + "token_logprobs" + ("_entropy" if entropy else "")
    hyper = dict(temperature=temperature) | ({} if softcap is None else dict(softcap=softcap))
    out = _compiled(name)(
        hidden, weight, target, ignore_index=ignore_index, process_group=process_group, memory=memory, **hyper
    )
    return out if entropy else out[0]


DISTILL_KINDS = ("jsd", "kl", "reverse_kl")


def _distill_checks(hidden, target, kind, beta, temperature, hard_weight, ignore_index):
    """``distill``'s keywords checked; (target, ignore_index), a target that ignores no
    token where none was given."""
    if kind not in DISTILL_KINDS:
        raise ValueError(f"kind must be one of {DISTILL_KINDS}, not {kind!r}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], not {beta}")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, not {temperature}")
    if not hard_weight >= 0:
        raise ValueError(f"hard_weight must be >= 0, not {hard_weight}")
    if target is None:
        if hard_weight != 0:
            raise ValueError(
                f"hard_weight={hard_weight} weighs the cross-entropy on target: pass target= "
                "(class indices in hidden's leading shape), or leave hard_weight at 0"
            )
        target = torch.zeros(hidden.shape[:-1], dtype=torch.int64, device=hidden.device)
        ignore_index = -1  # (no token is ignored)
    return target, ignore_index


def _distill_rule(kind: str, beta: float, temperature: float, hard_weight: float) -> tuple[str, dict]:
    """The rule's name and hyperparameters: Liger's beta 0 and 1 the forward and reverse KL,
    the twin without the hard loss where ``hard_weight`` is 0."""
    hyper = dict(temperature=temperature)
    if hard_weight != 0:
        hyper["hard_weight"] = hard_weight
    if kind == "jsd" and beta in (0.0, 1.0):
        kind = "kl" if beta == 0.0 else "reverse_kl"
    elif kind == "jsd":
        hyper["beta"] = beta
    return f"distill_{kind}" + ("" if hard_weight != 0 else "_soft"), hyper


def distill(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor | None = None,
    *,
    kind: str = "jsd",
    beta: float = 0.5,
    temperature: float = 1.0,
    hard_weight: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    memory: str = "auto",
) -> torch.Tensor:
    """Fused distillation loss of the student's head ``z = hidden @ weight.T (+ bias)``
    towards the teacher's ``t = teacher_hidden @ teacher_weight.T (+ teacher_bias)`` (the
    teacher's hidden size may differ from the student's), per token, with both logits
    divided by ``temperature``, plus ``hard_weight`` times the cross-entropy of the
    student's raw logits on ``target``:

    - ``"kl"``: forward KL, teacher to student, ``sum p_t (log p_t - log p_s)``;
    - ``"reverse_kl"``: ``sum p_s (log p_s - log p_t)``;
    - ``"jsd"``: Liger's generalised JSD (``LigerFusedLinearJSDLoss``, whose ``beta``
      conventions it keeps): ``beta * KL(p_t || m) + (1 - beta) * KL(p_s || m)`` with
      ``m = beta * p_t + (1 - beta) * p_s`` for ``0 < beta < 1``; ``beta=0`` is the forward
      KL and ``beta=1`` the reverse KL (not the limits, which are 0).

    Tokens whose ``target`` is ``ignore_index`` contribute nothing (with ``target=None``
    none is ignored, and ``hard_weight`` must be 0). ``reduction``: ``"mean"`` over the
    tokens not ignored (0 when all are), ``"sum"``, or ``"none"`` (fp32 per token of
    ``hidden``'s leading shape, 0 where ignored). Gradients reach the student's ``hidden``,
    ``weight`` and ``bias`` only; both heads' logits are accumulated and kept in fp32, in
    chunks of tokens (each rule a fuser loss rule: ``DISTILL_JSD``, ``DISTILL_KL``,
    ``DISTILL_REVERSE_KL``, and with ``hard_weight=0`` their twins without the hard loss,
    ``DISTILL_SOFT[kind]``). ``memory="lean"`` recomputes both heads' logits in backward one
    slice of vocabulary rows at a time (no fp32 ``[V, H]`` buffer, one more product of each);
    ``memory="fast"`` (one device, ``reduction="none"``) keeps every token's, of both heads.
    """
    target, ignore_index = _distill_checks(hidden, target, kind, beta, temperature, hard_weight, ignore_index)
    name, hyper = _distill_rule(kind, beta, temperature, hard_weight)
    return _compiled(name)(
        hidden,
        weight,
        target,
        bias,
        ignore_index=ignore_index,
        reduction=reduction,
        teacher_hidden=teacher_hidden,
        teacher_weight=teacher_weight,
        teacher_bias=teacher_bias,
        memory=memory,
        **hyper,
    )
