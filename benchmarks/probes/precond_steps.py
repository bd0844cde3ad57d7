"""Each step of SOAP timed alone (refresh steps stand out) for `fuser.optim.SOAP`, heavyball's
`SOAP` and the zoo's SOAP rule on TinyLlama-1.1B's shapes (fp32, TF32 off, refresh every 5
steps, `precond_bench.py`'s settings): a first step, 5 more, then 10 timed. Before them, QR,
Cholesky and a product on stacks of the factors' sizes (cuSOLVER, batched and looped).

    python benchmarks/probes/precond_steps.py OUT [name prefixes ...]

Writes OUT/soap_profile.json (per-step times in ms, their mean, the first step in s).
"""

import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples"))
import precond_bench as pb  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False


def _ms(fn, n=2):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def linalg(dev, res):
    for k, b in ((5632, 8), (2048, 32)):
        a = torch.randn(b, k, k, device=dev)
        a = a @ a.mT
        res[f"qr batched [{b},{k},{k}] ms"] = round(_ms(lambda a=a: torch.linalg.qr(a)), 1)
        res[f"qr looped [{b},{k},{k}] ms"] = round(_ms(lambda a=a: [torch.linalg.qr(x) for x in a]), 1)
        res[f"matmul [{b},{k},{k}] ms"] = round(_ms(lambda a=a: a @ a, 3), 2)
        ch = a + k * torch.eye(k, device=dev)
        res[f"cholesky batched [{b},{k},{k}] ms"] = round(_ms(lambda ch=ch: torch.linalg.cholesky(ch)), 1)
        print(json.dumps({x: y for x, y in res.items() if "[" in x}), flush=True)
        del a, ch


def steps(dev, res, which):
    shapes = pb.llama1b_shapes()
    builds = pb.builds("soap_llama1b", 5)
    for key in which:
        name = next(n for n in builds if n.startswith(key))
        ps = pb.make(shapes, dev, 0)
        grads = [p.grad for p in ps]
        step = pb._stepper(ps, grads, builds[name](ps))
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        print(name, "first step", round(first, 2), flush=True)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        per = []
        for _ in range(10):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            step()
            e.record()
            torch.cuda.synchronize()
            per.append(round(s.elapsed_time(e), 1))
        res[name] = dict(first_s=round(first, 2), per_step_ms=per, mean_ms=round(sum(per) / len(per), 1))
        print(name, json.dumps(res[name]), flush=True)
        del ps, grads, step
        torch.cuda.empty_cache()


def main():
    out, which = sys.argv[1], sys.argv[2:] or ["fuser.optim.SOAP", "heavyball", "fuser SOAP rule"]
    dev = torch.device("cuda")
    res: dict = {}
    linalg(dev, res)
    steps(dev, res, which)
    with open(os.path.join(out, "soap_profile.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
