"""Run a function on several processes of one gloo (CPU) or NCCL (one GPU each) group and
bring back what each returns, on the CPU.

The workers are spawned (never forked: Triton and torch keep threads), rendezvous on a
free local port, and serve the tests of the session one function at a time. A rank that
raises stops the others at once and its traceback becomes the test failure; ranks still
running at the deadline are killed, so a hung collective fails the test instead of
blocking CI.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import os
import signal
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


def _init_group(rank: int, world: int, port: int, backend: str) -> None:
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
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    timeout = datetime.timedelta(seconds=90)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl", rank=rank, world_size=world, timeout=timeout, device_id=torch.device("cuda", rank)
        )
    else:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)


# torch's default CPU generator seed in a new process: each task starts from it, as a task in
# a freshly spawned rank did.
_FRESH_SEED = torch.initial_seed()


def _serve(rank: int, world: int, port: int, backend: str, tasks, done) -> None:
    """A pool's rank: joins the group once, then runs each task ``(fn, args, env, out)`` it
    is sent, writing ``fn``'s result (or its traceback) into the folder ``out``."""
    try:
        import interpreter_calls  # (tests/: the parent's sys.path; as in the test process)

        interpreter_calls.install()
        _init_group(rank, world, port, backend)
    except BaseException:
        done.put((rank, traceback.format_exc()))
        os._exit(1)
    done.put((rank, None))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, env, out = task
        os.environ.update(env)
        torch.manual_seed(_FRESH_SEED)
        try:
            result = fn(rank, world, *args)
            torch.save(result, Path(out) / f"{rank}.pt")
            error = None
        except BaseException:
            error = traceback.format_exc()
            (Path(out) / f"{rank}.err").write_text(error)
        done.put((rank, error))
    # Leave without the interpreter's teardown: torch 2.13's C++ destructors at exit
    # sometimes abort ("terminate called without an active exception", no Python frame).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _Pool:
    """``world`` spawned processes (never forked: Triton and torch keep threads) in one
    process group, kept for the test session: each test's function runs in ranks that have
    already imported torch, fuser and the tests' modules and joined the group, instead of
    paying a spawn, the imports and a rendezvous per test. A task that fails or hangs ends
    the pool; the next test starts a new one."""

    def __init__(self, world: int, backend: str, timeout: float):
        ctx = multiprocessing.get_context("spawn")
        self.world = world
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.done = ctx.Queue()
        port = free_port()
        self.procs = [
            ctx.Process(target=_serve, args=(r, world, port, backend, self.tasks[r], self.done), daemon=True)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        errors = self._collect(timeout, "joining the process group")
        if errors:
            self.close()
            raise AssertionError("a rank failed:\n" + "\n".join(errors))

    def _collect(self, timeout: float, what: str) -> list[str]:
        """Each rank's report of its current task: the tracebacks of those that failed. A
        rank that dies or a task still running at the deadline closes the pool."""
        import queue

        deadline = time.monotonic() + timeout
        reports: dict[int, str | None] = {}
        while len(reports) < self.world:
            try:
                rank, error = self.done.get(timeout=0.05)
                reports[rank] = error
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in reports]
            if dead:
                try:  # a rank that reported its traceback just before it left
                    rank, error = self.done.get(timeout=1.0)
                    reports[rank] = error
                    continue
                except queue.Empty:
                    pass
                self.close()
                raise AssertionError(
                    f"ranks {dead} exited with {[self.procs[r].exitcode for r in dead]} ({what})"
                )
            if any(e is not None for e in reports.values()) or time.monotonic() > deadline:
                hung = [r for r in range(self.world) if r not in reports]
                for r in hung:  # their stacks on stderr (faulthandler), then kill them
                    os.kill(self.procs[r].pid, signal.SIGUSR1)
                time.sleep(1)
                self.close()
                errors = [e for e in reports.values() if e is not None]
                if errors:
                    return errors
                raise AssertionError(f"ranks {hung} still running after {timeout:.0f} s (a hung collective?)")
        return [e for e in reports.values() if e is not None]

    def run(self, fn, args: tuple, timeout: float) -> list:
        env = {k: os.environ[k] for k in ("FUSER_TEST_SEED", "FUSER_TEST_CASE_SEED") if k in os.environ}
        with tempfile.TemporaryDirectory(prefix="fuser-ranks-") as out:
            for q in self.tasks:
                q.put((fn, args, env, out))
            errors = self._collect(timeout, fn.__name__)
            if errors:
                self.close()
                raise AssertionError("a rank failed:\n" + "\n".join(errors))
            return [
                torch.load(Path(out) / f"{r}.pt", map_location="cpu", weights_only=True)
                for r in range(self.world)
            ]

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join()


_pools: dict[tuple[int, str], _Pool] = {}


def run_ranks(fn, *args, world: int = 2, timeout: float = 300.0, backend: str = "gloo") -> list:
    """``fn(rank, world, *args)`` on ``world`` processes in one ``backend`` group (``"nccl"``:
    rank r on cuda:r); returns each rank's result (tensors, numbers, strings, in lists and
    dicts; no DTensors), its tensors on the CPU. ``args`` travel pickled: CPU tensors.

    A rank that raises stops the others at once and its traceback becomes the test failure;
    ranks still running at the deadline are killed, so a hung collective fails the test
    instead of blocking CI. The ranks are kept between calls (``_Pool``)."""
    key = (world, backend)
    pool = _pools.get(key)
    if pool is None or not pool.alive:
        pool = _pools[key] = _Pool(world, backend, timeout)
    try:
        return pool.run(fn, args, timeout)
    finally:
        if not pool.alive:
            _pools.pop(key, None)
