"""Inverse roots of Shampoo's factor sizes: ``inv_root`` (by ``eigh``) against
``inv_root_newton`` (coupled Newton, products only), both as the matrix phase runs them on
a stack ``[n, d, d]`` in fp32 (TF32 off), with each one's error against float64 ``eigh``.

The factors are ``G Gᵀ / cols + eps I`` of Gaussian ``G`` (condition ~ (1 + sqrt(d/cols))²
/ (1 - sqrt(d/cols))² plus the ridge), the shapes TinyLlama-1.1B's Shampoo blocks give.

    python benchmarks/probes/root_probe.py OUT

Writes OUT/root_probe.json: per (n, d, k) the ms of each, the Newton iterations, and the
relative errors (Frobenius, against the float64 root).
"""

import json
import sys
import time

import torch

from fuser.optim import matrix_rules
from fuser.runtime import matrix

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.backends.cuda.matmul.allow_tf32 = False
CASES = ((32, 1024, 4), (32, 1024, 2), (16, 2048, 4), (4, 5632, 4)) if dev.type == "cuda" else ((3, 24, 4),)


def _ms(fn, n=3) -> float:
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def _factors(n: int, d: int) -> torch.Tensor:
    g = torch.randn(n, d, 2 * d, device=dev, generator=torch.Generator(dev).manual_seed(d))
    return g @ g.mT / (2 * d) + 1e-3 * torch.eye(d, device=dev)


def _root64(m: torch.Tensor, k: int) -> torch.Tensor:
    lam, vec = torch.linalg.eigh(m.double())
    return (vec * lam.pow(-1.0 / k).unsqueeze(-2)) @ vec.mT


def main(out: str) -> None:
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    res = {"device": name, "torch": torch.__version__}
    for n, d, k in CASES:
        m = _factors(n, d)
        want = _root64(m, k)
        calls = []
        power = torch.linalg.matrix_power

        def counted(t, e, calls=calls, power=power):  # (one call per Newton step)
            calls.append(1)
            return power(t, e)

        torch.linalg.matrix_power = counted
        try:
            newton = matrix.inv_root_newton(m, k)
            iterations = len(calls)
            t_newton = _ms(lambda m=m, k=k: matrix.inv_root_newton(m, k))
        finally:
            torch.linalg.matrix_power = power
        eigh = matrix_rules._inv_root(m, k)
        key = f"[{n},{d},{d}] k={k}"
        res[key] = dict(
            eigh_ms=round(_ms(lambda m=m, k=k: matrix_rules._inv_root(m, k)), 2),
            newton_ms=round(t_newton, 2),
            newton_iterations=iterations,
            eigh_rel_err=float((eigh.double() - want).norm() / want.norm()),
            newton_rel_err=float((newton.double() - want).norm() / want.norm()),
        )
        print(json.dumps({key: res[key]}), flush=True)
    with open(f"{out}/root_probe.json", "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
