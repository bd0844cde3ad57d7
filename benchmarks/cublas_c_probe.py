"""Whether cuBLAS adds a 16-bit ``C`` before rounding ``A @ B``: ``C.addmm_(A, B)`` (bf16,
contiguous operands, ``C`` a small term) against the same sum in float64 rounded once to
bf16, and ``A @ B`` with no ``C``, for the shapes of the loss's gradient products, with and
without ``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction``. Where
``addmm_`` reads like the product without ``C``, that kernel added ``C`` after rounding.

    python benchmarks/cublas_c_probe.py
"""

from __future__ import annotations

import torch

SHAPES = [
    (1280, 768, 128256),
    (28087, 768, 128256),
    (128256, 768, 28087),
    (2304, 768, 28087),
    (7168, 4096, 7000),
]


def probe(m: int, n: int, k: int) -> tuple[float, float, float, float]:
    a = torch.randn(m, k, device="cuda").bfloat16()
    b = torch.randn(k, n, device="cuda").bfloat16()
    ab = a.float() @ b.float()
    c = (ab * 2**-10 * torch.rand_like(ab)).bfloat16()
    exact = a.double() @ b.double() + c.double()
    out = c.clone()
    out.addmm_(a, b)
    once = exact.bfloat16()

    def rel(t):
        return ((t.double() - exact).norm() / exact.norm()).item()

    return rel(out), rel(once), rel(a @ b), (out != once).float().mean().item()


def main() -> None:
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__)
    for flag in (True, False):
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = flag
        for m, n, k in SHAPES:
            got, once, plain, differ = probe(m, n, k)
            row = f"addmm_ {got:.3e}  rounded-once {once:.3e}  no-C {plain:.3e}  differ {differ:.3f}"
            print(f"reduced-precision reduction {flag} {(m, n, k)} {row}", flush=True)


if __name__ == "__main__":
    main()
