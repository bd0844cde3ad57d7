"""TRL's GRPOTrainer with fuser computing its per-token log-probabilities and entropies.

Builds a small randomly initialised Llama and a word-level tokenizer in memory (nothing is
downloaded), saves them to a folder (GRPOTrainer loads its reference model from the
policy's path), and takes a few GRPO steps on a reward for distinct words. After
``fuser.integrations.trl.patch``, the policy's and the reference's log-probs of the sampled
completions, and the policy's entropies, come from ``fuser.losses.token_logprobs`` on the
last hidden states and the LM head, with the logits kept in fp32.

    python examples/trl_grpo.py [--steps N]     # needs trl (pip install 'fuser[trl]')

On a machine with no GPU the model runs on CPU and fuser's kernels through Triton's
interpreter.
"""

import argparse
import tempfile
from pathlib import Path

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

import fuser
import fuser.integrations.trl


def tiny_model(folder: Path, vocab: int = 80) -> Path:
    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(vocab - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def distinct_words(completions, **_):
    return [float(len(set(c.split()))) for c in completions]


def main(steps: int = 3, output_dir: str | None = None) -> list[dict]:
    output_dir = Path(output_dir or tempfile.mkdtemp())
    model_path = tiny_model(output_dir / "model")
    prompts = Dataset.from_dict({"prompt": ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9", "w10"] * 4})

    # --8<-- [start:grpo]
    args = GRPOConfig(
        output_dir=str(output_dir / "run"),
        max_steps=steps,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        temperature=0.9,
        beta=0.04,  # a KL term to the reference model: its log-probs come from fuser too
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        bf16=torch.cuda.is_available(),
    )
    trainer = GRPOTrainer(
        model=str(model_path), reward_funcs=distinct_words, args=args, train_dataset=prompts
    )
    # Per-token log-probs and entropies from the last hidden states and the LM head: no logits.
    fuser.integrations.trl.patch(trainer)
    trainer.train()
    # --8<-- [end:grpo]

    logs = [h for h in trainer.state.log_history if "loss" in h]
    for h in logs:
        print(f"step {h['step']:3d}  loss {h['loss']:+.4f}  entropy {h['entropy']:.4f}  kl {h['kl']:.5f}")
    print(f"fuser.stats() = {fuser.stats()}")
    return logs


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    cli = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        main(cli.steps, tmp)
