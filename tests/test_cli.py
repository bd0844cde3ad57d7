"""The ``fuser`` command: exit codes, messages, tables, and the cache it leaves.

Most tests swap the rule -> kernel step for small hand-written kernels (so they test the
command, not the optimizer's code generator); tests/cache/test_precompile_builtins.py runs
the real pipeline for every built-in, tests/cache/test_precompile_options.py for the kernel
options.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from childenv import child_env

import fuser
from fuser import cli, clitools
from fuser.cache import loader, store
from fuser.clitools import Variant

sys.path.insert(0, str(Path(__file__).parent / "cache"))
from cache_helpers import axpy, broken, files_state  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

RULES = '''
import fuser

sgd = fuser.rule("p = p - lr * g", name="sgd", hyper=dict(lr=0.1))
heavy_ball = fuser.rule("""
    m = mu * m + g
    p = p - lr * m
""", name="heavy_ball", hyper=dict(lr=0.1, mu=0.9), state=dict(m=0.0))
also_sgd = sgd  # the same rule twice is compiled once
not_a_rule = 3
'''

LOSSES = """
import fuser

ce = fuser.loss("loss = logsumexp(z) - z[y]", name="ce")
"""

BAD_RULE = '''
import fuser

good = fuser.rule("p = p - lr * g", name="good", hyper=dict(lr=0.1))
bad = fuser.rule("""
    m = bta1 * m + g
    p = p - lr * m
""", name="typo_rule", hyper=dict(lr=0.1, beta1=0.9), state=dict(m=0.0))
'''


def fake_sources(rule, variant):
    """One small kernel per (rule, variant); a rule named broken* gets one that fails."""
    if rule.name.startswith("broken"):
        return [broken(entry=f"{rule.name}_k")]
    return [axpy(tag=f"{rule.name}/{variant}", entry=f"{rule.name}_k", rule=rule.name)]


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("FUSER_CACHE_DIR", str(root))
    monkeypatch.setattr(store, "_checked_roots", set())
    monkeypatch.setattr(loader, "_loaded", {})
    return root


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(clitools, "kernel_sources", fake_sources)


@pytest.fixture
def rules_file(tmp_path):
    path = tmp_path / "my_rules.py"
    path.write_text(RULES)
    return path


def _rows(out: str) -> list[list[str]]:
    """Rows of the summary table (columns are separated by two or more spaces)."""
    import re

    lines = out.strip().splitlines()
    header = lines.index(next(ln for ln in lines if ln.startswith("rule ")))
    return [re.split(r"\s{2,}", ln.strip()) for ln in lines[header + 1 : -1]]


def test_precompile_file_then_again(cache_root, fake, rules_file, capsys):
    assert cli.main(["precompile", str(rules_file), "--dtype", "fp32", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    # 2 rules x 2 dtypes x 2 default targets
    assert len(rows) == 8
    assert {r[0] for r in rows} == {"sgd", "heavy_ball"}
    assert {r[2] for r in rows} == {"cuda:80", "cuda:90"}
    assert {r[5] for r in rows} == {"compiled"}
    before = files_state(cache_root)

    assert cli.main(["precompile", str(rules_file), "--dtype", "fp32", "--dtype", "bf16"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert len(rows) == 8 and {r[5] for r in rows} == {"hit"}
    assert files_state(cache_root) == before


def test_precompile_module_name_and_targets(cache_root, fake, rules_file, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(rules_file.parent))
    args = ["precompile", "my_rules", "--target", "sm_90", "--dtype", "fp16"]
    assert cli.main(args) == 0
    rows = _rows(capsys.readouterr().out)
    assert sorted((r[0], r[2]) for r in rows) == [("heavy_ball", "cuda:90"), ("sgd", "cuda:90")]


def test_bad_rule_file_is_one_line_without_traceback(cache_root, tmp_path, capsys):
    path = tmp_path / "bad_rules.py"
    path.write_text(BAD_RULE)
    assert cli.main(["precompile", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "typo_rule" in err[0] and "bta1" in err[0] and str(path) in err[0]
    assert "Traceback" not in err[0]


def test_good_file_still_compiles_beside_a_bad_one(cache_root, fake, rules_file, tmp_path, capsys):
    bad = tmp_path / "bad_rules.py"
    bad.write_text(BAD_RULE)
    assert cli.main(["precompile", str(bad), str(rules_file), "--dtype", "fp32", "--target", "cuda:90"]) == 1
    captured = capsys.readouterr()
    assert {r[0] for r in _rows(captured.out)} == {"sgd", "heavy_ball"}
    assert len([ln for ln in captured.err.splitlines() if ln.startswith("error:")]) == 1


def test_failing_kernel_names_rule_and_target(cache_root, fake, rules_file, tmp_path, capsys):
    path = tmp_path / "mixed.py"
    broken_rule = 'broken_one = fuser.rule("p = p - lr * g", name="broken_one", hyper=dict(lr=1.0))'
    path.write_text(RULES + "\n" + broken_rule + "\n")
    assert cli.main(["precompile", str(path), "--dtype", "fp32", "--target", "cuda:90", "-v"]) == 1
    captured = capsys.readouterr()
    errors = [ln for ln in captured.err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1
    assert "broken_one" in errors[0] and "cuda:90" in errors[0] and "undefined_name" in errors[0]
    assert {r[0] for r in _rows(captured.out)} == {"sgd", "heavy_ball"}


@pytest.mark.parametrize(
    "text, code, message",
    [
        ("x = 1\n", 1, "no fuser.Rule"),
        ("import fuser\n1 / 0\n", 1, "ZeroDivisionError"),
        ("def f(:\n", 1, "SyntaxError"),
    ],
)
def test_unusable_files(cache_root, tmp_path, capsys, text, code, message):
    path = tmp_path / "f.py"
    path.write_text(text)
    assert cli.main(["precompile", str(path)]) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0]


@pytest.mark.parametrize(
    "args, message",
    [
        (["precompile", "no/such/file.py"], "no such file"),
        (["precompile", "no_such_module_xyz"], "no such file or module"),
        (["precompile"], "nothing to precompile"),
        (["precompile", "--builtins", "--target", "tpu:1"], "unknown target"),
    ],
)
def test_usage_errors_exit_2(cache_root, capsys, args, message):
    assert cli.main(args) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("plan", ["fp8", "bf16:fp8", "bf16:fp32:fp16", "bf16:", ""])
def test_bad_dtype_plan_is_one_line_exit_2(cache_root, rules_file, capsys, plan):
    for command in (["precompile", str(rules_file)], ["show", str(rules_file)]):
        assert cli.main([*command, "--dtype", plan]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--dtype {plan!r}" in err[0] and "bf16:fp32" in err[0]


def test_argparse_errors_exit_2_on_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["precompile", "x.py", "--state-dtype", "fp8"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--state-dtype" in err[0] and "param" in err[0]


def _recording(monkeypatch) -> list:
    seen = []

    def sources(rule, variant):
        seen.append((rule.name, variant))
        return fake_sources(rule, variant)

    monkeypatch.setattr(clitools, "kernel_sources", sources)
    return seen


def test_precompile_optimizer_options(cache_root, rules_file, capsys, monkeypatch):
    seen = _recording(monkeypatch)
    args = ["precompile", str(rules_file), "--target", "cuda:90", "--dtype", "bf16:fp32", "--dtype", "fp16",
            "--state-dtype", "fp32", "--state-dtype", "param", "--stochastic-rounding"]  # fmt: skip
    assert cli.main(args) == 0, capsys.readouterr().err
    want = {Variant(p, g, sd, stochastic_rounding=True)
            for p, g in (("bf16", "fp32"), ("fp16", None)) for sd in ("fp32", "param")}  # fmt: skip
    assert {v for name, v in seen if name == "heavy_ball"} == want
    rows = _rows(capsys.readouterr().out)
    assert len(rows) == 2 * 4 and {r[4] for r in rows} == {"stochastic rounding"}


def test_precompile_compressed_state_options(cache_root, rules_file, capsys, monkeypatch):
    seen = _recording(monkeypatch)
    args = ["precompile", str(rules_file), "--target", "cuda:90", "--dtype", "bf16", "--state-dtype", "q8",
            "--state-dtype", "int8_linear", "--master-weights", "bf16+int16"]  # fmt: skip
    assert cli.main(args) == 0, capsys.readouterr().err
    want = {Variant("bf16", None, sd, master_weights="bf16+int16") for sd in ("q8", "int8_linear")}
    assert {v for name, v in seen if name == "heavy_ball"} == want
    rows = _rows(capsys.readouterr().out)
    assert rows and {r[4] for r in rows} == {"master bf16+int16"}


def test_show_renders_8bit_states_and_split_masters(cache_root, rules_file, capsys):
    # the real kernels: heavy_ball's momentum decoded and re-encoded, the bf16 parameter
    # joined with its master's low part and split again
    args = ["show", str(rules_file), "--rule", "heavy_ball", "--dtype", "bf16", "--state-dtype", "q8",
            "--master-weights", "bf16+int8"]  # fmt: skip
    assert cli.main(args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    wanted = ("_q8_decode(", "_q8_encode(", "_master_join(", "_master_low(", "p__lo_ptr", "QB: tl.constexpr")
    for text in wanted:
        assert text in out, text
    for bad in (["--state-dtype", "int4"], ["--master-weights", "bf16+int4"]):
        with pytest.raises(SystemExit) as e:
            cli.main(["show", str(rules_file), *bad])
        assert e.value.code == 2


def test_precompile_losses_include_the_staged_kernels(cache_root, tmp_path, capsys, monkeypatch):
    # the row kernel, the staged sequence (process_group= calls and the one-device
    # whole / vocab schedules), the lean schedule's matmul kernels (with its forward's tile
    # sums), the scaled schedule's, the residue's and the gradients' scaling, with or without
    # the older --vocab-parallel flag
    path = tmp_path / "losses.py"
    path.write_text(LOSSES)
    seen = _recording(monkeypatch)
    args = ["precompile", str(path), "--dtype", "bf16:fp32", "--dtype", "bf16", "--vocab-parallel"]
    assert cli.main(args) == 0
    assert [v for _, v in seen] == [Variant("bf16")]
    rows = _rows(capsys.readouterr().out)
    assert rows and {r[4] for r in rows} == {"-"}
    ce = fuser.loss("loss = logsumexp(z) - z[y]", name="ce")
    entries = [s.entry for s in fuser.losses.kernel_sources(ce, "bf16")]
    assert entries == [
        "ce_loss_rows",
        "ce_loss_rows_vp0",  # (the staged sequence on fp32 logits: process_group=, whole, vocab)
        "ce_loss_rows_vp1",
        "ce_loss_rows_vp1",  # (its last kernel on bf16 logits: fused and scaled, on the reductions)
        "ce_loss_rows_mm0",
        "ce_loss_rows_mm_grad",
        "ce_loss_rows_mm_grad_tma",
        "ce_loss_rows_mm_grad_tma",  # (warp-specialised: sm_90 at small H)
        "ce_loss_rows_mm_tile_sums_tma",  # (the lean forward's, for a rule of the scaled form)
        "ce_loss_rows_mm_tile_sums_tma",  # (warp-specialised)
        "ce_loss_rows_mm_scaled",
        "ce_loss_rows_mm_scaled_tma",
        "ce_loss_rows_mm_scaled_tma",
        "ce_loss_rows_scaled_prepare",
        "ce_loss_rows_scaled_tokens",
        "scaled_hidden_grad",
        "target_rows_pieces",
        "target_rows_runs",
        "target_rows_pieces",  # (the target column's residue: coefficients one per token)
        "target_rows_runs",
        "target_rows_gather",
        "target_rows_pieces",  # (the residue's rows written into a 16-bit grad_weight)
        "target_rows_runs",
        "weight_grad_tma",
        "grad_scale",  # (a forward's gradients times grad_output: fp32 into bf16, bf16 in place)
        "grad_scale",
    ]


@pytest.mark.parametrize(
    "text, options, message",
    [
        (RULES, ["--vocab-parallel"], "--vocab-parallel applies to loss rules"),
        (LOSSES, ["--stochastic-rounding"], "--stochastic-rounding applies to optimizer rules"),
        (LOSSES, ["--state-dtype", "bf16"], "--state-dtype applies to optimizer rules"),
    ],
)
def test_options_for_no_rule_found_exit_2(cache_root, fake, tmp_path, capsys, text, options, message):
    path = tmp_path / "rules.py"
    path.write_text(text)
    for command in ("precompile", "show"):
        assert cli.main([command, str(path), *options]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0]
    assert not cache_root.exists() or not list(cache_root.rglob("*.cubin"))


def test_cache_ls_clear(cache_root, fake, rules_file, capsys):
    cli.main(["precompile", str(rules_file), "--dtype", "fp32", "--target", "cuda:90"])
    capsys.readouterr()
    assert cli.main(["cache", "ls"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    body = [ln for ln in lines[1:-1]]
    assert len(body) == 2  # one line per entry
    assert any("sgd" in ln and "sgd_k" in ln and "cuda:90" in ln for ln in body)
    assert any("heavy_ball" in ln and "heavy_ball_k" in ln for ln in body)

    assert cli.main(["cache", "clear", "--older-than", "1"]) == 0  # nothing that old
    assert "removed 0 entries" in capsys.readouterr().out
    assert cli.main(["cache", "clear"]) == 0
    assert "removed 2 entries" in capsys.readouterr().out
    assert not list(cache_root.rglob("*.py"))
    cli.main(["cache", "ls"])
    assert capsys.readouterr().out.startswith("0 entries")


def test_cache_clear_older_than(cache_root, fake, rules_file, capsys):
    import json
    import time

    cli.main(["precompile", str(rules_file), "--dtype", "fp32", "--target", "cuda:90"])
    capsys.readouterr()
    # Age one entry by rewriting its creation time through the store's own writer.
    (manifest,) = [p for p in cache_root.rglob("manifest.json") if (p.parent / "sgd_k.py").exists()]
    m = json.loads(manifest.read_text())
    m["created"] = time.time() - 3 * 86400
    body = {k: v for k, v in m.items() if k != "checksum"}
    m["checksum"] = store._sha256(store._canonical(body))
    manifest.write_text(json.dumps(m))
    assert cli.main(["cache", "clear", "--older-than", "2"]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert not list(cache_root.rglob("sgd_k.py")) and list(cache_root.rglob("heavy_ball_k.py"))


def test_cache_ls_shows_damage(cache_root, fake, rules_file, capsys):
    cli.main(["precompile", str(rules_file), "--dtype", "fp32", "--target", "cuda:90"])
    capsys.readouterr()
    (manifest,) = [p for p in cache_root.rglob("manifest.json") if p.parent.name == "cuda90"
                   and (p.parent.parent / "sgd_k.py").exists()]  # fmt: skip
    manifest.write_text("{")
    assert cli.main(["cache", "ls"]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if "sgd_k" in ln]
    assert "DAMAGED" in line


def test_cache_explain(cache_root, fake, rules_file, capsys, monkeypatch):
    cli.main(["precompile", str(rules_file), "--dtype", "fp32", "--target", "cuda:90"])
    capsys.readouterr()
    cli.main(["cache", "ls"])
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "sgd_k" in ln)
    prefix = line.split()[0]
    assert cli.main(["cache", "explain", prefix[:10]]) == 0
    out = capsys.readouterr().out
    for field in ("source", "options", "fuser", "triton", "format", "target", "compiler_env"):
        assert any(ln.split()[:1] == [field] for ln in out.splitlines()), field
    assert "DIFFERS" not in out
    monkeypatch.setattr(fuser, "__version__", "99.0")
    assert cli.main(["cache", "explain", prefix]) == 0
    (fuser_line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.split()[:1] == ["fuser"]]
    assert "DIFFERS" in fuser_line and "99.0" in fuser_line


def test_cache_explain_unknown_key(cache_root, capsys):
    assert cli.main(["cache", "explain", "ffffffffffff"]) == 1
    assert "no cache entry" in capsys.readouterr().err


def test_show(cache_root, rules_file, capsys):
    from fuser.optim.factory import kernel_sources

    assert cli.main(["show", str(rules_file), "--rule", "heavy_ball"]) == 0
    out = capsys.readouterr().out
    module = clitools.load_module(str(rules_file))
    (source,) = kernel_sources(module.heavy_ball, "fp32")
    assert source.text.rstrip("\n") in out
    assert "sgd" not in out.splitlines()[0]
    assert cli.main(["show", str(rules_file), "--rule", "nope"]) == 1
    assert "heavy_ball" in capsys.readouterr().err  # lists the rules it has


def test_permission_error_is_one_clear_line(cache_root, fake, rules_file, capsys):
    cache_root.mkdir(mode=0o777)
    cache_root.chmod(0o777)
    assert cli.main(["precompile", str(rules_file), "--target", "cuda:90"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "writable by other users" in err[0] and "chmod" in err[0]
    assert cli.main(["cache", "ls"]) == 1


def _env(cache_root):
    return child_env(cache=cache_root, path=(REPO / "tests" / "cache",))


def test_python_dash_m(cache_root, tmp_path):
    bad = tmp_path / "bad_rules.py"
    bad.write_text(BAD_RULE)
    run = lambda *a: subprocess.run([sys.executable, "-m", "fuser", *a], env=_env(cache_root),
                                    capture_output=True, text=True)  # fmt: skip
    res = run("precompile", str(bad))
    assert res.returncode == 1 and "typo_rule" in res.stderr and "Traceback" not in res.stderr
    res = run("cache", "ls")
    assert res.returncode == 0 and res.stdout.startswith("0 entries")
    assert run("frobnicate").returncode == 2


DRIVER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from fuser import cli, clitools
    sys.path.insert(0, sys.argv[1])
    import test_cli
    clitools.kernel_sources = test_cli.fake_sources
    go = Path(sys.argv[2])
    while not go.exists():
        time.sleep(0.005)
    sys.exit(cli.main(sys.argv[3:]))
""")


def test_four_concurrent_cli_precompiles(cache_root, rules_file, tmp_path):
    go = tmp_path / "go"
    args = ["precompile", str(rules_file), "--dtype", "fp32", "--dtype", "bf16"]
    procs = [subprocess.Popen([sys.executable, "-c", DRIVER, str(Path(__file__).parent), str(go), *args],
                              env=_env(cache_root), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]  # fmt: skip
    import time

    time.sleep(1.0)
    go.touch()
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], [e for _, e in outs]
    statuses = [r[5] for out, _ in outs for r in _rows(out)]
    assert len(statuses) == 4 * 8
    assert statuses.count("compiled") == 8  # 2 rules x 2 dtypes x 2 targets, each compiled once
    rerun = subprocess.run([sys.executable, "-c", DRIVER, str(Path(__file__).parent), str(go), *args],
                           env=_env(cache_root), capture_output=True, text=True)  # fmt: skip
    assert rerun.returncode == 0 and {r[5] for r in _rows(rerun.stdout)} == {"hit"}


def test_jobs_compile_in_worker_processes(cache_root, fake, rules_file, tmp_path, capsys, monkeypatch):
    broken_rule = 'broken_two = fuser.rule("p = p - lr * g", name="broken_two", hyper=dict(lr=1.0))'
    path = tmp_path / "mixed.py"
    path.write_text(RULES + "\n" + broken_rule + "\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), str(REPO / "tests" / "cache")]))
    assert cli.main(["precompile", str(path), "--dtype", "fp32", "--dtype", "fp16", "-j", "2"]) == 1
    captured = capsys.readouterr()
    rows = _rows(captured.out)
    assert sorted((r[0], r[2]) for r in rows) == sorted(
        (name, t) for name in ("sgd", "heavy_ball") for t in ("cuda:80", "cuda:90") for _ in range(2)
    )
    assert {r[5] for r in rows} == {"compiled"}
    errors = [ln for ln in captured.err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "broken_two" in errors[0]
    assert cli.main(["precompile", str(rules_file), "--dtype", "fp32", "--dtype", "fp16", "-j", "0"]) == 0
    assert {r[5] for r in _rows(capsys.readouterr().out)} == {"hit"}


MATRIX_RULES = '''
import fuser
shampoo = fuser.rule("""
    m = 0.9 * m + g
    L = L + g @ transpose(g)
    PL = where(every(k), inv_root(L + eps * eye(rows), 2), PL)
    p = p - lr * PL @ m
""", name="left_shampoo", hyper=dict(lr=1e-2, eps=1e-6, k=2.0),
    state=dict(m=0.0, L="zeros(rows, rows)", PL="eye(rows)"))
'''


def test_precompile_compiles_a_matrix_rules_update_kernel(cache_root, tmp_path, capsys):
    # (the real pipeline: a matrix rule's one kernel is its update, for both GPU targets)
    path = tmp_path / "matrix_rules.py"
    path.write_text(MATRIX_RULES)
    assert cli.main(["precompile", str(path), "--dtype", "bf16"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert {(r[1], r[2], r[5]) for r in rows} == {
        ("left_shampoo_update_step", "cuda:80", "compiled"),
        ("left_shampoo_update_step", "cuda:90", "compiled"),
    }
    # bf16 momentum and split masters: kernels of their own (the buffers stay fp32), then hits
    more = ["--state-dtype", "bf16", "--master-weights", "bf16+int8"]
    assert cli.main(["precompile", str(path), "--dtype", "bf16", *more]) == 0
    assert {r[5] for r in _rows(capsys.readouterr().out)} == {"compiled"}
    assert cli.main(["precompile", str(path), "--dtype", "bf16", *more]) == 0
    assert {r[5] for r in _rows(capsys.readouterr().out)} == {"hit"}
    assert cli.main(["precompile", str(path), "--dtype", "bf16", "--state-dtype", "q8"]) == 1
    assert "8-bit states are not supported for matrix rules" in capsys.readouterr().err
