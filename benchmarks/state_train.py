"""Precision evidence for compressed optimizer state: one small causal language model
trained from the same weights on the same batches with each way of storing parameters and
AdamW's states, and the loss curves compared with torch's AdamW.

Runs (``--runs`` picks some):

- ``torch_fp32``: ``torch.optim.AdamW``, fp32 parameters and states (the reference);
- ``fuser_fp32``: ``fuser.optim.AdamW``, fp32 parameters and states;
- ``fuser_q8``: fp32 parameters, ``state_dtype="q8"`` (int8 m, uint8 v, one fp32 scale
  per 32 elements);
- ``fuser_bf16_q8_master8``: bf16 parameters, q8 states, ``master_weights="bf16+int8"``;
- ``fuser_bf16_q8_master16``: the same with ``"bf16+int16"``;
- ``fuser_bf16_q8``: bf16 parameters, q8 states, no master correction;
- ``fuser_bf16``: bf16 parameters and states (``state_dtype="param"``), no correction.

Only the storage differs between runs: the forward and backward compute in fp32 from
``p.float()`` of every parameter (``torch.func.functional_call``), so a bf16 parameter's
gradient reaches the optimizer in bf16, as in bf16 training, and nothing else changes.

Model, data and schedule come from ``fsdp_train.py``: a pre-norm decoder (RMSNorm, causal
attention, SwiGLU), N(0, 0.02) weights from ``--seed``, batches sampled from one fixed sparse
Markov chain (its entropy is ``loss_floor``), AdamW betas (0.9, 0.95), weight decay 0.1 on
matrices, linear warmup then cosine decay to a tenth of ``--lr``.

    python benchmarks/state_train.py                     # CPU preset, ~1 min (interpreter)
    PYTHONPATH=. python benchmarks/state_train.py --device cuda --steps 300 --out $OUT
    python benchmarks/state_train.py --plot RESULT.json  # the PNG again (needs matplotlib)

Writes ``state_train_<date>_<device>.json`` (every run's losses) and ``.md`` (a table and
one sparkline per run) under ``--out`` (default benchmarks/results), and the PNG when
matplotlib is importable.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from fsdp_train import BETAS, EPS, WEIGHT_DECAY, Model, initial_state, markov_data, schedule  # noqa: E402

import fuser  # noqa: E402
import fuser.optim  # noqa: E402

PRESETS = {
    # ~21 k parameters: tens of steps through Triton's interpreter in well under a minute.
    "cpu": dict(layers=2, dim=32, heads=4, vocab=64, seq=32, batch=8, steps=30, lr=5e-3, warmup=3),
    # ~12 M parameters, 4096 tokens a step: 300 steps of 7 runs in about a minute on an H100.
    "cuda": dict(layers=4, dim=384, heads=6, vocab=4096, seq=256, batch=16, steps=300, lr=2e-3, warmup=30),
}
# run name -> (parameter dtype, fuser options; None: torch.optim.AdamW)
RUNS = {
    "torch_fp32": (torch.float32, None),
    "fuser_fp32": (torch.float32, dict()),
    "fuser_q8": (torch.float32, dict(state_dtype="q8")),
    "fuser_bf16_q8_master8": (torch.bfloat16, dict(state_dtype="q8", master_weights="bf16+int8")),
    "fuser_bf16_q8_master16": (torch.bfloat16, dict(state_dtype="q8", master_weights="bf16+int16")),
    "fuser_bf16_q8": (torch.bfloat16, dict(state_dtype="q8")),
    "fuser_bf16": (torch.bfloat16, dict(state_dtype="param")),
}
REFERENCE = "torch_fp32"
SPARK = "▁▂▃▄▅▆▇█"


def make_optimizer(name: str, named: list):
    """AdamW over ``named`` [(name, tensor)], decay on matrices only (fsdp_train's groups)."""
    groups = [
        dict(params=[p for _, p in named if p.dim() >= 2], weight_decay=WEIGHT_DECAY),
        dict(params=[p for _, p in named if p.dim() < 2], weight_decay=0.0),
    ]
    _, options = RUNS[name]
    if options is None:
        return torch.optim.AdamW(groups, betas=BETAS, eps=EPS)
    return fuser.optim.AdamW(groups, betas=BETAS, eps=EPS, **options)


def state_bytes(opt) -> int:
    return sum(
        v.numel() * v.element_size()
        for st in opt.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )


def train(name: str, cfg: dict, init: dict, data: torch.Tensor, device: torch.device) -> dict:
    """One run from ``init`` over ``data``: per-step losses, the final weights (fp32, CPU),
    the state layout and the seconds taken."""
    dtype, _ = RUNS[name]
    model = Model(cfg).to(device)
    named = [
        (k, init[k].to(device=device, dtype=dtype, copy=True).requires_grad_())
        for k, _ in model.named_parameters()
    ]
    opt = make_optimizer(name, named)
    lr_at = schedule(cfg)
    losses = []
    t0 = time.perf_counter()
    for step in range(cfg["steps"]):
        for group in opt.param_groups:
            group["lr"] = cfg["lr"] * lr_at(step)
        batch = data[step].to(device)
        weights = {k: p.float() for k, p in named}  # fp32 compute from any storage dtype
        logits = torch.func.functional_call(model, weights, (batch[:, :-1],))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - t0
    first = named[1][1]  # a matrix
    layout = {
        k: str(v.dtype).replace("torch.", "")
        for k, v in opt.state[first].items()
        if isinstance(v, torch.Tensor)
    }
    n = sum(p.numel() for _, p in named)
    return dict(
        param_dtype=str(dtype).replace("torch.", ""),
        options=RUNS[name][1],
        optimizer=type(opt).__module__ + "." + type(opt).__name__,
        losses=losses,
        seconds=round(seconds, 2),
        state_bytes_per_param=round(state_bytes(opt) / n, 3),
        state_layout=layout,
        final={k: p.detach().float().cpu() for k, p in named},
    )


def compare(run: dict, ref: dict) -> dict:
    """Loss differences from the reference run, and how far the final weights are."""
    a, b = run["losses"], ref["losses"]
    diff = [x - y for x, y in zip(a, b)]
    half = len(diff) // 2
    tail = max(1, len(a) // 10)
    num = sum(((run["final"][k] - ref["final"][k]).double() ** 2).sum() for k in ref["final"])
    den = sum((ref["final"][k].double() ** 2).sum() for k in ref["final"])
    return dict(
        final_loss=sum(a[-tail:]) / tail,
        max_abs_diff=max(abs(d) for d in diff),
        mean_abs_diff_second_half=sum(abs(d) for d in diff[half:]) / max(1, len(diff) - half),
        mean_diff_second_half=sum(diff[half:]) / max(1, len(diff) - half),
        weights_rel_dist=math.sqrt(num / den),
    )


def run_all(cfg: dict, names: list, device: torch.device) -> dict:
    """Every run in ``names`` (the reference first); returns the result document (without
    the final weights)."""
    init = initial_state(cfg)
    data, floor = markov_data(cfg, world=1)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # this model's matmuls are tiny: threads cost more than they give
    names = [REFERENCE] + [n for n in names if n != REFERENCE]
    runs = {}
    for name in names:
        try:
            runs[name] = train(name, cfg, init, data, device)
        except Exception as e:  # an option fuser lacks is an error row, not the end of the run
            runs[name] = dict(error=f"{type(e).__name__}: {str(e)[:400]}", options=RUNS[name][1])
        r = runs[name]
        print(
            f"{name}: "
            + (
                r["error"]
                if "error" in r
                else f"loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}, {r['seconds']} s"
            ),
            flush=True,
        )
    torch.set_num_threads(threads)
    for r in runs.values():
        if "error" not in r:
            r.update(compare(r, runs[REFERENCE]))
    for r in runs.values():
        r.pop("final", None)
    return dict(config=cfg, loss_floor=floor, ln_vocab=math.log(cfg["vocab"]), reference=REFERENCE, runs=runs)


# --- outputs --------------------------------------------------------------------------------


def sparkline(values: list, lo: float, hi: float, width: int = 48) -> str:
    """``values`` averaged into ``width`` buckets, each drawn on the common scale [lo, hi]."""
    if not values:
        return ""
    k = max(1, math.ceil(len(values) / width))
    buckets = [sum(values[i : i + k]) / len(values[i : i + k]) for i in range(0, len(values), k)]
    span = max(hi - lo, 1e-12)
    return "".join(SPARK[min(len(SPARK) - 1, max(0, int((b - lo) / span * len(SPARK))))] for b in buckets)


def markdown(doc: dict) -> str:
    cfg, meta, runs = doc["config"], doc["meta"], doc["runs"]
    ok = {k: r for k, r in runs.items() if "error" not in r}
    steps = cfg["steps"]
    marks = sorted({0, steps // 4, steps // 2, 3 * steps // 4, steps - 1})
    lines = [
        f"# Training with compressed optimizer state, {meta['device']}, {meta['date']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}. Command: `{meta['command']}`",
        "",
        f"Model: {cfg['layers']} layers, dim {cfg['dim']}, vocab {cfg['vocab']}, seq {cfg['seq']}, "
        f"batch {cfg['batch']}, {doc['params']} parameters; lr {cfg['lr']} (warmup {cfg['warmup']}, cosine "
        f"to a tenth), {steps} steps, seed {cfg['seed']}. Loss of the true chain {doc['loss_floor']:.4f}, "
        f"ln V {doc['ln_vocab']:.4f}. Differences are against `{doc['reference']}`; final = mean of the "
        "last tenth of the steps; weights dist = ||w - w_ref|| / ||w_ref|| at the end.",
        "",
        "| run | params | options | "
        + " | ".join(f"loss @{m}" for m in marks)
        + " | final | max abs diff | mean abs diff (2nd half) | mean diff (2nd half) | weights dist "
        "| state B/param | s |",
        "|---|---|---|" + "---|" * (len(marks) + 7),
    ]
    for name, r in runs.items():
        if "error" in r:
            lines.append(f"| {name} | | {r['options']} | error: {r['error']} |" + " |" * (len(marks) + 6))
            continue
        cells = [name, r["param_dtype"], r["options"] if r["options"] is not None else "torch.optim.AdamW"]
        cells += [f"{r['losses'][m]:.4f}" for m in marks]
        cells += [f"{r['final_loss']:.4f}", f"{r['max_abs_diff']:.2e}"]
        cells += [
            f"{r[k]:.2e}" for k in ("mean_abs_diff_second_half", "mean_diff_second_half", "weights_rel_dist")
        ]
        cells += [r["state_bytes_per_param"], r["seconds"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    if ok:
        lo = min(min(r["losses"]) for r in ok.values())
        hi = max(max(r["losses"]) for r in ok.values())
        lines += ["", f"Loss per step, one scale for all runs ({lo:.3f} to {hi:.3f}):", "", "```"]
        width = max(len(k) for k in ok)
        lines += [f"{k:<{width}}  {sparkline(r['losses'], lo, hi)}" for k, r in ok.items()]
        lines.append("```")
    return "\n".join(lines) + "\n"


def plot(doc: dict, png: str) -> bool:
    """The loss curves and each run's difference from the reference; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = {k: r for k, r in doc["runs"].items() if "error" not in r}
    ref = runs.get(doc["reference"])
    fig, (ax_loss, ax_diff) = plt.subplots(1, 2, figsize=(14, 4.8))
    for i, (name, r) in enumerate(runs.items()):
        color = f"C{i}"  # the same run, the same colour in both panels
        ax_loss.plot(r["losses"], label=name, color=color, lw=2.5 if name == doc["reference"] else 1.0)
        if ref is not None and name != doc["reference"]:
            ax_diff.plot([x - y for x, y in zip(r["losses"], ref["losses"])], label=name, color=color, lw=1.0)
    ax_loss.axhline(doc["loss_floor"], color="black", ls="--", lw=1, label="entropy of the data")
    ax_loss.set(xlabel="step", ylabel="training loss", title="Loss")
    ax_diff.axhline(0.0, color="grey", lw=0.8)
    ax_diff.set(
        xlabel="step", ylabel=f"loss - loss of {doc['reference']}", title="Difference from the reference"
    )
    for ax in (ax_loss, ax_diff):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    meta = doc["meta"]
    fig.suptitle(f"AdamW state storage: {meta['device']}, torch {meta['torch']}, {meta['date']}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    for name, typ in (("layers", int), ("dim", int), ("heads", int), ("vocab", int), ("seq", int),
                      ("batch", int), ("steps", int), ("lr", float), ("warmup", int)):  # fmt: skip
        ap.add_argument(f"--{name}", type=typ, default=None, help="overrides the device's preset")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--tag", default="", help="suffix of the output files' names")
    ap.add_argument("--plot", metavar="JSON", help="only draw the PNG of a result written before")
    return ap.parse_args(argv)


def config(args) -> dict:
    cfg = dict(PRESETS[args.device])
    for key in cfg:
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    cfg.update(seed=args.seed)
    if cfg["dim"] % cfg["heads"]:
        raise SystemExit(f"--dim {cfg['dim']} is not a multiple of --heads {cfg['heads']}")
    return cfg


def main(argv=None) -> str:
    """Train every run; returns the path of the JSON written."""
    args = parse(argv)
    if args.plot:
        with open(args.plot) as f:
            doc = json.load(f)
        png = os.path.splitext(args.plot)[0] + ".png"
        print(f"wrote {png}" if plot(doc, png) else "matplotlib is not installed: no PNG")
        return args.plot
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU")
    device = torch.device(args.device)
    cfg = config(args)
    doc = run_all(cfg, args.runs, device)
    date = datetime.date.today().isoformat()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") if device.type == "cuda" else "cpu"
    doc["params"] = sum(v.numel() for v in initial_state(cfg).values())
    doc["meta"] = dict(
        date=date,
        device=name,
        torch=torch.__version__,
        triton=triton.__version__,
        command="python "
        + shlex.join([os.path.relpath(__file__)] + list(sys.argv[1:] if argv is None else argv)),
    )
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"state_train_{date}_{slug}{args.tag}")
    with open(stem + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    text = markdown(doc)
    with open(stem + ".md", "w") as f:
        f.write(text)
    print(text)
    if plot(doc, stem + ".png"):
        print(f"wrote {stem}.png")
    return stem + ".json"


if __name__ == "__main__":
    main()
