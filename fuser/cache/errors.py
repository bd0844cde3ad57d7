"""Errors of the compile step, shared by the compiler (``aot``) and its helper process."""

from __future__ import annotations


class CompileError(RuntimeError):
    """A generated kernel that Triton's compiler rejects."""
