"""fp32 inputs' matmul tiles on a GPU: forward + backward of the lean and scaled schedules
(and torch's fp32 cross-entropy, TF32 off) for one tile variant per process.

``python benchmarks/loss_fp32_tiles.py VARIANT``: ``default`` runs fuser's own choice
(``Tiles.for_dtype``: BK 16 for fp32); the others patch ``Tiles.for_dtype`` to give fp32
``bk16`` (the same as the default), ``bk32``, ``bk64`` (the 16-bit shape), ``bk32s4`` /
``bk32s2`` (BK 32, 4 or 2 stages) or ``bk32w4`` (BK 32, 4 warps). Rows are JSON lines on
stdout; run each variant in a fresh process and cache (``FUSER_CACHE_DIR``), alternating."""

import json
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from loss_bench import warm_up  # noqa: E402
from optim_bench import event_ms  # noqa: E402

import fuser  # noqa: E402
import fuser.codegen.loss_matmul as lm  # noqa: E402
import fuser.losses  # noqa: E402

VARIANTS = {
    "bk64": lambda t, d: t,
    "bk32": lambda t, d: replace(t, bk=32) if d == "fp32" else t,
    "bk16": lambda t, d: replace(t, bk=16) if d == "fp32" else t,
    "bk32s4": lambda t, d: replace(t, bk=32, num_stages=4) if d == "fp32" else t,
    "bk32s2": lambda t, d: replace(t, bk=32, num_stages=2) if d == "fp32" else t,
    "bk32w4": lambda t, d: replace(t, bk=32, num_warps=4) if d == "fp32" else t,
}
SHAPES = [(4096, 1024, 32768), (2048, 2048, 50304)]


def time_shape(variant: str, t: int, h: int, v: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, h, device="cuda", generator=g).requires_grad_()
    w = (torch.randn(v, h, device="cuda", generator=g) * 0.02).requires_grad_()
    y = torch.randint(0, v, (t,), device="cuda", generator=g)
    warm_up()
    ref = torch.nn.functional.cross_entropy(x.double() @ w.double().T, y)
    scaled = fuser.compile(fuser.losses.CROSS_ENTROPY, schedule="scaled")
    for name, f in [
        ("lean", lambda: fuser.losses.cross_entropy(x, w, y, memory="lean")),
        ("scaled", lambda: scaled(x, w, y)),
        ("torch fp32", lambda: torch.nn.functional.cross_entropy(x @ w.T, y)),
    ]:
        err = abs(f().item() - ref.item()) / ref.item()

        def step(f=f):
            x.grad = w.grad = None
            f().backward()

        ms = event_ms(step, warmup=3, rep=10)
        row = dict(variant=variant, shape=[t, h, v], name=name, fwd_bwd_ms=round(ms, 2), loss_rel_err=err)
        print(json.dumps(row), flush=True)


def main(variant: str) -> None:
    if variant in VARIANTS:
        lm.Tiles.for_dtype = VARIANTS[variant]
    elif variant != "default":
        raise SystemExit(f"unknown variant {variant!r}: default or one of {sorted(VARIANTS)}")
    torch.backends.cuda.matmul.allow_tf32 = False
    for t, h, v in SHAPES:
        time_shape(variant, t, h, v)


if __name__ == "__main__":
    main(sys.argv[1])
