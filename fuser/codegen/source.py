"""``KernelSource``: the rendered Triton module and everything needed to compile it."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class KernelSource:
    """Generated Triton source plus the one description of its arguments.

    ``signature`` lists every runtime argument of ``entry`` in order with its Triton type
    string (``*i64``, ``*fp32``, ``i32``, ``fp64``); ``constexprs`` the compile-time
    constants passed by keyword. The ahead-of-time compiler and the runtime launcher both
    read these fields, so the two can never disagree about the kernel's interface.
    """

    text: str
    entry: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, int], ...]
    num_warps: int
    num_stages: int
    # Registers a thread may hold (ptxas's -maxnreg; 0: the compiler's choice).
    max_registers: int = 0
    # Shown by `fuser cache ls`: rule name, kind, dtype plan...
    meta: tuple[tuple[str, str], ...] = ()

    @cached_property
    def digest(self) -> str:
        """Hash of the text and the launch options: the identity of this kernel (computed
        once per instance: every launcher lookup reads it)."""
        h = hashlib.sha256(self.text.encode())
        h.update(
            repr((self.entry, self.signature, self.constexprs, self.num_warps, self.num_stages)).encode()
        )
        if self.max_registers:
            h.update(f"maxnreg={self.max_registers}".encode())
        return h.hexdigest()
