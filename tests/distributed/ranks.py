"""Run a function on several processes of one gloo (CPU) or NCCL (one GPU each) group and
bring back what each returns, on the CPU.

The workers are spawned (never forked: Triton and torch keep threads) and rendezvous on
a free local port. A rank that raises stops the others at once and its traceback becomes
the test failure; ranks still running at the deadline are killed, so a hung collective
fails the test instead of blocking CI.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import os
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, world: int, port: int, out: str, args: tuple, backend: str) -> None:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    faulthandler.enable(all_threads=True)
    try:
        timeout = datetime.timedelta(seconds=90)
        if backend == "nccl":
            torch.cuda.set_device(rank)
            dist.init_process_group(
                "nccl", rank=rank, world_size=world, timeout=timeout, device_id=torch.device("cuda", rank)
            )
        else:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
        result = fn(rank, world, *args)
        torch.save(result, Path(out) / f"{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        (Path(out) / f"{rank}.err").write_text(traceback.format_exc())
        code = 1
    else:
        code = 0
    # Leave without the interpreter's teardown: torch 2.13's C++ destructors at exit
    # sometimes abort ("terminate called without an active exception", no Python frame)
    # after the rank's work and result are complete.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_ranks(fn, *args, world: int = 2, timeout: float = 150.0, backend: str = "gloo") -> list:
    """``fn(rank, world, *args)`` on ``world`` processes in one ``backend`` group (``"nccl"``:
    rank r on cuda:r); returns each rank's result (tensors, numbers, strings, in lists and
    dicts; no DTensors), its tensors on the CPU. ``args`` travel pickled: CPU tensors."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="fuser-ranks-") as out:
        port = free_port()
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world, port, out, args, backend), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        errors = [
            (Path(out) / f"{r}.err").read_text() for r in range(world) if (Path(out) / f"{r}.err").exists()
        ]
        if errors:
            raise AssertionError("a rank failed:\n" + "\n".join(errors))
        if any(p.exitcode != 0 for p in procs) and not hung:
            raise AssertionError(f"ranks exited with {[p.exitcode for p in procs]}")
        if hung:
            raise AssertionError(f"ranks {hung} still running after {timeout:.0f} s (a hung collective?)")
        return [
            torch.load(Path(out) / f"{r}.pt", map_location="cpu", weights_only=True) for r in range(world)
        ]
