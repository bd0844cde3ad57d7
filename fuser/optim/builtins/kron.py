"""PSGD Kron (Xi-Lin Li 2015–2024, "Preconditioned Stochastic Gradient Descent"): each
tensor's momentum, preconditioned by a Kronecker product of one factor per dimension,
``P = (Q_1ᵀ Q_1) ⊗ … ⊗ (Q_kᵀ Q_k)``, each ``Q_i`` upper triangular (or diagonal where its
dimension is large), fitted now and then from a random probe ``V`` by the Lie-group step
of PSGD. heavyball 3.2.1's ``PSGDKron`` keywords, defaults and math.

The momentum (one ``foreach`` lerp per param group) and the matrix work of a step run in
torch, the matrix work batched over the tensors of one shape: the probes, the fit of the
factors (products, batched triangular solves, the power iteration that bounds each step)
and ``P m``. The last phase, heavyball's trust-region clip of the
update and decoupled weight decay, is the fuser rule ``psgd_kron`` (one launch for every
tensor), which reads the preconditioned update from the state ``update``.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import fuser
from fuser.optim.builtins._base import BuiltinOptimizer, check_betas, check_lr, check_nonneg
from fuser.runtime.distributed import DTensor, check, like_param, local, local_pair
from fuser.runtime.plans import TORCH_DTYPES
from fuser.runtime.wholes import Owners, gather, published, scatter

# heavyball's trust_region_clip_ (lerp 0.9, scale 1.5): tanh near zero, log growth beyond,
# then clamped to [-2, 2].
psgd_kron = fuser.rule(
    """
    x = update / 1.5
    clipped = clamp(1.5 * (0.1 * sign(x) * log1p(abs(x)) + 0.9 * tanh(x)), -2, 2)
    u = where(trust_region > 0, clipped, update)
    p = p * (1 - lr * weight_decay) - lr * u
""",
    name="psgd_kron",
    hyper=dict(lr=1e-3, weight_decay=0.0, trust_region=1.0),
    state=dict(update=0.0),
)

_EPS32 = torch.finfo(torch.float32).eps
_TINY32 = torch.finfo(torch.float32).tiny
_MEMORY_MODES = (None, "one_diag", "smart_one_diag", "one_triu", "all_diag")


class _Default:
    """heavyball's ``use_default``: a keyword left to the optimizer's own choice."""

    def __repr__(self) -> str:
        return "use_default"


use_default = _Default()


def precond_update_prob_schedule(max_prob=1.0, min_prob=0.03, decay=0.999, flat_start=1000):
    """heavyball's default schedule of the probability of fitting the preconditioner at
    the ``n``-th step: ``max_prob`` for ``flat_start`` steps, then decaying by ``decay``
    a step down to ``min_prob``."""

    def prob(n: int) -> float:
        return max(min_prob, max_prob * decay ** max(n - flat_start, 0))

    return prob


def probe(seed: int, step: int, index: int, shape, device="cpu") -> torch.Tensor:
    """The random probe ``V`` (standard normal, fp32) that ``PSGDKron(seed=seed)`` draws for
    the parameter at position ``index`` (counted over the param groups in order, as in the
    state_dict) at its param group's step ``step`` (1 on the first step): a
    ``torch.Generator`` on ``device`` seeded from the three numbers. 0-D parameters have
    shape ``(1,)``. The same on every device of one type."""
    key = hashlib.blake2b(f"psgd_kron:{seed}:{step}:{index}".encode(), digest_size=8).digest()
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(key, "little") & ((1 << 63) - 1))
    return torch.randn(tuple(shape), generator=gen, device=device, dtype=torch.float32)


# --- factors ---------------------------------------------------------------------------


def factor_kinds(shape, max_size: int, min_ndim: int, memory_save_mode) -> tuple[bool, ...]:
    """For each dimension of ``shape`` (a 0-D tensor is ``(1,)``), whether its factor is
    triangular (True) or diagonal, as heavyball's ``init_Q_exprs`` chooses."""
    shape = tuple(shape) or (1,)
    diag = [False] * len(shape)
    largest = len(shape) - 1 - max(range(len(shape)), key=lambda i: (shape[::-1][i], -i))
    if memory_save_mode == "one_diag":
        diag[largest] = True
    elif memory_save_mode == "smart_one_diag":
        ordered = sorted(shape)
        if len(shape) >= 2 and ordered[-1] > ordered[-2]:
            diag[largest] = True
    elif memory_save_mode == "one_triu":
        ranks = sorted(range(len(shape)), key=lambda i: (shape[i], i))
        diag = [ranks.index(i) != 0 for i in range(len(shape))]
    elif memory_save_mode == "all_diag":
        diag = [True] * len(shape)
    return tuple(
        not (size == 1 or size > max_size or len(shape) < min_ndim or d) for size, d in zip(shape, diag)
    )


def init_scale(group: dict, g: torch.Tensor) -> float:
    """The factors' starting scale (their product's): ``precond_init_scale`` as given, or
    heavyball's heuristic ``(mean(g**4) ** (-1/8) * precond_init_scale_scale) **
    precond_init_scale_power`` (power 0.5 unless given) from the first gradients ``g``."""
    scale = group["precond_init_scale"]
    if scale is None:
        x = g.detach().double().abs().clamp(min=1e-12)
        root = math.exp(-(torch.logsumexp(4 * x.log().flatten(), 0).item() - math.log(x.numel())) / 8)
        power = group["precond_init_scale_power"]
        scale = (root * group["precond_init_scale_scale"]) ** (0.5 if power is None else power)
        if not (math.isfinite(scale) and scale > 0 and bool(torch.isfinite(g).all()) and bool(g.any())):
            raise ValueError(
                "PSGDKron: the first gradient of a parameter is all zeros or not finite, so "
                "precond_init_scale=None cannot set the preconditioner's scale; pass precond_init_scale=0.1"
            )
    elif not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"PSGDKron: precond_init_scale={scale} must be positive and finite")
    return float(scale)


def initial_factors(shape, kinds, scale: float, device) -> list[torch.Tensor]:
    """Each factor ``scale ** (1 / ndim)`` times the identity (a vector of ones where
    diagonal)."""
    shape = tuple(shape) or (1,)
    s = scale ** (1 / len(shape))
    return [
        s * (torch.eye(d, device=device) if tri else torch.ones(d, device=device))
        for d, tri in zip(shape, kinds)
    ]


def _along(x: torch.Tensor, dim: int):
    """``x`` ``[N, *shape]`` as ``[N, rows, shape[dim]]`` (that dimension last), and the
    way back."""
    moved = x.movedim(dim + 1, -1)
    flat = moved.reshape(x.shape[0], -1, moved.shape[-1])
    return flat, lambda y: y.reshape(moved.shape).movedim(-1, dim + 1)


def apply_factor(q: torch.Tensor, x: torch.Tensor, dim: int, transpose: bool = False) -> torch.Tensor:
    """``Q x`` (``Qᵀ x`` with ``transpose``) along dimension ``dim`` of each tensor of the
    batch ``x`` ``[N, *shape]``; ``q`` is ``[N, d, d]`` or ``[N, d]`` (diagonal)."""
    if q.dim() == 2:
        view = [q.shape[0]] + [1] * (x.dim() - 1)
        view[dim + 1] = -1
        return x * q.view(view)
    flat, back = _along(x, dim)
    return back(torch.bmm(flat, q if transpose else q.mT))


def precondition(qs: list[torch.Tensor], m: torch.Tensor) -> torch.Tensor:
    """``P m``: each factor's ``Qᵀ Q`` along its dimension."""
    for i, q in enumerate(qs):
        m = apply_factor(q, apply_factor(q, m, i), i, transpose=True)
    return m


def max_eigenvalue(a: torch.Tensor, iterations: int) -> torch.Tensor:
    """The largest eigenvalue of each symmetric PSD matrix of ``a`` ``[N, d, d]``: power
    iterations on ``a²`` from its largest row, as heavyball's ``max_eigenvalue_spd``."""
    norms, idx = a.norm(dim=-1).max(dim=-1)
    norms = norms.clamp(min=_TINY32)
    x = a.gather(-2, idx[:, None, None].expand(-1, 1, a.shape[-1])).squeeze(-2) / norms[:, None]
    a = a / norms[:, None, None]

    def mv(v):
        return torch.bmm(a, torch.bmm(a, v[:, :, None])).squeeze(-1)

    for _ in range(iterations):
        x = F.normalize(mv(x), dim=-1)
    return (x * mv(x)).sum(-1).sqrt() * norms


def fit_factors(qs, lbs, g, v, hp) -> tuple[list, list]:
    """One PSGD step of every factor of a batch: ``qs`` (``[N, d, d]`` triangular, ``[N, d]``
    diagonal), their running lower bounds ``lbs`` (``[N]`` each), the tensors ``g`` ``[N,
    *shape]`` the preconditioner fits and the probes ``v``; ``hp`` holds ``[N]`` rows of
    ``dampening``, ``precond_lr``, ``lower_bound_beta`` and the number ``power_iterations``.
    Returns the new factors and bounds (heavyball's ``psgd_update_precond``)."""
    n = g.shape[0]
    row = lambda t, like: t.view([n] + [1] * (like.dim() - 1))
    g = g + (row(hp["dampening"], g) + _EPS32 * g.abs()) * v
    # balance: the factors' largest entries to their geometric mean (the product unchanged)
    logs = [q.abs().flatten(1).amax(1).log() for q in qs]
    mean = sum(logs) / len(logs)
    qs = [q * row((mean - lg).exp(), q) for q, lg in zip(qs, logs)]
    a, b = g, v
    for i, q in enumerate(qs):
        a = apply_factor(q, a, i)
        if q.dim() == 2:
            b = apply_factor(1 / q, b, i)
        else:
            flat, back = _along(b, i)
            b = back(torch.linalg.solve_triangular(q, flat, upper=True, left=False))
    new_qs, new_lbs = [], []
    for i, (q, lb) in enumerate(zip(qs, lbs)):
        fa, fb = _along(a, i)[0], _along(b, i)[0]
        if q.dim() == 2:
            t1, t2 = (fa * fa).sum(1), (fb * fb).sum(1)
            ell = (t1 + t2).amax(-1)
            step = q * (t1 - t2)
        else:
            t1, t2 = torch.bmm(fa.mT, fa), torch.bmm(fb.mT, fb)
            ell = max_eigenvalue(t1 + t2, hp["power_iterations"])
            step = torch.bmm((t1 - t2).triu(), q)
        # a running lower bound: a smaller one decays towards it by 1 - lower_bound_beta
        ell = torch.maximum(ell, lb + (ell - lb) * (1 - hp["lower_bound_beta"]))
        new_qs.append(q - step / row(ell, step) * row(hp["precond_lr"], step))
        new_lbs.append(ell)
    return new_qs, new_lbs


# --- the optimizer ---------------------------------------------------------------------

# heavyball keywords fuser takes only at a value that changes nothing: (default, why).
_ONLY = {
    "cautious_weight_decay": (False, "cautious weight decay is not implemented"),
    "merge_dims": (False, "fuser keeps one factor per dimension"),
    "split": (False, "fuser keeps one factor per dimension"),
    "q_dtype": ("float32", "the factors are float32"),
    "storage_dtype": ("float32", "use fuser's state_dtype= for the momentum's dtype"),
    "mars": (False, "MARS is not implemented"),
    "caution": (False, "cautious updates are not implemented"),
    "precond_grad_accum": (False, "gradient accumulation for the fit is not implemented"),
    "finite_differences": (False, "Hessian-vector products are not implemented"),
    "fallback_to_finite_differences": (False, "Hessian-vector products are not implemented"),
    "hvp_interval": (1, "Hessian-vector products are not implemented"),
    "hessian_approx": (False, "Hessian-vector products are not implemented"),
    "compile_step": (False, "fuser compiles its own kernels"),
    "ecc": (None, "error-correcting storage is not implemented"),
    "param_ecc": (None, "error-correcting storage is not implemented"),
    "orig_shapes": (None, "fuser keeps one factor per dimension"),
}

# What each param group keeps for the fit and the momentum (the kernel reads lr,
# weight_decay and the clip).
_GROUP_KEYS = (
    "lr",
    "beta",
    "betas",
    "weight_decay",
    "max_size_triangular",
    "min_ndim_triangular",
    "memory_save_mode",
    "momentum_into_precond_update",
    "warmup_steps",
    "lower_bound_beta",
    "dampening",
    "precond_update_power_iterations",
    "precond_init_scale",
    "precond_init_scale_scale",
    "precond_init_scale_power",
    "precond_lr",
    "update_clipping",
)


def _warm_lr(group: dict) -> float:
    """heavyball's linear warmup: ``lr * t / max(t, warmup_steps + 1)`` at the group's step t."""
    t = max(group.get("step_count", 1), 1)
    return group["lr"] * t / max(t, group["warmup_steps"] + 1)


def _clipping(value) -> str | None:
    if value is use_default or value == "trust_region":
        return "trust_region"
    if value is None:
        return None
    if callable(value) and getattr(value, "__name__", "") == "trust_region_clip_":
        return "trust_region"  # heavyball's own function, with its defaults
    raise ValueError(
        f"PSGDKron: update_clipping={value!r} is not supported; fuser runs heavyball's default "
        "trust_region_clip_ (update_clipping left out) or none (update_clipping=None)"
    )


def check_keywords(given: dict) -> dict:
    """The param-group defaults of PSGDKron's keywords ``given``, checked: heavyball's
    keywords of features fuser lacks raise a ValueError naming them unless left at the
    value that turns them off."""
    for name, (ok, why) in _ONLY.items():
        value = given[name]
        if value is not use_default and value != ok:
            raise ValueError(f"PSGDKron: {name}={value!r} is not supported ({why}); leave it at {ok!r}")
    if given["gradient_clipping"] not in (use_default, None):
        raise ValueError(
            f"PSGDKron: gradient_clipping={given['gradient_clipping']!r} is not supported; clip the "
            "gradients before step() (torch.nn.utils.clip_grad_norm_)"
        )
    check_lr(given["lr"])
    check_nonneg(**{k: given[k] for k in ("weight_decay", "precond_lr", "dampening", "warmup_steps")})
    beta = given["beta"]
    if beta is not None and not 0.0 <= beta < 1.0:
        raise ValueError(f"Invalid beta value: {beta}")
    if given["memory_save_mode"] not in _MEMORY_MODES:
        raise ValueError(
            f"PSGDKron: memory_save_mode must be one of {_MEMORY_MODES}, not {given['memory_save_mode']!r}"
        )
    iterations = given["precond_update_power_iterations"]
    if not isinstance(iterations, int) or iterations < 0:
        raise ValueError(
            f"PSGDKron: precond_update_power_iterations must be a whole number >= 0, not {iterations!r}"
        )
    if not 0.0 <= given["lower_bound_beta"] <= 1.0:
        raise ValueError(f"PSGDKron: lower_bound_beta must be in [0, 1], not {given['lower_bound_beta']}")
    if given["state_dtype"] not in (None, torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"PSGDKron: state_dtype must be a torch float dtype, not {given['state_dtype']!r}")
    defaults = {k: given[k] for k in _GROUP_KEYS}
    defaults["betas"] = check_betas(given["betas"])
    defaults["update_clipping"] = _clipping(given["update_clipping"])
    return defaults


def schedule(prob):
    """``preconditioner_update_probability`` as the step uses it: heavyball's schedule
    where left out, else a number in [0, 1], a function of the step, or None (never)."""
    if prob is use_default:
        return precond_update_prob_schedule()
    if prob is None or callable(prob) or (isinstance(prob, numbers.Real) and 0 <= prob <= 1):
        return prob
    raise ValueError(
        "PSGDKron: preconditioner_update_probability must be in [0, 1], a function of the step, "
        f"or None, not {prob!r}"
    )


@dataclass(frozen=True)
class Member:
    """A tensor of a step's batch: its place in the param groups, its group, the momentum
    it preconditions, what the factors fit (the momentum or the gradient) and where ``P m``
    goes, all whole (a DTensor's on the rank that owns it)."""

    index: int
    p: torch.Tensor
    group: dict
    m: torch.Tensor
    target: torch.Tensor
    update: torch.Tensor


def check_gradient(p: torch.Tensor, g: torch.Tensor, attr: str) -> None:
    """Raise on a gradient the step cannot take (before anything changes)."""
    where = f"PSGDKron: the .{attr} of a parameter of shape {tuple(p.shape)}"
    if g.is_sparse or g.layout != torch.strided:
        raise RuntimeError(f"{where} is sparse; PSGDKron takes dense gradients")
    if g.dtype not in TORCH_DTYPES or p.dtype not in TORCH_DTYPES:
        raise RuntimeError(f"{where} is {g.dtype} (the parameter {p.dtype}); expected fp32, bf16 or fp16")
    if g.shape != p.shape or g.device != p.device:
        raise RuntimeError(f"{where} has shape {tuple(g.shape)} on {g.device}; expected {p.device}")


class PSGDKron(BuiltinOptimizer):
    """PSGD with a Kronecker-factored preconditioner (Xi-Lin Li; kron_torch by Evan Walters
    and Omead Pooladzandi; heavyball 3.2.1's ``PSGDKron``, whose keywords and defaults it
    takes). Each step: the debiased momentum ``exp_avg`` (heavyball's ``exp_avg``); with
    the probability ``preconditioner_update_probability`` (heavyball's schedule: 1 for
    1000 steps, then decaying to 0.03; a number, a function of the step, or None for
    never), drawn deterministically by its running sum, one PSGD fit of each factor ``Q_i``
    from the momentum (or the gradient) and a probe ``V`` (``probe(seed, step, index,
    shape)``); then ``u = P exp_avg`` (``delayed=True``: from the factors before the fit),
    heavyball's trust-region clip (``update_clipping=None``: none), decoupled weight
    decay and ``lr`` with heavyball's linear warmup.

    A dimension gets a triangular factor unless its size is 1 or over
    ``max_size_triangular``, the tensor has fewer than ``min_ndim_triangular`` dimensions,
    or ``memory_save_mode`` (``"one_diag"``, ``"smart_one_diag"``, ``"one_triu"``,
    ``"all_diag"``) makes it diagonal. State keys: ``exp_avg``, ``Q`` (a list of factors),
    ``running_lower_bound`` (one per factor), ``step``. A fit that would leave a factor not
    finite keeps the old one, with a warning. heavyball keywords of features fuser lacks are
    refused with a ValueError naming them unless left at the value that disables them.

    DTensor parameters sharded by rows (FSDP2's ``Shard(0)``, ``torch.chunk``'s split):
    ``exp_avg`` and ``update`` are DTensors like the parameter; the rows of the momentum
    (and of the gradient, where the factors fit it) reach the rank of the shard group that
    owns the parameter by one ``all_to_all`` per shard group and step, that rank alone
    keeps the factors, fits them and computes ``P m``, and one more ``all_to_all`` gives
    every rank its rows of it. ``state_dict()`` (a collective then) holds the factors
    replicated. A replicated DTensor is handled by every rank; other layouts raise a
    RuntimeError.
    """

    rule = psgd_kron
    # GradScaler unscales the gradients itself (and skips the step on an inf): the torch
    # phases read them before the kernel, which alone would know grad_scale.
    _step_supports_amp_scaling = False
    hyper_from = dict(
        lr=_warm_lr,
        trust_region=lambda group: float(group["update_clipping"] == "trust_region"),
    )

    # heavyball 3.2.1's signature, in its order, then fuser's own keywords.
    def __init__(
        self, params, lr=0.001, beta=None, betas=(0.9, 0.999), weight_decay=0.0,
        cautious_weight_decay=False, preconditioner_update_probability=use_default,
        max_size_triangular=2048, min_ndim_triangular=2, memory_save_mode=None,
        momentum_into_precond_update=True, warmup_steps=0, merge_dims=False, split=False,
        store_triu_as_line=True, multi_tensor=True, q_dtype="float32", storage_dtype="float32",
        mars=False, caution=False, mars_gamma=0.0025, delayed=use_default, cached=use_default,
        exp_avg_input=use_default, gradient_clipping=use_default, update_clipping=use_default,
        precond_grad_accum=False, lower_bound_beta=0.9, dampening=1e-9,
        precond_update_power_iterations=2, precond_init_scale=None, precond_init_scale_scale=1,
        precond_init_scale_power=None, precond_lr=0.1, finite_differences=use_default,
        fallback_to_finite_differences=use_default, hvp_interval=use_default,
        hessian_approx=use_default, compile_step=use_default, promote=use_default, ecc=None,
        param_ecc=None, orig_shapes=None, *, state_dtype=None, grad_attr="grad",
        stochastic_rounding=False, seed=0, static=False, **kwargs,
    ):  # fmt: skip
        if kwargs:
            raise TypeError(f"PSGDKron got unknown keyword arguments {sorted(kwargs)}")
        given = {k: v for k, v in locals().items() if k not in ("self", "params", "kwargs", "__class__")}
        defaults = check_keywords(given)
        self._schedule = schedule(preconditioner_update_probability)
        self._prob_step, self._cumulative_prob = 0, 0.0
        self._delayed = delayed is True
        self._momentum = exp_avg_input is not False
        self._grad_source = grad_attr
        self._exp_avg_dtype = state_dtype or torch.float32
        self._seed = int(seed)
        self._owners = Owners("PSGDKron's matrix work")
        # the kernel reads the preconditioned update (state ``update``), kept in fp32
        self._init_builtin(params, defaults, None, grad_attr, stochastic_rounding, seed, static)

    # --- the schedule and the step -----------------------------------------------------

    def _should_fit(self) -> bool:
        """heavyball's ``psgd_should_update``: fit when the running sum of the probabilities
        passes a whole number."""
        self._prob_step += 1
        if self._schedule is None:
            return False
        prob = self._schedule if isinstance(self._schedule, numbers.Real) else self._schedule(self._prob_step)
        before = self._cumulative_prob
        self._cumulative_prob = before + float(prob)
        return int(self._cumulative_prob) > int(before)

    def _kinds(self, group: dict, p: torch.Tensor) -> tuple[bool, ...]:
        return factor_kinds(
            p.shape, group["max_size_triangular"], group["min_ndim_triangular"], group["memory_save_mode"]
        )

    def _items(self) -> list:
        """(index, p, gradient, group) of every parameter with a gradient, checked before
        anything changes (a DTensor's gradient laid out like it)."""
        items, index, attr = [], 0, self._grad_source
        for group in self.param_groups:
            for p in group["params"]:
                g = getattr(p, attr, None)
                if g is not None:
                    check(p, g, f"parameter of shape {tuple(p.shape)}", attr)
                    g = local_pair(p, g, attr)[0]
                    check_gradient(p, g, attr)
                    items.append((index, p, g, group))
                index += 1
        self._owners.update([p for group in self.param_groups for p in group["params"]])
        return items

    def _step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self._precondition()
        for reader, engine in self._step_engines():
            engine.step(reader, loss)
        return loss

    def _precondition(self) -> None:
        """Everything before the kernel: each group's step, the momentum, the fit of the
        factors and ``P m`` into each parameter's ``update``."""
        items = self._items()
        news = self._initial(items)  # may raise: nothing has changed yet
        fit = self._should_fit()
        for group in self.param_groups:
            group["step_count"] = group.get("step_count", 0) + 1
        for p, qs in news.items():
            self._new_state(p, qs)
        items = [item for item in items if item[1].numel() > 0]  # (no elements: its update stays empty)
        grads = [local(g).detach().float() for _, _, g, _ in items]
        if self._momentum:
            self._momentum_step(items, grads)
        members, wholes, updates = self._members(items, grads)
        batches: dict = {}
        for x in members:
            shape = tuple(x.p.shape) or (1,)
            kinds, iterations = self._kinds(x.group, x.p), x.group["precond_update_power_iterations"]
            batches.setdefault((shape, x.m.device, kinds, iterations), []).append(x)
        kept = []  # (batch, which fits were finite): one host sync for the warning, after all
        for (shape, device, _, iterations), batch in batches.items():
            kept.append((batch, self._batch_step(shape, device, iterations, batch, fit)))
        scatter(wholes, updates, [local(self.state[w.p]["update"]) for w in wholes])
        if fit and kept and not bool(torch.stack([ok.all().cpu() for _, ok in kept]).all()):
            bad = [tuple(x.p.shape) for batch, ok in kept for x, fine in zip(batch, ok.tolist()) if not fine]
            warnings.warn(
                f"PSGDKron: the preconditioner's fit was not finite for parameters of shape {bad}; "
                "they keep their factors from before this step",
                RuntimeWarning,
                stacklevel=4,
            )

    def _members(self, items, grads) -> tuple[list, list, list]:
        """The batches' members, whole: a DTensor sharded by rows only on the rank that owns
        it, its momentum (and gradient, where the factors fit that) gathered there (one
        all_to_all per shard group), with a buffer for its ``P m``. Also those DTensors'
        owners and the buffers (None where not this rank's), for the way back."""
        members, wholes, parts, into, updates = [], [], [], [], []
        for (index, p, _, group), g32 in zip(items, grads):
            st = self.state[p]
            m = local(st["exp_avg"]).float() if self._momentum else g32
            target = m if group["momentum_into_precond_update"] else g32
            w = self._owners.get(p)
            if w is None:
                members.append(Member(index, p, group, m, target, local(st["update"])))
                continue
            wholes.append(w)
            parts.append([m] if target is m else [m, target])
            like = dict(size=p.shape, dtype=torch.float32, device=m.device)
            into.append([torch.empty(**like) for _ in parts[-1]] if w.mine else [])
            updates.append(torch.empty(**like) if w.mine else None)
            if w.mine:
                members.append(Member(index, p, group, into[-1][0], into[-1][-1], updates[-1]))
        gather(wholes, parts, into)
        return members, wholes, updates

    def _momentum_step(self, items, grads) -> None:
        """Each ``exp_avg`` to the debiased average of the gradients so far (heavyball's
        ``exp_avg``): one ``foreach`` lerp per param group and device."""
        lists: dict = {}
        for (_, p, _, group), g32 in zip(items, grads):
            eas, gs = lists.setdefault((id(group), p.device), (group, [], []))[1:]
            eas.append(local(self.state[p]["exp_avg"]))
            gs.append(g32.to(self._exp_avg_dtype))
        for group, eas, gs in lists.values():
            beta = group["beta"] if group["beta"] is not None else group["betas"][0]
            torch._foreach_lerp_(eas, gs, (1 - beta) / (1 - beta ** group["step_count"]))

    def _initial(self, items) -> dict:
        """parameter -> its first factors, for those without: as heavyball's buckets, a
        group's new tensors of one shape, dtype and device take one scale from all their
        gradients."""
        fresh: dict = {}
        for _, p, g, group in items:
            if "update" not in self.state.get(p, {}):
                fresh.setdefault((id(group), p.shape, p.dtype, local(p).device), []).append((p, g, group))
        news = {}
        for members in fresh.values():
            group, gs = members[0][2], None
            if group["precond_init_scale"] is None:  # (from the whole gradients: DTensors' gathered)
                whole = [g.full_tensor() if isinstance(g, DTensor) else g for _, g, _ in members]
                gs = torch.cat([g.detach().reshape(-1) for g in whole])
            # (tensors of no elements: no gradient to take a scale from, nothing to precondition)
            scale = 1.0 if gs is not None and gs.numel() == 0 else init_scale(group, gs)
            for p, _, _ in members:
                w = self._owners.get(p)  # (a DTensor sharded by rows: factors on its owner only)
                mine = w is None or w.mine
                news[p] = (
                    initial_factors(p.shape, self._kinds(group, p), scale, local(p).device) if mine else None
                )
        return news

    def _new_state(self, p: torch.Tensor, qs: list) -> None:
        st = self.state[p]
        if qs is not None:
            st["Q"] = qs
            st["running_lower_bound"] = [torch.zeros((), device=local(p).device) for _ in qs]
        fmt = torch.preserve_format
        if self._momentum:
            st["exp_avg"] = torch.zeros_like(p, dtype=self._exp_avg_dtype, memory_format=fmt)
        st["update"] = torch.zeros_like(p, dtype=torch.float32, memory_format=fmt)

    def _batch_step(self, shape, device, iterations: int, batch: list, fit: bool):
        """The factors' fit and ``P m`` of the tensors of one shape (and factor kinds),
        stacked; whether each tensor's fit was finite (a device tensor, None without a fit)."""
        states = [self.state[x.p] for x in batch]
        qs = [torch.stack(q) for q in zip(*(st["Q"] for st in states))]
        m = torch.stack([x.m.reshape(shape) for x in batch])
        u = precondition(qs, m) if self._delayed or not fit else None
        finite = None
        if fit:
            qs, lbs, finite = self._fit(shape, device, iterations, batch, states, qs)
            for j, st in enumerate(states):
                st["Q"] = [q[j].clone() for q in qs]
                st["running_lower_bound"] = [lb[j].clone() for lb in lbs]
        if u is None:
            u = precondition(qs, m)
        for j, x in enumerate(batch):
            x.update.copy_(u[j].reshape(x.update.shape))
        return finite

    def _fit(self, shape, device, iterations: int, batch: list, states: list, qs: list) -> tuple:
        """The fitted factors and bounds of a batch where finite, the old ones elsewhere, and
        where they were finite."""
        lbs = [torch.stack(lb) for lb in zip(*(st["running_lower_bound"] for st in states))]
        target = torch.stack([x.target.reshape(shape) for x in batch])
        v = torch.stack([probe(self._seed, x.group["step_count"], x.index, shape, device) for x in batch])
        hp = {
            k: torch.tensor([x.group[k] for x in batch], device=device, dtype=torch.float32)
            for k in ("dampening", "precond_lr", "lower_bound_beta")
        }
        hp["power_iterations"] = iterations
        new_qs, new_lbs = fit_factors(qs, lbs, target, v, hp)
        finite = torch.stack(
            [torch.isfinite(q.reshape(len(batch), -1)).all(1) for q in new_qs + new_lbs]
        ).all(0)
        keep = lambda new, old: torch.where(finite.view([-1] + [1] * (new.dim() - 1)), new, old)
        return (
            [keep(q, old) for q, old in zip(new_qs, qs)],
            [keep(lb, old) for lb, old in zip(new_lbs, lbs)],
            finite,
        )

    # --- state ---------------------------------------------------------------------------

    def state_dict(self, compressed: bool = False) -> dict:
        """torch's state dict with each parameter's ``exp_avg``, ``Q``,
        ``running_lower_bound`` and ``step``, and the schedule's position under ``psgd``
        (the kernel's ``update`` is rewritten every step, so it is left out)."""
        sd = super().state_dict(compressed)
        for st in sd["state"].values():
            st.pop("update", None)
        self._publish_factors(sd)
        sd["psgd"] = dict(prob_step=self._prob_step, cumulative_prob=self._cumulative_prob)
        return sd

    def _publish_factors(self, sd: dict) -> None:
        """The factors of each DTensor parameter sharded by rows, from its owner, into
        ``sd`` as plain tensors on every rank of its shard group (a collective there)."""
        params = [p for group in self.param_groups for p in group["params"]]
        self._owners.update(params)
        for i, p in enumerate(params):
            w = self._owners.get(p)
            if w is None:
                continue
            st = self.state.get(p, {})
            factors = {k: st[k] for k in ("Q", "running_lower_bound") if k in st}
            factors = published(w, factors if w.mine else {})
            if factors:
                sd["state"].setdefault(i, {}).update(factors)

    def load_state_dict(self, state_dict) -> None:
        restored = self._checked(state_dict)  # raises before anything loads
        psgd = state_dict.get("psgd", {})
        super().load_state_dict(state_dict)
        self._prob_step = int(psgd.get("prob_step", 0))
        self._cumulative_prob = float(psgd.get("cumulative_prob", 0.0))
        self._owners.update([p for group in self.param_groups for p in group["params"]])
        for p, st in restored.items():  # at full precision: torch casts them to the parameter's dtype
            mine, device, w = self.state[p], local(p).device, self._owners.get(p)
            mine.pop("Q", None)
            mine.pop("running_lower_bound", None)
            if w is None or w.mine:  # (a DTensor sharded by rows: its owner keeps the factors)
                mine["Q"] = [q.to(device=device, dtype=torch.float32, copy=True) for q in st["Q"]]
                mine["running_lower_bound"] = [
                    torch.as_tensor(lb).to(device=device, dtype=torch.float32, copy=True).reshape(())
                    for lb in st["running_lower_bound"]
                ]
            if self._momentum:
                ea = like_param(st["exp_avg"], p)  # (laid out like p: scattered, or gathered)
                kw = dict(dtype=self._exp_avg_dtype, copy=True)
                mine["exp_avg"] = ea.to(**kw) if isinstance(ea, DTensor) else ea.to(device=device, **kw)
            mine["update"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)

    def _checked(self, state_dict) -> dict:
        """parameter -> its saved state, each checked against the factors that its shape and
        its loaded group's keywords give."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        params = []
        for group, sg in zip(self.param_groups, saved_groups):
            if len(group["params"]) != len(sg["params"]):
                raise ValueError("loaded state dict has a parameter group of another size")
            loaded = {**group, **{k: sg[k] for k in _GROUP_KEYS if k in sg}}
            params += [(pid, p, loaded) for pid, p in zip(sg["params"], group["params"])]
        restored = {}
        for pid, p, group in params:
            st = state_dict["state"].get(pid)
            if not st:
                continue
            want = [tuple(q.shape) for q in initial_factors(p.shape, self._kinds(group, p), 1.0, "cpu")]
            qs, lbs = st.get("Q"), st.get("running_lower_bound")
            if (
                not isinstance(qs, (list, tuple))
                or [tuple(q.shape) for q in qs] != want
                or not isinstance(lbs, (list, tuple))
                or len(lbs) != len(want)
            ):
                raise ValueError(
                    f"PSGDKron: the saved factors of a parameter of shape {tuple(p.shape)} are not {want} "
                    "(its shape or the group's factor keywords differ)"
                )
            ea = st.get("exp_avg")
            if self._momentum and (not torch.is_tensor(ea) or ea.shape != p.shape):
                raise ValueError(
                    f"PSGDKron: the saved exp_avg of a parameter of shape {tuple(p.shape)} is not that shape"
                )
            restored[p] = st
        return restored


__all__ = ["PSGDKron", "precond_update_prob_schedule", "probe", "psgd_kron", "use_default"]
