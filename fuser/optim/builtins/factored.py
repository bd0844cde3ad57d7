"""Factored second moments: Adafactor and CAME keep one running mean of the squared gradient
per row and one per column of each matrix of a tensor's 2-D view, and rebuild the
per-element estimate as their outer product over the mean of that matrix's rows.

Both take ``view="batched"`` by default, as their references factor tensors: the last two
dimensions are a matrix, the leading ones a batch of them (each matrix its own row and
column means, and its own mean of the rows), while the RMS of the parameter and of the
update stay the whole tensor's. ``view="flatten"`` (the keyword, or a param group's
``"view"`` key) factors ``[shape[0], prod(rest)]`` instead. A 1-D tensor is one row: the
rules reduce to an unfactored second moment, the column state then holds one number per
element, which is what the references' ``variance`` holds, and the row state is unused.
"""

from __future__ import annotations

import math

import torch

import fuser
from fuser.ir.optim import state_kinds
from fuser.optim.builtins._base import BuiltinOptimizer, Variants, flag
from fuser.runtime.tables import is_batched


class _Factored(BuiltinOptimizer):
    """State dicts keyed as the reference keys them: for a parameter of fewer than 2
    dimensions the column state ``vector[0]`` is saved as ``vector[1]`` and the states of
    ``unused`` (name -> "row" or "col") are left out; on load they are rebuilt as zeros,
    which the rule does not read for one row. Row and column states are reshaped to
    ``_reduced_shape`` on load when their sizes agree."""

    vector: tuple[str, str]
    unused: dict[str, str]

    def state_dict(self) -> dict:
        sd = super().state_dict()
        params = [p for group in self.param_groups for p in group["params"]]
        col, key = self.vector
        for index, st in sd["state"].items():
            if params[index].dim() < 2 and col in st:  # a new dict: st may be the live state
                st = {k: v for k, v in st.items() if k != col and k not in self.unused}
                sd["state"][index] = {**st, key: sd["state"][index][col]}
        return sd

    def load_state_dict(self, state_dict) -> None:
        saved_ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        id_to_param = dict(zip(saved_ids, (p for group in self.param_groups for p in group["params"])))
        col, key = self.vector
        kinds = {
            col: "col",
            **self.unused,
            **{s: k for s, k in state_kinds(self.rule).items() if k in ("row", "col")},
        }
        state = {}
        for pid, st in state_dict["state"].items():
            st, p = dict(st), id_to_param.get(pid)
            view = self._view_of_param(p) if p is not None else "flatten"
            if p is not None and key in st:
                st[col] = st.pop(key)
                for name, kind in self.unused.items():
                    st[name] = torch.zeros(
                        self._reduced_shape(p, kind, view), dtype=st[col].dtype, device=st[col].device
                    )
            for name, kind in kinds.items():
                # Another size is refused, with the sizes, at the next step.
                if p is not None and torch.is_tensor(st.get(name)):
                    shape = self._reduced_shape(p, kind, view)
                    if st[name].numel() == math.prod(shape):
                        st[name] = st[name].reshape(shape)
            state[pid] = st
        super().load_state_dict({**state_dict, "state": state})


# --- Adafactor (torch.optim.Adafactor) --------------------------------------------------------
# Shazeer & Stern 2018 as torch writes it: beta2_t = 1 - step**beta2_decay, relative step
# size min(lr, 1/sqrt(step)) scaled by RMS(p), eps1 clamping the row mean and the variance,
# update clipped to RMS d, decoupled decay lr * weight_decay. For one row (1-D tensors)
# col_var is torch's `variance`.
adafactor = fuser.rule(
    """
    d_g = g - 2 * maximize * g
    beta2t = step ** beta2_decay
    alpha = maximum(eps2, norm(p) / sqrt(numel)) * minimum(lr, 1 / sqrt(step))
    row_var = row_var + beta2t * (rowmean(d_g**2) - row_var)
    col_var = col_var + beta2t * (colmean(d_g**2) - col_var)
    var = where(rows > 1, row_var * col_var / maximum(mean(row_var), eps1), col_var)
    u = d_g * rsqrt(maximum(var, eps1 * eps1))
    p = p * (1 - lr * weight_decay) - alpha / maximum(1, norm(u) / (sqrt(numel) * d)) * u
""",
    name="adafactor",
    hyper=dict(
        lr=1e-2,
        beta2_decay=-0.8,
        eps1=1.1920928955078125e-07,
        eps2=1e-3,
        d=1.0,
        weight_decay=0.0,
        maximize=0.0,
    ),
    state=dict(row_var=0.0, col_var=0.0),
)


def _eps1(group: dict) -> float:
    """``eps[0]``, or when it is None the machine epsilon of the group's first parameter's
    dtype (torch takes that of the first parameter with a gradient)."""
    eps1 = group["eps"][0]
    return torch.finfo(group["params"][0].dtype).eps if eps1 is None else eps1


class Adafactor(_Factored):
    """Drop-in for ``torch.optim.Adafactor``: the same keywords, defaults, checks, update and
    state keys (``step``; ``row_var`` of shape ``[*lead, rows, 1]`` and ``col_var`` of shape
    ``[*lead, 1, cols]`` for a parameter of shape ``[*lead, rows, cols]``; ``variance`` for a
    1-D one in ``state_dict()``), so checkpoints move both ways for parameters of every rank.

    ``view="batched"`` (the default) factors as torch does: the last two dimensions are a
    matrix, the leading ones a batch of them. ``view="flatten"`` factors
    ``[shape[0], prod(rest)]`` instead (``row_var`` of shape ``[shape[0], 1, ...]``,
    ``col_var`` of shape ``[1, *shape[1:]]``), whose states of 3-D and larger parameters
    do not move to torch's. ``eps=(None, ...)`` takes the machine epsilon of each param
    group's first parameter's dtype. In ``optimizer.state`` a 1-D parameter's ``variance``
    is ``col_var`` beside an unused one-element ``row_var``.
    """

    rule = adafactor
    vector = ("col_var", "variance")
    unused = dict(row_var="row")
    hyper_from = dict(eps1=_eps1, eps2=lambda group: group["eps"][1])

    def __init__(
        self,
        params,
        lr=1e-2,
        beta2_decay=-0.8,
        eps=(None, 1e-3),
        d=1.0,
        weight_decay=0.0,
        *,
        foreach=None,
        maximize=False,
        state_dtype=None,
        grad_attr="grad",
        stochastic_rounding=False,
        seed=0,
        static=False,
        master_weights=None,
        view="batched",
    ):
        if torch.is_tensor(lr) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not 0.0 >= beta2_decay:
            raise ValueError(f"beta2_decay should be <= 0 but is: {beta2_decay}")
        if eps[0] is not None and not 0.0 <= eps[0]:
            raise ValueError(f"epsilon1 should be >= 0 but is: {eps[0]}")
        if not 0.0 <= eps[1]:
            raise ValueError(f"epsilon2 should be >= 0 but is: {eps[1]}")
        if not 1.0 <= d:
            raise ValueError(f"Clipping threshold d should be >= 1 but is: {d}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight_decay should be >= 0 but is: {weight_decay}")
        defaults = dict(
            lr=lr,
            beta2_decay=beta2_decay,
            eps=eps,
            d=d,
            weight_decay=weight_decay,
            foreach=foreach,
            maximize=maximize,
        )
        self._init_builtin(
            params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static, master_weights, view
        )

    def _reduced_shape(self, p: torch.Tensor, kind: str, view: str = "flatten") -> tuple[int, ...]:
        """torch's shapes: ``[*lead, rows, 1]`` and ``[*lead, 1, cols]`` (batched), or
        ``[rows, 1, ...]`` and ``[1, *shape[1:]]`` (flatten), ``variance``'s ``p.shape``
        for the columns of a 1-D tensor."""
        if p.dim() < 2:
            return tuple(p.shape) if kind == "col" else (1,)
        if is_batched(p.shape, view):
            lead = tuple(p.shape[:-2])
            return (*lead, p.shape[-2], 1) if kind == "row" else (*lead, 1, p.shape[-1])
        if kind == "row":
            return (p.shape[0],) + (1,) * (p.dim() - 1)
        return (1, *p.shape[1:])


# --- CAME (Luo et al. 2023, pytorch-optimizer 4.1.0's CAME) ---------------------------------
# Adafactor's factored second moment of g**2 + eps1 (no bias correction), the update clipped
# to RMS clip_threshold, momentum of it, then a factored second moment of the residual
# (update - momentum)**2 + eps2 whose inverse root is the confidence scaling the momentum.
# One row (1-D tensors) is the reference's unfactored case: exp_avg_sq_col is its
# exp_avg_sq and the momentum steps unscaled.
_CAME_TEXT = """
    d_g = g - 2 * maximize * g
    d_g = d_g + (1 - weight_decouple) * weight_decay * p
    p = p * (1 - weight_decouple * weight_decay * (fixed_decay + (1 - fixed_decay) * lr))
    sq = d_g**2 + eps1
    exp_avg_sq_row = beta2 * exp_avg_sq_row + (1 - beta2) * rowmean(sq)
    exp_avg_sq_col = beta2 * exp_avg_sq_col + (1 - beta2) * colmean(sq)
    v = where(rows > 1, exp_avg_sq_row * exp_avg_sq_col / mean(exp_avg_sq_row), exp_avg_sq_col)
    {second_moment}
    u = u / maximum(norm(u) / sqrt(numel) / clip_threshold, 1)
    exp_avg = exp_avg + (1 - beta1) * (u - exp_avg)
    res = (u - exp_avg)**2 + eps2
    exp_avg_res_row = beta3 * exp_avg_res_row + (1 - beta3) * rowmean(res)
    exp_avg_res_col = beta3 * exp_avg_res_col + (1 - beta3) * colmean(res)
    res_v = exp_avg_res_row * exp_avg_res_col / mean(exp_avg_res_row)
    p = p - lr * where(rows > 1, rsqrt(res_v), 1) * exp_avg
"""
_CAME_HYPER = dict(
    lr=2e-4,
    beta1=0.9,
    beta2=0.999,
    beta3=0.9999,
    weight_decay=0.0,
    weight_decouple=1.0,
    fixed_decay=0.0,
    clip_threshold=1.0,
    eps1=1e-30,
    eps2=1e-16,
    maximize=0.0,
)
_CAME_STATE = dict(
    exp_avg=0.0, exp_avg_sq_row=0.0, exp_avg_sq_col=0.0, exp_avg_res_row=0.0, exp_avg_res_col=0.0
)

came = fuser.rule(
    _CAME_TEXT.format(second_moment="u = d_g * rsqrt(v)"),
    name="came",
    hyper=_CAME_HYPER,
    state=_CAME_STATE,
)

# ams_bound: the running maximum of sqrt(v), divided by beta2 under the inverse root.
came_ams_bound = fuser.rule(
    _CAME_TEXT.format(
        second_moment="exp_avg_sq_hat = maximum(exp_avg_sq_hat, sqrt(v))\n"
        "    u = d_g * rsqrt(exp_avg_sq_hat / beta2)"
    ),
    name="came_ams_bound",
    hyper=_CAME_HYPER,
    state=dict(_CAME_STATE, exp_avg_sq_hat=0.0),
)


def _ams_bound_key(group: dict) -> tuple:
    return (bool(group.get("ams_bound", False)),)


class CAME(_Factored):
    """CAME (Luo et al. 2023, "Confidence-guided Adaptive Memory Efficient Optimization"):
    pytorch-optimizer 4.1.0's ``CAME``, with its keywords, defaults, update and state keys
    (``exp_avg``, ``exp_avg_sq_row``/``_col`` and ``exp_avg_res_row``/``_col`` for a 2-D
    parameter, ``exp_avg_sq`` for a 1-D one in ``state_dict()``, ``exp_avg_sq_hat`` with
    ``ams_bound``).

    Differences from the reference: the gradient is read, never negated or decayed in place;
    ``step`` is counted per parameter (not per group); the unused diagnostic ``RMS`` state
    is not kept; ``clip_threshold``, ``eps1``, ``eps2`` and ``maximize`` are param-group
    keywords (the reference reads the constructor's values for every group).

    ``view="batched"`` (the default) factors as the reference does: the last two dimensions
    are a matrix, the leading ones a batch of them (``exp_avg_sq_row`` of shape
    ``[*lead, rows]``, ``exp_avg_sq_col`` of shape ``[*lead, cols]``); ``view="flatten"``
    factors ``[shape[0], prod(rest)]`` instead.
    """

    rule = came
    variants = Variants("ams_bound", _ams_bound_key, {(False,): came, (True,): came_ams_bound})
    hyper_from = dict(weight_decouple=flag("weight_decouple"), fixed_decay=flag("fixed_decay"))
    vector = ("exp_avg_sq_col", "exp_avg_sq")
    unused = dict(exp_avg_sq_row="row", exp_avg_res_row="row", exp_avg_res_col="col")

    def __init__(
        self,
        params,
        lr=2e-4,
        betas=(0.9, 0.999, 0.9999),
        weight_decay=0.0,
        weight_decouple=True,
        fixed_decay=False,
        clip_threshold=1.0,
        ams_bound=False,
        eps1=1e-30,
        eps2=1e-16,
        maximize=False,
        foreach=None,
        *,
        state_dtype=None,
        grad_attr="grad",
        stochastic_rounding=False,
        seed=0,
        static=False,
        master_weights=None,
        view="batched",
    ):
        if lr is not None and lr < 0.0:
            raise ValueError(f"learning rate must be positive. ({lr} > 0)")
        _check_came_betas(betas)
        for value, name in ((weight_decay, "weight_decay"), (eps1, "eps1"), (eps2, "eps2")):
            if value < 0.0:
                raise ValueError(f"{name} must be non-negative")
        defaults = dict(
            lr=lr,
            foreach=foreach,
            betas=tuple(betas),
            weight_decay=weight_decay,
            weight_decouple=weight_decouple,
            fixed_decay=fixed_decay,
            ams_bound=ams_bound,
            eps1=eps1,
            eps2=eps2,
            clip_threshold=clip_threshold,
            maximize=maximize,
        )
        self._init_builtin(
            params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static, master_weights, view
        )

    def load_state_dict(self, state_dict) -> None:
        # The reference keeps clip_threshold and maximize on the optimizer, not in its groups.
        groups = [{**self.defaults, **group} for group in state_dict["param_groups"]]
        super().load_state_dict({**state_dict, "param_groups": groups})


def _check_came_betas(betas) -> None:
    """pytorch-optimizer's checks and messages: beta1, beta2 in [0, 1), beta3 in [0, 1]."""
    if len(betas) != 3:
        raise ValueError(f"betas must have 3 values, not {len(betas)}")
    for i, beta in enumerate(betas):
        high = "1.0]" if i == 2 else "1.0)"
        if not (0.0 <= beta <= 1.0 if i == 2 else 0.0 <= beta < 1.0):
            raise ValueError(f"beta{i + 1} must be in the range [0.0, {high}")
