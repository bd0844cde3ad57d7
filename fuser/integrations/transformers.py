"""Hugging Face transformers: fuser optimizers in a ``Trainer``.

A compiled optimizer is a ``torch.optim.Optimizer``, so ``Trainer`` takes one as it is,
either as a class (``optimizer_cls_and_kwargs=(fuser.optim.AdamW, {...})``, with the
Trainer's own parameter groups and scheduler) or built here, the way the Trainer would build
its default, and passed as ``optimizers=(opt, scheduler)``:

    opt, sched = trainer_optimizers(model, fuser.compile(my_rule), args)
    Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, sched)).train()
"""

from __future__ import annotations

import inspect

import torch

from fuser.rules.rule import Rule


def _accepted_keywords(cls) -> set[str]:
    """Constructor keywords of an optimizer class: a compiled rule's class takes its rule's
    hyperparameters; a built-in (or any other class) takes what its signature names."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()) and hasattr(cls, "rule"):
        return set(cls.rule.hyper_defaults)
    return {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def trainer_hyper(cls, args) -> dict:
    """The keywords ``TrainingArguments`` sets for an optimizer class: ``lr`` from
    ``learning_rate``, and Adam's ``adam_beta1``, ``adam_beta2``, ``adam_epsilon`` as
    ``betas=``/``eps=`` (torch's names, taken by the built-ins) or as ``beta1``, ``beta2``,
    ``eps`` (the names rules usually give them), for the keywords the class takes."""
    accepted = _accepted_keywords(cls)
    candidates = {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2),
                  "beta1": args.adam_beta1, "beta2": args.adam_beta2, "eps": args.adam_epsilon}
    return {k: v for k, v in candidates.items() if k in accepted}


def decay_parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two param groups as ``Trainer.create_optimizer`` makes them: weights with
    ``weight_decay``, and biases and norms without."""
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]


def trainer_optimizers(model: torch.nn.Module, optimizer, args, num_training_steps: int | None = None,
                       **hyper) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """``(optimizer, scheduler)`` for ``Trainer(optimizers=...)``, built as the Trainer builds
    its default: the same parameter groups (no weight decay on biases and norms), the
    hyperparameters ``args`` sets (see ``trainer_hyper``), and the scheduler
    ``args.lr_scheduler_type`` names with its warmup.

    ``optimizer`` is a class from ``fuser.compile`` or ``fuser.optim``, or a rule (compiled
    here). ``hyper`` sets or overrides constructor keywords. ``num_training_steps`` defaults
    to ``args.max_steps``.
    """
    from transformers import get_scheduler

    cls = optimizer
    if isinstance(optimizer, Rule):
        import fuser

        cls = fuser.compile(optimizer)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"trainer_optimizers takes an optimizer class or a fuser rule, not {optimizer!r}")
    if num_training_steps is None:
        if args.max_steps is None or args.max_steps <= 0:
            raise ValueError("pass num_training_steps= (or set max_steps in TrainingArguments): "
                             "the scheduler needs the length of training")
        num_training_steps = args.max_steps
    kwargs = {**trainer_hyper(cls, args), **hyper}
    if "weight_decay" in _accepted_keywords(cls):
        groups = decay_parameter_groups(model, kwargs.pop("weight_decay", args.weight_decay))
    else:
        groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    opt = cls(groups, **kwargs)
    sched = get_scheduler(args.lr_scheduler_type, optimizer=opt,
                          num_warmup_steps=args.get_warmup_steps(num_training_steps),
                          num_training_steps=num_training_steps,
                          scheduler_specific_kwargs=args.lr_scheduler_kwargs)
    return opt, sched
