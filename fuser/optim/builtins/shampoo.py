"""Shampoo (Gupta et al. 2018) with the conventions of Meta's distributed Shampoo (Shi et al.
2023, facebookresearch/optimizers): blocked Kronecker factors, inverse roots by ``eigh``,
grafting to a diagonal method's step size.

Each parameter (its dimensions merged while they fit in ``max_preconditioner_dim`` with
``use_merge_dims``) is cut into blocks of at most ``max_preconditioner_dim`` along every
dimension. A block of order ``k`` keeps one factor per dimension, ``F_i ← β₂F_i + (1-β₂)
G_(i) G_(i)ᵀ`` (a plain sum where ``β₂ = 1``), ``G_(i)`` the block unfolded along dimension
``i``, and its root ``(F_i / (1-β₂ᵗ) + shift + εI)^(-η/(2k))`` refreshed every
``precondition_frequency`` steps. The Shampoo direction ``Ḡ ×₁ R₁ … ×ₖ Rₖ`` (for a matrix
``R_L Ḡ R_R``) is rescaled, block by block, to the norm of the grafting method's direction.

A step is two fuser launches, each over every parameter, around the matrix work in torch
(one where there are no moments: ``β₁ = 0`` with SGD grafting or none):
the moments' kernel (the filtered gradient ``Ḡ``, the grafting method's second moment and
direction, into per-parameter buffers), then torch in fp32 (the factors' ``G Gᵀ`` and the
Shampoo products by ``torch.bmm``, the roots by batched ``eigh``, each batched over every
factor of one size across the step's tensors; the grafting norms per block), then the
parameters' kernel (the grafted direction, decoupled weight decay, momentum, the step).
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from collections import defaultdict

import torch

import fuser
from fuser.optim.builtins._base import (
    BuiltinOptimizer,
    RuleKernel,
    Variants,
    check_lr,
    own_loaded_states,
    published_state_dict,
    whole_tensor_step,
)
from fuser.runtime.distributed import DTensor
from fuser.runtime.matrix import inv_root_newton
from fuser.runtime.plans import FROM_NAME, MASTER_WEIGHTS, TORCH_DTYPES, parse_options, state_format
from fuser.runtime.quant import master_join

# The moments' kernel, before the matrix work, on a buffer ``p`` whose gradient is the step's
# fp32 gradient: the filtered gradient ``gbar`` (``bias1``: its bias correction), the grafting
# method's second moment (``decay``, ``gain``: its EMA or sum; ``bias2``: Adam's correction)
# and, into ``p``, the grafting direction (``gbar`` itself for SGD grafting or none).
_FILTER = """
    gbar = (beta3 * filtered_grad + (1 - beta3) * g) / bias1
    filtered_grad = beta1 * filtered_grad + (1 - beta1) * g
"""
_GRAFT = """
    grafting = decay * grafting + gain * g**2
    p = {gbar} / (sqrt(grafting / bias2) + grafting_epsilon)
"""
_FILTER_HYPER = dict(beta1=0.9, beta3=0.9, bias1=1.0)
_GRAFT_HYPER = dict(decay=0.999, gain=1e-3, bias2=1.0, grafting_epsilon=1e-8)
shampoo_filter_graft = fuser.rule(
    _FILTER + _GRAFT.format(gbar="gbar"),
    name="shampoo_filter_graft",
    hyper=_FILTER_HYPER | _GRAFT_HYPER,
    state=dict(filtered_grad=0.0, gbar=0.0, grafting=0.0),
)
shampoo_graft = fuser.rule(
    _GRAFT.format(gbar="g"), name="shampoo_graft", hyper=_GRAFT_HYPER, state=dict(grafting=0.0)
)
shampoo_filter = fuser.rule(
    _FILTER + "    p = gbar\n", name="shampoo_filter", hyper=_FILTER_HYPER, state=dict(filtered_grad=0.0)
)

# The parameters' kernel: ``u`` is the grafted direction of the step, written by torch;
# ``weight_decay`` is the group's where it is decoupled, else 0 (then already in the gradient).
shampoo_update = fuser.rule(
    "p = p - lr * (u + weight_decay * p)",
    name="shampoo_update",
    hyper=dict(lr=1e-2, weight_decay=0.0),
    state=dict(u=0.0),
)
_MOMENTUM = """
    d = u + weight_decay * p
    momentum_buffer = momentum * momentum_buffer + (1 - dampening) * d
    p = p - lr * {step}
"""
_HYPER = dict(lr=1e-2, weight_decay=0.0, momentum=0.9, dampening=0.0)
shampoo_update_momentum = fuser.rule(
    _MOMENTUM.format(step="momentum_buffer"),
    name="shampoo_update_momentum",
    hyper=_HYPER,
    state=dict(u=0.0, momentum_buffer=0.0),
)
shampoo_update_nesterov = fuser.rule(
    _MOMENTUM.format(step="((1 - dampening) * d + momentum * momentum_buffer)"),
    name="shampoo_update_nesterov",
    hyper=_HYPER,
    state=dict(u=0.0, momentum_buffer=0.0),
)

GRAFTINGS = ("adam", "adagrad", "rmsprop", "sgd", None)
# The states of the parameter's shape, which state_dtype stores (the factors and roots: fp32).
_ELEMENT_STATES = ("filtered_grad", "grafting", "momentum_buffer")
# The constructor keywords each param group holds (and may override).
GROUP_KEYWORDS = (
    "lr", "betas", "beta3", "epsilon", "momentum", "dampening", "weight_decay", "max_preconditioner_dim",
    "precondition_frequency", "start_preconditioning_step", "inv_root_override", "exponent_multiplier",
    "use_nesterov", "use_bias_correction", "use_decoupled_weight_decay", "grafting", "grafting_beta2",
    "grafting_epsilon", "use_merge_dims",
)  # fmt: skip
_DIAGONAL = ("adam", "adagrad", "rmsprop")
# Keywords of Meta's optimizer that fuser takes only at these values.
_UNSUPPORTED = dict(
    distributed_config=None,
    preconditioner_dtype=None,
    precision_config=None,
    use_pytorch_compile=False,
    track_root_inv_residuals=False,
)


def merge_small_dims(shape, max_dim: int) -> tuple[int, ...]:
    """Meta's ``merge_small_dims``: dimensions of size 1 dropped, then neighbours multiplied
    while the product stays within ``max_dim`` (a tensor of one element: ``(1,)``)."""
    dims = [d for d in shape if d != 1] or [1]
    out = [dims[0]]
    for d in dims[1:]:
        if out[-1] * d <= max_dim:
            out[-1] *= d
        else:
            out.append(d)
    return tuple(out)


def block_shapes(shape, max_dim: int) -> list[tuple[int, ...]]:
    """The blocks of a tensor of ``shape``, in Meta's order (split along dimension 0, then
    each piece along dimension 1, ...): every dimension cut into pieces of ``max_dim``."""
    pieces = [[min(max_dim, d - s) for s in range(0, d, max_dim)] for d in shape]
    return [tuple(b) for b in itertools.product(*pieces)]


def split_blocks(t: torch.Tensor, max_dim: int) -> list[torch.Tensor]:
    """Views of ``t``'s blocks, in ``block_shapes``' order."""
    out = [t]
    for i in range(t.dim()):
        out = [piece for x in out for piece in torch.split(x, max_dim, dim=i)]
    return out


def _unfold(t: torch.Tensor, i: int) -> torch.Tensor:
    """``t`` as the matrix ``[shape[i], numel / shape[i]]``."""
    return t.movedim(i, 0).reshape(t.shape[i], -1)


def _mode_products(blocks: list, roots: list) -> list:
    """Each block multiplied along every dimension by that dimension's (symmetric) root,
    ``B ×₁ R₁ … ×ₖ Rₖ``; batched per dimension over the blocks whose matrix ``[rest, d]``
    has one shape."""
    out = list(blocks)
    for i in range(max((b.dim() for b in out), default=0)):
        jobs = defaultdict(list)
        for j, b in enumerate(out):
            if i < b.dim():
                jobs[(b.numel() // b.shape[i], b.shape[i])].append(j)
        for (rest, d), js in jobs.items():
            x = torch.stack([out[j].movedim(i, -1).reshape(rest, d) for j in js])
            y = torch.bmm(x, torch.stack([roots[j][i] for j in js]))
            for k, j in enumerate(js):
                out[j] = y[k].reshape(out[j].movedim(i, -1).shape).movedim(-1, i)
    return out


def _eigh(mats: torch.Tensor, protected: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eigenvalues and vectors of a stack of symmetric matrices, in the stack's dtype, and
    which succeeded; a failed or non-finite one retried in fp64 (``protected``)."""
    vals = torch.zeros(mats.shape[:-1], dtype=mats.dtype, device=mats.device)
    vecs = torch.zeros_like(mats)
    ok = torch.zeros(len(mats), dtype=torch.bool, device=mats.device)
    try:
        vals, vecs = torch.linalg.eigh(mats)
        ok = torch.isfinite(vals).all(-1) & torch.isfinite(vecs).flatten(1).all(-1)
    except RuntimeError:
        if not protected:
            raise
    if not protected or bool(ok.all()):
        return vals, vecs, ok
    for k in (~ok).nonzero().flatten().tolist():
        try:
            lam, q = torch.linalg.eigh(mats[k].double())
            good = bool(torch.isfinite(lam).all() and torch.isfinite(q).all())
        except RuntimeError:
            good = False
        if good:
            vals[k], vecs[k], ok[k] = lam, q, True
    return vals, vecs, ok


def inverse_roots(mats: torch.Tensor, exponents: torch.Tensor, epsilon: float, protected: bool = True):
    """Meta's ``matrix_inverse_root`` by ``eigh`` over a stack of fp32 factors: eigenvalues
    shifted up by the most negative one (rounding makes a singular factor's slightly
    negative), plus ``epsilon``, raised to ``exponents`` (one per matrix, negative).
    Returns the roots and which matrices succeeded (the others' roots are garbage)."""
    vals, vecs, ok = _eigh(mats, protected)
    lam = vals - torch.clamp(vals.min(-1, keepdim=True).values, max=0.0) + epsilon
    lam = lam.pow(exponents.to(lam)[:, None])
    roots = (vecs * lam[:, None, :]) @ vecs.mT
    ok &= torch.isfinite(roots).flatten(1).all(-1)
    return roots, ok


ROOT_METHODS = ("eigh", "newton")


def newton_roots(mats: torch.Tensor, roots: list[int], epsilon: float, protected: bool = True):
    """``(F + epsilon I)^(-1/r)`` of each factor of a stack by coupled Newton iterations
    (``fuser.runtime.matrix.inv_root_newton``: products only, Meta's ``CoupledNewtonConfig``
    defaults), ``roots`` a whole ``r`` per matrix. A factor whose Cholesky factorisation
    fails in fp32 (singular or indefinite: a 1-D block's sum of fewer outer products than its
    size) goes to ``inverse_roots`` at once, where the iteration would spend its 100 steps
    before failing; so does one the iteration leaves outside its tolerance. Returns the
    roots and which matrices succeeded, as ``inverse_roots`` does."""
    eye = torch.eye(mats.shape[-1], dtype=mats.dtype, device=mats.device)
    ridge = mats + epsilon * eye
    out = torch.full_like(mats, float("nan"))
    regular = (torch.linalg.cholesky_ex(ridge).info == 0).tolist()
    for r in sorted(set(roots)):
        idx = [i for i, q in enumerate(roots) if q == r and regular[i]]
        if idx:
            idx = torch.tensor(idx, device=mats.device)
            out[idx] = inv_root_newton(ridge[idx], r)
    ok = torch.isfinite(out).flatten(1).all(-1)
    bad = (~ok).nonzero().flatten()
    if len(bad):
        exponents = torch.tensor([-1.0 / roots[i] for i in bad.tolist()], device=mats.device)
        out[bad], ok[bad] = inverse_roots(mats[bad], exponents, epsilon, protected)
    return out, ok


def _variant(group: dict) -> tuple:
    heavy = group["momentum"] != 0.0
    return (heavy, heavy and bool(group["use_nesterov"]))


class Shampoo(BuiltinOptimizer):
    """Shampoo (Gupta et al. 2018) as Meta's distributed Shampoo computes it (Shi et al.
    2023; "Scalable second order optimization", Anil et al. 2020): its keywords, their
    order and defaults (``lr=1e-2, betas=(0.9, 1.0), epsilon=1e-12``, ...), its checks and
    its update, step ``t``:

    - ``G ← G + weight_decay * W`` unless ``use_decoupled_weight_decay``;
    - each block's factors ``F ← β₂F + (1-β₂) G Gᵀ`` (a sum where ``β₂ = 1``), zero at
      first, and the grafting method's ``V ← β V + (1-β) G²`` (AdaGrad: a sum);
    - at ``t = start_preconditioning_step`` and every ``precondition_frequency`` steps
      after it, each root ``R = (F / (1-β₂ᵗ) + εI)^(-η/(2k))`` (``k`` the block's order,
      or ``inv_root_override``; ``η`` ``exponent_multiplier``; bias corrected with
      ``use_bias_correction`` and ``β₂ < 1``; eigenvalues first shifted to be
      non-negative) by ``eigh`` in fp32, retried in fp64 (``use_protected_eigh``), and
      where that fails too the root kept, with a warning; roots are zero until then
      (``root_method="newton"``: below);
    - ``Ḡ``: the gradient, or for ``β₁ > 0`` its EMA (``β₃`` for the current step's mix,
      ``beta3=-1``: ``β₁``) divided by ``1 - β₃β₁ᵗ⁻¹`` with ``use_bias_correction``;
    - the grafting direction ``P_g = Ḡ / (√(V / (1-βᵗ)) + grafting_epsilon)`` (bias
      corrected for Adam only; ``Ḡ`` itself for SGD), the Shampoo direction
      ``P_s = Ḡ ×₁ R₁ … ×ₖ Rₖ`` (``R_L Ḡ R_R`` for a matrix); before
      ``start_preconditioning_step`` the step is ``P = P_g``, then
      ``P = P_s ‖P_g‖ / (‖P_s‖ + 1e-16)``, norms per block (``grafting=None``: ``P_s``);
    - ``P ← P + weight_decay * W`` with decoupled weight decay, then momentum
      ``M ← μM + (1-dampening) P`` (``use_nesterov``: ``P ← (1-dampening) P + μM``,
      else ``P ← M``), and ``W ← W - lr P``.

    ``use_merge_dims`` (Meta's default) first merges neighbouring dimensions while their
    product fits in ``max_preconditioner_dim``, so a small matrix (``m n ≤ 1024``) is
    preconditioned as one vector with one factor and root ``-1/2``; pass
    ``use_merge_dims=False`` for the two-sided ``L^{-1/4} Ḡ R^{-1/4}`` of every matrix. A
    dimension over ``max_preconditioner_dim`` is cut into blocks of that size, each with
    its own factors (a 7-long dimension with ``max_preconditioner_dim=4``: 4 + 3). A 1-D
    tensor is a block of order 1 (root ``-1/2``), as in Meta's code.

    Grafting is a keyword here: ``grafting="adam"`` (fuser's default; Meta's default is no
    grafting), ``"adagrad"``, ``"rmsprop"``, ``"sgd"`` or ``None``, with
    ``grafting_beta2`` (Adam, RMSprop) and ``grafting_epsilon``, in place of Meta's
    ``grafting_config`` objects.

    ``root_method="newton"`` (Meta's ``amortized_computation_config=CoupledNewtonConfig()``)
    computes each root ``(F / (1-β₂ᵗ) + εI)^(-1/r)`` by coupled Newton iterations, matrix
    products only, the factors of one size iterating together, each until every entry of its
    residual is within ``1e-6`` (at most 100 iterations, Meta's defaults); it needs
    ``exponent_multiplier=1``. A factor whose fp32 Cholesky factorisation fails, singular
    or indefinite (such as a block's factor over fewer gradient rows than its size: its
    rank is below its order until enough steps have summed), or that the iteration leaves
    outside its tolerance, is computed by ``eigh`` as above. On an H100 the iteration took
    0.19x and 0.64x ``eigh``'s time on stacks of blocks of 1024 and 2048
    (``benchmarks/results/root_probe_2026-12-07_h100.md``).

    pytorch-optimizer 4.1.0's ``ScalableShampoo`` (after Google's ``scalable_shampoo``)
    differs: its factors start at ``matrix_eps * I`` and are never bias corrected, roots
    by SVD or coupled Newton, no preconditioning of 1-D tensors, grafting per tensor and before
    momentum on the grafted step, and lr applied to the momentum; its keywords are not
    taken here.

    State per parameter: ``step``, ``factor_matrices`` and ``inv_factor_matrices`` (one
    list per block of one fp32 ``[d, d]`` per dimension), ``filtered_grad`` (``β₁ > 0``),
    ``grafting`` (the second moment of Adam, AdaGrad, RMSprop), ``momentum_buffer``
    (``momentum > 0``). Differences from Meta's: the step is counted per parameter (Meta
    counts per param group), and the standard ``state_dict`` works (Meta's needs
    ``distributed_state_dict``). A step's kernels take three fp32 buffers the size of each
    parameter, freed when it ends (between steps only the states stay). fuser's
    ``state_dtype`` (``torch.bfloat16``, ``torch.float16``, ``"param"``) stores
    ``filtered_grad``, ``grafting`` and ``momentum_buffer`` (the kernels compute in fp32 and
    round each new value once; the factors and roots stay fp32), ``stochastic_rounding``
    rounds those stores and bf16 parameters stochastically, and ``master_weights`` keeps a
    bf16 parameter's fp32 master (``state["master_lo"]``; L2 decay reads it). Not supported
    (a ValueError): ``distributed_config``, ``precision_config``, ``preconditioner_dtype``,
    ``use_pytorch_compile``, ``track_root_inv_residuals``, 8-bit or per-state
    ``state_dtype``. Nor yet CUDA-graph capture (the step reads its count on the host) or
    GradScaler's in-step unscaling (unscale first).

    DTensor parameters sharded by rows (FSDP2's ``Shard(0)``, ``torch.chunk``'s split) are
    stepped whole, each by one rank of its shard group, as SOAP's are: one ``all_to_all``
    per shard group and step brings the rows of the parameters and their gradients to
    their owners, one more takes the stepped rows back; the owner keeps the states whole.
    ``state_dict()`` (a collective then) holds the states of the parameter's shape as
    DTensors like it, ``step`` and the factor and root matrices replicated.
    """

    rule = shampoo_update
    variants = Variants(
        "momentum, use_nesterov",
        _variant,
        {
            (False, False): shampoo_update,
            (True, False): shampoo_update_momentum,
            (True, True): shampoo_update_nesterov,
        },
        per_group=True,
    )
    # GradScaler unscales the gradients first: the matrix work reads them in torch.
    _step_supports_amp_scaling = False

    def __init__(
        self,
        params,
        lr=1e-2,
        betas=(0.9, 1.0),
        beta3=-1.0,
        epsilon=1e-12,
        momentum=0.0,
        dampening=0.0,
        weight_decay=0.0,
        max_preconditioner_dim=1024,
        precondition_frequency=1,
        start_preconditioning_step=-1,
        inv_root_override=0,
        exponent_multiplier=1.0,
        use_nesterov=False,
        use_bias_correction=True,
        use_decoupled_weight_decay=True,
        grafting="adam",
        use_merge_dims=True,
        *,
        grafting_beta2=0.999,
        grafting_epsilon=1e-8,
        use_protected_eigh=True,
        root_method="eigh",
        distributed_config=None,
        preconditioner_dtype=None,
        precision_config=None,
        use_pytorch_compile=False,
        track_root_inv_residuals=False,
        state_dtype=None,
        grad_attr="grad",
        stochastic_rounding=False,
        seed=0,
        static=False,
        master_weights=None,
    ):
        keywords = locals()
        defaults = {k: keywords[k] for k in GROUP_KEYWORDS}
        _check_group(defaults)
        _check_unsupported({k: keywords[k] for k in _UNSUPPORTED})
        _check_options(state_dtype, stochastic_rounding, master_weights)
        self.use_protected_eigh = bool(use_protected_eigh)
        if root_method not in ROOT_METHODS:
            raise ValueError(f"root_method must be one of {ROOT_METHODS}, not {root_method!r}")
        self.root_method = root_method
        self._kernels: dict = {}
        self._work: dict = {}  # p -> its buffers between phases
        self._tensors: dict = {}  # p -> the tensor its kernels update (a DTensor's whole tensor)
        self._init_builtin(
            params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static, master_weights
        )

    def __str__(self) -> str:
        return "Shampoo"

    def add_param_group(self, param_group: dict) -> None:
        group = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        _check_group(group)
        if self.root_method == "newton" and group["exponent_multiplier"] != 1.0:
            raise ValueError(
                f"exponent_multiplier must be 1.0 with root_method='newton' (whole inverse roots), "
                f"not {group['exponent_multiplier']}"
            )
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["start_preconditioning_step"] == -1:
            group["start_preconditioning_step"] = group["precondition_frequency"]

    # --- layout ------------------------------------------------------------------------------

    def _shape(self, p: torch.Tensor, group: dict) -> tuple[int, ...]:
        """The shape the factors see: merged (``use_merge_dims``); a scalar as one element."""
        if group["use_merge_dims"]:
            return merge_small_dims(p.shape, group["max_preconditioner_dim"])
        return tuple(p.shape) or (1,)

    def _blocks(self, t: torch.Tensor, p: torch.Tensor, group: dict) -> list[torch.Tensor]:
        return split_blocks(t.reshape(self._shape(p, group)), group["max_preconditioner_dim"])

    def _new_state(self, p: torch.Tensor, group: dict) -> dict:
        dims = block_shapes(self._shape(p, group), group["max_preconditioner_dim"])
        zeros = lambda d: torch.zeros(d, d, device=p.device)  # noqa: E731
        return dict(
            step=torch.tensor(0.0),
            factor_matrices=[[zeros(d) for d in b] for b in dims],
            inv_factor_matrices=[[zeros(d) for d in b] for b in dims],
        )

    def _elementwise(self, st: dict, key: str, p: torch.Tensor) -> torch.Tensor:
        if key not in st:
            dtype = FROM_NAME[self._format(p)]
            st[key] = torch.zeros_like(self._t(p), dtype=dtype, memory_format=torch.preserve_format)
        return st[key]

    def _format(self, p: torch.Tensor) -> str:
        """The dtype (a name) of ``p``'s moments and momentum (``state_dtype``)."""
        return state_format(self.options, None, "", TORCH_DTYPES[self._t(p).dtype])

    def _master(self, p: torch.Tensor):
        """``p``'s split master's low part (``master_weights``, bf16 parameters), or None."""
        if not self.options.master_weights or self._t(p).dtype != torch.bfloat16:
            return None
        st = self.state[p]
        if "master_lo" not in st:  # (the master is p at first)
            lo = getattr(torch, MASTER_WEIGHTS[self.options.master_weights])
            st["master_lo"] = torch.zeros_like(self._t(p), dtype=lo, memory_format=torch.preserve_format)
        return st["master_lo"]

    # --- the step ----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = whole_tensor_step(self, closure, self._step_found)
        self.refresh()  # (between steps only the states stay: the buffers and their tables go)
        return loss

    def _step_found(self, found: list) -> None:
        self._tensors = {p: t for p, t, _, _ in found}  # what the kernels update, by parameter
        for p, _, _, gi in found:
            if not self.state[p]:
                self.state[p].update(self._new_state(p, self.param_groups[gi]))
        items = []  # (group, p, fp32 gradient with L2 decay, step t)
        for p, t, g, gi in found:
            group, st = self.param_groups[gi], self.state[p]
            g = g.float()
            if group["weight_decay"] != 0.0 and not group["use_decoupled_weight_decay"]:
                lo = self._master(p)
                g = g + group["weight_decay"] * (t.float() if lo is None else master_join(t, lo))
            st["step"] += 1
            if p.numel() > 0:  # (no elements: its states stay as initialised)
                items.append((group, p, g, int(st["step"].item())))
        if items:
            self._update_factors(items)
            moments = self._moments(items)
            self._refresh_roots(items)
            directions = self._directions(items, *moments)
            self._apply(items, directions)

    def _t(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor the kernels update for ``p``: itself, or a DTensor's whole tensor."""
        return self._tensors.get(p, p)

    def _update_factors(self, items: list) -> None:
        """Every factor's ``G_(i) G_(i)ᵀ``, batched by (size, rest, β₂)."""
        jobs = defaultdict(list)
        for group, p, g, _ in items:
            beta2 = group["betas"][1]
            for block, factors in zip(self._blocks(g, p, group), self.state[p]["factor_matrices"]):
                for i, f in enumerate(factors):
                    x = _unfold(block, i)
                    jobs[(*x.shape, beta2)].append((f, x))
        for (_, _, beta2), js in jobs.items():
            x = torch.stack([x for _, x in js])
            products = list(torch.bmm(x, x.mT).unbind())
            factors = [f for f, _ in js]
            if beta2 == 1.0:
                torch._foreach_add_(factors, products)
            else:
                torch._foreach_mul_(factors, beta2)
                torch._foreach_add_(factors, products, alpha=1 - beta2)

    def _moments(self, items: list) -> tuple[list, list]:
        """``Ḡ`` and the grafting direction (None without grafting) of each parameter, from
        the moments' kernels: one launch per variant over every parameter that has one."""
        gbars, grafts = [], []
        launches = defaultdict(lambda: defaultdict(list))  # (rule, dtype) -> (group, t) -> [(p, g)]
        for group, p, g, t in items:
            filtered, diagonal = group["betas"][0] != 0.0, group["grafting"] in _DIAGONAL
            rule = {(True, True): shampoo_filter_graft, (False, True): shampoo_graft}.get(
                (filtered, diagonal), shampoo_filter if filtered else None
            )
            if rule is not None:
                launches[rule, self._format(p)][(id(group), t)].append((group, p, g))
            gbars.append(g)
            grafts.append(g if group["grafting"] is not None else None)
        out = {}  # p -> (gbar, graft)
        for (rule, fmt), groups in launches.items():
            launch, states = [], {}
            for (_, t), members in groups.items():
                group = members[0][0]
                launch.append(([self._buffers(p)["graft"] for _, p, _ in members], _moment_hyper(group, t)))
                for _, p, g in members:
                    work, st = self._buffers(p), self.state[p]
                    work["graft"].grad = g
                    named = {
                        k: work[k] if k == "gbar" else self._elementwise(st, k, p) for k, _ in rule.state
                    }
                    states[work["graft"]] = named
                    gbar = work["gbar"] if rule is shampoo_filter_graft else work["graft"]
                    out[p] = (g if rule is shampoo_graft else gbar, work["graft"])
            self._kernel((rule.name, fmt), rule, "grad", fmt).run(launch, states)
        for k, (group, p, _, _) in enumerate(items):
            if p in out:
                gbars[k] = out[p][0]
                grafts[k] = out[p][1] if group["grafting"] is not None else None
        return gbars, grafts

    def _refresh_roots(self, items: list) -> None:
        """The roots due this step, batched by factor size."""
        jobs = defaultdict(list)  # d -> [(factor / bias correction, exponent, root, group)]
        for group, p, _, t in items:
            start, every = group["start_preconditioning_step"], group["precondition_frequency"]
            if not (t == start or (t > start and t % every == 0)):
                continue
            st = self.state[p]
            beta2 = group["betas"][1]
            bc = 1 - beta2**t if group["use_bias_correction"] and beta2 < 1.0 else 1.0
            for factors, roots in zip(st["factor_matrices"], st["inv_factor_matrices"]):
                exponent = -group["exponent_multiplier"] / _root(group["inv_root_override"], len(factors))
                for f, r in zip(factors, roots):
                    jobs[(f.shape[0], group["epsilon"])].append((f / bc, exponent, r))
        for (d, epsilon), js in jobs.items():
            mats = torch.stack([m for m, _, _ in js])
            exponents = torch.tensor([e for _, e, _ in js], device=mats.device)
            if self.root_method == "newton":
                whole = [round(-1 / e) for _, e, _ in js]  # (exponent_multiplier is 1 here)
                roots, ok = newton_roots(mats, whole, epsilon, self.use_protected_eigh)
            else:
                roots, ok = inverse_roots(mats, exponents, epsilon, self.use_protected_eigh)
            good = ok.tolist()
            for (_, _, r), new, fine in zip(js, roots.unbind(), good):
                if fine:
                    r.copy_(new)
            if not all(good):
                warnings.warn(
                    f"Shampoo: the inverse root of {good.count(False)} {d}x{d} factor matrices failed "
                    "in fp32 and fp64; they keep their previous roots",
                    RuntimeWarning,
                    stacklevel=3,
                )

    def _directions(self, items: list, filtered: list, grafted: list) -> list[torch.Tensor]:
        """Each parameter's grafted step direction ``P`` (before weight decay and momentum)."""
        shampoo_items = [
            k
            for k, (group, _, _, t) in enumerate(items)
            if grafted[k] is None or t >= group["start_preconditioning_step"]
        ]
        blocks, roots, owner = [], [], []
        for k in shampoo_items:
            group, p = items[k][0], items[k][1]
            mine = self._blocks(filtered[k], p, group)
            blocks += mine
            roots += self.state[p]["inv_factor_matrices"]
            owner += [k] * len(mine)
        preconditioned = _mode_products(blocks, roots)
        out = list(grafted)
        by_item = defaultdict(list)
        for k, b in zip(owner, preconditioned):
            by_item[k].append(b)
        for k, shampoo_blocks in by_item.items():
            group, p = items[k][0], items[k][1]
            u = torch.empty(self._shape(p, group), device=p.device)
            u_blocks = split_blocks(u, group["max_preconditioner_dim"])
            if grafted[k] is None:
                torch._foreach_copy_(u_blocks, shampoo_blocks)
            else:
                graft_blocks = self._blocks(grafted[k], p, group)
                scale = torch._foreach_div(
                    torch._foreach_norm(graft_blocks),
                    torch._foreach_add(torch._foreach_norm(shampoo_blocks), 1e-16),
                )
                for ub, sb, s in zip(u_blocks, shampoo_blocks, scale):
                    ub.copy_(sb * s)
            out[k] = u.reshape(p.shape)
        return out

    def _apply(self, items: list, directions: list) -> None:
        """The parameters' kernel, one launch per rule variant in use."""
        by_key = defaultdict(lambda: defaultdict(list))  # variant -> group -> [(p, u)]
        for (group, p, _, _), u in zip(items, directions):
            by_key[self._key(group)][id(group)].append((group, p, u))
        for key, groups in by_key.items():
            launch, states = [], {}
            for members in groups.values():
                group = members[0][0]
                launch.append(([self._t(p) for _, p, _ in members], _hyper(group, key)))
                for _, p, u in members:
                    buf = self._buffers(p)["u"]
                    buf.copy_(u)
                    named = dict(u=buf)
                    if key[0]:
                        named["momentum_buffer"] = self._elementwise(self.state[p], "momentum_buffer", p)
                    if self._master(p) is not None:
                        named["master_lo"] = self._master(p)
                    states[self._t(p)] = named
            self._kernel(key, self._rule_for(key)).run(launch, states)

    def _kernel(self, key, rule, grad_attr: str | None = None, fmt: str | None = None) -> RuleKernel:
        """The step engine of ``rule``; the moments' kernels read their buffers' ``.grad``,
        their states in ``fmt``. Buffers (``gbar``, ``u``) stay fp32."""
        if key not in self._kernels:
            asked = self.options.state_dtype or "fp32"
            kept = {s: (fmt or asked) for s, _ in rule.state if s in _ELEMENT_STATES}
            options = dataclasses.replace(self.options, state_dtype=tuple(sorted(kept.items())) or None)
            if grad_attr is not None:  # (the moments' kernels update buffers, not parameters)
                options = dataclasses.replace(options, grad_attr=grad_attr, master_weights=None)
            self._kernels[key] = RuleKernel(rule, options)
        return self._kernels[key]

    def _buffers(self, p: torch.Tensor) -> dict:
        """``p``'s fp32 buffers between the phases of a step (not state): ``graft`` (the
        moments' kernel's ``p``), ``gbar``, ``u`` (the parameters' kernel's direction)."""
        work = self._work.get(p)
        if work is None:
            like = dict(dtype=torch.float32, device=p.device)
            work = self._work[p] = {k: torch.zeros(p.shape, **like) for k in ("graft", "gbar", "u")}
        return work

    # --- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return published_state_dict(self, torch.optim.Optimizer.state_dict(self))

    def load_state_dict(self, state_dict) -> None:
        saved = state_dict["state"]
        ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        pairs = list(zip(ids, [(p, g) for g in self.param_groups for p in g["params"]]))
        for pid, (p, group) in pairs:  # checked before anything changes
            if pid in saved:
                _check_saved(saved[pid], self._new_state(p, {**group, **_saved_group(state_dict, pid)}), p)
        torch.optim.Optimizer.load_state_dict(self, state_dict)
        # torch casts loaded states to each parameter's dtype: taken back as saved, the factors
        # and roots in fp32, the moments and momentum in state_dtype.
        for pid, (p, _) in pairs:
            if pid in saved:
                self.state[p] = {k: self._loaded(k, v, p) for k, v in saved[pid].items()}
        own_loaded_states(self)
        self._use_variant(self._key(self.param_groups[0]))
        self.refresh()

    def _loaded(self, key: str, value, p: torch.Tensor):
        if key in _ELEMENT_STATES and torch.is_tensor(value):
            dtype = FROM_NAME[state_format(self.options, None, key, TORCH_DTYPES[p.dtype])]
            return value.to(
                device=value.device if isinstance(value, DTensor) else p.device, dtype=dtype, copy=True
            )
        return _fp32_copy(value, p.device)

    def refresh(self) -> None:
        for kernel in self._kernels.values():
            kernel.forget()
        self._work = {}


def _moment_hyper(group: dict, t: int) -> dict:
    """The moments' kernels' hyperparameters of a group at step ``t``."""
    beta1 = group["betas"][0]
    beta3 = beta1 if group["beta3"] == -1.0 else group["beta3"]
    kind, beta = group["grafting"], group["grafting_beta2"]
    decay, gain = (1.0, 1.0) if kind == "adagrad" else (beta, 1 - beta)
    return dict(
        beta1=beta1,
        beta3=beta3,
        bias1=1 - beta3 * beta1 ** (t - 1) if group["use_bias_correction"] else 1.0,
        decay=decay,
        gain=gain,
        bias2=1 - beta**t if kind == "adam" else 1.0,
        grafting_epsilon=group["grafting_epsilon"],
    )


def _hyper(group: dict, key: tuple) -> dict:
    decay = group["weight_decay"] if group["use_decoupled_weight_decay"] else 0.0
    hyper = dict(lr=group["lr"], weight_decay=decay)
    if key[0]:
        hyper.update(momentum=group["momentum"], dampening=group["dampening"])
    return hyper


def _root(override, order: int) -> float:
    """Meta's inverse root of a block of ``order``: ``2 * order``, or the override (an int,
    or one per order, 0 meaning the default)."""
    if isinstance(override, (list, tuple)):
        value = override[order] if order < len(override) else 0
    else:
        value = override
    return float(value or 2 * order)


def _saved_group(state_dict: dict, pid) -> dict:
    for group in state_dict["param_groups"]:
        if pid in group["params"]:
            return {k: v for k, v in group.items() if k != "params"}
    return {}


def _check_saved(st: dict, fresh: dict, p: torch.Tensor) -> None:
    if not torch.is_tensor(st.get("step")) or st["step"].numel() != 1:
        raise ValueError(f"Shampoo: the saved state of a parameter of shape {tuple(p.shape)} has no step")
    for key in ("factor_matrices", "inv_factor_matrices"):
        want = [[tuple(f.shape) for f in b] for b in fresh[key]]
        got = [[tuple(f.shape) for f in b] for b in st.get(key, [])]
        if got != want:
            raise ValueError(
                f"Shampoo: the saved {key} of a parameter of shape {tuple(p.shape)} are {got}; its blocks "
                f"need {want} (another max_preconditioner_dim or use_merge_dims?)"
            )
    for key in ("filtered_grad", "grafting", "momentum_buffer"):
        if key in st and tuple(st[key].shape) != tuple(p.shape):
            raise ValueError(
                f"Shampoo: the saved {key} has shape {tuple(st[key].shape)}, its parameter {tuple(p.shape)}"
            )


def _fp32_copy(value, device):
    if torch.is_tensor(value):
        if not value.is_floating_point():
            return value.clone()
        return value.to(device="cpu" if value.dim() == 0 else device, dtype=torch.float32, copy=True)
    if isinstance(value, (list, tuple)):
        return [_fp32_copy(v, device) for v in value]
    return value


def _check_unsupported(given: dict) -> None:
    for name, value in given.items():
        if value != _UNSUPPORTED[name]:
            raise ValueError(
                f"Shampoo: {name}={value!r} is not supported (fuser runs one process's "
                f"tensors, fp32 states); leave it {_UNSUPPORTED[name]!r}"
            )


def _check_options(state_dtype, stochastic_rounding, master_weights) -> None:
    options = parse_options(
        state_dtype=state_dtype, stochastic_rounding=stochastic_rounding, master_weights=master_weights
    )
    if options.state_dtype not in (None, "fp32", "bf16", "fp16", "param"):
        raise ValueError(
            "Shampoo stores filtered_grad, grafting and momentum_buffer in one dtype: state_dtype "
            f"must be torch.float32, torch.bfloat16, torch.float16 or 'param', not {state_dtype!r} "
            "(its factors and roots stay fp32)"
        )


def _check_group(group: dict) -> None:
    """Meta's checks (its wording), before anything changes."""
    check_lr(group["lr"])
    betas = tuple(group["betas"])
    if len(betas) != 2:
        raise ValueError(f"betas must have 2 values, not {len(betas)}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}. Must be in [0.0, 1.0).")
    if not 0.0 < betas[1] <= 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}. Must be in (0.0, 1.0].")
    if group["beta3"] != -1.0 and not 0.0 <= group["beta3"] < 1.0:
        raise ValueError(f"Invalid beta3 parameter: {group['beta3']}. Must be in [0.0, 1.0).")
    if not group["epsilon"] > 0.0:
        raise ValueError(f"Invalid epsilon value: {group['epsilon']}. Must be > 0.0.")
    for name in ("momentum", "dampening"):
        if not 0.0 <= group[name] < 1.0:
            raise ValueError(f"Invalid {name} parameter: {group[name]}. Must be [0.0, 1.0).")
    if not group["weight_decay"] >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {group['weight_decay']}. Must be >= 0.0.")
    for name in ("max_preconditioner_dim", "precondition_frequency"):
        value = group[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"Invalid {name}: {value!r}. Must be a whole number >= 1.")
    start, every = group["start_preconditioning_step"], group["precondition_frequency"]
    if not isinstance(start, int) or isinstance(start, bool) or start < -1:
        raise ValueError(f"Invalid start preconditioning step: {start!r}. Must be >= -1.")
    if start != -1 and start < every:
        raise ValueError(
            f"Invalid start_preconditioning_step value: {start}. Must be >= precondition_frequency={every}."
        )
    override = group["inv_root_override"]
    values = override if isinstance(override, (list, tuple)) else [override]
    if not all(isinstance(v, int) and v >= 0 for v in values):
        raise ValueError(f"Invalid inv_root_override: {override!r}. Whole numbers >= 0.")
    if not group["exponent_multiplier"] > 0.0:
        raise ValueError(f"Invalid exponent_multiplier: {group['exponent_multiplier']}. Must be > 0.0.")
    if group["grafting"] not in GRAFTINGS:
        raise ValueError(f"grafting must be one of {GRAFTINGS}, not {group['grafting']!r}")
    if not 0.0 < group["grafting_beta2"] <= 1.0:
        raise ValueError(f"Invalid grafting_beta2: {group['grafting_beta2']}. Must be in (0.0, 1.0].")
    if not group["grafting_epsilon"] > 0.0:
        raise ValueError(f"Invalid grafting_epsilon: {group['grafting_epsilon']}. Must be > 0.0.")


__all__ = [
    "Shampoo",
    "block_shapes",
    "inverse_roots",
    "merge_small_dims",
    "newton_roots",
    "shampoo_filter",
    "shampoo_filter_graft",
    "shampoo_graft",
    "shampoo_update",
    "shampoo_update_momentum",
    "shampoo_update_nesterov",
    "split_blocks",
]
