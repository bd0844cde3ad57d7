"""Precompiling works in a process started with TRITON_INTERPRET=1 (as CPU test suites
are): Triton imported that way cannot compile, so a helper process does."""

import json
import subprocess
import sys

CODE = """
import json
import triton.language.standard as standard
from triton.runtime.jit import JITFunction
assert not isinstance(standard.sum, JITFunction)  # Triton really is in interpreter mode here
from cache_helpers import axpy, broken
from fuser.cache import CompileError, precompile
results = precompile([axpy("a"), axpy("b")], ["cuda:80", "cuda:90"])
try:
    precompile([broken()], ["cuda:90"])
    error = None
except CompileError as e:
    error = str(e)
elf = [r.binary.read_bytes()[:4].hex() for r in results]
print(json.dumps({"status": [r.status for r in results], "elf": elf, "error": error}))
"""


def test_precompile_api_under_triton_interpret(cache_root, subprocess_env):
    env = dict(subprocess_env, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["status"] == ["compiled"] * 4
    assert set(out["elf"]) == {b"\x7fELF".hex()}
    assert "broken" in out["error"] and "undefined_name" in out["error"]


RULES = """
import fuser

heavy_ball = fuser.rule(\"""
    m = mu * m + g
    p = p - lr * m
\""", name="heavy_ball", hyper=dict(lr=0.1, mu=0.9), state=dict(m=0.0))
"""


def test_cli_precompile_under_triton_interpret(cache_root, subprocess_env, tmp_path):
    # (one rule: the built-ins' fp32 kernels took ~300 s on two cores, the whole timeout;
    # test_precompile_builtins compiles those)
    rules = tmp_path / "job_rules.py"
    rules.write_text(RULES)
    env = dict(subprocess_env, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "fuser", "precompile", str(rules), "--dtype", "fp32", "--target", "sm_90"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert any(ln.startswith("heavy_ball ") and " compiled " in ln for ln in lines), res.stdout
    assert " 0 failed" in lines[-1], res.stdout
    assert list(cache_root.rglob("*.cubin"))
