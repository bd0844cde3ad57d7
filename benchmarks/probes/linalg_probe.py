"""QR, eigh and Cholesky on the H200: cuSOLVER against MAGMA, and Cholesky-QR in fp64,
on stacks of SOAP's factor sizes."""

import json
import sys
import time

import torch

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SM = dev.type == "cpu"
torch.backends.cuda.matmul.allow_tf32 = False
res = {}


def t(fn, n=2):
    fn()
    (torch.cuda.synchronize() if not SM else None)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    (torch.cuda.synchronize() if not SM else None)
    return round((time.perf_counter() - t0) / n * 1e3, 1)


def cholqr2(a):
    a = a.double()
    for _ in range(2):
        r = torch.linalg.cholesky(a.mT @ a, upper=True)
        a = torch.linalg.solve_triangular(r, a, upper=True, left=False)
    return a.float()


g = torch.Generator(device=dev).manual_seed(0)
for k, b, other in ((48, 2, 96), (96, 2, 48)) if SM else ((2048, 16, 5632), (5632, 4, 2048)):
    G = torch.randn(b, k, other, device=dev, generator=g)
    L = G @ G.mT / other
    q0 = torch.linalg.qr(torch.randn(b, k, k, device=dev, generator=g))[0]
    A = L @ q0
    for lib in ("cusolver", "magma"):
        if not SM:
            torch.backends.cuda.preferred_linalg_library(lib)
        try:
            res[f"{lib} qr [{b},{k}]"] = t(lambda A=A: torch.linalg.qr(A))
            res[f"{lib} eigh [{b},{k}]"] = t(lambda L=L: torch.linalg.eigh(L), 1)
            res[f"{lib} cholesky fp64 [{b},{k}]"] = t(
                lambda L=L, k=k: torch.linalg.cholesky(
                    L.double() + torch.eye(k, device=dev, dtype=torch.float64)
                )
            )
        except Exception as e:
            res[f"{lib} error [{b},{k}]"] = str(e)[:200]
        print(json.dumps(res), flush=True)
    if not SM:
        torch.backends.cuda.preferred_linalg_library("cusolver")
    try:
        res[f"cholqr2 fp64 [{b},{k}]"] = t(lambda A=A: cholqr2(A))
    except Exception as e:
        res[f"cholqr2 time error [{b},{k}]"] = str(e)[:120]
    res[f"matmul fp64 [{b},{k}]"] = t(lambda A=A: A.double() @ A.double(), 3)
    q, r = torch.linalg.qr(A.double())
    try:
        c = cholqr2(A).double()
        s = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
        res[f"cholqr2 vs qr rel [{b},{k}]"] = float((c - q * s).norm() / q.norm())
        res[f"cholqr2 orth err [{b},{k}]"] = float(
            (c.mT @ c - torch.eye(k, device=dev, dtype=torch.float64)).abs().max()
        )
    except Exception as e:
        res[f"cholqr2 error [{b},{k}]"] = str(e)[:200]
    ev = torch.linalg.eigvalsh(L.double())
    res[f"cond L [{b},{k}]"] = float((ev[..., -1] / ev[..., 0].clamp_min(1e-300)).max())
    print(json.dumps(res), flush=True)
    del G, L, A, q0
json.dump(res, open(f"{sys.argv[1]}/linalg_probe.json", "w"), indent=1)
