"""The benchmark suite's CPU-side tools: latest.json from recorded result files, and the
scaling plot (when matplotlib is installed)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def test_latest_json_rows_from_recorded_results(tmp_path):
    files = [
        os.path.join(RESULTS, name)
        for name in (
            "optim_2026-11-22.json",
            "loss_2026-11-22.json",
            "first_step_2026-11-22_llama1b_fp32_v3.json",
        )
    ]
    out = tmp_path / "latest.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "latest.py"), *files, "--out", str(out)],
                   check=True, capture_output=True)  # fmt: skip
    rows = json.loads(out.read_text())
    by = {(r["workload"], r["impl"]): r for r in rows}
    for r in rows:
        assert {"workload", "impl", "ms", "device"} <= set(r) and r["ms"] > 0
    with open(files[0]) as f:
        recorded = {(r["workload"], r["impl"]): r for r in json.load(f)["rows"]}
    small, source = (x[("adamw_fp32_small1000", "fuser.optim.AdamW")] for x in (by, recorded))
    assert (small["ms"], small["event_ms"]) == (source["wall_ms"], source["ms"])  # wall time for this one
    big = by[("adamw_fp32_llama1b", "fuser.optim.AdamW")]
    assert big["ms"] == recorded[("adamw_fp32_llama1b", "fuser.optim.AdamW")]["ms"]
    assert by[("lce_gist", "fuser cross_entropy")]["peak_mib"] > 0
    assert {"first_step_cold", "first_step_warm"} <= {r["workload"] for r in rows}


def test_latest_json_keeps_the_option_rows_and_skips_failed_anchors(tmp_path):
    # loss_bench --options rows are time only; an anchor that failed to import is a row
    # with an error, left out of latest.json
    src = os.path.join(RESULTS, "loss_2026-11-25.json")
    with open(src) as f:
        recorded = json.load(f)["rows"]
    out = tmp_path / "latest.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "latest.py"), src, "--out", str(out)],
                   check=True, capture_output=True)  # fmt: skip
    by = {(r["workload"], r["impl"]): r for r in json.loads(out.read_text())}
    options = [r for r in recorded if "option" in r]
    assert options
    for r in options:
        row = by[(f"lce_{r['cfg']}_option_{r['option']}", f"fuser memory={r['memory']}")]
        assert row["ms"] == r["fwd_bwd_ms"] and "peak_mib" not in row
    assert by[("lce_gist_lean", "fuser memory=lean")]["peak_mib"] > 0
    assert len(by) == len([r for r in recorded if "error" not in r])


def test_scaling_plot(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [
        dict(sweep=s, x=x, impl=i, ms=x * 1e-3 + 0.05, wall_ms=x * 1e-3 + 0.04)
        for s in ("tensors", "params")
        for x in (1, 10, 100)
        for i in ("fuser.optim.AdamW", "torch.AdamW fused")
    ]
    meta = dict(date="2026-11-22", device="test", torch="t", triton="t")
    src = tmp_path / "scaling.json"
    src.write_text(json.dumps(dict(meta=meta, rows=rows)))
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "plot.py"), str(src)], check=True)
    png = tmp_path / "scaling.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
