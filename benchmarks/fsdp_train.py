"""A small decoder-only transformer trained with FSDP2 on 2 ranks, twice from the same
weights and data: torch's AdamW + eager cross-entropy, then fuser's AdamW + fuser's
vocabulary-parallel cross-entropy.

Runs (same initial weights, same batches, same hyperparameters and schedule):

- ``baseline``: every module under ``fully_shard`` (each block, then the root holding the
  embedding, the final norm and the LM head); ``F.cross_entropy`` on the full logits of
  this rank's tokens, upcast to fp32; ``torch.optim.AdamW`` (``fused=True`` on CUDA, the default on CPU).
  FSDP averages the ranks' gradients, so the step follows the mean loss over the global
  batch.
- ``fuser``: the body (embedding, blocks, final norm) under ``fully_shard``; the LM head is
  split over the vocabulary: rank r holds rows ``[r*V//W, (r+1)*V//W)`` as a plain local
  ``nn.Parameter`` (not an FSDP parameter). The loss needs every token's hidden state on
  every rank, since each rank holds only a slice of the vocabulary but ranks train on
  different tokens (data parallel). So the final hidden states and targets are all-gathered
  along the token axis (``GatherTokens``, autograd-aware), and every rank calls
  ``fuser.losses.cross_entropy(h_all, head_shard, y_all, process_group=world)``: the mean
  over all tokens of the global batch, the same number on every rank. The loss gives each
  rank the exact full-batch gradient of its head rows (nothing to reduce) and the full
  ``grad_hidden`` (summed over the vocabulary group). ``GatherTokens`` hands each rank the
  rows of its own tokens; the body's gradients of the ranks are then partial sums of one
  loss, so FSDP must sum them rather than average (``set_gradient_divide_factor(1.0)``, as
  a plain ``SUM``).
  One ``fuser.optim.AdamW`` steps the sharded body and the local head rows together.

Model: token embedding, N pre-norm blocks (RMSNorm, causal attention through
``F.scaled_dot_product_attention`` with no position encoding, SwiGLU MLP), final RMSNorm,
untied LM head. On CUDA the blocks compute in bf16 (FSDP ``MixedPrecisionPolicy``, fp32
gradient reduction), parameters and optimizer states stay fp32; on CPU everything is fp32.

Data: a fixed random sparse Markov chain over the vocabulary (each token has ``branches``
successors with skewed probabilities), sampled once from ``--seed``; step s of rank r
trains on rows ``[r*B, (r+1)*B)`` of the step's global batch. Its entropy (the best
achievable loss, ``loss_floor`` in the outputs) is far below ``ln V``.

Timing: per step, CUDA events around forward + backward and around ``optimizer.step()``
(host clocks on CPU, where the numbers mean nothing); medians over the steps after
``--timing-warmup``.

    python benchmarks/fsdp_train.py [--nproc 2] [--preset gpu|cpu-smoke] [--layers N]
        [--dim D] [--heads H] [--vocab V] [--seq S] [--batch B] [--steps N] [--lr LR]
        [--warmup N] [--dtype bf16|fp32] [--seed N] [--timing-warmup N] [--out DIR]
        [--dump-params FILE]

The script spawns its own ranks on a free local port: NCCL on CUDA (one GPU per rank),
gloo on CPU. NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1`` are set for the
ranks). Writes ``fsdp_train_<date>_<device>.json`` and ``.md`` under ``--out`` (default
``benchmarks/results``); ``benchmarks/plot_fsdp.py`` draws the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import re
import shlex
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import triton
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fuser  # noqa: E402
import fuser.losses  # noqa: E402

# 8 x 1024 with a 32768 vocabulary: 170 M parameters, 8192 tokens per rank per step,
# about 9 TFLOP per rank per step.
PRESETS = {
    "gpu": dict(layers=8, dim=1024, heads=16, vocab=32768, seq=1024, batch=8, steps=300, lr=1e-3, warmup=30),
    "cpu-smoke": dict(layers=2, dim=32, heads=4, vocab=97, seq=16, batch=2, steps=3, lr=1e-2, warmup=1),
}
MULTICAST_OFF = dict(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
BETAS, EPS, WEIGHT_DECAY = (0.9, 0.95), 1e-8, 0.1
# Step-0 losses of the two runs must agree to this, relative to the loss. Both losses are
# fp32; in bf16 their logits come from bf16 matmuls of different shapes (the full head, the
# vocabulary shards), each product rounded to bf16 on its own, so 5e-3 is kept in bf16.
STEP0_RTOL = {"fp32": 1e-5, "bf16": 5e-3}


# --- model ----------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.RMSNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim, eps=1e-6)
        self.gate_up = nn.Linear(dim, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Body(nn.Module):
    """Tokens ``[B, S]`` to final hidden states ``[B, S, dim]``."""

    def __init__(self, cfg: dict):
        super().__init__()
        dim = cfg["dim"]
        step = min(256, dim)
        ffn = step * math.ceil(8 * dim / 3 / step)
        self.embed = nn.Embedding(cfg["vocab"], dim)
        self.blocks = nn.ModuleList(Block(dim, cfg["heads"], ffn) for _ in range(cfg["layers"]))
        self.norm = nn.RMSNorm(dim, eps=1e-6)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class Model(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.body = Body(cfg)
        self.head = nn.Linear(cfg["dim"], cfg["vocab"], bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(idx))


def initial_state(cfg: dict) -> dict:
    """The initial weights (CPU), the same on every rank: N(0, 0.02), the residual
    projections scaled by 1 / sqrt(2 * layers)."""
    torch.manual_seed(cfg["seed"])
    model = Model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                std = (
                    0.02 / math.sqrt(2 * cfg["layers"])
                    if name.endswith(("proj.weight", "down.weight"))
                    else 0.02
                )
                p.normal_(0.0, std)
    return {k: v.clone() for k, v in model.state_dict().items()}


# --- data -----------------------------------------------------------------------------------


def markov_data(cfg: dict, world: int, branches: int = 4) -> tuple[torch.Tensor, float]:
    """Every step's global batch, ``[steps, world * batch, seq + 1]`` int64 on the CPU, and
    the mean of ``-log p(next | current)`` over its targets (the loss of the true chain)."""
    gen = torch.Generator().manual_seed(cfg["seed"] + 1)
    vocab = cfg["vocab"]
    succ = torch.randint(0, vocab, (vocab, branches), generator=gen)
    probs = torch.softmax(2.0 * torch.randn(vocab, branches, generator=gen), dim=1)
    cdf = probs.cumsum(1)
    rows = cfg["steps"] * world * cfg["batch"]
    seqs = torch.empty(rows, cfg["seq"] + 1, dtype=torch.int64)
    seqs[:, 0] = torch.randint(0, vocab, (rows,), generator=gen)
    nll = torch.zeros((), dtype=torch.float64)
    for t in range(cfg["seq"]):
        cur = seqs[:, t]
        u = torch.rand(rows, 1, generator=gen)
        k = (u > cdf[cur]).sum(1).clamp(max=branches - 1)
        nxt = succ[cur, k]
        seqs[:, t + 1] = nxt
        p = (probs[cur] * (succ[cur] == nxt[:, None])).sum(1)
        nll -= p.double().log().sum()
    floor = float(nll / (rows * cfg["seq"]))
    return seqs.view(cfg["steps"], world * cfg["batch"], cfg["seq"] + 1), floor


# --- distributed pieces ---------------------------------------------------------------------


class GatherTokens(torch.autograd.Function):
    """``[T, ...]`` on each rank -> ``[world * T, ...]``, the ranks' rows in rank order.

    Backward returns this rank's rows of the incoming gradient, unchanged: the loss after
    the gather gives every rank the same full ``grad_hidden`` (already summed over the
    vocabulary group), so the rows are this rank's tokens' exact share of the gradient.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return gather_rows(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rank, world = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        return grad.chunk(world)[rank].contiguous(), None


# torch 2.13 renamed all_gather_into_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` (same shape on every rank) along dim 0, in rank order."""
    out = x.new_empty((dist.get_world_size(group) * x.shape[0],) + tuple(x.shape[1:]))
    _all_gather_single(out, x.contiguous(), group=group)
    return out


def vocab_slice(vocab: int, rank: int, world: int) -> slice:
    return slice(rank * vocab // world, (rank + 1) * vocab // world)


def full_params(named: list, group, head_rows: torch.Tensor | None = None, vocab: int = 0) -> dict:
    """Every parameter as a full fp32 CPU tensor, by name, on rank 0 (collective: every rank
    calls it; the others get an empty dict). ``head_rows``: this rank's vocabulary slice of
    the LM head (fuser run), gathered into ``head.weight``."""
    keep = dist.get_rank(group) == 0
    out = {}
    for n, p in named:
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        if keep:
            out[n] = full.detach().float().cpu()
    if head_rows is not None:
        world = dist.get_world_size(group)
        sizes = [len(range(vocab)[vocab_slice(vocab, r, world)]) for r in range(world)]
        pad = head_rows.detach().new_zeros(max(sizes), head_rows.shape[1])
        pad[: head_rows.shape[0]] = head_rows.detach()
        gathered = gather_rows(pad, group).view(world, max(sizes), -1)
        if keep:
            out["head.weight"] = torch.cat([gathered[r, :n] for r, n in enumerate(sizes)]).float().cpu()
    return out


def grad_norm(params: list, group) -> torch.Tensor:
    """L2 norm of every gradient over all ranks. Each element lives on one rank (FSDP shards,
    vocabulary slices of the head), so the ranks' local sums of squares add up."""
    local = [
        p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None
    ]
    sq = torch.nn.utils.get_total_norm(local).float() ** 2
    dist.all_reduce(sq, group=group)
    return sq.sqrt()


# --- one run --------------------------------------------------------------------------------


def param_groups(named: list) -> list[dict]:
    """Weight decay on matrices (embedding and head included), none on the norms."""
    return [
        dict(params=[p for _, p in named if p.dim() >= 2], weight_decay=WEIGHT_DECAY),
        dict(params=[p for _, p in named if p.dim() < 2], weight_decay=0.0),
    ]


def schedule(cfg: dict):
    """Linear warmup over ``warmup`` steps, then cosine decay to a tenth."""

    def factor(step: int) -> float:
        if step < cfg["warmup"]:
            return (step + 1) / cfg["warmup"]
        t = (step - cfg["warmup"]) / max(1, cfg["steps"] - cfg["warmup"])
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    return factor


class Timer:
    """Marks within a step: CUDA events on a GPU (read after the run), host clocks on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[list] = []

    def mark(self, new_step: bool = False):
        if new_step:
            self.marks.append([])
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks[-1].append(e)
        else:
            self.marks[-1].append(time.perf_counter())

    def intervals_ms(self) -> list[list[float]]:
        if self.cuda:
            torch.cuda.synchronize()
            return [[a.elapsed_time(b) for a, b in zip(m, m[1:])] for m in self.marks]
        return [[(b - a) * 1e3 for a, b in zip(m, m[1:])] for m in self.marks]


def train(kind: str, cfg: dict, init: dict, data: torch.Tensor, device: torch.device, mesh) -> dict:
    """One run of ``kind`` (``baseline`` or ``fuser``); per-step losses (the global batch's
    mean), per-step (forward + backward, optimizer) milliseconds and the final full
    parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    group = mesh.get_group()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    bf16 = cfg["dtype"] == "bf16"
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    shard = dict(mesh=mesh, mp_policy=policy) if bf16 else dict(mesh=mesh)
    with torch.device("meta"):
        model = Model(cfg)
    model.to_empty(device=device)
    model.load_state_dict(init)
    for block in model.body.blocks:
        fully_shard(block, **shard)
    head = None
    if kind == "baseline":
        fully_shard(model, **shard)
        named = list(model.named_parameters())
    else:
        fully_shard(model.body, **shard)
        for m in model.body.modules():
            # The name of this setter changed across torch versions.
            divide = getattr(m, "set_gradient_divide_factor", None) or getattr(
                m, "set_reduce_scatter_divide_factor", None
            )
            if divide is not None:
                divide(1.0)
                if hasattr(m, "set_force_sum_reduction_for_comms"):  # torch >= 2.12
                    m.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
        head = nn.Parameter(model.head.weight.detach()[vocab_slice(cfg["vocab"], rank, world)].clone())
        del model.head
        named = [("body." + n, p) for n, p in model.body.named_parameters()] + [("head.weight", head)]
    groups = param_groups(named)
    hyper = dict(lr=cfg["lr"], betas=BETAS, eps=EPS)
    if kind == "baseline":
        opt = torch.optim.AdamW(groups, fused=device.type == "cuda", **hyper)
    else:
        opt = fuser.optim.AdamW(groups, **hyper)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(cfg))

    timer = Timer(device)
    losses, norms = [], []
    data = data[:, rank * cfg["batch"] : (rank + 1) * cfg["batch"]].to(device)
    for step in range(cfg["steps"]):
        x, y = data[step, :, :-1], data[step, :, 1:].reshape(-1)
        timer.mark(new_step=True)
        if kind == "baseline":
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y)
        else:
            h = model.body(x)
            h_all = GatherTokens.apply(h.reshape(-1, h.shape[-1]), group)
            y_all = gather_rows(y, group)
            loss = fuser.losses.cross_entropy(h_all, head.to(h_all.dtype), y_all, process_group=group)
        loss.backward()
        timer.mark()
        opt.step()
        timer.mark()
        norms.append(grad_norm([p for _, p in named], group))
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach().float()
        if kind == "baseline":  # this rank's mean: average over the ranks
            dist.all_reduce(loss, group=group)
            loss /= world
        losses.append(loss)
    times = timer.intervals_ms()
    if kind == "baseline":
        params = full_params(named, group)
    else:
        params = full_params(named[:-1], group, head, cfg["vocab"])
    out = dict(
        losses=[float(v) for v in torch.stack(losses).cpu()],
        grad_norms=[float(v) for v in torch.stack(norms).cpu()],
        fwd_bwd_ms=[t[0] for t in times],
        opt_ms=[t[1] for t in times],
        params=params,
    )
    if kind == "fuser":
        out["fuser_stats"] = dict(fuser.stats())
    return out


# --- ranks and outputs ----------------------------------------------------------------------


def summary(run: dict, skip: int) -> dict:
    """Medians over the steps after ``skip``: step, forward + backward, optimizer; the
    optimizer's share of the step."""
    fb, op = run["fwd_bwd_ms"][skip:], run["opt_ms"][skip:]
    step = statistics.median(a + b for a, b in zip(fb, op))
    opt = statistics.median(op)
    return dict(
        step_ms=round(step, 4),
        fwd_bwd_ms=round(statistics.median(fb), 4),
        opt_ms=round(opt, 4),
        opt_share=round(opt / step, 4) if step > 0 else None,
    )


def compare_params(a: dict, b: dict) -> dict:
    """Largest absolute difference and relative L2 distance between two parameter sets."""
    diff = sq = ref = 0.0
    for name, p in a.items():
        d = (b[name] - p).double()
        diff = max(diff, float(d.abs().max()) if d.numel() else 0.0)
        sq += float((d**2).sum())
        ref += float((p.double() ** 2).sum())
    return dict(max_abs=diff, rel_l2=math.sqrt(sq / max(ref, 1e-300)))


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _worker(rank: int, world: int, cfg: dict, port: int, meta: dict):
    """One rank: both runs; rank 0 writes the outputs named in ``meta``."""
    device = torch.device(f"cuda:{rank}" if cfg["device"] == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
        **(dict(device_id=device) if device.type == "cuda" else {}),
    )
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world,))
        init = initial_state(cfg)
        data, floor = markov_data(cfg, world)
        t0 = time.perf_counter()
        runs = {}
        for kind in ("baseline", "fuser"):
            runs[kind] = train(kind, cfg, init, data, device, mesh)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            runs[kind]["wall_s"] = round(time.perf_counter() - t0, 2)
            t0 = time.perf_counter()
        if rank == 0:
            write_outputs(cfg, world, device, runs, floor, meta)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Done: leave without the interpreter's teardown, whose C++ destructors under torch
    # 2.13 with FSDP2 on gloo sometimes abort ("terminate called without an active
    # exception") after all the work is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def write_outputs(cfg: dict, world: int, device: torch.device, runs: dict, floor: float, meta: dict) -> None:
    base, fus = runs["baseline"], runs["fuser"]
    diffs = [abs(a - b) for a, b in zip(base["losses"], fus["losses"])]
    skip = min(cfg["timing_warmup"], cfg["steps"] - 1)
    step0_tol = STEP0_RTOL[cfg["dtype"]] * max(1.0, abs(base["losses"][0]))
    labels = dict(
        baseline=dict(
            optimizer="torch.optim.AdamW (fused)" if device.type == "cuda" else "torch.optim.AdamW",
            loss="F.cross_entropy, full logits",
            loss_dtype="fp32",
        ),
        fuser=dict(
            optimizer="fuser.optim.AdamW",
            loss="fuser.losses.cross_entropy, vocab-parallel",
            loss_dtype="fp32",
        ),
    )
    g0 = (base["grad_norms"][0], fus["grad_norms"][0])
    result = dict(
        config=cfg,
        world=world,
        device=device_name(device),
        torch=torch.__version__,
        triton=triton.__version__,
        command=meta["command"],
        date=meta["date"],
        loss_floor=floor,
        ln_vocab=math.log(cfg["vocab"]),
        runs={
            kind: dict(
                **labels[kind],
                losses=r["losses"],
                grad_norms=r["grad_norms"],
                fwd_bwd_ms=r["fwd_bwd_ms"],
                opt_ms=r["opt_ms"],
                wall_s=r["wall_s"],
                summary=summary(r, skip),
                **({"fuser_stats": r["fuser_stats"]} if "fuser_stats" in r else {}),
            )
            for kind, r in runs.items()
        },
        timing_skip_steps=skip,
        step0_loss_diff=diffs[0],
        step0_tolerance=step0_tol,
        max_loss_diff=max(diffs),
        step0_grad_norm_rel_diff=abs(g0[1] - g0[0]) / max(g0[0], 1e-30),
        final_loss_diff=fus["losses"][-1] - base["losses"][-1],
        final_params=compare_params(base["params"], fus["params"]),
    )
    stem = meta["stem"]
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(result) + "\n")
    if meta["dump"]:
        torch.save({k: r["params"] for k, r in runs.items()}, meta["dump"])
    print(markdown(result))
    print(f"wrote {stem}.json and .md")
    assert diffs[0] <= step0_tol, f"step-0 losses differ by {diffs[0]:.3e} > {step0_tol:.1e}"


def markdown(r: dict) -> str:
    cfg = r["config"]
    lines = [
        f"# FSDP2 training, {r['world']} x {r['device']}, {r['date']}",
        "",
        f"torch {r['torch']}, triton {r['triton']}. Command: `{r['command']}`",
        "",
        f"{cfg['layers']} layers, dim {cfg['dim']}, {cfg['heads']} heads, vocab {cfg['vocab']}, "
        f"seq {cfg['seq']}, batch {cfg['batch']} per rank, {cfg['steps']} steps, lr {cfg['lr']} "
        f"(warmup {cfg['warmup']}, cosine), {cfg['dtype']}, seed {cfg['seed']}. Medians over steps "
        f"{r['timing_skip_steps']}..{cfg['steps'] - 1}.",
        "",
        "| run | optimizer | loss (dtype) | first loss | final loss | step ms | fwd+bwd ms | opt ms "
        "| opt share | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, run in r["runs"].items():
        s = run["summary"]
        lines.append(
            f"| {kind} | {run['optimizer']} | {run['loss']} ({run['loss_dtype']}) | {run['losses'][0]:.5f} | "
            f"{run['losses'][-1]:.5f} | {s['step_ms']:.2f} | {s['fwd_bwd_ms']:.2f} | {s['opt_ms']:.2f} | "
            f"{100 * s['opt_share']:.1f}% | {run['wall_s']} |"
        )
    lines += [
        "",
        f"Loss floor of the data (the chain's entropy) {r['loss_floor']:.4f}; ln V = {r['ln_vocab']:.4f}. "
        f"|loss difference|: step 0 {r['step0_loss_diff']:.3e} (tolerance {r['step0_tolerance']:.1e}), "
        f"max {r['max_loss_diff']:.3e}, final (fuser - baseline) {r['final_loss_diff']:+.3e}. "
        f"Step-0 gradient norms differ by {r['step0_grad_norm_rel_diff']:.1e} (relative). "
        f"Final parameters: max |diff| {r['final_params']['max_abs']:.3e}, "
        f"relative L2 {r['final_params']['rel_l2']:.3e}.",
    ]
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None)
    for name, typ in (("layers", int), ("dim", int), ("heads", int), ("vocab", int), ("seq", int),
                      ("batch", int), ("steps", int), ("lr", float), ("warmup", int)):  # fmt: skip
        ap.add_argument(f"--{name}", type=typ, default=None)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timing-warmup", type=int, default=5, help="steps left out of the medians")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--dump-params", default=None, help="torch.save both runs' final full parameters here")
    return ap.parse_args(argv)


def main(argv=None) -> str:
    """Train both runs on ``--nproc`` spawned ranks; returns the path of the JSON written."""
    args = parse(argv)
    cuda = torch.cuda.is_available()
    if cuda and torch.cuda.device_count() < args.nproc:
        raise SystemExit(
            f"--nproc {args.nproc} needs as many GPUs; this host has {torch.cuda.device_count()}"
        )
    cfg = dict(PRESETS[args.preset or ("gpu" if cuda else "cpu-smoke")])
    for key in cfg:
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    cfg.update(
        dtype=args.dtype or ("bf16" if cuda else "fp32"),
        seed=args.seed,
        timing_warmup=args.timing_warmup,
        device="cuda" if cuda else "cpu",
        preset=args.preset or ("gpu" if cuda else "cpu-smoke"),
    )
    if cfg["dim"] % cfg["heads"]:
        raise SystemExit(f"--dim {cfg['dim']} is not a multiple of --heads {cfg['heads']}")
    if cuda:
        os.environ.update(MULTICAST_OFF)
    date = datetime.date.today().isoformat()
    slug = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-") if cuda else "cpu"
    meta = dict(
        command="python "
        + shlex.join([os.path.relpath(__file__)] + list(sys.argv[1:] if argv is None else argv)),
        date=date,
        stem=os.path.join(args.out, f"fsdp_train_{date}_{slug}"),
        dump=args.dump_params,
    )
    mp.spawn(_worker, args=(args.nproc, cfg, free_port(), meta), nprocs=args.nproc, join=True)
    return meta["stem"] + ".json"


if __name__ == "__main__":
    main()
