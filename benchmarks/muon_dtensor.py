"""Muon on TinyLlama-1.1B's 154 hidden matrices sharded by rows (``Shard(0)``, as FSDP2
shards them) over N GPUs, one process each (NCCL): a step's time on each rank, beside
the same optimizer on whole tensors on one GPU, and the first step's update against that
one-GPU step (both bf16 products; cuBLAS may pick other kernels for other batch sizes).

    python benchmarks/muon_dtensor.py [--gpus 2] [--out DIR] [--tag _v2]

Writes `muon_dtensor_<date><tag>.json` and `.md` under --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def hidden_shapes():
    from muon_bench import llama1b_shapes, split

    return [tuple(p.shape) for p in split([torch.empty(s, device="meta") for s in llama1b_shapes()])[0]]


def inputs(device):
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = hidden_shapes()
    params = [(torch.randn(s, device=device, generator=gen) * 0.02).bfloat16() for s in shapes]
    grads = [(torch.randn(s, device=device, generator=gen) * 1e-3).bfloat16() for s in shapes]
    return params, grads


def worker(rank: int, world: int, port: int, queue) -> None:
    import torch.distributed as dist
    from optim_bench import event_ms
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import fuser
    import fuser.optim

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    mesh = init_device_mesh("cuda", (world,))
    full, grads = inputs(torch.device("cuda", rank))
    params = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in full]
    for p, g in zip(params, grads):
        p.grad = distribute_tensor(g, mesh, [Shard(0)])
    opt = fuser.optim.Muon(params, lr=0.02)
    opt.step()
    got = [p.full_tensor() for p in params]
    before = fuser.stats()["collectives"]
    opt.step()
    collectives = fuser.stats()["collectives"] - before
    ms = event_ms(opt.step, rep=10)
    row = dict(rank=rank, ms=round(ms, 3), collectives=collectives)
    if rank == 0:
        whole = [torch.nn.Parameter(t.clone()) for t in full]
        for p, g in zip(whole, grads):
            p.grad = g.clone()
        one = fuser.optim.Muon(whole, lr=0.02)
        one.step()
        num = sum(((a.double() - b.double()) ** 2).sum() for a, b in zip(got, whole)).sqrt()
        den = sum(((b.double() - s.double()) ** 2).sum() for b, s in zip(whole, full)).sqrt()
        row["rel_err_vs_one_gpu"] = (num / den).item()
        row["one_gpu_ms"] = round(event_ms(one.step, rep=10), 3)
    queue.put(row)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    import triton

    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=worker, args=(r, args.gpus, 29611, queue)) for r in range(args.gpus)]
    for p in procs:
        p.start()
    rows = sorted((queue.get() for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join()
    date = datetime.date.today().isoformat()
    command = "python " + " ".join([os.path.relpath(__file__)] + (argv or sys.argv[1:]))
    meta = dict(date=date, device=torch.cuda.get_device_name(), gpus=args.gpus, torch=torch.__version__,
                triton=triton.__version__, command=command)  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"muon_dtensor_{date}{args.tag}")
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"# Muon on row-sharded DTensors, {args.gpus} x {meta['device']}, {date}", "",
             f"torch {meta['torch']}, triton {meta['triton']}. Command: `{meta['command']}`", "",
             "| rank | ms a step (events) | collectives a step | one GPU, whole tensors, ms | update vs it |",
             "|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        err = r.get("rel_err_vs_one_gpu")
        lines.append(f"| {r['rank']} | {r['ms']} | {r['collectives']} | {r.get('one_gpu_ms', '')} | "
                     f"{'' if err is None else f'{err:.2e}'} |")  # fmt: skip
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
