"""The compile helper process (``python -m fuser.cache.worker_main``), started by
``fuser.cache.worker``: reads one JSON request a line, compiles it with ``aot``, writes
one line ``MARK`` + JSON reply."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

from fuser.cache.aot import compile_binary
from fuser.cache.errors import CompileError
from fuser.cache.worker import MARK
from fuser.codegen.source import KernelSource


def main() -> None:
    out = sys.stdout
    sys.stdout = sys.stderr  # anything else printed must not reach the protocol
    for line in sys.stdin:
        req = json.loads(line)
        path = Path(req["path"])
        source = KernelSource(
            text=path.read_text(),
            entry=req["entry"],
            signature=tuple(tuple(x) for x in req["signature"]),
            constexprs=tuple(tuple(x) for x in req["constexprs"]),
            num_warps=req["num_warps"],
            num_stages=req["num_stages"],
            max_registers=req["max_registers"],
        )
        try:
            binary, metadata = compile_binary(source, path, req["target"])
            reply = {"ok": True, "cubin": base64.b64encode(binary).decode(), "metadata": metadata.decode()}
        except CompileError as e:
            reply = {"ok": False, "error": str(e)}
        except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
            reply = {"ok": False, "error": f"kernel {source.entry}: {type(e).__name__}: {e}"}
        out.write(MARK + json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
