"""What every built-in shares: ``BuiltinOptimizer`` (fuser's own keywords, the choice of a
rule variant, param-group keywords to rule hyperparameters) and torch's argument checks,
with torch's messages.

A built-in states what differs as data: ``rule`` (the variant its default keywords select),
``variants`` (when some keywords change the update's shape) and ``hyper_from`` (for a
hyperparameter not read from the group keyword of its own name). Its constructor keeps
torch's signature and defaults as written code: they are the drop-in's contract.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable
from operator import itemgetter

import torch

from fuser.optim.factory import FuserOptimizer, Options, parse_options
from fuser.rules.rule import Rule
from fuser.runtime.distributed import from_local_like, local, local_pair
from fuser.runtime.engine import StepEngine
from fuser.runtime.plans import check_state_formats
from fuser.runtime.state import validate
from fuser.runtime.wholes import (
    OWNER,
    Owners,
    gather,
    is_like_param,
    owned,
    published,
    scatter,
    whole_values,
)

# --- reading a param group ---------------------------------------------------------------

Reader = Callable[[dict], object]


def flag(keyword: str) -> Reader:
    """A boolean keyword as a 0/1 hyperparameter (absent: 0): ``g - 2 * maximize * g`` is
    then exactly ``g`` or ``-g``."""
    return lambda group: float(bool(group.get(keyword, False)))


def steps(keyword: str) -> Reader:
    """A number of steps where ``None`` means none, as a number (``None``: 0)."""
    return lambda group: float(group[keyword] or 0)


def beta(index: int, count: int) -> Reader:
    """``betas[index]`` of a group whose ``betas`` holds ``count`` values."""

    def read(group: dict):
        betas = group["betas"]
        if len(betas) != count:
            raise ValueError(f"betas must have {count} values, not {len(betas)}")
        return betas[index]

    return read


_BETAS = ("beta1", "beta2", "beta3")


def hyper_readers(rule: Rule, hyper_from: dict[str, Reader]) -> tuple[tuple[str, Reader], ...]:
    """How to read each of ``rule``'s hyperparameters from a param group: ``hyper_from``'s
    reader where it has one, then the conventions every built-in follows (``maximize`` a
    0/1 flag, ``beta1``.. from the ``betas`` tuple), else the group keyword of that name."""
    names = list(rule.hyper_defaults)
    n_betas = sum(name in _BETAS for name in names)
    readers = []
    for name in names:
        if name in hyper_from:
            read = hyper_from[name]
        elif name == "maximize":
            read = flag("maximize")
        elif name in _BETAS:
            read = beta(_BETAS.index(name), n_betas)
        else:
            read = itemgetter(name)
        readers.append((name, read))
    return tuple(readers)


# --- checks, as torch.optim words them ---------------------------------------------------


def check_lr(lr) -> None:
    if torch.is_tensor(lr) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")


def check_nonneg(**values) -> None:
    for name, v in values.items():
        if not 0.0 <= v:
            raise ValueError(f"Invalid {name} value: {v}")


def check_betas(betas, n: int = 2) -> tuple:
    betas = tuple(float(b) for b in betas)
    if len(betas) != n:
        raise ValueError(f"betas must have {n} values, not {len(betas)}")
    for i, b in enumerate(betas):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b}")
    return betas


# --- the class ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variants:
    """The rule variants of a built-in whose keywords change the update's shape (``amsgrad``,
    ``nesterov``, ``centered``, ``momentum`` zero or not).

    ``key(group)`` is the variant a param group needs, ``rules`` maps each key to its rule,
    and ``keywords`` names those keywords in errors. Every param group must need the same
    variant, checked whenever groups are added or a state_dict replaces them, unless
    ``per_group``: then each group's variant updates it (Muon's hidden matrices and its
    auxiliary AdamW groups), one step engine per variant in use.
    """

    keywords: str
    key: Callable[[dict], tuple]
    rules: dict[tuple, Rule]
    per_group: bool = False


class BuiltinOptimizer(FuserOptimizer):
    """Constructor plumbing shared by the built-ins.

    A subclass sets ``rule`` (the variant default keywords select: the class's ``source``),
    ``variants`` when it has several, ``hyper_from`` for the hyperparameters the conventions
    of ``hyper_readers`` do not cover, and ``options`` when its state keys differ from its
    rule's names. Its ``__init__`` takes torch's keywords, checks them, and passes its
    param-group defaults and fuser's own keywords to ``_init_builtin``.
    """

    options = Options()
    variants: Variants | None = None
    hyper_from: dict[str, Reader] = {}

    def _init_builtin(
        self,
        params,
        defaults: dict,
        state_dtype,
        grad_attr="grad",
        stochastic_rounding=False,
        seed=0,
        static=False,
        master_weights=None,
        view="flatten",
    ) -> None:
        """fuser's own keywords, on every built-in: ``state_dtype``, ``grad_attr``
        (``"main_grad"``), ``stochastic_rounding``, ``seed``, ``static`` and
        ``master_weights`` (see ``fuser.compile``); shaped built-ins also take ``view``."""
        if defaults.get("differentiable"):
            raise ValueError("fuser optimizers are not differentiable")
        self._variant_key = None
        checked = parse_options(
            state_dtype=state_dtype,
            grad_attr=grad_attr,
            stochastic_rounding=stochastic_rounding,
            seed=seed,
            static=static,
            master_weights=master_weights,
            view=view,
        )
        options = dataclasses.replace(
            type(self).options,
            state_dtype=checked.state_dtype,
            grad_attr=checked.grad_attr,
            stochastic_rounding=checked.stochastic_rounding,
            seed=checked.seed,
            static=checked.static,
            master_weights=checked.master_weights,
            view=checked.view,
        )
        rules = self.variants.rules.values() if self.variants else [type(self).rule]
        check_state_formats(rules, options)
        self._init_fuser(params, defaults, options=options)  # its first group picks the variant

    def _key(self, group: dict) -> tuple:
        return self.variants.key(group) if self.variants else ()

    def _rule_for(self, key: tuple) -> Rule:
        return self.variants.rules[key] if self.variants else type(self).rule

    def _use_variant(self, key: tuple) -> None:
        self._variant_key = key
        self.rule = self._rule_for(key)

    def _rule_of(self, group: dict) -> Rule:
        if self.variants is not None and self.variants.per_group:
            return self._rule_for(self._key(group))
        return self.rule

    def _group_hyper(self, group: dict) -> dict:
        rule = self._rule_of(group)
        # Read every step (the hyperparameter rows), so worked out once per rule.
        cache = self.__dict__.setdefault("_readers", {})
        if rule not in cache:
            cache[rule] = hyper_readers(rule, self.hyper_from)
        return {name: read(group) for name, read in cache[rule]}

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        key = self._key(self.param_groups[-1])
        if self._variant_key is None:
            self._use_variant(key)
        elif key != self._variant_key and not self.variants.per_group:
            self.param_groups.pop()
            raise ValueError(
                f"{type(self).__name__}: {self.variants.keywords} must be the same in every "
                "param group (it selects the compiled rule)"
            )

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        keys = [self._key(g) for g in self.param_groups]
        if self.variants is not None and self.variants.per_group:
            self._use_variant(keys[0])
            return
        keys = set(keys)
        if len(keys) > 1:
            raise ValueError(
                f"{type(self).__name__}: the loaded param groups disagree on "
                f"{self.variants.keywords}, which must be the same in every group"
            )
        self._use_variant(keys.pop())


class RuleKernel:
    """One rule of a built-in whose step runs several (SOAP's, Shampoo's) as a step engine
    reads an optimizer: the rule, the tensors it updates (parameters, or buffers) in param
    groups of their hyperparameters, their states, the built-in's options. Groups and
    states stay the same objects while nothing changes, so the engine's quick check keeps
    its tables."""

    def __init__(self, rule, options):
        self.rule, self.options = rule, options
        self.param_groups: list = []
        self.state: dict = defaultdict(dict)
        self.engine = StepEngine()

    @property
    def _state_keys(self) -> dict:
        return {s: s for s, _ in self.rule.state}

    def _state_keys_of(self, rule) -> dict:
        return {s: s for s, _ in rule.state}

    def _view_of(self, group: dict) -> str:
        return "flatten"

    def _group_hyper(self, group: dict) -> dict:
        return group["hyper"]

    def run(self, groups: list, states: dict) -> None:
        """One launch over ``groups`` (``(tensors, hyperparameters)``), whose tensors' states
        are ``states`` (name -> tensor, per tensor)."""
        same = [[id(t) for t in g["params"]] for g in self.param_groups]
        if [[id(t) for t in ts] for ts, _ in groups] != same:
            self.param_groups = [dict(params=list(ts), hyper=h) for ts, h in groups]
            self.engine.forget()
        for group, (_, hyper) in zip(self.param_groups, groups):
            group["hyper"] = hyper
        for t, named in states.items():
            st = self.state[t]
            for key, value in named.items():
                if st.get(key) is not value:
                    st[key] = value
        self.engine.step(self)

    def forget(self) -> None:
        self.state = defaultdict(dict)
        self.param_groups = []
        self.engine.forget()


def whole_tensor_step(opt, closure, run: Callable[[list], None], check=validate):
    """``opt.step(closure)`` for work that reads whole tensors: the closure's loss, then
    ``run`` over what ``whole_tensor_gradients`` finds, then its closing exchange on every
    rank, also where ``run`` raises (the other ranks wait for the rows an owner sends)."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    found, finish = whole_tensor_gradients(opt, check=check)
    try:
        run(found)
    finally:
        finish()
    return loss


def whole_tensor_gradients(opt, check=validate) -> tuple[list[tuple], Callable[[], None]]:
    """``(p, tensor, gradient, group index)`` of every parameter of ``opt`` with a gradient
    whose matrix work runs on this rank, checked (``check(opt, [(p, gradient, group
    index)])``, ``validate`` by default) before anything changes, and the call that ends
    the step. ``tensor`` and ``gradient`` are whole: ``p`` itself for a plain parameter;
    for a DTensor parameter, buffers of ``opt``'s that hold it and its gradient whole. A
    DTensor sharded by dim 0 (``Shard(0)``) is gathered onto the rank of its shard group
    that owns it (``runtime.wholes``: one all_to_all per shard group for all of them) and
    left out on the others, which keep the marker ``{OWNER: rank}`` as its state; a
    replicated one is copied on every rank. The call writes each rank's rows of the
    stepped tensors back into its shards (one more all_to_all). Other layouts raise,
    before anything changes."""
    attr = opt.options.grad_attr
    found = []
    for gi, group in enumerate(opt.param_groups):
        for p in group["params"]:
            g = getattr(p, attr, None)
            if g is not None:
                found.append((p, local_pair(p, g, attr)[0], gi))
    check(opt, found)
    owners = opt.__dict__.setdefault("_owners", Owners(f"{type(opt).__name__}'s matrix work"))
    owners.update([p for group in opt.param_groups for p in group["params"]])
    items, wholes, parts, into, copies = [], [], [], [], []
    for p, g, gi in found:
        if local(p) is p:
            items.append((p, p, g, gi))
            continue
        w = owners.get(p)
        if w is None:  # replicated: every rank steps its copy
            tensor, grad = _whole_buffers(opt, p, g)
            tensor.copy_(local(p))
            grad.copy_(local(g))
            copies.append((p, tensor))
            items.append((p, tensor, grad, gi))
            continue
        wholes.append(w)
        parts.append([local(p), local(g)])
        into.append(list(_whole_buffers(opt, p, g)) if w.mine else [])
        if w.mine:
            items.append((p, *into[-1], gi))
        else:
            opt.state[p] = {OWNER: w.owner}
    gather(wholes, parts, into)

    def finish() -> None:
        scatter(wholes, [t[0] if t else None for t in into], [local(w.p) for w in wholes])
        for p, tensor in copies:
            local(p).copy_(tensor)

    return items, finish


def _whole_buffers(opt, p, g) -> tuple[torch.Tensor, torch.Tensor]:
    """``opt``'s whole tensor of a DTensor parameter ``p`` and of its gradient, kept from
    step to step (the kernels' tables stay valid): the tensor's ``grad_attr`` is the
    gradient."""
    buffers = opt.__dict__.setdefault("_whole_tensors", {})
    found = buffers.get(p)
    if found is None or found[1].dtype != g.dtype:
        device = local(p).device
        tensor = torch.empty(p.shape, dtype=p.dtype, device=device)
        grad = torch.empty(p.shape, dtype=g.dtype, device=device)
        setattr(tensor, opt.options.grad_attr, grad)
        found = buffers[p] = (tensor, grad)
    return found


def published_state_dict(opt, sd: dict, keys=None) -> dict:
    """``sd`` (torch's state dict of ``opt``) with the states of its DTensor parameters as
    state dicts keep them (``runtime.wholes.published``; a replicated parameter's states
    of its shape as DTensors like it). ``keys``, where given, names the states laid out
    like the parameter (a square factor has its shape too); else every one of its shape.
    A collective of every shard group where ``opt`` has DTensor parameters sharded by
    dim 0."""
    params = [p for group in opt.param_groups for p in group["params"]]
    owners = opt.__dict__.setdefault("_owners", Owners(f"{type(opt).__name__}'s matrix work"))
    owners.update(params)
    ids = [pid for group in sd["param_groups"] for pid in group["params"]]
    for pid, p in zip(ids, params):
        if local(p) is p:
            continue
        w = owners.get(p)
        if w is not None:
            st = published(w, opt.state.get(p, {}), keys)
        else:
            st = {
                k: from_local_like(p, v) if is_like_param(p, k, v, keys) else v
                for k, v in opt.state.get(p, {}).items()
            }
        if st:
            sd["state"][pid] = st
    return sd


def own_loaded_states(opt) -> None:
    """After torch's ``load_state_dict``: each DTensor parameter's state as ``opt`` keeps
    it (``runtime.wholes.owned``; whole plain tensors for a replicated one). A collective
    where the states hold DTensors."""
    params = [p for group in opt.param_groups for p in group["params"]]
    owners = opt.__dict__.setdefault("_owners", Owners(f"{type(opt).__name__}'s matrix work"))
    owners.update(params)
    for p in params:
        if local(p) is p or p not in opt.state:
            continue
        w = owners.get(p)
        st = opt.state[p]
        opt.state[p] = owned(w, st) if w is not None else whole_values(st)
