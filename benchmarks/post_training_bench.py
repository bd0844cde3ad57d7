"""Per-token log-probabilities and entropy for RL (GRPO), forward + backward, bf16: fuser
beside its own cross-entropy at the same shape and the systems it replaces.

Workload `logprobs_rl`: T=8192 tokens (8 completions of 1024), H=4096, V=151936,
`token_logprobs(..., entropy=True)` with examples/post_training.py's GRPO objective on top
(`grpo_tail`, the same for every variant); goal <= 1.05 x fuser's own cross-entropy at that
shape and <= 1 GiB of extra peak.
Variants, each in this process on this GPU:

- `fuser cross_entropy`: the reference time (`fuser.losses.cross_entropy`, mean);
- `fuser token_logprobs + GRPO`: `token_logprobs(..., entropy=True)` and the GRPO tail;
  again with `memory="lean"` (the logits recomputed by vocabulary slices in backward);
- `fuser GRPO as one rule`: examples/post_training.py's `grpo_loss_one_rule`, the same
  objective as one loss rule over per-token inputs (its gradients from the forward sweep);
- `TRL path`: the logits as TRL's GRPOTrainer takes them (`hidden @ weight.T` in bf16, divided
  by the temperature), `selective_log_softmax` and `entropy_from_logits` from trl (torch's
  same formulas where trl does not import), the same GRPO tail;
- `Liger LigerFusedLinearGRPOLoss` and verl's `linear_cross_entropy` where they import (a
  row says why where they do not).

Each variant's log-probabilities (and entropy) on the first 256 tokens are checked against
float64, and fuser's `grad_hidden` there against float64 autograd of the same loss. Extra
peak is measured above the inputs, the weight and their existing `.grad`. The floor is the
three bf16 products (forward logits, both gradients) at the GEMM rate measured in the run.

Workload `distill_jsd`: T=8192, student and teacher H=4096, V=128256, `fuser.losses.distill(
kind="jsd", beta=0.5)` (mean over tokens, no hard loss); goal <= 1.1 x (fuser's cross-entropy
at the student's shape + one teacher logits product) and >= 1.3 x Liger's chunked JSD, <= 1 GiB
of extra peak. Anchors: Liger `LigerFusedLinearJSDLoss(weight_hard_loss=0, weight_soft_loss=1)`
(the same loss) and torch.compile of the JSD on the full logits. The loss over every token
and `grad_hidden` on the first 256 are checked against float64; fuser's again with
`memory="lean"`, and with `memory="fast"` (`reduction="none"`, its mean taken in torch).

Workload `dpo`: 2 x 4 sequences (4 chosen, then 4 rejected) x 1024 tokens, the first 128 of
each a prompt (-100), H=4096, V=128256, a reference head: fuser = `token_logprobs` of the
policy, the reference's under no_grad, summed per sequence, and examples/post_training.py's
DPO formula (sigmoid, beta=0.1); goal >= 1.3 x Liger `LigerFusedLinearDPOLoss` (with its
reference model). Anchors: Liger, torch (bf16 logits, log_softmax, gather). The loss and
`grad_hidden` on the first 256 completion tokens of each sequence are checked against
float64.

The floor of each new row is the flops of its products (student or policy: logits, both
gradients; the teacher's or reference's logits once) over the tokens that count (DPO's
completion tokens, not its prompts) at the bf16 GEMM rate measured in the run; beside it,
`products_ms` times those four products as cuBLAS runs them at these shapes. Each row gives
its time, its extra peak, the floor and its ratio to its goal's reference; an anchor that
does not import or fails gives a row saying why. Tensors of one workload are freed before
the next.

    python benchmarks/post_training_bench.py [--out DIR] [--tag _v2] [--tokens 8192]
        [--workloads logprobs_rl distill_jsd dpo] [--smoke]

`--smoke` runs `distill_jsd` and `dpo` at tiny shapes on the CPU through Triton's
interpreter: fuser's variant and its float64 checks only, no anchors, no timing claims.

Writes `post_training_<date><tag>.json` and `.md` under --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import math
import os
import sys

import torch

if "--smoke" in sys.argv[1:] or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
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


WORKLOADS = ("logprobs_rl", "distill_jsd", "dpo")
V_NEW = 128256
JSD_BETA, DPO_BETA, PROMPT = 0.5, 0.1, 128


def _row(workload, name, **kw):
    row = dict(workload=workload, name=name, **kw)
    print(json.dumps(row), flush=True)
    return row


def _err(e):
    return f"{type(e).__name__}: {str(e)[:300]}"


def flops_floor_ms(t, h, v, teacher_h, tflops):
    """The floor: the flops of three products of the student (logits, dX, dW) over ``t``
    counted tokens and the teacher's logits over them, at the run's bf16 GEMM rate."""
    return 2 * t * v * (3 * h + teacher_h) / (tflops * 1e12) * 1e3


def products_ms(t, h, v, teacher_h):
    """The same four products timed as cuBLAS runs them (bf16, back to back, warm GPU):
    what cuBLAS reaches at these shapes, beside the floor."""
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(v, h, device="cuda", dtype=torch.bfloat16, generator=g)
    xt = torch.randn(t, teacher_h, device="cuda", dtype=torch.bfloat16, generator=g)
    wt = torch.randn(v, teacher_h, device="cuda", dtype=torch.bfloat16, generator=g)
    dz = torch.rand(t, v, device="cuda", dtype=torch.bfloat16, generator=g)

    def four():
        torch.mm(x, w.t())
        torch.mm(dz, w)
        torch.mm(dz.t(), x)
        torch.mm(xt, wt.t())

    floor = event_ms(four, warmup=2, rep=5)
    teacher = event_ms(lambda: torch.mm(xt, wt.t()), warmup=2, rep=5)
    return floor, teacher  # (the inputs are freed on return)


def jsd_reference(x, w, xt, wt, checked, chunk=1024):
    """float64: the mean JSD over every token, and grad_hidden of the first ``checked``."""
    t = x.shape[0]
    w64, wt64 = w.detach().double(), wt.detach().double()

    def per_token(xs, xts):
        ls = (xs @ w64.T).log_softmax(-1)
        lt = (xts @ wt64.T).log_softmax(-1)
        lm = torch.logsumexp(torch.stack([ls + math.log(1 - JSD_BETA), lt + math.log(JSD_BETA)]), 0)
        return JSD_BETA * (lt.exp() * (lt - lm)).sum(-1) + (1 - JSD_BETA) * (ls.exp() * (ls - lm)).sum(-1)

    total = 0.0
    with torch.no_grad():
        for s in range(0, t, chunk):
            total += float(per_token(x.detach()[s : s + chunk].double(), xt[s : s + chunk].double()).sum())
    xs = x.detach()[:checked].double().requires_grad_()
    (per_token(xs, xt[:checked].double()).sum() / t).backward()
    return total / t, xs.grad


def _time_row(workload, name, step, x, want_loss, want_grad, checked, floor_ms, timed, extra=None):
    """One variant: checked once against float64, then its extra peak and median time."""
    try:
        x.grad = None
        loss = step()
        errs = dict(loss_rel_err=abs(float(loss) - want_loss) / max(abs(want_loss), 1e-30))
        errs["grad_hidden_rel_err"] = rel(x.grad[:checked], want_grad)
        del loss
        if not timed:
            return _row(workload, name, **errs, **(extra or {}))
        x.grad = torch.zeros_like(x)
        peak, ms = peak_and_ms(step, rep=5)
        return _row(workload, name, fwd_bwd_ms=round(ms, 2), extra_peak_GiB=round(peak, 3),
                    floor_ms=round(floor_ms, 2), **errs, **(extra or {}))  # fmt: skip
    except Exception as e:  # one failing variant must not hide the others
        return _row(workload, name, error=_err(e))
    finally:
        if timed:
            torch.cuda.empty_cache()


def distill_inputs(t, h, ht, v, dev):
    """The student's bf16 hidden states and head (requiring grad), the teacher's, targets."""
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (torch.randn(v, h, device=dev, dtype=torch.bfloat16, generator=g) * 0.02).requires_grad_()
    xt = torch.randn(t, ht, device=dev, dtype=torch.bfloat16, generator=g)
    wt = torch.randn(v, ht, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    y = torch.randint(0, v, (t,), device=dev, generator=g)
    return x, w, xt, wt, y


def distill_jsd(rows, smoke, tflops=None):
    """``distill_jsd``: fuser's JSD beside Liger's chunked JSD and torch.compile on full logits."""
    dev = "cpu" if smoke else "cuda"
    t, h, ht, v, checked = (48, 16, 24, 61, 8) if smoke else (8192, 4096, 4096, V_NEW, CHECKED)
    x, w, xt, wt, y = distill_inputs(t, h, ht, v, dev)
    want_loss, want_grad = jsd_reference(x, w, xt, wt, checked)
    if smoke:
        floor_ms = teacher_ms = ce_ms = None
    else:
        floor_ms = flops_floor_ms(t, h, v, ht, tflops)
        four_ms, teacher_ms = products_ms(t, h, v, ht)
        w.grad = torch.zeros_like(w)
        x.grad = torch.zeros_like(x)
        try:
            ce_ms = event_ms(lambda: fuser.losses.cross_entropy(x, w, y).backward(), warmup=2, rep=5)
            ref_ms = ce_ms + teacher_ms
            name = "reference: fuser cross_entropy + one teacher logits product"
            ms = dict(fwd_bwd_ms=round(ref_ms, 2), cross_entropy_ms=round(ce_ms, 2))
            rows.append(_row("distill_jsd", name, **ms, teacher_logits_ms=round(teacher_ms, 2),
                             floor_ms=round(floor_ms, 2), products_ms=round(four_ms, 2)))  # fmt: skip
        except Exception as e:
            rows.append(_row("distill_jsd", "reference: fuser cross_entropy", error=_err(e)))
            ce_ms = None

    def fuser_step():
        loss = fuser.losses.distill(x, w, xt, wt, y, kind="jsd", beta=JSD_BETA)
        loss.backward()
        return loss.detach()

    fuser_row = _time_row("distill_jsd", "fuser distill kind=jsd", fuser_step, x, want_loss, want_grad,
                          checked, floor_ms, not smoke)  # fmt: skip
    rows.append(fuser_row)
    if smoke:
        return
    fuser_ms = fuser_row.get("fwd_bwd_ms")
    if fuser_ms and ce_ms:
        fuser_row["x_reference"] = round(fuser_ms / (ce_ms + teacher_ms), 3)  # goal <= 1.1

    def lean_step():
        loss = fuser.losses.distill(x, w, xt, wt, y, kind="jsd", beta=JSD_BETA, memory="lean")
        loss.backward()
        return loss.detach()

    name = "fuser distill kind=jsd, memory=lean"
    rows.append(_time_row("distill_jsd", name, lean_step, x, want_loss, want_grad, checked, floor_ms, True))

    def fast_step():  # (no target is ignored here, so the mean over tokens is the reduced loss)
        kw = dict(kind="jsd", beta=JSD_BETA, memory="fast", reduction="none")
        loss = fuser.losses.distill(x, w, xt, wt, y, **kw).mean()
        loss.backward()
        return loss.detach()

    name = "fuser distill kind=jsd, memory=fast, reduction=none + mean"
    row = _time_row("distill_jsd", name, fast_step, x, want_loss, want_grad, checked, floor_ms, True)
    if ce_ms and row.get("fwd_bwd_ms"):
        row["x_reference"] = round(row["fwd_bwd_ms"] / (ce_ms + teacher_ms), 3)
    rows.append(row)
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        liger = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=JSD_BETA)

        def liger_step():
            loss = liger(x, w, xt, wt, y)
            loss.backward()
            return loss.detach()

        name = f"Liger {_version('liger-kernel')} LigerFusedLinearJSDLoss"
        row = _time_row("distill_jsd", name, liger_step, x, want_loss, want_grad, checked, floor_ms, True)
    except Exception as e:
        row = _row("distill_jsd", "Liger LigerFusedLinearJSDLoss", error="import: " + _err(e))
    if fuser_ms and row.get("fwd_bwd_ms"):
        row["x_fuser"] = round(row["fwd_bwd_ms"] / fuser_ms, 3)  # goal: fuser >= 1.3 x faster
    rows.append(row)

    @torch.compile
    def full_jsd(x, w, xt, wt):
        ls = (x @ w.T).float().log_softmax(-1)
        with torch.no_grad():
            lt = (xt @ wt.T).float().log_softmax(-1)
        lm = torch.logsumexp(torch.stack([ls + math.log(1 - JSD_BETA), lt + math.log(JSD_BETA)]), 0)
        per = JSD_BETA * (lt.exp() * (lt - lm)).sum(-1) + (1 - JSD_BETA) * (ls.exp() * (ls - lm)).sum(-1)
        return per.mean()

    def compiled_step():
        loss = full_jsd(x, w, xt, wt)
        loss.backward()
        return loss.detach()

    row = _time_row("distill_jsd", "torch.compile, full logits", compiled_step, x, want_loss, want_grad,
                    checked, floor_ms, True)  # fmt: skip
    if fuser_ms and row.get("fwd_bwd_ms"):
        row["x_fuser"] = round(row["fwd_bwd_ms"] / fuser_ms, 3)
    rows.append(row)


def dpo_inputs(smoke):
    dev = "cpu" if smoke else "cuda"
    n, s, h, v = (2, 12, 16, 61) if smoke else (4, 1024, 4096, V_NEW)
    prompt = 3 if smoke else PROMPT
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(2 * n, s, h, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (torch.randn(v, h, device=dev, dtype=torch.bfloat16, generator=g) * 0.02).requires_grad_()
    xr = torch.randn(2 * n, s, h, device=dev, dtype=torch.bfloat16, generator=g)
    wr = (w.detach() + 0.002 * torch.randn(v, h, device=dev, dtype=torch.bfloat16, generator=g)).contiguous()
    y = torch.randint(0, v, (2 * n, s), device=dev, generator=g)
    y[:, :prompt] = -100
    return x, w, xr, wr, y, prompt


def dpo_reference(x, w, xr, wr, y, checked):
    """float64 DPO loss, and grad_hidden at the first ``checked`` completion tokens of each
    sequence (each token's hidden state reaches only its own log-prob)."""
    keep = y != -100
    yc = y.clamp(min=0)

    def seq_logps(hid, wt):
        out = []
        w64 = wt.detach().double()
        for i in range(hid.shape[0]):
            lq = (hid[i].detach().double() @ w64.T).log_softmax(-1)
            out.append((lq.gather(-1, yc[i, :, None])[:, 0] * keep[i]).sum())
        return torch.stack(out)

    with torch.no_grad():
        logps, ref = seq_logps(x, w), seq_logps(xr, wr)
    logps.requires_grad_()
    chosen, rejected = (logps - ref).chunk(2)
    loss = -torch.nn.functional.logsigmoid(DPO_BETA * (chosen - rejected)).mean()
    loss.backward()
    first = int(keep[0].nonzero()[0])
    span = slice(first, first + checked)
    xs = x.detach()[:, span].double().requires_grad_()
    lq = (xs @ w.detach().double().T).log_softmax(-1)
    tok = lq.gather(-1, yc[:, span, None])[..., 0] * keep[:, span]
    (tok * logps.grad[:, None]).sum().backward()
    return float(loss.detach()), xs.grad, span


def example():
    """examples/post_training.py as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "post_training", os.path.join(ROOT, "examples", "post_training.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def grpo_one_rule(x, w, y, mask, advantages, old, ref, want, floor_ms, rows):
    """examples/post_training.py's ``grpo_loss_one_rule`` (the objective as one rule, its
    gradients from the forward sweep): time, extra peak, ``grad_hidden`` against float64."""
    name = "fuser GRPO as one rule"
    one_rule = example().grpo_loss_one_rule

    def step():
        one_rule(x, w, y, mask, advantages, old, ref, **GRPO).backward()

    try:
        x.grad.zero_()
        w.grad.zero_()
        step()
        err = rel(x.grad[:, :CHECKED], want[2])
        peak, ms = peak_and_ms(step)
        row = dict(workload="logprobs_rl", name=name, fwd_bwd_ms=round(ms, 2), extra_peak_GiB=round(peak, 3),
                   gemm_floor_ms=round(floor_ms, 2), grad_hidden_rel_err=err)  # fmt: skip
    except Exception as e:  # one failing variant must not hide the others
        row = dict(workload="logprobs_rl", name=name, error=f"{type(e).__name__}: {str(e)[:300]}")
    print(json.dumps(row), flush=True)
    rows.append(row)
    torch.cuda.empty_cache()


def dpo(rows, smoke, tflops=None):
    """``dpo``: fuser's per-token log-probs summed per sequence + DPO, beside Liger and torch."""
    dpo_loss = example().dpo_loss

    x, w, xr, wr, y, _ = dpo_inputs(smoke)
    checked = 4 if smoke else CHECKED
    want_loss, want_grad, span = dpo_reference(x, w, xr, wr, y, checked)
    h, v = x.shape[-1], w.shape[0]
    counted = int((y != -100).sum())  # the prompt's tokens need no product
    floor_ms = None if smoke else flops_floor_ms(counted, h, v, xr.shape[-1], tflops)
    if not smoke:
        w.grad = torch.zeros_like(w)
        four_ms = products_ms(counted, h, v, xr.shape[-1])[0]
        rows.append(_row("dpo", "floor: the four products over the completion tokens",
                         floor_ms=round(floor_ms, 2), products_ms=round(four_ms, 2)))  # fmt: skip

    def run(name, step, timed):
        try:
            x.grad = None
            loss = step()
            errs = dict(loss_rel_err=abs(float(loss) - want_loss) / max(abs(want_loss), 1e-30),
                        grad_hidden_rel_err=rel(x.grad[:, span], want_grad))  # fmt: skip
            del loss
            if not timed:
                return _row("dpo", name, **errs)
            x.grad = torch.zeros_like(x)
            peak, ms = peak_and_ms(step, rep=5)
            return _row("dpo", name, fwd_bwd_ms=round(ms, 2), extra_peak_GiB=round(peak, 3),
                        floor_ms=round(floor_ms, 2), **errs)  # fmt: skip
        except Exception as e:
            return _row("dpo", name, error=_err(e))
        finally:
            if timed:
                torch.cuda.empty_cache()

    def fuser_step():
        loss = dpo_loss(x, w, xr, wr, y, beta=DPO_BETA)
        loss.backward()
        return loss.detach()

    fuser_row = run("fuser token_logprobs + DPO", fuser_step, not smoke)
    rows.append(fuser_row)

    def fast_step():
        loss = dpo_loss(x, w, xr, wr, y, beta=DPO_BETA, memory="fast")
        loss.backward()
        return loss.detach()

    fast_row = run("fuser token_logprobs + DPO, memory=fast", fast_step, not smoke)
    rows.append(fast_row)
    if smoke:
        return
    fuser_ms = fuser_row.get("fwd_bwd_ms")
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss

        liger = LigerFusedLinearDPOLoss(beta=DPO_BETA, use_ref_model=True)

        def liger_step():
            out = liger(w, x, y, ref_input=xr, ref_weight=wr)
            loss = out[0] if isinstance(out, tuple) else out
            loss.backward()
            return loss.detach()

        row = run(f"Liger {_version('liger-kernel')} LigerFusedLinearDPOLoss", liger_step, True)
    except Exception as e:
        row = _row("dpo", "Liger LigerFusedLinearDPOLoss", error="import: " + _err(e))
    if fuser_ms and row.get("fwd_bwd_ms"):
        row["x_fuser"] = round(row["fwd_bwd_ms"] / fuser_ms, 3)  # goal >= 1.3
        for r in (fuser_row, fast_row):
            if r.get("fwd_bwd_ms"):
                r["x_liger"] = round(r["fwd_bwd_ms"] / row["fwd_bwd_ms"], 3)  # goal <= 1 / 1.3
    rows.append(row)

    keep = y != -100
    yc = y.clamp(min=0)

    def torch_seq(hid, wt):
        lq = (hid @ wt.T).float().log_softmax(-1)  # bf16 logits, as a model returns them
        return (lq.gather(-1, yc[..., None])[..., 0] * keep).sum(-1)

    def torch_step():
        logps = torch_seq(x, w)
        with torch.no_grad():
            ref = torch_seq(xr, wr)
        chosen, rejected = (logps - ref).chunk(2)
        loss = -torch.nn.functional.logsigmoid(DPO_BETA * (chosen - rejected)).mean()
        loss.backward()
        return loss.detach()

    row = run("torch (bf16 logits, log_softmax, gather)", torch_step, True)
    if fuser_ms and row.get("fwd_bwd_ms"):
        row["x_fuser"] = round(row["fwd_bwd_ms"] / fuser_ms, 3)
    rows.append(row)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    ap.add_argument("--smoke", action="store_true", help="distill_jsd and dpo, tiny, on the CPU, untimed")
    args = ap.parse_args(argv)
    if args.smoke:
        return smoke(args, argv)
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
    warm_up()
    rows = []
    if "logprobs_rl" in args.workloads:
        logprobs_rl(args, tflops, rows)
        gc.collect()
        torch.cuda.empty_cache()
    for name, fn in (("distill_jsd", distill_jsd), ("dpo", dpo)):
        if name in args.workloads:
            warm_up()
            fn(rows, smoke=False, tflops=tflops)
            gc.collect()
            torch.cuda.empty_cache()
    write(args, meta, rows)


def smoke(args, argv):
    meta = dict(device="cpu (Triton interpreter)", torch=torch.__version__, triton=triton.__version__,
                fuser=fuser.__version__, date=datetime.date.today().isoformat(), smoke=True,
                command=" ".join(["python", os.path.relpath(__file__), *(argv or sys.argv[1:])]))  # fmt: skip
    rows = []
    for name, fn in (("distill_jsd", distill_jsd), ("dpo", dpo)):
        if name in args.workloads:
            fn(rows, smoke=True)
    write(args, meta, rows)


def logprobs_rl(args, tflops, rows):
    x, w, y, mask, advantages, old, ref = inputs(args.tokens)
    x.grad, w.grad = torch.zeros_like(x), torch.zeros_like(w)
    want = reference(x, w, y, mask, advantages, old, ref)
    floor_ms = 6 * args.tokens * H * V / (tflops * 1e12) * 1e3
    target = y.masked_fill(mask == 0, -100)

    # the reference time: fuser's own cross-entropy at this shape (the tail's cost is nil)
    def ce_step():
        fuser.losses.cross_entropy(x.view(-1, H), w, target.view(-1)).backward()

    try:
        peak, ms = peak_and_ms(ce_step)
        rows.append(
            dict(
                workload="logprobs_rl",
                name="fuser cross_entropy",
                fwd_bwd_ms=round(ms, 2),
                extra_peak_GiB=round(peak, 3),
                gemm_floor_ms=round(floor_ms, 2),
            )
        )
    except Exception as e:
        rows.append(
            dict(workload="logprobs_rl", name="fuser cross_entropy", error=f"{type(e).__name__}: {e}"[:300])
        )
    print(json.dumps(rows[-1]), flush=True)

    for memory, suffix in (("auto", ""), ("lean", ", memory=lean"), ("fast", ", memory=fast")):

        def fuser_tokens(x, w, y, memory=memory):
            return fuser.losses.token_logprobs(
                x, w, y.masked_fill(mask == 0, -100), entropy=True, memory=memory
            )

        name = "fuser token_logprobs + GRPO" + suffix
        args = (x, w, y, mask, advantages, old, ref, want, floor_ms, rows)
        measure(name, fuser_tokens, *args, check_grad=True)
    grpo_one_rule(x, w, y, mask, advantages, old, ref, want, floor_ms, rows)

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
    torch.cuda.empty_cache()  # (the inputs are freed on return)


GOALS = {
    "logprobs_rl": "fuser <= 1.05 x its own cross-entropy, <= 1 GiB extra",
    "distill_jsd": (
        "fuser <= 1.1 x (cross-entropy + one teacher logits product), Liger >= 1.3 x fuser, <= 1 GiB extra"
    ),
    "dpo": "Liger >= 1.3 x fuser",
}
ERRS = ("loss_rel_err", "logp_rel_err", "entropy_rel_err", "grad_hidden_rel_err")


def write(args, meta, rows):
    os.makedirs(args.out, exist_ok=True)
    stem = f"post_training_{meta['date']}{args.tag}{'_smoke' if args.smoke else ''}"
    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [
        f"# Post-training losses, forward + backward, bf16 ({meta.get('gpu', meta.get('device'))})",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, fuser {meta['fuser']}.",
    ]
    for workload in WORKLOADS:
        mine = [r for r in rows if r["workload"] == workload]
        if not mine:
            continue
        ce = next(
            (r["fwd_bwd_ms"] for r in mine if r["name"] == "fuser cross_entropy" and "fwd_bwd_ms" in r), None
        )
        lines += ["", f"## `{workload}`", "", f"Goal: {GOALS[workload]}.", "",
                  "| variant | fwd+bwd ms | ratio | extra peak GiB | floor ms | " + " | ".join(ERRS) + " |",
                  "|---|---|---|---|---|" + "---|" * len(ERRS)]  # fmt: skip
        for r in mine:
            if "error" in r:
                lines.append(f"| {r['name']} | error: {r['error']} |" + " |" * (4 + len(ERRS)))
                continue
            if "x_reference" in r:
                ratio = f"{r['x_reference']} x reference"
            elif "x_fuser" in r:
                ratio = f"{r['x_fuser']} x fuser"
            elif "x_liger" in r:
                ratio = f"{r['x_liger']} x Liger"
            elif ce and "fwd_bwd_ms" in r:
                ratio = f"{r['fwd_bwd_ms'] / ce:.3f} x fuser CE"
            else:
                ratio = ""
            floor = r.get("floor_ms", r.get("gemm_floor_ms", ""))
            errs = " | ".join(f"{r[k]:.2e}" if k in r else "" for k in ERRS)
            ms, peak = r.get("fwd_bwd_ms", ""), r.get("extra_peak_GiB", "")
            lines.append(f"| {r['name']} | {ms} | {ratio} | {peak} | {floor} | {errs} |")
    lines += ["", f"Command: `{meta['command']}`"]
    with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
