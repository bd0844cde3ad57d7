"""A helper process that compiles kernels for a process whose Triton was imported with
``TRITON_INTERPRET=1`` (as test suites on CPU do): Triton's compiler cannot run there,
because its own library functions were built as interpreter objects.

One worker starts on first need and serves the process's compiles one at a time over
its stdin and stdout (one JSON line each way); it exits when its parent does. Its own
loop is ``fuser.cache.worker_main``, which imports the compiler this module is called by.
"""

from __future__ import annotations

import atexit
import base64
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from fuser.cache.errors import CompileError
from fuser.codegen.source import KernelSource

MARK = "fuser-worker:"

_proc: subprocess.Popen | None = None
_stderr = None
_lock = threading.Lock()


def _start() -> subprocess.Popen:
    global _proc, _stderr
    if _proc is not None and _proc.poll() is None:
        return _proc
    import fuser

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    package_root = str(Path(fuser.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    _stderr = tempfile.TemporaryFile()
    command = [sys.executable, "-m", "fuser.cache.worker_main"]
    _proc = subprocess.Popen(command, env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=_stderr, text=True)  # fmt: skip
    atexit.register(_stop)
    return _proc


def _stop() -> None:
    if _proc is not None and _proc.poll() is None:
        _proc.stdin.close()
        try:
            _proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _proc.kill()


def _died() -> str:
    _stderr.seek(0)
    tail = _stderr.read().decode(errors="replace").strip().splitlines()[-3:]
    return " | ".join(tail) or "no message"


def compile_in_worker(source: KernelSource, path: Path, target: str) -> tuple[bytes, bytes]:
    """(cubin, metadata JSON) of the kernel at ``path``, compiled by the helper process."""
    request = {
        "path": str(path),
        "entry": source.entry,
        "signature": source.signature,
        "constexprs": source.constexprs,
        "num_warps": source.num_warps,
        "num_stages": source.num_stages,
        "max_registers": source.max_registers,
        "target": target,
    }
    with _lock:
        proc = _start()
        try:
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
            while line and not line.startswith(MARK):
                line = proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            raise CompileError(f"the compile helper process stopped: {_died()}")
    reply = json.loads(line[len(MARK) :])
    if not reply["ok"]:
        raise CompileError(reply["error"])
    return base64.b64decode(reply["cubin"]), reply["metadata"].encode()
