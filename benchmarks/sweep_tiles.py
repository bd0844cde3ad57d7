"""Tile shape and warps of the shape-aware (tiled) step kernels: fuser's Adafactor and
CAME on TinyLlama-1.1B's shapes (fp32) for each (TILE, num_warps), each in a fresh process
(the values are rendered into the kernels): median of device events around one step, and
the time of each phase's launch alone.

    python benchmarks/sweep_tiles.py [--out DIR] [--configs 8x256:8,16x256:8]
"""

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
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
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--configs", default="8x256:8,16x256:8,32x128:8,16x128:4,32x256:8")
    args = ap.parse_args(argv)
    configs = []
    for cfg in args.configs.split(","):
        tile, warps = cfg.split(":")
        configs.append(
            ({"FUSER_OPTIM_TILE": tile, "FUSER_OPTIM_WARPS": warps}, dict(tile=tile, warps=int(warps)))
        )
    results = sweep(CHILD, configs)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"sweep_tiles_{datetime.date.today().isoformat()}.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
