"""The benchmark suite's CPU-side tools: latest.json from recorded result files, RESULTS.md
from latest.json, the plots (when matplotlib is installed), the CPU smoke runs of the benchmarks that have
one, and the Gluon probe's ahead-of-time compile."""

import json
import os
import subprocess
import sys

import pytest
from childenv import child_env

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
                   check=True, capture_output=True, env=child_env())  # fmt: skip
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
                   check=True, capture_output=True, env=child_env())  # fmt: skip
    by = {(r["workload"], r["impl"]): r for r in json.loads(out.read_text())}
    options = [r for r in recorded if "option" in r]
    assert options
    for r in options:
        row = by[(f"lce_{r['cfg']}_option_{r['option']}", f"fuser memory={r['memory']}")]
        assert row["ms"] == r["fwd_bwd_ms"] and "peak_mib" not in row
    assert by[("lce_gist_lean", "fuser memory=lean")]["peak_mib"] > 0
    assert len(by) == len([r for r in recorded if "error" not in r])


def test_post_training_rows_join_an_earlier_latest_json(tmp_path):
    # post_training_bench's rows under its workloads' names, joined onto an earlier latest.json;
    # its own cross-entropy is a reference, neither fuser's call nor an anchor in RESULTS.md
    src = os.path.join(RESULTS, "post_training_2026-12-03_v3.json")
    base = tmp_path / "base.json"
    base.write_text(json.dumps([dict(workload="adamw_fp32_llama1b", impl="fuser.optim.AdamW", ms=10.0,
                                     device="d", source="optim_2026-11-25_v7.json")]))  # fmt: skip
    out = tmp_path / "latest.json"
    script = os.path.join(ROOT, "benchmarks", "latest.py")
    subprocess.run([sys.executable, script, src, "--onto", str(base), "--out", str(out)],
                   check=True, capture_output=True, env=child_env())  # fmt: skip
    rows = json.loads(out.read_text())
    by = {(r["workload"], r["impl"]): r for r in rows}
    with open(src) as f:
        recorded = [r for r in json.load(f)["rows"] if "fwd_bwd_ms" in r]
    assert len(rows) == len(recorded) + 1 and ("adamw_fp32_llama1b", "fuser.optim.AdamW") in by
    assert {"logprobs_rl", "distill_jsd", "dpo"} <= {r["workload"] for r in rows}
    ce = by[("logprobs_rl", "reference: fuser cross_entropy")]
    assert ce["ms"] == 51.03 and ce["peak_mib"] > 0 and ce["floor_ms"] > 0
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import results_md

    entries = {e["workload"]: e for e in results_md.summary(rows, RESULTS)}
    rl = entries["logprobs_rl"]
    assert rl["fuser"]["impl"] == "fuser token_logprobs + GRPO"
    assert not rl["anchor"]["impl"].startswith(("fuser", "reference"))


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
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "plot.py"), str(src)], check=True, env=child_env()
    )
    png = tmp_path / "scaling.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def write_latest(folder):
    """A latest.json of two workloads and the result file its rows name."""
    meta = dict(
        date="2026-11-25", device="GPU", command="python benchmarks/optim_bench.py lamb --out /x/y --tag _v2"
    )
    (folder / "optim_2026-11-25_v2.json").write_text(json.dumps(dict(meta=meta, rows=[])))
    row = dict(device="GPU", source="optim_2026-11-25_v2.json")
    rows = [
        dict(workload="lamb_fp32_llama1b", impl="fuser.optim.LAMB static", ms=9.0, pct_of_floor=99.0, **row),
        dict(workload="lamb_fp32_llama1b", impl="fuser.optim.LAMB", ms=10.0, pct_of_floor=90.0, **row),
        dict(workload="lamb_fp32_llama1b", impl="pytorch_optimizer.Lamb foreach", ms=31.0, **row),
        dict(workload="lamb_fp32_llama1b", impl="other Lamb", ms=25.0, **row),
        dict(
            workload="lamb_fp32_llama1b",
            impl="old anchor",
            ms=12.0,
            device="GPU",
            source="optim_2026-11-20.json",
        ),
        dict(
            workload="first_step_warm",
            impl="fuser.optim.AdamW",
            ms=80.0,
            device="GPU",
            source="first_step_x.json",
        ),
    ]
    (folder / "latest.json").write_text(json.dumps(rows))
    return folder / "latest.json"


def test_results_md_one_line_a_workload(tmp_path):
    latest = write_latest(tmp_path)
    out = tmp_path / "RESULTS.md"
    script = os.path.join(ROOT, "benchmarks", "results_md.py")
    subprocess.run([sys.executable, script, str(latest), "--out", str(out)], check=True, capture_output=True)
    lines = out.read_text().splitlines()
    lamb = next(line for line in lines if line.startswith("| `lamb_fp32_llama1b`"))
    cells = [c.strip() for c in lamb.strip("|").split("|")]
    # the default call (not static); the fastest anchor of the same run (not the other run's 12 ms)
    assert cells[1] == "10.00 ms (fuser.optim.LAMB)"
    assert cells[2] == "other Lamb 25.00 ms"
    assert cells[3] == f"{25.0 / 10.0:.2f}x" and cells[4] == "90.0%"
    assert cells[5:7] == ["GPU", "2026-11-25"]
    assert cells[7] == "`python benchmarks/optim_bench.py lamb --tag _v2`"  # --out left out
    first = next(line for line in lines if line.startswith("| `first_step_warm`"))
    assert "| – | – | – |" in first and "flags are not recorded" in first  # no anchor, no floor, no file
    assert lines.index(lamb) < lines.index(first)
    assert sum(line.startswith("### `") for line in lines) == 2  # every row, by workload


def test_latest_plot(tmp_path):
    pytest.importorskip("matplotlib")
    latest = write_latest(tmp_path)
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "plot.py"), str(latest)], check=True)
    assert (tmp_path / "latest.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _shaped_smoke(tmp_path):
    env = child_env()
    script = os.path.join(ROOT, "benchmarks", "shaped_bench.py")
    cmd = [sys.executable, script, "--smoke", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    (result,) = tmp_path.glob("shaped_*.json")
    recorded = json.loads(result.read_text())
    rows = {r["impl"]: r for r in recorded["rows"]}
    assert {"fuser.optim.Adafactor", "torch.Adafactor foreach", "torch.Adafactor for-loop"} <= set(rows)
    assert "fuser.optim.CAME" in rows and "pytorch_optimizer.CAME" in rows
    for r in recorded["rows"]:
        if "error" not in r:
            # (on a busy CPU the fraction of a GPU floor rounds to 0.0)
            assert r["ms"] > 0 and r["floor_ms"] > 0
            assert abs(r["pct_of_floor"] - 100 * r["floor_ms"] / r["ms"]) <= 0.1
            # Each anchor took the same step as fuser from the same inputs.
            assert r["rel_err_vs_fuser"] is None or r["rel_err_vs_fuser"] < 1e-5, r
    assert {"date", "device", "torch", "triton", "copy_TBps", "command"} <= set(recorded["meta"])
    assert (tmp_path / result.name.replace(".json", ".md")).read_text().count("| adafactor_smoke |") == 3


def _muon_smoke(tmp_path):
    env = child_env()
    script = os.path.join(ROOT, "benchmarks", "muon_bench.py")
    cmd = [sys.executable, script, "--smoke", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    (result,) = tmp_path.glob("muon_*.json")
    recorded = json.loads(result.read_text())
    rows = {(r["workload"], r["impl"]): r for r in recorded["rows"]}
    assert ("muon_llama1b", "fuser.optim.Muon (+AdamW groups)") in rows
    assert ("muon_hidden_llama1b", "fuser.optim.Muon") in rows
    assert ("muon_moe", "fuser.optim.Muon view=batched") in rows and (
        "muon_moe",
        "torch.optim.Muon (per expert)",
    ) in rows
    for r in recorded["rows"]:
        assert "error" not in r, r
        assert r["ms"] > 0 and r["floor_ms"] > 0
    # Three shapes of hidden matrices, 3 NS launches an iteration for each, two elementwise phases; one
    # more launch for the AdamW groups.
    assert rows[("muon_hidden_llama1b", "fuser.optim.Muon")]["fuser_launches"] == 2 + 3 * 15
    assert rows[("muon_llama1b", "fuser.optim.Muon (+AdamW groups)")]["fuser_launches"] == 2 + 3 * 15 + 1
    assert {"date", "device", "torch", "triton", "bf16_gemm_TFLOPs", "command"} <= set(recorded["meta"])


def _state_smoke(tmp_path):
    env = child_env()
    script = os.path.join(ROOT, "benchmarks", "state_bench.py")
    cmd = [sys.executable, script, "--cpu-smoke", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    (result,) = tmp_path.glob("state_*.json")
    recorded = json.loads(result.read_text())
    rows = {(r["workload"], r["impl"]): r for r in recorded["rows"]}
    workloads = {"adamw_q8_llama1b", "adamw_q8_master24_llama1b", "adamw_bf16p_fp32s_llama1b",
                 "adamw_bf16_llama1b", "lion_q8_llama1b"}  # fmt: skip
    assert {w for w, _ in rows} == workloads and len(rows) == 10  # each as built and static
    for r in recorded["rows"]:
        assert "error" not in r, r
        assert r["ms"] > 0 and r["floor_ms"] > 0
        assert abs(r["pct_of_floor"] - 100 * r["floor_ms"] / r["ms"]) <= 0.1
        assert (
            r["device_ms"] > 0 and abs(r["pct_of_floor_device"] - 100 * r["floor_ms"] / r["device_ms"]) <= 0.1
        )
    for static in ("", " static"):
        q8 = rows[("adamw_q8_llama1b", "fuser.optim.AdamW" + static)]
        master = rows[("adamw_q8_master24_llama1b", "fuser.optim.AdamW" + static)]
        lion = rows[("lion_q8_llama1b", "fuser.rule lion" + static)]
        want = dict(exp_avg="int8", exp_avg_absmax="float32", exp_avg_sq="uint8", exp_avg_sq_absmax="float32")
        assert {k: q8["state_layout"].get(k) for k in want} == want
        assert master["state_layout"]["master_lo"] == "int8"
        assert lion["state_layout"]["exp_avg"] == "int8"
        # 1 byte a state element and a 4-byte scale per 32: 2.25 B per parameter for AdamW
        # (2.253 for these shapes' partial blocks), 1 more with the correction.
        assert 2.2 < q8["state_bytes_per_param"] < 2.4
        assert 3.2 < master["state_bytes_per_param"] < 3.4
        assert 1.1 < lion["state_bytes_per_param"] < 1.2
        # The correction carries what bf16 parameters lose: 10 steps' update nearer float64's.
        assert master["update_rel_err"] < 0.75 * q8["update_rel_err"]
    fp32 = rows[("adamw_bf16p_fp32s_llama1b", "fuser.optim.AdamW")]
    assert fp32["state_layout"]["exp_avg"] == "float32" and 7.9 < fp32["state_bytes_per_param"] < 8.1
    meta = recorded["meta"]
    assert {"date", "device", "torch", "triton", "versions", "copy_TBps", "command"} <= set(meta)
    assert (tmp_path / result.name.replace(".json", ".md")).read_text().count("| adamw_q8_llama1b |") == 2


def test_gluon_probe_compiles_its_kernels_for_sm90_on_cpu():
    # the Gluon probe's kernels, compiled ahead of time: the ping-pong kernel has its two
    # warp-specialised partitions and wgmma, and none spills
    script = os.path.join(ROOT, "benchmarks", "loss_gluon_probe.py")
    done = subprocess.run(
        [sys.executable, script, "--compile-only"], capture_output=True, text=True, env=child_env()
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    kinds = {r["variant"].split("_")[0] for r in rows}
    assert kinds == {"pingpong", "persistent"} and len(rows) == 4
    for r in rows:
        assert r["wgmma"] > 0 and r["spill_bytes"] == 0, r
        assert r["ws_partitions"] == (2 if r["variant"].startswith("pingpong") else 0), r


def _post_training_smoke(tmp_path):
    env = child_env()
    script = os.path.join(ROOT, "benchmarks", "post_training_bench.py")
    cmd = [sys.executable, script, "--smoke", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    (result,) = tmp_path.glob("post_training_*_smoke.json")
    recorded = json.loads(result.read_text())
    rows = {(r["workload"], r["name"]): r for r in recorded["rows"]}
    assert set(rows) == {
        ("distill_jsd", "fuser distill kind=jsd"),
        ("dpo", "fuser token_logprobs + DPO"),
        ("dpo", "fuser token_logprobs + DPO, memory=fast"),
    }
    for r in rows.values():
        assert "error" not in r, r
        assert "fwd_bwd_ms" not in r  # no timing claims from the interpreter
        # fp32 losses against float64; grad_hidden is bf16
        assert r["loss_rel_err"] < 1e-5 and r["grad_hidden_rel_err"] < 1e-2, r
    assert recorded["meta"]["smoke"] is True
    md = (tmp_path / result.name.replace(".json", ".md")).read_text()
    assert "## `distill_jsd`" in md and "## `dpo`" in md


# The benchmarks' CPU smoke runs (each a subprocess through the interpreter, 5-22 s): half a
# run, all in 2 runs (tests/README.md, sweeps): muon and shaped (~35 s), post_training and
# state (~27 s).
SMOKES = dict(muon=_muon_smoke, post_training=_post_training_smoke, shaped=_shaped_smoke, state=_state_smoke)


@pytest.mark.sweep(runs=2)
@pytest.mark.parametrize("bench", sorted(SMOKES))
def test_bench_smoke_runs_on_cpu(bench, tmp_path):
    SMOKES[bench](tmp_path)


def test_precond_bench_times_one_refresh_interval_however_the_window_falls():
    # heavyball's refresh gate drifts (steps 5, 11, 15, 20 at an interval of 5): a window of
    # ten steps holds one to three refreshes, and the time of one interval must not depend on it.
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from precond_bench import interval_ms

    step, refresh = 900.0, 7400.0
    expected = (4 * step + refresh) / 5
    for at in ({4}, {4, 9}, {0, 4, 9}, {3, 8}):
        per = [refresh if i in at else step + 0.1 * i for i in range(10)]
        ms, n = interval_ms(per, 5)
        assert n == len(at) and abs(ms - expected) < 1.0, (at, ms)
    flat = [10.0, 12.0, 11.0]  # (no refresh step: every step updates, PSGD's early steps)
    assert interval_ms(flat, 5) == (11.0, 0)
