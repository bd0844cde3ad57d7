"""A Hugging Face Trainer with a fuser optimizer and a fused loss.

Trains a small randomly initialised Llama (built from a config: nothing is downloaded) on
sequences that count up, for a few steps. The optimizer is a new rule compiled by fuser and
handed to the Trainer with the scheduler ``TrainingArguments`` asks for, so the Trainer's
warmup, decay, gradient clipping, logging and checkpoints all apply. The model computes its
loss with fuser's fused linear + cross-entropy from its last hidden states and LM head
weight, so the ``[tokens, vocab]`` logits are never made.

    python examples/hf_trainer.py [--steps N]

On a machine with no GPU the model runs on CPU and the optimizer's kernel through Triton's
interpreter.
"""

import argparse
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import fuser
from fuser.integrations.transformers import trainer_optimizers, use_fused_loss


def counting(n: int, length: int, vocab: int, seed: int = 0) -> list[dict]:
    """Sequences that count up from a random start: easy to learn, so the loss falls fast."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = (torch.randint(0, vocab, (1,), generator=g) + torch.arange(length)) % vocab
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def main(steps: int = 12, output_dir: str | None = None) -> list[dict]:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config)
    data = counting(64, 32, config.vocab_size)

    # --8<-- [start:trainer]
    adabelief = fuser.rule(
        """
        m = beta1 * m + (1 - beta1) * g
        s = beta2 * s + (1 - beta2) * (g - m)**2 + eps
        p = p * (1 - lr * weight_decay) - lr * (m / (1 - beta1**step)) / (sqrt(s / (1 - beta2**step)) + eps)
    """,
        name="adabelief",
        hyper=dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-16, weight_decay=0.0),
        state=dict(m=0.0, s=0.0),
    )

    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        learning_rate=1e-2,
        weight_decay=0.01,
        warmup_steps=2,
        lr_scheduler_type="cosine",
        per_device_train_batch_size=4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
    )
    # The Trainer's own parameter groups (no decay on biases and norms), learning rate,
    # betas and epsilon from `args`, and the scheduler it names.
    opt, sched = trainer_optimizers(model, adabelief, args)
    # Training loss from the last hidden states and the LM head weight: no logits.
    model = use_fused_loss(model, fuser.losses.cross_entropy)
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, sched))
    trainer.train()
    # --8<-- [end:trainer]

    logs = [h for h in trainer.state.log_history if "loss" in h]
    for h in logs:
        print(f"step {h['step']:3d}  loss {h['loss']:.4f}  lr {h['learning_rate']:.2e}")
    print(f"fuser.stats() = {fuser.stats()}")
    return logs


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    cli = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        main(cli.steps, tmp)
