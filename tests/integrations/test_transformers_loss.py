"""use_fused_loss: a causal LM's training loss from its last hidden states and LM head weight,
with the model's own label shift, ignore_index, num_items_in_batch and shift_labels, and no
logits. Compared with the model's own loss on a tiny Llama built from a config: the wiring
through a recording stand-in, the numbers through fuser's fused cross-entropy."""

import pytest
import torch
from seeds import case_seed

import fuser
from fuser.integrations.transformers import use_fused_loss

transformers = pytest.importorskip("transformers")
LlamaConfig, LlamaForCausalLM = transformers.LlamaConfig, transformers.LlamaForCausalLM
Trainer, TrainingArguments = transformers.Trainer, transformers.TrainingArguments

VOCAB = 80


class RecordingLoss:
    """A linear + cross-entropy with the fused loss's signature, written with torch (it makes
    the logits itself): checks the wiring, and records how it was called."""

    def __init__(self):
        self.calls = []

    def __call__(self, hidden, weight, target, bias=None, *, ignore_index=-100, reduction="mean", **hyper):
        self.calls.append(
            dict(
                shape=tuple(hidden.shape),
                target=target.clone(),
                bias=bias,
                ignore_index=ignore_index,
                reduction=reduction,
                hyper=hyper,
            )
        )
        logits = torch.nn.functional.linear(hidden, weight, bias).float() * hyper.get("scale", 1.0)
        return torch.nn.functional.cross_entropy(
            logits, target, ignore_index=ignore_index, reduction=reduction
        )


def tiny_llama(seed=0):
    torch.manual_seed(case_seed(seed))
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
    )


def batch(seed=3):
    g = torch.Generator().manual_seed(case_seed(seed))
    ids = torch.randint(0, VOCAB, (3, 9), generator=g)
    labels = ids.clone()
    labels[:, :2] = -100  # prompts
    labels[2, 6:] = -100  # padding
    mask = torch.ones_like(ids)
    mask[2, 6:] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def no_logits(model):
    """Fail if the LM head's forward runs: the fused path reads its weight only."""

    def hook(*_):
        raise AssertionError("the LM head made logits")

    return model.lm_head.register_forward_hook(hook)


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("extra", [{}, {"num_items_in_batch": torch.tensor(9)}], ids=["mean", "num_items"])
def test_loss_and_gradients_match_the_models_own(extra):
    ref, fused = tiny_llama(), tiny_llama()
    ref.train()
    fused.train()
    loss_fn = RecordingLoss()
    use_fused_loss(fused, loss_fn)
    want = ref(**batch(), **extra)
    want.loss.backward()
    handle = no_logits(fused)
    got = fused(**batch(), **extra)
    got.loss.backward()
    handle.remove()
    assert got.logits is None
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=1e-6)
    gw, gf = grads(ref), grads(fused)
    assert gw.keys() == gf.keys() and "lm_head.weight" in gf
    for name in gw:
        torch.testing.assert_close(gf[name], gw[name], rtol=1e-5, atol=1e-7, msg=name)
    (call,) = loss_fn.calls
    # The model's own shift: position i predicts label i + 1; the last position predicts nothing.
    labels = batch()["labels"]
    expected = torch.cat([labels[:, 1:], torch.full((3, 1), -100)], dim=1).reshape(-1)
    assert torch.equal(call["target"], expected)
    assert call["shape"] == (27, 32) and call["ignore_index"] == -100
    assert call["reduction"] == ("sum" if extra else "mean")


@pytest.mark.parametrize("extra", [{}, {"num_items_in_batch": torch.tensor(9)}], ids=["mean", "num_items"])
@pytest.mark.parametrize("loss", [None, fuser.losses.CROSS_ENTROPY], ids=["default", "rule"])
def test_fuser_loss_matches_the_models_own(loss, extra):
    ref, fused = tiny_llama(), tiny_llama()
    use_fused_loss(fused, loss)
    want = ref(**batch(), **extra)
    want.loss.backward()
    handle = no_logits(fused)
    got = fused(**batch(), **extra)
    got.loss.backward()
    handle.remove()
    assert got.logits is None
    torch.testing.assert_close(got.loss, want.loss, rtol=2e-6, atol=2e-6)
    gw, gf = grads(ref), grads(fused)
    for name in gw:
        torch.testing.assert_close(gf[name], gw[name], rtol=1e-4, atol=1e-6, msg=name)


def test_fuser_loss_in_bf16():
    ref, fused = tiny_llama().to(torch.bfloat16), tiny_llama().to(torch.bfloat16)
    use_fused_loss(fused)
    want, got = ref(**batch()), fused(**batch())
    # fp32, as the model's own loss (it upcasts the logits) and whatever the model's dtype
    assert got.loss.dtype == want.loss.dtype == torch.float32 and got.logits is None
    torch.testing.assert_close(got.loss.float(), want.loss.float(), rtol=1e-2, atol=1e-2)


def test_a_custom_loss_rule_with_its_hyperparameters():
    """A new loss from fuser.loss, with a hyperparameter override, against the same math on
    the model's own logits."""
    rule = fuser.loss(
        """
        lse = logsumexp(z)
        loss = lse - z[y] + z_loss * lse**2
    """,
        name="ce_zloss",
        hyper=dict(z_loss=1e-4),
    )
    model = use_fused_loss(tiny_llama(), rule, z_loss=0.05)
    got = model(**batch()).loss
    ref = tiny_llama()
    logits = ref(input_ids=batch()["input_ids"], attention_mask=batch()["attention_mask"]).logits
    labels = torch.nn.functional.pad(batch()["labels"], (0, 1), value=-100)[:, 1:].reshape(-1)
    logits = logits.reshape(-1, VOCAB)
    lse = torch.logsumexp(logits, -1)
    keep = labels != -100
    per_token = lse - logits.gather(1, labels.clamp(min=0)[:, None])[:, 0] + 0.05 * lse**2
    torch.testing.assert_close(got, per_token[keep].mean(), rtol=1e-5, atol=1e-6)


def test_shift_labels_and_hyperparameters_pass_through():
    model = tiny_llama()
    loss_fn = RecordingLoss()
    use_fused_loss(model, loss_fn, scale=0.5)
    shift = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(case_seed(4)))
    inputs = batch()
    out = model(input_ids=inputs["input_ids"], shift_labels=shift)
    (call,) = loss_fn.calls
    assert torch.equal(call["target"], shift.reshape(-1)) and call["hyper"] == {"scale": 0.5}
    ref = tiny_llama()
    logits = ref(input_ids=inputs["input_ids"]).logits.float() * 0.5
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), shift.reshape(-1))
    torch.testing.assert_close(out.loss, want, rtol=1e-6, atol=1e-6)


def test_eval_mode_keeps_logits_unless_told():
    model = tiny_llama()
    loss_fn = RecordingLoss()
    use_fused_loss(model, loss_fn)
    model.eval()
    out = model(**batch())
    assert out.logits is not None and out.logits.shape == (3, 9, VOCAB) and not loss_fn.calls
    assert model(input_ids=batch()["input_ids"]).logits is not None  # no labels: plain forward
    forced = use_fused_loss(tiny_llama(), loss_fn, skip_logits=True).eval()
    assert forced(**batch()).logits is None and len(loss_fn.calls) == 1
    torch.testing.assert_close(forced(**batch()).loss, out.loss, rtol=1e-6, atol=1e-6)
    del model.forward  # undoes the change
    model.train()
    assert model(**batch()).logits is not None and len(loss_fn.calls) == 2


def test_refuses_what_it_cannot_fuse():
    with pytest.raises(TypeError, match="loss rule"):
        use_fused_loss(tiny_llama(), fuser.optim.AdamW.rule)
    with pytest.raises(TypeError, match="callable"):
        use_fused_loss(tiny_llama(), 3)
    model = tiny_llama()
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        use_fused_loss(model, RecordingLoss())


def test_trainer_with_gradient_accumulation(tmp_path):
    """The Trainer passes num_items_in_batch to a model whose forward takes **kwargs; the
    fused path divides the summed loss by it exactly as the model's own loss does.

    The runs train with fuser's SGD with momentum: its update is linear in the gradient, so
    a gradient scaled wrongly (the bug this guards against) moves every parameter by a
    multiple of its update, and fp32's rounding moves it by a bounded fraction of it. Adam
    would hide the first (its update ignores the gradient's scale) and magnify the second
    without bound where a gradient is near zero (its update is g / sqrt(v))."""
    g = torch.Generator().manual_seed(case_seed(5))
    data = []
    for i in range(12):
        ids = torch.randint(0, VOCAB, (10,), generator=g)
        labels = ids.clone()
        labels[: 2 + i % 5] = -100  # different counts per row: the mean of means would differ
        data.append({"input_ids": ids, "labels": labels})

    def run(model, out):
        args = TrainingArguments(
            output_dir=str(out),
            max_steps=3,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            learning_rate=0.1,
            max_grad_norm=0.0,  # no clipping: it would scale a wrong gradient back
            report_to="none",
            use_cpu=True,
            save_strategy="no",
            logging_steps=1,
            seed=case_seed() % 2**31,
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=data,
            optimizer_cls_and_kwargs=(fuser.optim.SGD, dict(lr=0.1, momentum=0.9)),
        )
        trainer.train()
        return model, [h["loss"] for h in trainer.state.log_history if "loss" in h]

    initial = [p.detach().clone() for p in tiny_llama().parameters()]
    loss_fn = RecordingLoss()
    ref, ref_losses = run(tiny_llama(), tmp_path / "ref")
    wired, losses = run(use_fused_loss(tiny_llama(), loss_fn), tmp_path / "wired")
    assert len(loss_fn.calls) == 6 and all(c["reduction"] == "sum" for c in loss_fn.calls)
    # A mean of positive terms (-log softmax) over at most 80 vocabulary entries and 40
    # tokens: fp32 sums it to within (80 + 40) * 6e-8 = 7e-6 of its value.
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    # fuser's own loss and optimizer together: the same run to fp32 rounding.
    fused, fused_losses = run(use_fused_loss(tiny_llama()), tmp_path / "fused")
    assert fused_losses == pytest.approx(ref_losses, rel=1e-5)
    for model in (wired, fused):
        for (name, p), q, q0 in zip(model.named_parameters(), ref.parameters(), initial):
            # Norm-wise over each tensor, against its largest update: a gradient element's
            # fp32 error is at most n * u (n <= 80 + 48 + 40 terms for this model and batch,
            # u = 6e-8) times the sum of the |terms| it adds; taking that sum as at most 40
            # (tokens per step) times the largest update gives 168 * 6e-8 * 40 = 4e-4 of it
            # (measured: under 5e-5). Each of the 3 steps also rounds the parameter itself,
            # by u * |p|, in either run.
            moved, rounding = (q - q0).abs().max(), 2 * 3 * 6e-8 * q.abs().max()
            assert moved > 100 * rounding, f"{name}: its update is within rounding of nothing"
            err = (p - q).abs().max()
            assert err <= 1e-3 * moved + rounding, f"{name}: {err:.3g} > {1e-3 * moved + rounding:.3g}"
