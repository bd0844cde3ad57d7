"""SOAP (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using Adam"): Adam run in
the eigenbasis of Shampoo's Kronecker factors, with pytorch-optimizer 4.1.0's keywords,
defaults and state keys.

For a gradient ``G`` with factors ``L ← βL + (1-β) G Gᵀ`` and ``R ← βR + (1-β) GᵀG`` (one
per dimension of an N-D tensor, over the others), with eigenbases ``Q_L`` and ``Q_R``:
the first moment is kept in the parameter's basis, the second on the projected gradient
``Q_Lᵀ G Q_R``, and the update is ``Q_L (m̂ / (√v̂ + ε)) Q_Rᵀ``. The bases come from
``eigh`` once, then from one QR power iteration every ``precondition_frequency`` steps,
the second moment's entries carried along with the re-sorted columns.

The matrix work runs in torch, in fp32, batched over every factor of one shape across the
step's tensors (``torch.bmm``, batched ``eigh`` and ``qr``). The elementwise work is two
fuser rules, each one launch over every tensor: ``soap_precondition`` on the projected
tensors (the second moment and the direction ``m / (√v + ε)`` in the eigenbasis) and
``soap`` (``soap_normalized``) on the parameters (the first moment, the step and decoupled
weight decay). The first moment is projected before that kernel updates it, through
``Q_Lᵀ (β₁ m + (1-β₁) G) Q_R = β₁ Q_Lᵀ m Q_R + (1-β₁) Q_Lᵀ G Q_R``.
"""

from __future__ import annotations

import dataclasses
import math
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
from fuser.runtime.matrix import budget_slices, workspace_budget
from fuser.runtime.plans import FROM_NAME, MASTER_WEIGHTS, TORCH_DTYPES, parse_options, state_format

# The projected tensors' kernel: ``g`` the projected gradient, ``m`` the projected first
# moment before this step, ``p`` a buffer that takes the direction in the eigenbasis.
soap_precondition = fuser.rule(
    """
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g**2
    p = (beta1 * m + (1 - beta1) * g) / (sqrt(exp_avg_sq) + eps)
""",
    name="soap_precondition",
    hyper=dict(beta1=0.95, beta2=0.95, eps=1e-8),
    state=dict(exp_avg_sq=0.0, m=0.0),
)

# The parameters' kernel: ``u`` the direction projected back; ``step_size`` is lr with
# the bias corrections of the step, worked out per param group.
_SOAP = """
    exp_avg = beta1 * exp_avg + (1 - beta1) * (g - 2 * maximize * g)
    p = (p - step_size * {u}) * (1 - lr * weight_decay)
"""
_HYPER = dict(lr=3e-3, beta1=0.95, step_size=3e-3, weight_decay=0.01, maximize=0.0)
soap = fuser.rule(_SOAP.format(u="u"), name="soap", hyper=_HYPER, state=dict(exp_avg=0.0, u=0.0))
soap_normalized = fuser.rule(
    _SOAP.format(u="u / (sqrt(mean(u**2)) + eps)"),
    name="soap_normalized",
    hyper=dict(_HYPER, eps=1e-8),
    state=dict(exp_avg=0.0, u=0.0),
)

_DATA_FORMATS = ("channels_first", "channels_last")


def merged_shape(shape, max_dim: int) -> tuple[int, ...]:
    """pytorch-optimizer's ``merge_small_dims``: neighbouring dimensions multiplied while the
    product stays within ``max_dim``. Where everything fits in one dimension (the reference
    returns ``[1]`` and its reshape fails), that one dimension, as the authors' SOAP does."""
    out, product = [], 1
    for d in shape:
        product *= d
        if product > max_dim:
            out.append(product // d)
            product = d
    out.append(product)
    return tuple(out)


def _unfold(t: torch.Tensor, i: int) -> torch.Tensor:
    """``t`` as the matrix ``[shape[i], numel / shape[i]]`` (dimension ``i`` against the rest)."""
    return t.movedim(i, 0).reshape(t.shape[i], -1)


def _mode_products(tensors: list, factors: list, back: bool = False) -> list:
    """Each tensor multiplied along each dimension that has a basis: ``t ×ᵢ Qᵢᵀ`` (coordinates
    in the eigenbasis) or with ``back`` ``t ×ᵢ Qᵢ``. Batched per dimension over the tensors
    whose matrix ``[rest, d]`` has one shape."""
    out = list(tensors)
    for i in range(max((t.dim() for t in out), default=0)):
        jobs = defaultdict(list)
        for j, (t, qs) in enumerate(zip(out, factors)):
            if i < t.dim() and qs[i] is not None:
                jobs[(t.numel() // t.shape[i], t.shape[i])].append(j)
        for (rest, d), js in jobs.items():
            x = torch.stack([out[j].movedim(i, -1).reshape(rest, d) for j in js])
            q = torch.stack([factors[j][i] for j in js])
            y = torch.bmm(x, q.mT if back else q)
            for k, j in enumerate(js):
                out[j] = y[k].reshape(out[j].movedim(i, -1).shape).movedim(-1, i)
    return out


def _decompose(fn, mats: torch.Tensor, old: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn`` over a stack of fp32 matrices; a matrix whose result fails or is not finite is
    retried in fp64, and where that fails too keeps ``old`` (with a warning), so a failed
    decomposition never reaches a parameter. Returns the results and which are new."""
    try:
        out = fn(mats)
        ok = torch.isfinite(out).flatten(1).all(1)
    except RuntimeError:
        out, ok = old.clone(), torch.zeros(len(mats), dtype=torch.bool, device=mats.device)
    if bool(ok.all()):
        return out, ok
    for k in (~ok).nonzero().flatten().tolist():
        try:
            q = fn(mats[k : k + 1].double())[0].float()
            good = bool(torch.isfinite(q).all())
        except RuntimeError:
            good = False
        if good:
            out[k], ok[k] = q, True
        else:
            out[k] = old[k]
            warnings.warn(
                f"SOAP: the {what} of a {mats.shape[-1]}x{mats.shape[-1]} preconditioner factor failed "
                "in fp32 and fp64; it keeps its previous basis",
                RuntimeWarning,
                stacklevel=4,
            )
    return out, ok


def _eigh_basis(mats: torch.Tensor) -> torch.Tensor:
    eye = torch.eye(mats.shape[-1], dtype=mats.dtype, device=mats.device)
    # Descending eigenvalues, the order the QR refresh keeps; 1e-30 I as the reference adds.
    return torch.linalg.eigh(mats + 1e-30 * eye)[1].flip(-1)


def _qr_basis(mats: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(mats)[0]


class SOAP(BuiltinOptimizer):
    """SOAP (Vyas et al. 2024): Adam in the eigenbasis of Shampoo's factors, as
    pytorch-optimizer 4.1.0's ``SOAP`` (its keywords in its order, its defaults, its
    checks, state keys ``exp_avg``, ``exp_avg_sq``, ``GG``, ``Q``, the step count as the
    param group's ``step``). The first step only builds the preconditioner, as the
    reference's does.

    A dimension over ``max_precondition_dim`` has no factor (``GG`` and ``Q`` hold ``[]``
    there: the identity); 1-D parameters have one only with ``precondition_1d``.
    ``merge_dims`` merges neighbouring dimensions while their product fits in
    ``max_precondition_dim`` (4-D tensors with ``data_format="channels_last"`` seen as
    NCHW first). The factors and bases are fp32 whatever the parameter's dtype; ``exp_avg``
    and ``exp_avg_sq`` fp32 too, or as ``state_dtype`` asks (``torch.bfloat16``,
    ``torch.float16``, ``"param"``: the kernels read them, compute in fp32 and round each new
    value once). A step's kernels take three fp32 buffers per parameter (the projected
    gradient and first moment, the direction), freed when it ends, as are their tables:
    between steps SOAP holds its states alone.

    As in the reference, each parameter keeps the ``precondition_frequency`` and
    ``shampoo_beta`` of its first step in its state. Differences from the reference:
    ``maximize`` leaves ``p.grad`` as it is (the reference negates it in place); with
    ``merge_dims`` a tensor that fits in one dimension is preconditioned as that one
    dimension (the reference's reshape fails there).

    fuser's keywords: ``state_dtype`` (one dtype for both moments, not 8 bits),
    ``stochastic_rounding`` (of bf16 parameters and moments), ``master_weights``
    (``"bf16+int8"``, ``"bf16+int16"``: a bf16 parameter's fp32 master, its low part in
    ``state["master_lo"]``), ``grad_attr`` (``"main_grad"``), ``seed`` and ``static``.

    DTensor parameters sharded by rows (FSDP2's ``Shard(0)``, ``torch.chunk``'s split):
    each is stepped whole by one rank of its shard group, which keeps its states whole
    (the others hold ``{"whole_on_rank": rank}``); its rows and its gradient's reach that
    rank by one ``all_to_all`` per shard group and step, and the stepped rows come back
    by another. ``state_dict()`` and
    ``load_state_dict()`` are then collectives of the shard group; the state dict holds
    the states of the parameter's shape as DTensors like it and the factors and bases
    as replicated plain tensors, which torch.distributed.checkpoint reshards. A replicated
    DTensor is stepped by every rank; other layouts raise a RuntimeError.
    """

    rule = soap
    variants = Variants(
        "normalize_gradient",
        lambda group: (bool(group["normalize_gradient"]),),
        {(False,): soap, (True,): soap_normalized},
        per_group=True,
    )
    # GradScaler unscales the gradients first: the matrix work reads them in torch.
    _step_supports_amp_scaling = False

    def __init__(
        self,
        params,
        lr=3e-3,
        betas=(0.95, 0.95),
        shampoo_beta=None,
        weight_decay=1e-2,
        precondition_frequency=10,
        max_precondition_dim=10000,
        merge_dims=False,
        precondition_1d=False,
        correct_bias=True,
        normalize_gradient=False,
        data_format="channels_first",
        eps=1e-8,
        maximize=False,
        *,
        state_dtype=None,
        grad_attr="grad",
        stochastic_rounding=False,
        seed=0,
        static=False,
        master_weights=None,
    ):
        defaults = dict(
            lr=lr,
            betas=betas,
            shampoo_beta=shampoo_beta,
            weight_decay=weight_decay,
            precondition_frequency=precondition_frequency,
            max_precondition_dim=max_precondition_dim,
            merge_dims=merge_dims,
            precondition_1d=precondition_1d,
            correct_bias=correct_bias,
            normalize_gradient=normalize_gradient,
            eps=eps,
        )
        _check_group(defaults)
        if data_format not in _DATA_FORMATS:
            raise ValueError(f"data_format must be one of {_DATA_FORMATS}, not {data_format!r}")
        options = parse_options(
            state_dtype=state_dtype, stochastic_rounding=stochastic_rounding, master_weights=master_weights
        )
        if options.state_dtype not in (None, "fp32", "bf16", "fp16", "param"):
            raise ValueError(
                f"SOAP stores exp_avg and exp_avg_sq in one dtype: state_dtype must be torch.float32, "
                f"torch.bfloat16, torch.float16 or 'param', not {state_dtype!r} (its factors and bases "
                "stay fp32)"
            )
        self.data_format = data_format
        self.maximize = bool(maximize)
        self._init_builtin(
            params, defaults, state_dtype, grad_attr, stochastic_rounding, seed, static, master_weights
        )
        self._kernels = {}
        self._work = {}  # p -> its kernels' buffers
        self._tensors = {}  # p -> the tensor its kernels update (a DTensor's whole tensor)

    def __str__(self) -> str:
        return "SOAP"

    def add_param_group(self, param_group: dict) -> None:
        _check_group({**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}})
        super().add_param_group(param_group)
        self.param_groups[-1].setdefault("step", 0)

    def state_dict(self) -> dict:
        return published_state_dict(self, torch.optim.Optimizer.state_dict(self))

    def load_state_dict(self, state_dict) -> None:
        torch.optim.Optimizer.load_state_dict(self, state_dict)
        # torch casts every state tensor to its parameter's dtype (a bf16 parameter's factors
        # and bases, a split master's integer low part): the saved values are taken back, the
        # moments in state_dtype, the low part as saved, the rest in fp32.
        ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        for pid, p in zip(ids, (p for group in self.param_groups for p in group["params"])):
            for key, value in state_dict["state"].get(pid, {}).items():
                if key in self.state[p]:
                    self.state[p][key] = _restored(value, p, self._loaded_dtype(key, p))
        own_loaded_states(self)
        self._use_variant(self._key(self.param_groups[0]))
        self.refresh()

    def _loaded_dtype(self, key: str, p: torch.Tensor):
        if key in ("exp_avg", "exp_avg_sq"):
            return FROM_NAME[state_format(self.options, None, key, TORCH_DTYPES[p.dtype])]
        return None if key == "master_lo" else torch.float32

    def refresh(self) -> None:
        for kernel in self._kernels.values():
            kernel.forget()
        self._work = {}

    def _kernel(self, key, fmt: str = "fp32") -> RuleKernel:
        """The kernel of ``key`` (a variant, or ``"precondition"`` with ``exp_avg_sq`` stored
        in ``fmt``). Its tensors' buffers (``u``, ``m``) are fp32 whatever the states' dtype."""
        if (key, fmt) not in self._kernels:
            if key == "precondition":  # its tensors are SOAP's buffers, their gradients .grad
                rule = soap_precondition
                options = dataclasses.replace(
                    self.options, grad_attr="grad", master_weights=None, state_dtype=(("exp_avg_sq", fmt),)
                )
            else:
                rule, asked = self._rule_for(key), self.options.state_dtype or "fp32"
                options = dataclasses.replace(self.options, state_dtype=(("exp_avg", asked),))
            self._kernels[key, fmt] = RuleKernel(rule, options)
        return self._kernels[key, fmt]

    def _format(self, p: torch.Tensor) -> str:
        """The dtype (a name) of ``p``'s ``exp_avg`` and ``exp_avg_sq``."""
        return state_format(self.options, None, "exp_avg", TORCH_DTYPES[self._tensors.get(p, p).dtype])

    # --- the layout the preconditioner sees -------------------------------------------------

    def _view(self, t: torch.Tensor, group: dict) -> torch.Tensor:
        """``t`` as its factors see it: merged (``merge_dims``; NCHW first for channels_last)."""
        if not group["merge_dims"] or t.dim() < 2:
            return t
        if self.data_format == "channels_last" and t.dim() == 4:
            t = t.permute(0, 3, 1, 2)
        return t.reshape(merged_shape(t.shape, group["max_precondition_dim"]))

    def _unview(self, t: torch.Tensor, like: torch.Tensor, group: dict) -> torch.Tensor:
        if not group["merge_dims"] or like.dim() < 2:
            return t
        if self.data_format == "channels_last" and like.dim() == 4:
            n, h, w, c = like.shape
            return t.reshape(n, c, h, w).permute(0, 2, 3, 1)
        return t.reshape(like.shape)

    def _new_state(self, p: torch.Tensor, g: torch.Tensor, group: dict) -> dict:
        shape = g.shape if g.dim() == 1 else self._view(g, group).shape
        limit = group["max_precondition_dim"]
        if g.dim() == 1 and not group["precondition_1d"]:
            limit = 0
        gg = [torch.zeros(d, d, device=g.device) if d <= limit else [] for d in shape]
        dtype = FROM_NAME[state_format(self.options, None, "exp_avg", TORCH_DTYPES[p.dtype])]
        zeros = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        # The reference keeps each parameter's first frequency and shampoo_beta, and reads them
        # from its state: kept so, checkpoints load both ways.
        beta = group["shampoo_beta"] if group["shampoo_beta"] is not None else group["betas"][1]
        state = dict(
            exp_avg=zeros,
            exp_avg_sq=zeros.clone(),
            GG=gg,
            Q=None,
            precondition_frequency=group["precondition_frequency"],
            shampoo_beta=beta,
        )
        if self.options.master_weights and p.dtype == torch.bfloat16:  # (the master is p at first)
            state["master_lo"] = torch.zeros_like(
                p, dtype=getattr(torch, MASTER_WEIGHTS[self.options.master_weights])
            )
        return state

    # --- the step ----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = whole_tensor_step(self, closure, self._step_found)
        self.refresh()  # (between steps only the states stay: the buffers and their tables go)
        return loss

    def _step_found(self, found: list) -> None:
        self._tensors = {p: t for p, t, _, _ in found}  # what the kernels update, by parameter
        items = []  # (group, p, fp32 gradient: the one to descend)
        for p, _, g, gi in found:
            g = g.float()
            items.append((self.param_groups[gi], p, -g if self.maximize else g))

        # Parameters seen for the first time: their factors from this gradient, then eigh.
        new = [(group, p, g) for group, p, g in items if len(self.state[p]) == 0]
        for group, p, g in new:
            self.state[p].update(self._new_state(self._tensors[p], g, group))
        self._precondition(new, [group["step"] for group, _, _ in new])

        for group in self.param_groups:
            group["step"] += 1
        update = [(group, p, g) for group, p, g in items if group["step"] > 1]
        self._adam(update)
        self._precondition(update, [group["step"] - 1 for group, _, _ in update])

    def _buffers(self, p: torch.Tensor) -> dict:
        work = self._work.get(p)
        if work is None:
            like = self.state[p]["exp_avg_sq"]
            work = {k: torch.zeros_like(like, dtype=torch.float32) for k in ("direction", "grad", "m")}
            work["direction"].grad = work["grad"]
            work["u"] = work["m"]  # free once the first kernel has read m
            self._work[p] = work
        return work

    def _adam(self, items: list) -> None:
        """The projections (batched), then the two kernels: Adam on the projected gradient,
        and on the parameters the step along the direction projected back."""
        if not items:
            return
        states = [self.state[p] for _, p, _ in items]
        bases = [_bases(st) for st in states]
        views = [self._view(g, group) for group, _, g in items]
        views += [self._view(st["exp_avg"].float(), group) for (group, _, _), st in zip(items, states)]
        projected = _mode_products(views, bases + bases)
        works = [self._buffers(p) for _, p, _ in items]
        for k, ((group, _, g), work) in enumerate(zip(items, works)):
            work["grad"].copy_(self._unview(projected[k], g, group))
            work["m"].copy_(self._unview(projected[len(items) + k], g, group))

        by_group = defaultdict(list)  # param group -> its (p, buffers), in group order
        for (group, p, _), work in zip(items, works):
            by_group[id(group)].append((group, p, work))
        members = list(by_group.values())
        for fmt in dict.fromkeys(self._format(p) for _, p, _ in items):  # (one launch per dtype)
            mine = [[m for m in ms if self._format(m[1]) == fmt] for ms in members]
            mine = [ms for ms in mine if ms]
            self._kernel("precondition", fmt).run(
                [([w["direction"] for _, _, w in ms], _pre_hyper(ms[0][0])) for ms in mine],
                {
                    w["direction"]: dict(exp_avg_sq=self.state[p]["exp_avg_sq"], m=w["m"])
                    for _, p, w in _items_of(mine)
                },
            )

        directions = [self._view(w["direction"], group) for (group, _, _), w in zip(items, works)]
        directions = _mode_products(directions, bases, back=True)
        for (group, _, g), work, u in zip(items, works, directions):
            work["u"].copy_(self._unview(u, g, group))
        for key in dict.fromkeys(self._key(ms[0][0]) for ms in members):
            mine = [ms for ms in members if self._key(ms[0][0]) == key]
            tensors = self._tensors
            self._kernel(key).run(
                [([tensors[p] for _, p, _ in ms], self._hyper(ms[0][0])) for ms in mine],
                {tensors[p]: self._update_states(p, w) for _, p, w in _items_of(mine)},
            )

    def _update_states(self, p: torch.Tensor, work: dict) -> dict:
        st = self.state[p]
        out = dict(exp_avg=st["exp_avg"], u=work["u"])
        if "master_lo" in st:
            out["master_lo"] = st["master_lo"]
        return out

    def _hyper(self, group: dict) -> dict:
        beta1, beta2 = group["betas"]
        t = group["step"] - 1
        step_size = group["lr"]
        if group["correct_bias"]:
            step_size *= math.sqrt(1 - beta2**t) / (1 - beta1**t)
        hyper = dict(
            lr=group["lr"],
            beta1=beta1,
            step_size=step_size,
            weight_decay=group["weight_decay"],
            maximize=float(self.maximize),
        )
        if group["normalize_gradient"]:
            hyper["eps"] = group["eps"]
        return hyper

    def _precondition(self, items: list, steps: list) -> None:
        """Accumulate each factor's ``G Gᵀ`` (batched per shape), then its basis: ``eigh`` the
        first time, a QR power iteration where ``step`` is a positive multiple of
        ``precondition_frequency``."""
        if not items:
            return
        outer = defaultdict(list)  # (d, rest, beta) -> [(factor, unfolded gradient)]
        for group, p, g in items:
            st = self.state[p]
            view = g if g.dim() == 1 else self._view(g, group)
            beta = st["shampoo_beta"]
            for i, gg in enumerate(st["GG"]):
                if len(gg):
                    x = _unfold(view, i)
                    outer[(*x.shape, beta)].append((gg, x))
        for (d, rest, beta), jobs in outer.items():
            for part in _budgeted(jobs, 4 * d * (d + rest)):  # (a slice's x and x xᵀ)
                x = torch.stack([x for _, x in part])
                products = torch.bmm(x, x.mT).unbind()
                torch._foreach_lerp_([gg for gg, _ in part], list(products), 1 - beta)

        fresh = [self.state[p] for _, p, _ in items if self.state[p]["Q"] is None]
        for st in fresh:
            st["Q"] = [[] for _ in st["GG"]]
        first = [(st, i) for st in fresh for i, gg in enumerate(st["GG"]) if len(gg)]
        for jobs in _by_size(first).values():
            for part in _budgeted(jobs, _decomposition_bytes(jobs)):
                self._first_basis(part)

        refresh = []
        for (group, p, _), step in zip(items, steps):
            st = self.state[p]
            if step > 0 and step % st["precondition_frequency"] == 0:
                refresh += [(st, i, group) for i, gg in enumerate(st["GG"]) if len(gg)]
        for jobs in _by_size(refresh).values():
            for part in _budgeted(jobs, _decomposition_bytes(jobs)):
                self._refresh(part)

    @staticmethod
    def _first_basis(jobs: list) -> None:
        """``eigh`` of factors of one size: their first bases."""
        mats = torch.stack([st["GG"][i] for st, i in jobs])
        old = torch.eye(mats.shape[-1], device=mats.device).expand_as(mats)
        qs, _ = _decompose(_eigh_basis, mats, old, "eigendecomposition")
        for (st, i), q in zip(jobs, qs):
            st["Q"][i] = q

    def _refresh(self, jobs: list) -> None:
        """One power iteration ``QR(GG Q)`` for factors of one size, columns sorted by the
        estimated eigenvalues ``diag(Qᵀ GG Q)``, ``exp_avg_sq`` permuted with them."""
        gg = torch.stack([st["GG"][i] for st, i, _ in jobs])
        old = torch.stack([st["Q"][i] for st, i, _ in jobs])
        power = torch.bmm(gg, old)
        order = (old * power).sum(1).argsort(dim=-1, descending=True)
        power = power.gather(2, order[:, None, :].expand_as(power))
        qs, ok = _decompose(_qr_basis, power, old, "QR decomposition")
        for (st, i, group), q, idx, good in zip(jobs, qs, order, ok.tolist()):
            if not good:
                continue
            st["Q"][i] = q
            v = st["exp_avg_sq"]
            v.copy_(self._unview(self._view(v, group).index_select(i, idx), v, group))


def _items_of(members: list) -> list:
    return [item for ms in members for item in ms]


def _pre_hyper(group: dict) -> dict:
    return dict(beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"])


def _bases(st: dict) -> list:
    return [q if len(q) else None for q in st["Q"]]


def _budgeted(jobs: list, each: int) -> list[list]:
    """``jobs`` in slices within ``FUSER_MATRIX_WORKSPACE``, ``each`` bytes a job: the stacks
    of factors of TinyLlama's sizes gain nothing from larger batches
    (``linalg_probe_2026-12-04_h200.json``), and one stack of its 66 factors of 5632² is 8.3 GB."""
    return budget_slices(jobs, lambda _: each, workspace_budget())


def _decomposition_bytes(jobs: list) -> int:
    """A decomposition's bytes a factor of ``jobs`` (one size ``d``): about five ``[d, d]``
    fp32 matrices at once (factors, old bases, ``GG Q``, sorted, the result)."""
    d = jobs[0][0]["GG"][jobs[0][1]].shape[0]
    return 5 * 4 * d * d


def _by_size(jobs: list) -> dict:
    out = defaultdict(list)
    for job in jobs:
        st, i = job[0], job[1]
        out[st["GG"][i].shape[0]].append(job)
    return out


def _restored(value, p: torch.Tensor, dtype):
    """A saved state value copied onto ``p``'s device (a DTensor stays one), its floating
    tensors in ``dtype`` (``None``: as saved)."""
    if isinstance(value, list):
        return [_restored(v, p, dtype) for v in value]
    if not torch.is_tensor(value):
        return value
    device = value.device if isinstance(value, DTensor) else p.device
    keep = dtype is None or not value.is_floating_point()
    return value.to(device=device, dtype=value.dtype if keep else dtype, copy=True)


def _check_group(group: dict) -> None:
    """pytorch-optimizer's checks, and that the betas and frequencies are what SOAP can
    use, before anything changes."""
    check_lr(group["lr"])
    betas = tuple(group["betas"])
    if len(betas) != 2:
        raise ValueError(f"betas must have 2 values, not {len(betas)}")
    for name, b in zip(("beta1", "beta2"), betas):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"{name} must be in the range [0.0, 1.0), not {b}")
    for name in ("shampoo_beta", "weight_decay", "eps"):
        if group[name] is not None and group[name] < 0.0:
            raise ValueError(f"{name} must be non-negative")
    if group["shampoo_beta"] is not None and not group["shampoo_beta"] < 1.0:
        raise ValueError(f"shampoo_beta must be below 1, not {group['shampoo_beta']}")
    for name in ("precondition_frequency", "max_precondition_dim"):
        value = group[name]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive whole number, not {value!r}")


__all__ = ["SOAP", "merged_shape", "soap", "soap_normalized", "soap_precondition"]
