"""Loss epilogues compiled into fused ``linear + loss`` with forward and backward.

    ce = fuser.loss('''
        z = cap * tanh(z / cap)
        lse = logsumexp(z)
        loss = lse - z[y] + z_loss * lse**2
    ''', name="softcap_ce_zloss", hyper=dict(cap=30.0, z_loss=1e-4))
    f = fuser.compile(ce)
    loss = f(hidden, weight, target, bias=None, ignore_index=-100, reduction="mean")

Loss functions may also be written in Python and traced: they take ``z`` and ``y`` (and
hyperparameters as keyword-only arguments), use ``z[y]``, fuser's elementwise functions and
the vocabulary reductions below, and return the per-token loss.

``api.py`` holds ``CompiledLoss`` (argument checks, the schedule's choice); ``builtins.py``
the built-in rules (a new loss is a rule there); their execution is ``fuser.runtime.loss``'s.
"""

from fuser.losses.api import CompiledLoss, kernel_sources, make_loss
from fuser.losses.builtins import (
    CROSS_ENTROPY,
    CROSS_ENTROPY_FULL,
    DISTILL_JSD,
    DISTILL_KL,
    DISTILL_REVERSE_KL,
    ENTROPY_REGULARIZED_CROSS_ENTROPY,
    SOFTCAP_CROSS_ENTROPY,
    SOFTCAP_CROSS_ENTROPY_APPROX,
    SOFTCAP_CROSS_ENTROPY_UNSMOOTHED,
    SOFTCAP_CROSS_ENTROPY_UNSMOOTHED_APPROX,
    SOFTCAP_TOKEN_LOGPROBS,
    SOFTCAP_TOKEN_LOGPROBS_ENTROPY,
    TOKEN_LOGPROBS,
    TOKEN_LOGPROBS_ENTROPY,
    cross_entropy,
    distill,
    entropy_regularized_cross_entropy,
    token_logprobs,
)
from fuser.rules.loss import logsumexp
from fuser.rules.loss import vocab_max as max  # noqa: A004 - the rule language's names
from fuser.rules.loss import vocab_mean as mean
from fuser.rules.loss import vocab_sum as sum  # noqa: A004

__all__ = [
    "CROSS_ENTROPY",
    "CROSS_ENTROPY_FULL",
    "CompiledLoss",
    "DISTILL_JSD",
    "DISTILL_KL",
    "DISTILL_REVERSE_KL",
    "ENTROPY_REGULARIZED_CROSS_ENTROPY",
    "SOFTCAP_CROSS_ENTROPY",
    "SOFTCAP_CROSS_ENTROPY_APPROX",
    "SOFTCAP_CROSS_ENTROPY_UNSMOOTHED",
    "SOFTCAP_CROSS_ENTROPY_UNSMOOTHED_APPROX",
    "SOFTCAP_TOKEN_LOGPROBS",
    "SOFTCAP_TOKEN_LOGPROBS_ENTROPY",
    "TOKEN_LOGPROBS",
    "TOKEN_LOGPROBS_ENTROPY",
    "cross_entropy",
    "distill",
    "entropy_regularized_cross_entropy",
    "kernel_sources",
    "logsumexp",
    "make_loss",
    "max",
    "mean",
    "sum",
    "token_logprobs",
]
