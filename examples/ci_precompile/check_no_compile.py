"""Run by the GPU job with FUSER_CACHE_DIR pointing at the published cache: a few steps
of the project's optimizer, then a check that no kernel was compiled in this process.

On a machine without a GPU it runs through Triton's interpreter and checks the same.
"""

import sys

import torch
from my_rules import Lion

import fuser

device = "cuda" if torch.cuda.is_available() else "cpu"
dtypes = [torch.float32, torch.bfloat16] if device == "cuda" else [torch.float32]
for dtype in dtypes:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    model = model.to(device=device, dtype=dtype)
    opt = Lion(model.parameters(), lr=1e-4)
    for _ in range(3):
        loss = model(torch.randn(32, 64, device=device, dtype=dtype)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

stats = fuser.stats()
print(f"{device}: {stats}")
if stats["compiles"]:
    sys.exit(f"{stats['compiles']} kernels were compiled: the cache does not cover this run")
