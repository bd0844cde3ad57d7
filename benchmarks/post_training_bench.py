"""Per-token log-probabilities and entropy for RL (GRPO), forward + backward, bf16: fuser
beside its own cross-entropy at the same shape and the systems it replaces.

Workload `logprobs_rl`: T=8192 tokens (8 completions of 1024), H=4096, V=151936,
`token_logprobs(..., entropy=True)` with examples/post_training.py's GRPO objective on top
(`grpo_tail`, the same for every variant); goal <= 1.05 x fuser's own cross-entropy at that
shape and <= 1 GiB of extra peak.
Variants, each in this process on this GPU:

- `fuser cross_entropy`: the reference time (`fuser.losses.cross_entropy`, mean);
- `fuser token_logprobs + GRPO`: `token_logprobs(..., entropy=True)` and the GRPO tail;
- `TRL path`: the logits as TRL's GRPOTrainer takes them (`hidden @ weight.T` in bf16, divided
  by the temperature), `selective_log_softmax` and `entropy_from_logits` from trl (torch's
  same formulas where trl does not import), the same GRPO tail;
- `Liger LigerFusedLinearGRPOLoss` and verl's `linear_cross_entropy` where they import (a
  row says why where they do not).

Each variant's log-probabilities (and entropy) on the first 256 tokens are checked against
float64, and fuser's `grad_hidden` there against float64 autograd of the same loss. Extra
peak is measured above the inputs, the weight and their existing `.grad`. The floor is the
three bf16 products (forward logits, both gradients) at the GEMM rate measured in the run.

    python benchmarks/post_training_bench.py [--out DIR] [--tag _v2] [--tokens 8192]

Writes `post_training_<date><tag>.json` and `.md` under --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import sys

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from loss_bench import gemm_tflops, warm_up  # noqa: E402
from optim_bench import event_ms  # noqa: E402

import fuser  # noqa: E402
import fuser.losses  # noqa: E402

GIB = 1 << 30
H, V, S = 4096, 151936, 1024
GRPO = dict(epsilon_low=0.2, epsilon_high=0.28, beta=0.04, entropy_coef=0.01, temperature=1.0)
CHECKED = 256  # tokens checked against float64


def grpo_tail(logp, entropy, old_logp, ref_logp, advantages, mask, c=GRPO):
    """examples/post_training.py's objective on given [B, S] log-probs and entropy."""
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1 - c["epsilon_low"], 1 + c["epsilon_high"])
    adv = advantages[:, None]
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    log_ratio_ref = ref_logp - logp
    per_token = per_token + c["beta"] * (torch.exp(log_ratio_ref) - log_ratio_ref - 1)
    per_token = per_token - c["entropy_coef"] * entropy
    mask = mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def inputs(tokens):
    b = tokens // S
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(b, S, H, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (torch.randn(V, H, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02).requires_grad_()
    y = torch.randint(0, V, (b, S), device="cuda", generator=g)
    mask = torch.ones(b, S, device="cuda")
    mask[:, -S // 8 :] = 0  # padding after each completion
    advantages = torch.randn(b, device="cuda", generator=g)
    with torch.no_grad():
        z = (x[:, :CHECKED].double() @ w.double().T).log_softmax(-1)
        ref_small = z.gather(-1, y[:, :CHECKED, None])[..., 0]
    # old and reference log-probs near the policy's: ratios near 1, some clipped
    old = torch.full((b, S), -float(torch.log(torch.tensor(V))), device="cuda")
    old[:, :CHECKED] = ref_small.float()
    old = old + 0.1 * torch.randn(b, S, device="cuda", generator=g)
    ref = old + 0.05 * torch.randn(b, S, device="cuda", generator=g)
    return x, w, y, mask, advantages, old, ref


def reference(x, w, y, mask, advantages, old, ref):
    """float64 log-probs, entropy and grad_hidden of the first CHECKED tokens of each
    completion (each token's hidden state reaches only its own log-prob)."""
    xs = x.detach()[:, :CHECKED].double().requires_grad_()
    z = xs @ w.detach().double().T
    logq = z.log_softmax(-1)
    logp = logq.gather(-1, y[:, :CHECKED, None])[..., 0]
    entropy = -(logq.exp() * logq).sum(-1)
    m = mask[:, :CHECKED].double()
    total = mask.sum().double()
    part = grpo_tail(
        logp, entropy, old[:, :CHECKED].double(), ref[:, :CHECKED].double(), advantages.double(), m
    )
    (part * m.sum() / total).backward()
    return logp.detach(), entropy.detach(), xs.grad


def rel(a, b):
    a = a.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def peak_and_ms(step, rep=10):
    """(extra peak GiB of one ``step`` above what is allocated before it, median ms)."""
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / GIB
    return peak, event_ms(step, warmup=2, rep=rep)


def measure(name, per_token, x, w, y, mask, advantages, old, ref, want, floor_ms, rows, check_grad=False):
    """``per_token(x, w, y) -> (logp, entropy)``, both [B, S]; the GRPO tail on top."""

    def step():
        logp, entropy = per_token(x, w, y)
        loss = grpo_tail(logp, entropy, old, ref, advantages, mask)
        loss.backward()
        return logp, entropy

    try:
        x.grad.zero_()
        w.grad.zero_()
        logp, entropy = step()
        torch.cuda.synchronize()
        errs = dict(
            logp_rel_err=rel(logp.detach()[:, :CHECKED], want[0]),
            entropy_rel_err=rel(entropy.detach()[:, :CHECKED], want[1]),
            logp_max=float(logp.detach().max()),
        )
        if check_grad:
            x.grad.zero_()
            w.grad.zero_()
            step()
            errs["grad_hidden_rel_err"] = rel(x.grad[:, :CHECKED], want[2])
        del logp, entropy
        peak, ms = peak_and_ms(step)
        row = dict(
            workload="logprobs_rl",
            name=name,
            fwd_bwd_ms=round(ms, 2),
            extra_peak_GiB=round(peak, 3),
            gemm_floor_ms=round(floor_ms, 2),
            **errs,
        )
    except Exception as e:  # one failing variant must not hide the others
        row = dict(workload="logprobs_rl", name=name, error=f"{type(e).__name__}: {str(e)[:300]}")
    print(json.dumps(row), flush=True)
    rows.append(row)
    torch.cuda.empty_cache()


def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args(argv)
    tflops = gemm_tflops()
    meta = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        fuser=fuser.__version__,
        versions={d: _version(d) for d in ("trl", "liger-kernel", "verl")},
        bf16_gemm_TFLOPs=round(tflops, 1),
        date=datetime.date.today().isoformat(),
        command="python " + " ".join([os.path.relpath(__file__)] + (argv or sys.argv[1:])),
    )
    print(json.dumps(meta), flush=True)
    x, w, y, mask, advantages, old, ref = inputs(args.tokens)
    x.grad, w.grad = torch.zeros_like(x), torch.zeros_like(w)
    want = reference(x, w, y, mask, advantages, old, ref)
    floor_ms = 6 * args.tokens * H * V / (tflops * 1e12) * 1e3
    warm_up()
    rows = []
    target = y.masked_fill(mask == 0, -100)

    # the reference time: fuser's own cross-entropy at this shape (the tail's cost is nil)
    def ce_step():
        fuser.losses.cross_entropy(x.view(-1, H), w, target.view(-1)).backward()

    try:
        ms = event_ms(ce_step, warmup=2, rep=10)
        rows.append(
            dict(
                workload="logprobs_rl",
                name="fuser cross_entropy",
                fwd_bwd_ms=round(ms, 2),
                gemm_floor_ms=round(floor_ms, 2),
            )
        )
    except Exception as e:
        rows.append(
            dict(workload="logprobs_rl", name="fuser cross_entropy", error=f"{type(e).__name__}: {e}"[:300])
        )
    print(json.dumps(rows[-1]), flush=True)

    def fuser_tokens(x, w, y):
        return fuser.losses.token_logprobs(x, w, y.masked_fill(mask == 0, -100), entropy=True)

    measure(
        "fuser token_logprobs + GRPO",
        fuser_tokens,
        x,
        w,
        y,
        mask,
        advantages,
        old,
        ref,
        want,
        floor_ms,
        rows,
        check_grad=True,
    )

    try:
        from trl.trainer.utils import entropy_from_logits, selective_log_softmax

        trl_name = f"TRL {_version('trl')} path"
    except Exception as e:  # torch's same formulas
        print(json.dumps(dict(anchor="trl", error=f"{type(e).__name__}: {str(e)[:200]}")), flush=True)
        trl_name = "TRL's formulas in torch (trl did not import)"

        def selective_log_softmax(logits, index):
            return logits.log_softmax(-1).gather(-1, index[..., None])[..., 0]

        def entropy_from_logits(logits):
            logq = logits.log_softmax(-1)
            return -(logq.exp() * logq).sum(-1)

    def trl_tokens(x, w, y):
        logits = (x @ w.T) / GRPO["temperature"]  # bf16, as the trainer's model returns them
        return selective_log_softmax(logits, y), entropy_from_logits(logits)

    measure(trl_name, trl_tokens, x, w, y, mask, advantages, old, ref, want, floor_ms, rows)

    try:
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

        def verl_tokens(x, w, y):
            logp, entropy = linear_cross_entropy(x.view(-1, H), w, y.view(-1), GRPO["temperature"], "none")
            return logp.view(y.shape), entropy.view(y.shape)

        measure(
            f"verl {_version('verl')} linear_cross_entropy",
            verl_tokens,
            x,
            w,
            y,
            mask,
            advantages,
            old,
            ref,
            want,
            floor_ms,
            rows,
        )
    except Exception as e:
        rows.append(
            dict(workload="logprobs_rl", name="verl", error=f"import: {type(e).__name__}: {str(e)[:300]}")
        )
        print(json.dumps(rows[-1]), flush=True)

    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        liger = LigerFusedLinearGRPOLoss(
            beta=GRPO["beta"],
            epsilon_low=GRPO["epsilon_low"],
            epsilon_high=GRPO["epsilon_high"],
            temperature=GRPO["temperature"],
        )

        def liger_step():
            out = liger(x, w, y, mask, advantages, ref_per_token_logps=ref, old_per_token_logps=old)
            (out[0] if isinstance(out, tuple) else out).backward()

        x.grad.zero_()
        liger_step()
        torch.cuda.synchronize()
        peak, ms = peak_and_ms(liger_step, rep=5)
        liger_name = (
            f"Liger {_version('liger-kernel')} LigerFusedLinearGRPOLoss (no entropy bonus: it takes none)"
        )
        rows.append(
            dict(
                workload="logprobs_rl",
                name=liger_name,
                fwd_bwd_ms=round(ms, 2),
                extra_peak_GiB=round(peak, 3),
                gemm_floor_ms=round(floor_ms, 2),
            )
        )
    except Exception as e:
        rows.append(
            dict(
                workload="logprobs_rl",
                name="Liger LigerFusedLinearGRPOLoss",
                error=f"{type(e).__name__}: {str(e)[:300]}",
            )
        )
    print(json.dumps(rows[-1]), flush=True)
    torch.cuda.empty_cache()

    os.makedirs(args.out, exist_ok=True)
    stem = f"post_training_{meta['date']}{args.tag}"
    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    ce = next(
        (r["fwd_bwd_ms"] for r in rows if r["name"] == "fuser cross_entropy" and "fwd_bwd_ms" in r), None
    )
    lines = [
        f"# Per-token log-probs + entropy + GRPO, forward + backward, bf16 ({meta['gpu']})",
        "",
        f"T={args.tokens}, H={H}, V={V}; torch {meta['torch']}, triton {meta['triton']}, bf16 GEMM "
        f"{meta['bf16_gemm_TFLOPs']} TFLOP/s (three products' floor {floor_ms:.2f} ms). "
        "Goal: fuser <= 1.05 x its own cross-entropy, <= 1 GiB extra.",
        "",
        "| variant | fwd+bwd ms | x fuser CE | extra peak GiB | logp rel err | entropy rel err | "
        "grad_hidden rel err |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | error: {r['error']} | | | | | |")
            continue
        ratio = f"{r['fwd_bwd_ms'] / ce:.3f}" if ce else ""
        lines.append(
            f"| {r['name']} | {r['fwd_bwd_ms']} | {ratio} | {r.get('extra_peak_GiB', '')} | "
            f"{r.get('logp_rel_err', float('nan')):.2e} | {r.get('entropy_rel_err', float('nan')):.2e} | "
            f"{r.get('grad_hidden_rel_err', float('nan')):.2e} |"
        )
    lines += ["", f"Command: `{meta['command']}`"]
    with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
