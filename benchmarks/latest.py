"""``benchmarks/results/latest.json`` from the JSON files of one benchmark run.

    python benchmarks/latest.py RESULT.json... [--out benchmarks/results/latest.json]
        [--onto benchmarks/results/latest.json]

Where two files hold the same (workload, impl), the later file's row is kept.

Reads what ``optim_bench.py`` (and ``state_bench.py`` and ``precond_bench.py``, in its
format), ``loss_bench.py``, ``post_training_bench.py`` and ``first_step.py`` wrote and emits
one list of rows with
``workload``, ``impl`` (fuser's start with ``fuser``), ``ms`` (median), ``peak_mib`` where
memory matters (optimizer state: ``state_bytes_per_param``), ``device``, and the source
file. ``--onto`` starts from an earlier ``latest.json``, whose rows the files' replace or
join. ``ms`` of
``adamw_fp32_small1000`` is the wall time per step, Python included (the event median is
kept as ``event_ms``); elsewhere it is the median of device events, and for the first step
the seconds to the first completed step, in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os

WALL_WORKLOADS = {"adamw_fp32_small1000"}
FIRST_STEP = {
    "fuser-cold": "first_step_cold",
    "fuser-warm": "first_step_warm",
    "fuser-precompiled": "first_step_precompiled",
}


def optim_rows(doc: dict, source: str) -> list[dict]:
    device = doc["meta"]["device"]
    out = []
    for r in doc["rows"]:
        if "error" in r:
            continue
        row = dict(workload=r["workload"], impl=r["impl"], device=r.get("device", device), source=source)
        if r["workload"] in WALL_WORKLOADS:
            row.update(ms=r["wall_ms"], event_ms=r["ms"])
        else:
            row.update(ms=r["ms"], wall_ms=r.get("wall_ms"))
        keys = ("pct_of_floor", "floor_ms", "pass_floor_ms", "pct_of_pass_floor", "state_bytes_per_param",
                "device_ms", "pct_of_floor_device", "held_B_per_param", "first_step_s")  # fmt: skip
        row.update({k: r[k] for k in keys if k in r})
        out.append(row)
    return out


def loss_rows(doc: dict, source: str) -> list[dict]:
    device = doc["meta"]["gpu"]
    out = []
    for r in doc["rows"]:
        if "error" in r:
            continue
        if "option" in r:  # time only, beside plain cross-entropy (--options)
            workload = f"lce_{r['cfg']}_option_{r['option']}"
            impl = f"fuser memory={r['memory']}"
            row = dict(workload=workload, impl=impl, ms=r["fwd_bwd_ms"], device=device, source=source)
            if "over_plain" in r:  # the median of the rounds' ratios to plain's time
                row["over_plain"] = r["over_plain"]
            out.append(row)
            continue
        out.append(
            dict(
                workload=r.get("workload", f"lce_{r['cfg']}"),
                impl=r["name"],
                ms=r["fwd_bwd_ms"],
                peak_mib=round(r["extra_peak_GiB"] * 1024, 1),
                device=device,
                source=source,
                loss_rel_err=r.get("loss_rel_err"),
                wgrad_rel_err=r["grad_weight_rel_err"],
                hgrad_rel_err=r["grad_hidden_rel_err"],
                floor_ms=r.get("gemm_floor_ms"),  # three T·H·V products at a fixed GEMM rate
            )
        )
    return out


POST_TRAINING = ("logprobs_rl", "distill_jsd", "dpo")


def post_training_rows(doc: dict, source: str) -> list[dict]:
    """post_training_bench's timed rows; its reference rows (fuser's own cross-entropy, the
    products' floor) keep a ``reference:`` or ``floor:`` name, which no summary takes as
    fuser's call or an anchor."""
    device = doc["meta"]["gpu"]
    out = []
    for r in doc["rows"]:
        if "error" in r or "fwd_bwd_ms" not in r:
            continue
        impl = r["name"]
        if r["workload"] == "logprobs_rl" and impl == "fuser cross_entropy":
            impl = "reference: fuser cross_entropy"
        row = dict(workload=r["workload"], impl=impl, ms=r["fwd_bwd_ms"], device=device, source=source)
        if "extra_peak_GiB" in r:
            row["peak_mib"] = round(r["extra_peak_GiB"] * 1024, 1)
        floor = r.get("floor_ms", r.get("gemm_floor_ms"))
        if floor is not None:
            row["floor_ms"] = floor
        out.append(row)
    return out


def first_step_rows(doc: dict, source: str) -> list[dict]:
    device = doc["environment"]["gpu"]
    out = []
    for mode, m in doc["modes"].items():
        seconds = m["median"]["first_step_s"]
        if mode in FIRST_STEP:
            out.append(dict(workload=FIRST_STEP[mode], impl="fuser.optim.AdamW", ms=round(seconds * 1e3, 1),
                            device=device, source=source))  # fmt: skip
        elif mode.startswith("torch"):
            workload = "first_step_cold" if mode.endswith("cold") else "first_step_warm"
            if mode == "torch-fused":
                workload = "first_step_warm"  # eager: nothing to compile, so no cold/warm difference
            out.append(
                dict(workload=workload, impl=mode, ms=round(seconds * 1e3, 1), device=device, source=source)
            )
    return out


def rows_of(path: str) -> list[dict]:
    with open(path) as f:
        doc = json.load(f)
    source = os.path.basename(path)
    if doc.get("benchmark") == "first_step":
        return first_step_rows(doc, source)
    rows = doc.get("rows") or [{}]
    if "meta" in doc and "gpu" in doc["meta"] and rows[0].get("workload") in POST_TRAINING:
        return post_training_rows(doc, source)
    if "meta" in doc and "gpu" in doc["meta"]:
        return loss_rows(doc, source)
    if "meta" in doc and doc.get("rows") and "workload" in doc["rows"][0]:
        return optim_rows(doc, source)
    raise ValueError(f"{path}: not a result file of optim_bench.py, loss_bench.py or first_step.py")


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", default=os.path.join(here, "results", "latest.json"))
    ap.add_argument("--onto", help="a latest.json whose rows the files' rows replace or join")
    args = ap.parse_args(argv)
    latest = {}
    if args.onto:
        with open(args.onto) as f:
            latest = {(row["workload"], row["impl"]): row for row in json.load(f)}
    # A later file's row replaces an earlier one of the same workload and implementation.
    latest |= {(row["workload"], row["impl"]): row for path in args.files for row in rows_of(path)}
    rows = list(latest.values())
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
