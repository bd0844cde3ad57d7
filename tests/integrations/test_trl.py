"""fuser.integrations.trl: trl 1.16's GRPOTrainer computing its per-token log-probs and
entropies with fuser. On a tiny fp32 Llama built from a config (TRL's own path rounds its
logits to the product's dtype: fp32 here) the trainer's own
``_get_per_token_logps_and_entropies`` is called before and after ``patch``, at a
temperature, with left and right padding, ``logits_to_keep`` and batch slicing: the values
against each other and float64, and the gradients of every parameter; then two training steps
of a patched trainer against an unpatched one from the same seed."""

import copy
import re

import pytest
import torch
from seeds import case_seed

import fuser

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

from fuser.integrations.trl import patch, use_fused_logprobs  # noqa: E402

VOCAB = 80
PAD, EOS = 0, 1


def tokenizer():
    """A word-level tokenizer of ``w0 .. w76`` built in memory (nothing comes from a hub)."""
    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


def save_tiny_llama(path, **config):
    """A tiny fp32 Llama and its tokenizer saved to a folder: GRPOTrainer builds its
    reference model from the policy's path."""
    torch.manual_seed(case_seed())
    config = transformers.LlamaConfig(
        **config,
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=EOS,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def model_dir(tmp_path):
    return save_tiny_llama(tmp_path / "model")


def reward(completions, **_):
    return [float(len(set(c.split()))) for c in completions]  # distinct words: a spread of rewards


def grpo_trainer(model_dir, **config):
    config.setdefault("bf16", False)  # fp32: TRL's own path rounds its logits to the product's dtype
    args = trl.GRPOConfig(
        output_dir=str(model_dir.parent / "out"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        max_steps=2,
        learning_rate=1e-2,
        beta=0.04,  # a reference model, and its log-probs
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=case_seed() % 2**31,
        **config,
    )
    data = datasets.Dataset.from_dict({"prompt": ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9", "w10"]})
    return trl.GRPOTrainer(
        model=str(model_dir), reward_funcs=reward, args=args, train_dataset=data, processing_class=tokenizer()
    )


def sequences():
    """Prompts left-padded and completions right-padded, as the trainer's batches are."""
    g = torch.Generator().manual_seed(case_seed(1))
    ids = torch.randint(3, VOCAB, (5, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a short prompt
    mask[2, 8:] = 0  # a short completion
    mask[4, 6:] = 0  # no completion token at all
    return ids, mask


def float64_reference(model, ids, mask, keep, temperature, softcap=None):
    """log-probs and entropies of the last ``keep`` next tokens from the model's own logits
    (soft-capped as TRL's head reads the config), in float64, 0 at padding."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.double()[:, :-1]
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits / temperature
    logsm = torch.log_softmax(logits, dim=-1)[:, -keep:]
    target = ids[:, 1:][:, -keep:]
    counted = mask[:, 1:][:, -keep:].bool()
    logp = torch.where(counted, logsm.gather(-1, target[..., None])[..., 0], 0.0)
    entropy = torch.where(counted, -(logsm.exp() * logsm).sum(-1), 0.0)
    return logp, entropy


def no_logits(model):
    def hook(*_):
        raise AssertionError("the LM head made logits")

    return model.lm_head.register_forward_hook(hook)


def logps_and_grads(trainer, ids, mask, keep, batch_size, upstream):
    model = trainer.model
    model.zero_grad()
    logp, entropy, _ = trainer._get_per_token_logps_and_entropies(
        model, ids, mask, keep, batch_size=batch_size, compute_entropy=True
    )
    (logp * upstream[0] + entropy * upstream[1]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), entropy.detach(), grads


@pytest.mark.parametrize(
    "temperature, batch_size, variant",
    [(0.7, 2, "plain"), (1.0, None, "plain"), (0.9, 3, "bias"), (0.8, 2, "softcap")],
)
def test_patched_logps_and_entropies_match_trls_own(model_dir, temperature, batch_size, variant):
    softcap = 2.0 if variant == "softcap" else None
    if softcap is not None:
        model_dir = save_tiny_llama(model_dir.parent / "capped", final_logit_softcapping=softcap)
    trainer = grpo_trainer(model_dir, temperature=temperature)
    if variant == "bias":  # a head with a bias (TRL's head and the model's logits add it)
        trainer.model.lm_head.bias = torch.nn.Parameter(torch.randn(VOCAB))
    ids, mask = sequences()
    keep = 6
    upstream = (torch.randn(5, keep), torch.rand(5, keep) + 0.5)
    want = logps_and_grads(trainer, ids, mask, keep, batch_size, upstream)
    ref_logp, ref_entropy = float64_reference(trainer.model, ids, mask, keep, temperature, softcap)

    patch(trainer)
    launches = fuser.stats()["launches"]
    handle = no_logits(trainer.model)
    got = logps_and_grads(trainer, ids, mask, keep, batch_size, upstream)
    handle.remove()
    assert fuser.stats()["launches"] > launches

    logp, entropy, grads = got
    assert logp.dtype == entropy.dtype == torch.float32 and logp.shape == (5, keep)
    assert (logp[mask[:, -keep:] == 0] == 0).all() and (entropy[mask[:, -keep:] == 0] == 0).all()
    assert (logp <= 0).all() and (entropy >= 0).all()
    # fp32 on both paths: within fp32's error of each other and of float64
    torch.testing.assert_close(logp, want[0], rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(entropy, want[1], rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(logp.double(), ref_logp, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=2e-6, atol=2e-6)
    assert grads.keys() == want[2].keys() and "lm_head.weight" in grads
    assert ("lm_head.bias" in grads) == (variant == "bias")
    for name, grad in want[2].items():  # fp32 sums in another order: relative to each tensor's size
        assert (grads[name] - grad).abs().max() <= 1e-5 * grad.abs().max(), name


@pytest.mark.parametrize("cast_lm_head_to_fp32", [False, True])
def test_under_bf16_autocast(model_dir, cast_lm_head_to_fp32):
    """GRPO's default bf16 autocast: the head's product takes bf16 inputs as TRL's does, or
    fp32 ones with ``cast_lm_head_to_fp32`` (then both paths agree to fp32's error); fuser's
    logits stay fp32 where TRL rounds them to bf16, hence the looser bound without the cast."""
    trainer = grpo_trainer(model_dir, temperature=0.8, bf16=True, cast_lm_head_to_fp32=cast_lm_head_to_fp32)
    ids, mask = sequences()
    keep = 6
    upstream = (torch.randn(5, keep), torch.rand(5, keep) + 0.5)
    want = logps_and_grads(trainer, ids, mask, keep, 2, upstream)
    patch(trainer)
    got = logps_and_grads(trainer, ids, mask, keep, 2, upstream)
    assert got[0].dtype == got[1].dtype == torch.float32
    tol = 2e-6 if cast_lm_head_to_fp32 else 5e-3
    torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol)
    torch.testing.assert_close(got[1], want[1], rtol=tol, atol=tol)
    for name, grad in want[2].items():
        assert (got[2][name] - grad).abs().max() <= (
            1e-4 if cast_lm_head_to_fp32 else 5e-2
        ) * grad.abs().max(), name


def test_reference_model_and_plain_calls(model_dir):
    """The reference model is patched too (log-probs, no entropy, as TRL's head for it);
    calls without ``fused_lm_head`` still return the model's logits."""
    trainer = grpo_trainer(model_dir, temperature=0.9)
    ids, mask = sequences()
    labels = ids.masked_fill(mask == 0, -100)
    ref = trainer.ref_model
    want = ref(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    patch(trainer)
    got = ref(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    assert got.entropy is None and want.entropy is None
    torch.testing.assert_close(got.log_probs, want.log_probs, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(got.loss, want.loss, rtol=2e-6, atol=2e-6)
    assert torch.equal(got.label_mask, want.label_mask)
    plain = trainer.model(input_ids=ids, attention_mask=mask)
    assert plain.logits.shape == (5, 11, VOCAB)


def test_two_training_steps_match_an_unpatched_trainer(model_dir):
    """Generation, old log-probs (two iterations per generation, in slices), reference
    log-probs, the loss and its gradients: a patched trainer logs what TRL's own does."""
    config = dict(temperature=0.8, num_iterations=2, optim="sgd")  # (Adam's first steps amplify noise)
    own = grpo_trainer(model_dir, **config)
    initial = [p.detach().clone() for p in own.model.parameters()]
    own.train()
    fused = patch(grpo_trainer(model_dir, **config))
    launches = fuser.stats()["launches"]
    fused.train()
    assert fuser.stats()["launches"] > launches
    logged = [(a, b) for a, b in zip(own.state.log_history, fused.state.log_history) if "loss" in a]
    assert len(logged) == 2
    for a, b in logged:
        assert a.get("num_tokens") == b.get("num_tokens") and a.get("reward") == b.get(
            "reward"
        )  # same samples
        for key in ("loss", "grad_norm", "entropy", "kl"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    for (name, p), q, p0 in zip(own.model.named_parameters(), fused.model.parameters(), initial):
        assert (q - p).abs().max() <= 1e-4 * (p - p0).abs().max(), name  # the updates agree


def test_refuses_what_it_cannot_compute(model_dir):
    model = transformers.LlamaForCausalLM.from_pretrained(str(model_dir))
    scaled = copy.deepcopy(model)
    scaled.config.logit_scale = 0.5
    with pytest.raises(ValueError, match="logit_scale"):
        use_fused_logprobs(scaled)
    with pytest.raises(ValueError, match="temperature"):
        use_fused_logprobs(model, temperature=0.0)
    with pytest.raises(TypeError, match="GRPOTrainer"):
        patch(object())


def test_example_runs(tmp_path, capsys):
    """examples/trl_grpo.py: GRPO steps with the integration on."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "trl_grpo.py"
    spec = importlib.util.spec_from_file_location("trl_grpo_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    logs = module.main(2, str(tmp_path))
    out = capsys.readouterr().out
    assert len(logs) == 2 and len(re.findall(r"step +\d+  loss", out)) == 2 and "nan" not in out
    assert all(h["entropy"] > 0 for h in logs)
