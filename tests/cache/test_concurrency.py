"""Four processes precompiling the same kernels at once: each key is compiled once."""

import json
import subprocess
import sys
import time

from cache_helpers import axpy

from fuser.cache import precompile

CHILD = """
import json, os, sys, time
from pathlib import Path
from cache_helpers import axpy
from fuser.cache import precompile
go = Path(sys.argv[1])
while not go.exists():  # start together, after the slow imports
    time.sleep(0.005)
sources = [axpy(tag) for tag in "abc"]
results = precompile(sources, ["cuda:80", "cuda:90"])
print(json.dumps([[r.key, r.status] for r in results]))
"""


def test_four_concurrent_precompiles_compile_each_key_once(cache_root, subprocess_env, tmp_path):
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(go)], env=subprocess_env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]  # fmt: skip
    time.sleep(1.0)
    go.touch()
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err
        assert "Traceback" not in err
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    keys = {k for res in results for k, _ in res}
    assert len(keys) == 6
    compiled = [k for res in results for k, status in res if status == "compiled"]
    assert sorted(compiled) == sorted(keys)  # every key compiled by exactly one process
    # One entry per kernel, each complete: a fresh run in this process hits everything.
    assert len(list(cache_root.rglob("axpy.py"))) == 3
    assert not list(cache_root.rglob("*.tmp"))
    again = precompile([axpy(tag) for tag in "abc"], ["cuda:80", "cuda:90"])
    assert {r.status for r in again} == {"hit"}
