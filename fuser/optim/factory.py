"""``fuser.compile(optimizer_rule)`` -> a ``torch.optim.Optimizer`` subclass.

This is the torch.optim front end: param groups, constructor keywords, ``state_dict``,
hooks and ``zero_grad``. What a step checks, rebuilds and launches is the step engine's
(``fuser.runtime.engine``); what it launches, before any tensor is seen, is
``fuser.runtime.plans``'.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.optim.optimizer as _optimizer

from fuser.display import NotebookDisplay
from fuser.ir.optim import state_kinds
from fuser.rules.matrices import is_matrix_rule
from fuser.rules.rule import Rule, reads_loss
from fuser.runtime import distributed, quant
from fuser.runtime.engine import StepEngine
from fuser.runtime.plans import (
    Options,
    check_state_formats,
    dtype_plan,
    kernel_sources,
    parse_options,
    plan_and_sources,
    state_dtype,
)
from fuser.runtime.state import check_saved_format, dequantized, labelled, quantize_loaded, saved_scales
from fuser.runtime.tables import check_view, is_batched, matrix_2d
from fuser.runtime.tracking import ParamState

__all__ = ["FuserOptimizer", "Options", "kernel_sources", "make_optimizer", "parse_options"]


class _Source:
    """``Optimizer.source``: the generated Triton kernel for fp32 tensors, rendered on first
    read (on the class, or on an instance whose rule was chosen by its constructor)."""

    def __get__(self, obj, cls):
        owner = obj if obj is not None else cls
        plan = dtype_plan(owner.rule, owner.options, "fp32", "fp32")
        sources = plan_and_sources(owner.rule, plan, owner.options.stochastic_rounding)[1]
        return "\n\n".join(src.text for src in sources)


class FuserOptimizer(NotebookDisplay, torch.optim.Optimizer):
    """Base of every compiled optimizer. Subclasses set ``rule`` and ``options``.

    Built-ins whose constructors take torch.optim's keywords call ``_init_fuser`` with
    their own defaults (and, for structural options such as ``amsgrad``, their own rule)
    and override ``_group_hyper`` to map a param group to the rule's hyperparameters.
    """

    rule: Rule
    options: Options
    source = _Source()
    # torch.amp.GradScaler sets `grad_scale` and `found_inf` on the optimizer and lets the
    # step unscale and skip on its own device, with no host synchronisation.
    _step_supports_amp_scaling = True

    def __init__(self, params, *, view=None, **hyper):
        defaults = dict(self.rule.hyper_defaults)
        self._set_view(view)
        unknown = set(hyper) - set(defaults)
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got unknown hyperparameters {sorted(unknown)}; "
                f"it takes {sorted(defaults)}"
            )
        defaults.update(hyper)
        self._init_fuser(params, defaults)

    def _init_fuser(
        self, params, defaults: dict, rule: Rule | None = None, options: Options | None = None
    ) -> None:
        if rule is not None:
            self.rule = rule
        if options is not None:
            self.options = options
        self._fuser = StepEngine()
        self._engines: dict = {}  # rule -> (view, StepEngine), where groups use several rules
        torch.optim.Optimizer.__init__(self, params, defaults)

    def _set_view(self, view) -> None:
        """The instance's default 2-D view of tensors of 3 or more dimensions (the class's
        where ``view`` is None): ``"flatten"`` ``[shape[0], prod(rest)]``, or ``"batched"``,
        a batch of ``[shape[-2], shape[-1]]`` matrices. A param group's ``view`` key
        overrides it."""
        if view is not None:
            self.options = dataclasses.replace(self.options, view=check_view(view, type(self).__name__))

    def _view_of(self, group: dict) -> str:
        """A param group's 2-D view: its ``view`` key, else the optimizer's."""
        return check_view(group.get("view", self.options.view), f"{type(self).__name__}'s param group")

    def _view_of_param(self, p: torch.Tensor) -> str:
        """The 2-D view of the param group that holds ``p``."""
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                return self._view_of(group)
        return self.options.view

    # Hooks for built-ins whose constructor keywords differ from the rule's names.
    def _group_hyper(self, group: dict) -> dict:
        """The hyperparameters of a param group's rule, read from the group."""
        return {h: group[h] for h in self._rule_of(group).hyper_defaults}

    def _rule_of(self, group: dict) -> Rule:
        """The rule that updates a param group's parameters (one, unless a subclass lets
        groups choose)."""
        return self.rule

    @property
    def _state_keys(self) -> dict:
        return self._state_keys_of(self.rule)

    def _state_keys_of(self, rule: Rule) -> dict:
        keys = dict(self.options.state_keys)
        return {s: keys.get(s, s) for s, _ in rule.state}

    def _step_engines(self) -> list:
        """(what the engine reads, engine) for each rule the groups use, in group order:
        the optimizer and its own engine where every group uses ``rule``."""
        rules = list(dict.fromkeys(self._rule_of(g) for g in self.param_groups))
        if rules == [self.rule] or not rules:
            return [(self, self._fuser)]
        out = []
        for rule in rules:
            if rule not in self._engines:
                self._engines[rule] = (rule_view(self, rule), StepEngine())
            out.append(self._engines[rule])
        return out

    def step(self, closure=None):
        # torch wraps every optimizer's step in a profiler range and its hook loops (~20 us
        # a call); fuser does the same only when a hook is registered or the profiler runs.
        if (
            self._optimizer_step_pre_hooks
            or self._optimizer_step_post_hooks
            or _optimizer._global_optimizer_pre_hooks
            or _optimizer._global_optimizer_post_hooks
            or torch.autograd.profiler._is_profiler_enabled
        ):
            return _hooked_step(self, closure)
        return self._step(closure)

    step.hooked = True  # tells torch.optim.Optimizer not to wrap it again

    def _step(self, closure=None):
        engines = self._step_engines()
        readers = [reader.rule.name for reader, _ in engines if reads_loss(reader.rule)]
        if readers and closure is None:
            raise ValueError(
                f"rule {readers[0]!r} reads `loss`: call step(closure) with a closure that "
                "computes the loss, calls backward() and returns the loss"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if readers:
            check_loss(loss, readers[0])
        for reader, engine in engines:
            engine.step(reader, loss)
        return loss

    def refresh(self) -> None:
        """Re-read every parameter, gradient and state tensor at the next step. Needed only
        with ``static=True``, after replacing one (``p.data = ...``, ``p.grad = ...``)."""
        for _, engine in self._step_engines():
            engine.snapshot = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``; with ``static=True`` gradients are zeroed in place
        (``set_to_none`` is ignored: the step relies on their storage), one ``foreach``
        call per (device, dtype)."""
        snaps = [engine.snapshot for _, engine in self._step_engines()]
        if self.options.static and all(snap is not None for snap in snaps):
            for snap in snaps:
                for grads in snap.grads_by_kind:
                    torch._foreach_zero_(grads)
            return
        super().zero_grad(set_to_none)

    def _state_dtype(self, p: torch.Tensor, state: str = "") -> torch.dtype:
        """The dtype of a new state ``state`` (a rule state name) of ``p``: fp32 for an
        8-bit one, which the step quantizes."""
        return state_dtype(self.options, p.dtype, self.rule, state)

    def _reduced_shape(self, p: torch.Tensor, kind: str, view: str = "flatten") -> tuple[int, ...]:
        """The shape of a new state of one number per row (``kind="row"``) or column of
        ``p``'s 2-D view: a vector, or for a batched view ``[*shape[:-2], rows]``
        (``[..., cols]``), as pytorch-optimizer keeps them (built-ins may keep torch's
        shapes)."""
        rows, cols = matrix_2d(p.shape, view)
        lead = tuple(p.shape[:-2]) if is_batched(p.shape, view) else ()
        return (*lead, rows if kind == "row" else cols)

    def state_dict(self, compressed: bool = False) -> dict:
        """torch's state dict. States stored in 8 bits are given as fp32 tensors (which
        torch's optimizers and checkpoints load) unless ``compressed``: then as stored,
        codes under their key and fp32 scales under ``key + "_absmax"``, which
        ``load_state_dict`` restores exactly (one row of scales per row of the
        parameter's 2-D view where its rows are whole blocks, so that checkpoints reshard
        them: ``distributed.scales_like``). A split master's low part is ``master_lo``."""
        # Plain dicts: torch.load(weights_only=True) takes nothing else.
        sd = super().state_dict()
        sd["state"] = {k: dict(v) if isinstance(v, ParamState) else v for k, v in sd["state"].items()}
        params = [(p, self._rule_of(g)) for g in self.param_groups for p in g["params"]]
        for i, (p, rule) in enumerate(params):
            if i in sd["state"]:
                sd["state"][i] = (labelled if compressed else dequantized)(self, p, sd["state"][i], rule)
        return sd

    def load_state_dict(self, state_dict) -> None:
        # torch casts floating state to each parameter's dtype; fuser keeps its own state
        # dtype (fp32 by default), so restore the saved values at full precision.
        saved = state_dict["state"]
        # Saved ids in group order, as torch maps them: indices from state_dict(), or
        # parameter names from torch.distributed.checkpoint's set_optimizer_state_dict.
        saved_ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        id_to_param = dict(zip(saved_ids, (p for group in self.param_groups for p in group["params"])))
        rule_of = {p: self._rule_of(group) for group in self.param_groups for p in group["params"]}
        for pid, st in saved.items():  # 8-bit codes in another format: refused before anything loads
            p = id_to_param.get(pid)
            if p is not None:
                keys = self._state_keys_of(rule_of[p])
                for s, key in keys.items():
                    if quant.is_codes(st.get(key)):
                        check_saved_format(self, p, st, key, s, rule_of[p])
                        if torch.is_tensor(st.get(key + "_absmax")):
                            saved_scales(p, st[key + "_absmax"])
        super().load_state_dict(state_dict)
        rule_of = {p: self._rule_of(group) for group in self.param_groups for p in group["params"]}
        for pid, st in saved.items():
            p = id_to_param.get(pid)
            if p is None:
                continue
            self._restore(p, st, rule_of[p])
        self._forget()

    def _restore(self, p: torch.Tensor, st: dict, rule: Rule) -> None:
        """Saved state tensors of ``p`` (updated by ``rule``) at full precision."""
        kinds = state_kinds(rule)
        keys = self._state_keys_of(rule)
        element_keys = {keys[s] for s in keys if kinds[s] == "element"}
        reduced_keys = {keys[s] for s in keys if kinds[s] in ("row", "col")}
        # The step too: a live optimizer's state_dict() holds views of its scalar table,
        # which its next step advances.
        scalar_keys = {keys[s] for s in keys if kinds[s] == "scalar"} | {"step"}
        state_of = {k: s for s, k in keys.items()}
        for key, value in st.items():
            if not torch.is_tensor(value):
                continue
            dtype = state_dtype(self.options, p.dtype, rule, state_of.get(key, ""))
            if key in element_keys and value.shape == p.shape:
                value = distributed.like_param(value, p)
                # 8-bit codes stay as saved (with their scales), checked at the step
                keep = value.dtype if quant.is_codes(value) else dtype
                self.state[p][key] = value.to(device=p.device, dtype=keep, copy=True)
                if not quant.is_codes(value):
                    quantize_loaded(self, p, key, state_of[key], rule)
            elif key in reduced_keys:  # checked against the parameter's rows and columns at the step
                self.state[p][key] = value.to(device=p.device, dtype=dtype, copy=True)
            elif key.endswith("_absmax") and key[: -len("_absmax")] in element_keys:
                value = saved_scales(p, value)
                self.state[p][key] = value.to(
                    device=distributed.local(p).device, dtype=torch.float32, copy=True
                )
            elif key == "master_lo":
                self.state[p][key] = distributed.like_param(value, p).to(device=p.device, copy=True)
            elif key in scalar_keys and value.numel() == 1:
                self.state[p][key] = value.to(device=p.device, dtype=torch.float32, copy=True).reshape(())
        for key in element_keys:  # the formats of saved codes were checked before loading
            self.state[p].pop(key + "_format", None)

    def _forget(self) -> None:
        """Re-read everything at the next step (new param groups, loaded state)."""
        self._fuser.forget()
        for _, engine in self._engines.values():
            engine.forget()

    def add_param_group(self, param_group: dict) -> None:
        # torch's method is wrapped to keep torch.compile out of it, and that wrapper imports
        # torch._dynamo on its first call (~1 s). Where nothing has imported it, nothing
        # compiles, and the method itself runs.
        add = torch.optim.Optimizer.add_param_group
        if "torch._dynamo" not in sys.modules:
            add = getattr(add, "__wrapped__", add)
        add(self, param_group)
        self._forget()


_hooked_step = torch.optim.Optimizer.profile_hook_step(FuserOptimizer._step)


def check_loss(loss, rule: str) -> None:
    """The closure's value, for a rule that reads ``loss``: one real number (a tensor of
    one element, or a Python number). Its value is not read here: no host sync."""
    if torch.is_tensor(loss):
        if loss.numel() != 1 or loss.is_complex():
            raise ValueError(
                f"rule {rule!r} reads `loss`: the closure must return one real number, not a tensor "
                f"of shape {tuple(loss.shape)} and dtype {loss.dtype}"
            )
        return
    if isinstance(loss, bool) or not isinstance(loss, (int, float)):
        raise TypeError(
            f"rule {rule!r} reads `loss`: the closure must return the loss (a tensor of one element "
            f"or a number), not {type(loss).__name__}"
        )


class RuleView:
    """One rule's share of an optimizer whose param groups use several rules, as a step
    engine reads it: that rule, its groups, its state keys; the rest is the optimizer's
    (``state``, ``options``, AMP's ``grad_scale`` and ``found_inf``)."""

    def __init__(self, opt: FuserOptimizer, rule: Rule):
        object.__setattr__(self, "_opt", opt)
        object.__setattr__(self, "rule", rule)

    @property
    def param_groups(self) -> list:
        return [g for g in self._opt.param_groups if self._opt._rule_of(g) is self.rule]

    @property
    def state(self):
        return self._opt.state

    @state.setter
    def state(self, value) -> None:
        self._opt.state = value

    @property
    def _state_keys(self) -> dict:
        return self._opt._state_keys_of(self.rule)

    def __getattr__(self, name):
        return getattr(self._opt, name)


def rule_view(opt: FuserOptimizer, rule: Rule) -> RuleView:
    """``opt`` as the engine of ``rule`` reads it; named after ``opt``'s class, which the
    engine's messages name."""
    cls = type(type(opt).__name__, (RuleView,), {"__module__": type(opt).__module__})
    return cls(opt, rule)


class MultiRuleOptimizer(FuserOptimizer):
    """Base of an optimizer compiled from several rules: each param group names its rule
    with the key ``rule`` (the first rule where it names none), and takes that rule's
    hyperparameters (constructor keywords override the defaults of every rule that has
    them). One ``step()`` runs a step engine per rule in use."""

    rules: dict

    def __init__(self, params, *, view=None, **hyper):
        self._set_view(view)
        known = {h for r in self.rules.values() for h in r.hyper_defaults}
        unknown = set(hyper) - known
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got unknown hyperparameters {sorted(unknown)}; "
                f"its rules take {sorted(known)}"
            )
        self._overrides = dict(hyper)
        self._init_fuser(params, {})

    def add_param_group(self, param_group: dict) -> None:
        name = param_group.setdefault("rule", next(iter(self.rules)))
        if name not in self.rules:
            raise ValueError(f"param group rule {name!r} is not one of {sorted(self.rules)}")
        for h, default in self.rules[name].hyper_defaults.items():
            param_group.setdefault(h, self._overrides.get(h, default))
        super().add_param_group(param_group)

    def _rule_of(self, group: dict) -> Rule:
        return self.rules[group["rule"]]


def make_optimizer(rule: Rule | dict, *, name: str | None = None, **options) -> type:
    """Build the optimizer class for ``rule`` (see ``fuser.compile``), or for a dict of
    named rules whose param groups choose one (``dict(params=..., rule="adamw")``).

    Options: ``state_dtype`` (``torch.float32`` default, ``torch.bfloat16``, ...,
    or ``"param"`` to store each state like its parameter), ``grad_attr`` (``"main_grad"``
    reads Megatron-style fp32 gradients), ``stochastic_rounding``, ``seed`` (of stochastic
    rounding and of the rule's ``rand()`` / ``randn()``), and
    ``static``: the caller promises that no parameter, gradient or state tensor is replaced
    between steps (``p.data = ...``, ``p.grad = None``, ``optimizer.state[p][k] = ...``), so
    a step checks nothing per tensor (as a replayed CUDA graph would not); ``zero_grad()``
    then zeroes gradients in place, and ``refresh()`` re-reads everything once. ``view``:
    the 2-D view that ``rows``, ``cols``, axis reductions, row and column states and
    ``orthogonalize`` take of a tensor of 3 or more dimensions, ``"flatten"`` (default:
    one matrix ``[shape[0], prod(rest)]``) or ``"batched"`` (each ``[shape[-2], shape[-1]]``
    matrix of the leading dimensions' batch on its own); the constructor's ``view=`` and a
    param group's ``"view"`` key override it.
    """
    opts = parse_options(**options)
    if isinstance(rule, dict):
        for key, r in rule.items():
            if isinstance(r, Rule) and is_matrix_rule(r):
                raise ValueError(f"rule {key!r} holds matrices: compile it on its own (fuser.compile(rule))")
        return _multi_rule_class(rule, name, opts)
    if is_matrix_rule(rule):  # (fuser.compile builds those: fuser.optim.matrix_rules)
        raise ValueError(f"rule {rule.name!r} holds matrices: compile it with fuser.compile(rule)")
    check_state_formats(rule, opts)
    plan_and_sources(rule, dtype_plan(rule, opts, "fp32", "fp32"), opts.stochastic_rounding)  # errors now
    return rule_class(rule, name, FuserOptimizer, "rule", options=opts)


def rule_class(rule: Rule, name: str | None, base: type, what: str, **attributes) -> type:
    """The optimizer class of ``rule`` on ``base``: named after the rule (or ``name``), its
    text, defaults and states in the docstring, ``rule`` and ``attributes`` set on it."""
    cls_name = name or "".join(part.capitalize() for part in rule.name.split("_")) or "Optimizer"
    doc = (
        f"Optimizer compiled by fuser from {what} {rule.name!r}.\n\nRule:\n\n"
        + "\n".join("    " + line for line in rule.text.splitlines())
        + f"\n\nHyperparameters (defaults): {dict(rule.hyper)}\nState: {dict(rule.state)}\n"
    )
    return type(cls_name, (base,), {"rule": rule, **attributes, "__doc__": doc, "__module__": "fuser.optim"})


def _multi_rule_class(rules: dict, name: str | None, opts: Options) -> type:
    if not rules:
        raise ValueError("fuser.compile needs at least one rule")
    for key, r in rules.items():
        if not isinstance(key, str) or not isinstance(r, Rule) or r.kind != "optim":
            raise TypeError(f"fuser.compile takes a dict of names to optimizer rules; {key!r} is {r!r}")
        check_state_formats(r, opts)
        plan_and_sources(r, dtype_plan(r, opts, "fp32", "fp32"), opts.stochastic_rounding)  # errors now
    first = next(iter(rules.values()))
    doc = "Optimizer compiled by fuser from rules " + ", ".join(f"{k!r} ({r.name})" for k, r in rules.items())
    attrs = {
        "rules": dict(rules),
        "rule": first,
        "options": opts,
        "__doc__": doc,
        "__module__": "fuser.optim",
    }
    return type(name or "MultiRuleOptimizer", (MultiRuleOptimizer,), attrs)
