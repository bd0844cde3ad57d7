"""Hugging Face transformers: fuser optimizers in a ``Trainer``, and causal LMs whose loss
is a fused ``linear + loss`` that never holds the logits.

A compiled optimizer is a ``torch.optim.Optimizer``, so ``Trainer`` takes one as it is,
either as a class (``optimizer_cls_and_kwargs=(fuser.optim.AdamW, {...})``, with the
Trainer's own parameter groups and scheduler) or built here, the way the Trainer would build
its default, and passed as ``optimizers=(opt, scheduler)``:

    opt, sched = trainer_optimizers(model, fuser.compile(my_rule), args)
    Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, sched)).train()

``use_fused_loss(model)`` makes a causal LM compute its training loss from the final hidden
states and the LM head's weight with a fuser loss (``fuser.losses.cross_entropy`` unless told
otherwise), shifting the labels and ignoring ``-100`` as the model's own loss does, so the
``[tokens, vocab]`` logits are never made.
"""

from __future__ import annotations

import inspect
import types

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
    candidates = {
        "lr": args.learning_rate,
        "betas": (args.adam_beta1, args.adam_beta2),
        "beta1": args.adam_beta1,
        "beta2": args.adam_beta2,
        "eps": args.adam_epsilon,
    }
    return {k: v for k, v in candidates.items() if k in accepted}


def decay_parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two param groups as ``Trainer.create_optimizer`` makes them: weights with
    ``weight_decay``, and biases and norms without."""
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]


def trainer_optimizers(
    model: torch.nn.Module, optimizer, args, num_training_steps: int | None = None, **hyper
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
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
            raise ValueError(
                "pass num_training_steps= (or set max_steps in TrainingArguments): "
                "the scheduler needs the length of training"
            )
        num_training_steps = args.max_steps
    kwargs = {**trainer_hyper(cls, args), **hyper}
    if "weight_decay" in _accepted_keywords(cls):
        groups = decay_parameter_groups(model, kwargs.pop("weight_decay", args.weight_decay))
    else:
        groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    opt = cls(groups, **kwargs)
    sched = get_scheduler(
        args.lr_scheduler_type,
        optimizer=opt,
        num_warmup_steps=args.get_warmup_steps(num_training_steps),
        num_training_steps=num_training_steps,
        scheduler_specific_kwargs=args.lr_scheduler_kwargs,
    )
    return opt, sched


# Keyword arguments of a causal LM's forward that belong to its loss, not to its decoder.
_LOSS_KWARGS = ("num_items_in_batch", "shift_labels", "ignore_index")


def _fused_loss_fn(loss):
    if loss is None:
        import fuser.losses

        return fuser.losses.cross_entropy
    if isinstance(loss, Rule):
        if loss.kind != "loss":
            raise TypeError(f"use_fused_loss takes a loss rule (fuser.loss), not an {loss.kind} rule")
        import fuser

        return fuser.compile(loss)
    if not callable(loss):
        raise TypeError(
            f"loss must be a fuser loss rule or a callable like fuser.losses.cross_entropy, "
            f"not {type(loss).__name__}"
        )
    return loss


def use_fused_loss(model: torch.nn.Module, loss=None, *, skip_logits: bool | None = None, **hyper):
    """Make a causal LM (``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
    ...) compute its loss with a fused ``linear + loss`` from its final hidden states and its
    LM head, never making the logits. Returns the model, changed in place.

    ``loss`` is a loss rule from ``fuser.loss`` (compiled here) or a compiled loss; by default
    ``fuser.losses.cross_entropy``. ``hyper`` overrides its hyperparameters on every call.
    Labels are shifted by one and ``-100`` ignored, as the model's own loss does; when the
    Trainer passes ``num_items_in_batch`` (gradient accumulation) the loss is summed and
    divided by it, as the model's own loss is. ``shift_labels=`` is honoured.

    With ``skip_logits=None`` (the default) the fused path runs when labels are given and the
    model is in training mode, and the output's ``logits`` is ``None``; in eval mode the
    model runs as before (logits and its own loss), for metrics. ``True`` or ``False`` forces
    one or the other. ``del model.forward`` undoes the change.
    """
    fn = _fused_loss_fn(loss)
    _check_model(model)
    model.forward = types.MethodType(_fused_forward(type(model).forward, fn, skip_logits, hyper), model)
    return model


def _check_model(model: torch.nn.Module) -> None:
    """Raise unless the fused loss computes what ``model``'s own loss does: logits that are
    its LM head's plain output, and a decoder under ``base_model_prefix``."""
    config = getattr(model, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale"):
        if getattr(config, attr, None) not in (None, 1.0):
            raise ValueError(
                f"this model's logits use {attr}={getattr(config, attr)}; the fused loss "
                "reads the LM head's weight directly, so write that transform into the loss "
                "rule (e.g. z = cap * tanh(z / cap)) and pass it as loss="
            )
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(
            f"use_fused_loss needs a model whose output embeddings are a torch.nn.Linear, "
            f"not {type(head).__name__}"
        )
    decoder = getattr(model, model.base_model_prefix, None)
    if decoder is None or decoder is model:
        raise TypeError(f"{type(model).__name__} has no decoder under {model.base_model_prefix!r}")


def _fused_forward(original, fn, skip_logits: bool | None, hyper: dict):
    """The ``forward`` that ``use_fused_loss`` binds: the fused loss when it applies, else
    the class's own ``original``."""

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        shift_labels = kwargs.get("shift_labels")
        fused = skip_logits if skip_logits is not None else self.training
        if not fused or (labels is None and shift_labels is None):
            return original(
                self,
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                inputs_embeds=inputs_embeds,
                labels=labels,
                use_cache=use_cache,
                logits_to_keep=logits_to_keep,
                **kwargs,
            )
        decoder_kw = dict(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        return _fused_output(self, fn, labels, decoder_kw, kwargs, hyper)

    forward.__doc__ = original.__doc__
    return forward


def _fused_output(model, fn, labels, decoder_kw: dict, kwargs: dict, hyper: dict):
    """The model's output with the fused loss of its decoder's last hidden states and no logits."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    loss_kw = {k: kwargs.pop(k) for k in _LOSS_KWARGS if k in kwargs}
    outputs = getattr(model, model.base_model_prefix)(**decoder_kw, **kwargs)
    value = causal_lm_loss(
        fn, outputs.last_hidden_state, model.get_output_embeddings(), labels, **loss_kw, **hyper
    )
    return CausalLMOutputWithPast(
        loss=value,
        logits=None,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )


def causal_lm_loss(
    fn,
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    labels: torch.Tensor | None,
    *,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch=None,
    ignore_index: int = -100,
    **hyper,
) -> torch.Tensor:
    """A causal LM's loss from its last hidden states ``[batch, seq, hidden]`` and LM head,
    computed by the fused loss ``fn``: position ``i`` predicts label ``i + 1`` (or
    ``shift_labels[i]``), ``ignore_index`` is skipped; the mean over counted tokens, or the
    sum over ``num_items_in_batch`` when that is given."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.reshape(-1).to(hidden.device)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if num_items_in_batch is None:
        return fn(
            flat, head.weight, target, bias=head.bias, ignore_index=ignore_index, reduction="mean", **hyper
        )
    total = fn(flat, head.weight, target, bias=head.bias, ignore_index=ignore_index, reduction="sum", **hyper)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
