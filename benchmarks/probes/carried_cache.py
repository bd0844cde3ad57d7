"""Decision 6 across machines: a cache precompiled on a CPU-only machine, copied to a new
path on a GPU machine, gives zero compilations and correct results for AdamW (fp32 and
all-bf16) and the cross-entropy loss. Any call to Triton's compiler fails.

On the CPU machine:

    FUSER_CACHE_DIR=.bench/cpu-cache fuser precompile --builtins --target cuda:90 \\
        --dtype fp32 --dtype bf16 --state-dtype fp32 --state-dtype param

then, with that folder carried to the GPU machine:

    python benchmarks/probes/carried_cache.py .bench/cpu-cache

Exits non-zero when anything compiled or a result is off.
"""

from __future__ import annotations

import os
import shutil
import sys
import time


def forbid_compiling() -> None:
    import triton
    import triton.compiler
    import triton.compiler.compiler as cc

    def boom(*args, **kwargs):
        raise AssertionError("triton.compile was called")

    triton.compile = triton.compiler.compile = cc.compile = boom


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check_adamw(torch, fuser, g) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        shapes = [(1000, 37), (4099,), (3, 5, 7), (1,)]
        mine = [torch.randn(s, device="cuda", dtype=dtype, generator=g) for s in shapes]
        ref = [p.clone() for p in mine]
        for p, q in zip(mine, ref):
            p.grad = torch.randn(p.shape, device="cuda", dtype=dtype, generator=g)
            q.grad = p.grad.clone()
        bf16 = dtype == torch.bfloat16
        ours = fuser.optim.AdamW(mine, lr=1e-2, weight_decay=0.1, state_dtype="param" if bf16 else None)
        theirs = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
        for _ in range(3):
            ours.step()
            theirs.step()
        err = max(rel(a, b) for a, b in zip(mine, ref))
        print(f"{dtype} AdamW rel err vs torch fused {err:.2e}")
        assert err < (1e-2 if bf16 else 1e-6)


def check_loss(torch, fuser, g) -> None:
    x = torch.randn(257, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (torch.randn(1001, 64, device="cuda", dtype=torch.bfloat16, generator=g) * 0.1).requires_grad_()
    y = torch.randint(0, 1001, (257,), device="cuda", generator=g)
    loss = fuser.losses.cross_entropy(x, w, y)
    loss.backward()
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(x64 @ w64.T, y)
    ref.backward()
    for name, got, want in (("loss", loss, ref), ("grad x", x.grad, x64.grad), ("grad w", w.grad, w64.grad)):
        err = rel(got, want)
        print(f"{name} rel err {err:.2e}")
        assert err < 2e-2


def main() -> None:
    src, dst = sys.argv[1], "/tmp/carried-cache"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    os.environ["FUSER_CACHE_DIR"] = dst
    t0 = time.time()
    forbid_compiling()
    import torch

    import fuser
    import fuser.losses
    import fuser.optim

    g = torch.Generator(device="cuda").manual_seed(1)
    check_adamw(torch, fuser, g)
    check_loss(torch, fuser, g)
    stats = fuser.stats()
    print(stats)
    assert stats["compiles"] == 0 and stats["cache_misses"] == 0, stats
    print(f"OK: zero compilations from the carried cache, {time.time() - t0:.2f} s")


if __name__ == "__main__":
    main()
