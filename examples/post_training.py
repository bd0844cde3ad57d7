"""GRPO, DPO and SimPO losses on fuser's per-token log-probabilities and entropy.

``fuser.losses.token_logprobs`` computes each completion token's log-probability under the
policy head and the entropy of its distribution straight from the last hidden states,
never holding the ``[tokens, vocab]`` logits (which it accumulates and keeps in fp32). The
rest of the objective is a few lines of torch over ``[B, S]`` tensors: the clipped ratio
(``epsilon_low``/``epsilon_high``, as DAPO decouples them), a KL penalty to a reference
policy's log-probabilities through the k3 estimator ``exp(ref - logp) - (ref - logp) - 1``
with weight ``beta``, an entropy bonus, and DAPO's token-level normalisation (the sum over
every completion token of the batch over their count). ``grpo_loss_one_rule`` writes the
same objective as one loss rule over per-token inputs, whose gradients come out of the
forward sweep.

The preference losses sum the same per-token log-probabilities over each sequence's
completion tokens (``-100`` elsewhere), the batch holding the chosen sequences and then the
rejected ones, as TRL concatenates them: DPO against a frozen reference head (TRL's
``DPOTrainer``, ``loss_type="sigmoid"``, with the conservative ``label_smoothing`` of
``CPOTrainer``'s sigmoid loss), and SimPO on length-normalised sums with a target margin
(TRL's ``CPOTrainer(loss_type="simpo", cpo_alpha=0)``).

Run it as a script to take a few steps on a tiny policy head; on a machine with no GPU the
kernels run through Triton's interpreter on CPU tensors.
"""

import torch

import fuser.losses


# --8<-- [start:grpo]
def grpo_loss(
    hidden,  # [B, S, H] the policy's last hidden states at the completion tokens
    weight,  # [V, H] its output head
    completion,  # [B, S] sampled token ids
    mask,  # [B, S] 1 for completion tokens, 0 for padding
    advantages,  # [B] one per sequence (group-normalised rewards)
    old_logp,  # [B, S] log-probs of the policy that sampled the completions
    ref_logp,  # [B, S] log-probs of the reference policy
    *,
    epsilon_low=0.2,
    epsilon_high=0.28,
    beta=0.04,
    entropy_coef=0.01,
    temperature=1.0,
):
    target = completion.masked_fill(mask == 0, -100)  # padding: 0 in logp and entropy
    logp, entropy = fuser.losses.token_logprobs(hidden, weight, target, temperature=temperature, entropy=True)
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    adv = advantages[:, None]
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    log_ratio_ref = ref_logp - logp
    per_token = per_token + beta * (torch.exp(log_ratio_ref) - log_ratio_ref - 1)
    per_token = per_token - entropy_coef * entropy
    mask = mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)  # DAPO: over every token
    # --8<-- [end:grpo]


# --8<-- [start:grpo_rule]
# The same objective as one rule over per-token inputs: its gradients come out of the
# forward sweep (three products a chunk, as the cross-entropy's, not four).
GRPO_RULE = fuser.compile(
    fuser.loss(
        """
        z = z / temperature
        lse = logsumexp(z)
        d = z[y] - lse
        logp = where(d < 0, d, 0)
        entropy = sum(exp(z - lse) * (lse - z))
        ratio = exp(logp - old)
        clipped = -minimum(ratio * adv, clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv)
        kl = exp(ref - logp) - (ref - logp) - 1
        loss = (clipped + beta * kl - entropy_coef * entropy) * w
        """,
        name="grpo",
        hyper=dict(epsilon_low=0.2, epsilon_high=0.28, beta=0.04, entropy_coef=0.01, temperature=1.0),
        inputs=("old", "ref", "adv", "w"),
    )
)


def grpo_loss_one_rule(hidden, weight, completion, mask, advantages, old_logp, ref_logp, **hyper):
    """``grpo_loss`` as one rule; ``hyper``: its keywords (``beta=``, ``temperature=``, ...)."""
    target = completion.masked_fill(mask == 0, -100)
    w = mask / mask.sum().clamp(min=1)  # DAPO: over every token of the batch
    adv = advantages[:, None].expand_as(old_logp)
    return GRPO_RULE(
        hidden, weight, target, old=old_logp, ref=ref_logp, adv=adv, w=w, reduction="sum", **hyper
    )
    # --8<-- [end:grpo_rule]


# --8<-- [start:preference]
def sequence_logps(hidden, weight, target, *, average=False, memory="auto"):
    """Sum (or mean) of each sequence's log-probs over its counted tokens: [N, S] -> [N]."""
    logp = fuser.losses.token_logprobs(hidden, weight, target, memory=memory)  # 0 at -100
    total = logp.sum(-1)
    return total / (target != -100).sum(-1).clamp(min=1) if average else total


def preference_loss(margin, label_smoothing=0.0):
    """-log sigmoid(margin), mixed with the flipped preference by label_smoothing."""
    sig = torch.nn.functional.logsigmoid
    return (-(1 - label_smoothing) * sig(margin) - label_smoothing * sig(-margin)).mean()


def dpo_loss(
    hidden,  # [2N, S, H] the policy's last hidden states: N chosen sequences, then N rejected
    weight,  # [V, H] its output head
    ref_hidden,  # [2N, S, H'] the frozen reference model's, on the same sequences
    ref_weight,  # [V, H'] its head
    target,  # [2N, S] next-token ids, -100 at prompt and padding
    *,
    beta=0.1,
    label_smoothing=0.0,
    memory="auto",  # "fast": the policy's fp32 logits kept for backward, one product fewer
):
    logps = sequence_logps(hidden, weight, target, memory=memory)
    with torch.no_grad():
        ref_logps = sequence_logps(ref_hidden, ref_weight, target)
    chosen, rejected = (logps - ref_logps).chunk(2)  # log-ratios to the reference
    return preference_loss(beta * (chosen - rejected), label_smoothing)


def simpo_loss(hidden, weight, target, *, beta=2.0, gamma=0.5, label_smoothing=0.0):
    chosen, rejected = sequence_logps(hidden, weight, target, average=True).chunk(2)
    return preference_loss(beta * (chosen - rejected) - gamma, label_smoothing)
    # --8<-- [end:preference]


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    B, S, H, V = 4, 9, 16, 61
    weight = (torch.randn(V, H, device=device) * 0.3).requires_grad_()
    reference = weight.detach().clone()
    hidden = torch.randn(B, S, H, device=device)
    completion = torch.randint(0, V, (B, S), device=device)
    mask = torch.ones(B, S, device=device)
    mask[:, -2:] = 0  # padding after each completion
    advantages = torch.randn(B, device=device)
    with torch.no_grad():
        old_logp = fuser.losses.token_logprobs(hidden, weight, completion)
        ref_logp = fuser.losses.token_logprobs(hidden, reference, completion)
    opt = torch.optim.SGD([weight], lr=0.5)
    for step in range(3):
        loss = grpo_loss(hidden, weight, completion, mask, advantages, old_logp, ref_logp)
        one_rule = grpo_loss_one_rule(hidden, weight, completion, mask, advantages, old_logp, ref_logp)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step}: GRPO loss {loss.item():+.6f} (as one rule {one_rule.item():+.6f})")

    # Preference pairs: 2 chosen then 2 rejected completions after a 3-token prompt.
    target = torch.randint(0, V, (4, S), device=device)
    target[:, :3] = -100
    target[1::2, -2:] = -100  # shorter completions, padded
    for step in range(2):
        dpo = dpo_loss(hidden, weight, hidden, reference, target, beta=0.1)
        simpo = simpo_loss(hidden, weight, target)
        opt.zero_grad()
        (dpo + simpo).backward()
        opt.step()
        print(f"step {step}: DPO loss {dpo.item():+.6f}, SimPO loss {simpo.item():+.6f}")


if __name__ == "__main__":
    main()
