"""TRL (trl 1.16): a ``GRPOTrainer`` whose per-token log-probabilities and entropies come
from fuser's ``token_logprobs``, computed from the last hidden states and the LM head's
weight with logits accumulated and kept in fp32, never as ``[batch, seq, vocab]`` logits.

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data)
    fuser.integrations.trl.patch(trainer)
    trainer.train()

trl 1.16's ``GRPOTrainer._get_per_token_logps_and_entropies`` scores the completion tokens by
calling ``model(..., labels=labels, fused_lm_head=True)``, where ``labels`` is ``-100`` at
padding (``attention_mask == 0``) and before the last ``logits_to_keep`` positions, one slice
of ``batch_size`` sequences at a time; the model's forward is TRL's fused LM head
(``trl.trainer.utils.add_fused_lm_head``, with the trainer's temperature). ``patch`` puts
fuser's head in its place on the policy and the reference model, so the trainer's own method,
its slicing, masks, old and reference log-probs and entropy metrics run unchanged; calls
without ``fused_lm_head`` (generation, evaluation) reach TRL's forward as before.
"""

from __future__ import annotations

import functools
import types

import torch

# Config attributes by which a model scales its logits before the soft cap (TRL reads each).
_LOGIT_SCALES = ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")


def patch(trainer):
    """Make a trl ``GRPOTrainer`` compute its per-token log-probs (and the entropy its loss
    asks for) with ``fuser.losses.token_logprobs``, at the trainer's temperature. Call it
    after building the trainer and before ``train()``; returns the trainer."""
    from accelerate.utils import is_peft_model
    from trl import GRPOTrainer

    if not isinstance(trainer, GRPOTrainer):
        raise TypeError(f"fuser.integrations.trl.patch takes a trl GRPOTrainer, not {type(trainer).__name__}")
    model = trainer.model
    if is_peft_model(model):  # the head sits on the base model, where TRL put its own
        model = model.get_base_model()
    fp32 = bool(getattr(trainer.args, "cast_lm_head_to_fp32", False))
    use_fused_logprobs(model, temperature=trainer.temperature, entropy=True, cast_lm_head_to_fp32=fp32)
    if trainer.ref_model is not None:
        use_fused_logprobs(
            trainer.ref_model, temperature=trainer.temperature, entropy=False, cast_lm_head_to_fp32=fp32
        )
    return trainer


def use_fused_logprobs(
    model: torch.nn.Module,
    *,
    temperature: float = 1.0,
    entropy: bool = True,
    cast_lm_head_to_fp32: bool = False,
):
    """Give a causal LM the forward that TRL's fused LM head has, computed by fuser:
    ``model(..., labels=labels, fused_lm_head=True)`` returns a ``FusedCausalLMOutput`` whose
    ``log_probs`` (and ``entropy`` with ``entropy=True``) are fp32 ``[batch, seq - 1]`` (or
    ``[batch, seq]`` with ``shift_labels=``), 0 where the label is ``-100``, from the decoder's
    last hidden states and the LM head at ``temperature`` (after the config's
    ``final_logit_softcapping``). Only the counted tokens are scored. The product takes
    autocast's dtype where autocast is on, as TRL's head does, unless
    ``cast_lm_head_to_fp32``; the logits are fp32 always. Other calls go to the forward the
    model had. Returns the model, changed in place."""
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, not {temperature}")
    softcap = _check_model(model)
    previous = model.forward
    fused = _fused_forward(previous, type(model).forward, temperature, entropy, softcap, cast_lm_head_to_fp32)
    model.forward = types.MethodType(fused, model)
    return model


def _check_model(model: torch.nn.Module) -> float | None:
    """The model's logit soft cap (or ``None``); raise where fuser's head would not compute
    the logits the model's own head does."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for attr in _LOGIT_SCALES:
        if getattr(config, attr, None) not in (None, 1.0):
            raise ValueError(
                f"this model scales its logits ({attr}={getattr(config, attr)}); "
                "fuser.integrations.trl supports unscaled heads"
            )
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            "fuser.integrations.trl does not compute the MoE load-balancing loss of router logits"
        )
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"the LM head must be a torch.nn.Linear, not {type(head).__name__}")
    decoder = getattr(model, model.base_model_prefix, None)
    if decoder is None or decoder is model:
        raise TypeError(f"{type(model).__name__} has no decoder under {model.base_model_prefix!r}")
    return getattr(config, "final_logit_softcapping", None)


def _fused_forward(previous, original, temperature: float, entropy: bool, softcap: float | None, fp32: bool):
    # `generate` checks its keywords against the forward's signature: keep the class's.
    @functools.wraps(original)
    def forward(
        self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs
    ):
        if not fused_lm_head:
            passed = dict(labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch)
            return previous(*args, **{k: v for k, v in passed.items() if v is not None}, **kwargs)
        if kwargs.get("output_router_logits"):
            raise ValueError("fuser.integrations.trl does not compute the MoE load-balancing loss")
        kwargs["use_cache"] = False
        hidden = getattr(self, self.base_model_prefix)(*args, **kwargs).last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        head = self.get_output_embeddings()
        labels = labels.to(head.weight.device)
        mask = labels != -100
        x = hidden.to(head.weight.device)[mask]  # the counted tokens only: [N, H]
        logp, ent = head_logprobs(
            x, head, labels[mask], temperature=temperature, entropy=entropy, softcap=softcap, fp32=fp32
        )
        # masked_scatter keeps an all-ignored slice connected to the graph (a zero gradient).
        log_probs = logp.new_zeros(mask.shape).masked_scatter(mask, logp)
        ent = None if ent is None else ent.new_zeros(mask.shape).masked_scatter(mask, ent)
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        from trl.trainer.utils import FusedCausalLMOutput

        return FusedCausalLMOutput(
            loss=-log_probs.sum() / count, log_probs=log_probs, entropy=ent, label_mask=mask
        )

    return forward


def head_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    target: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    softcap: float | None = None,
    fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logp, entropy or None)``, fp32 ``[N]``, of ``hidden`` ``[N, H]`` under the linear
    ``head`` (its bias included) at ``temperature``. The product's inputs take the dtype TRL's
    head gives them: autocast's where it is on (unless ``fp32``, TRL's
    ``cast_lm_head_to_fp32``), else the head's; the logits are fp32 either way."""
    import fuser.losses

    device = hidden.device.type
    dtype = head.weight.dtype
    if torch.is_autocast_enabled(device) and not fp32:
        dtype = torch.get_autocast_dtype(device)
    weight = head.weight.to(dtype)
    bias = None if head.bias is None else head.bias.to(dtype)
    with torch.autocast(device, enabled=False):
        hidden = hidden.to(dtype)
        if bias is None:
            out = fuser.losses.token_logprobs(
                hidden, weight, target, temperature=temperature, entropy=entropy, softcap=softcap
            )
            return out if entropy else (out, None)
        hyper = dict(temperature=temperature) | ({} if softcap is None else dict(softcap=softcap))
        out = _with_bias(softcap is not None, entropy)(hidden, weight, target, bias, **hyper)
        return (out[0], out[1]) if entropy else (out[0], None)


@functools.cache
def _with_bias(capped: bool, entropy: bool):
    """The compiled built-in token rule, called with a bias (``token_logprobs`` takes none)."""
    import fuser
    import fuser.losses

    name = ("SOFTCAP_" if capped else "") + "TOKEN_LOGPROBS" + ("_ENTROPY" if entropy else "")
    return fuser.compile(getattr(fuser.losses, name))
