"""Tile shape, warps and strip of the shape-aware (tiled) step kernels: fuser's Adafactor
and CAME on TinyLlama-1.1B's shapes (fp32) for each (TILE, num_warps, tiles per program),
each in a fresh process (the values are rendered into the kernels): median of device events
around one step, and the time of each phase's launch alone.

    python benchmarks/probes/sweep_tiles.py [--out DIR] [--tag _v2] [--configs 32x128:8:4,16x128:4:8]

A config is TILE:WARPS[:STRIP] (FUSER_OPTIM_TILE, FUSER_OPTIM_WARPS, FUSER_OPTIM_STRIP;
the strip defaults to fuser's own).
"""

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # probes/: sweep_optim
from sweep_optim import sweep  # noqa: E402

CHILD = r"""
import json, sys, torch
sys.path.insert(0, {root!r})
sys.path.insert(0, {bench!r})
import fuser, fuser.optim
from optim_bench import event_ms, llama1b_shapes, make
rows = []
for name in ("Adafactor", "CAME"):
    ps = make(llama1b_shapes(), torch.float32, 0)
    opt = getattr(fuser.optim, name)(ps)
    ms = event_ms(opt.step, rep=10)
    engine = opt._fuser
    phases = [round(event_ms(lambda s=s: s(engine, opt, 0), rep=10), 3) for s in engine.program]
    del ps, opt, engine
    torch.cuda.empty_cache()
    rows.append(dict(optimizer=name, ms=round(ms, 3), launches_ms=phases))
print(json.dumps(rows))
"""


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
    )
    ap.add_argument("--configs", default="32x128:8:1,32x128:8:2,32x128:8:4,16x128:4:4,16x128:4:8")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    configs = []
    for cfg in args.configs.split(","):
        tile, warps, *strip = cfg.split(":")
        env = {"FUSER_OPTIM_TILE": tile, "FUSER_OPTIM_WARPS": warps}
        label = dict(tile=tile, warps=int(warps))
        if strip:
            env["FUSER_OPTIM_STRIP"] = strip[0]
            label["strip"] = int(strip[0])
        configs.append((env, label))
    results = sweep(CHILD, configs)
    os.makedirs(args.out, exist_ok=True)
    name = f"sweep_tiles_{datetime.date.today().isoformat()}{args.tag}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
