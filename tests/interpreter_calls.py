"""A helper call of an interpreted kernel without re-patching ``triton.language``.

Triton's interpreter patches ``triton.language`` (every builtin of ``tl``, ``tl.core``,
``tl.math`` and the tensor classes, found through ``inspect.getmembers``) when a grid starts,
and again at each call of a ``@triton.jit`` helper from inside the kernel: a fifth of an
interpreted step whose kernel calls helpers (``_q8_encode``, ``_to_bf16`` ...) once per
element block. The second patch changes nothing where the helper shares its kernel's module
(fuser's kernels carry their helpers): the builtins it would patch are those of the same
modules, patched already, and ``is_builtin`` skips the patched ones. ``install()`` makes
such a call run the helper directly; a helper from another module is patched as before.

Only for the Triton whose ``InterpretedFunction.__call__`` is the one written here
(``installed()`` says whether it took); ``tests/test_interpreter_calls.py`` checks results
are bit-identical either way."""

import hashlib
import inspect
import threading

from triton.runtime import interpreter

# sha256 of inspect.getsource(interpreter.InterpretedFunction.__call__) in Triton 3.6.0
KNOWN_CALL = "f2446df46264004916b677478c2eef6ef349bd2c04a99da9eade596b78cd54d8"

_running = threading.local()  # the module globals of each grid running in this thread
_grid_call = interpreter.GridExecutor.__call__
_helper_call = interpreter.InterpretedFunction.__call__


def call_fingerprint() -> str:
    return hashlib.sha256(inspect.getsource(_helper_call).encode()).hexdigest()


def _run_grid(self, *args, **kwargs):
    stack = _running.__dict__.setdefault("stack", [])
    stack.append(self.fn.__globals__)
    try:
        return _grid_call(self, *args, **kwargs)
    finally:
        stack.pop()


def _call_helper(self, *args, **kwargs):
    stack = getattr(_running, "stack", None)
    if not stack or self.fn.__globals__ is not stack[-1]:
        return _helper_call(self, *args, **kwargs)
    fn = self.rewrite()  # (Triton's own call, less its _patch_lang(self.fn))
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        raise interpreter.InterpreterError(repr(e)) from e


def install() -> bool:
    if call_fingerprint() != KNOWN_CALL:
        return False
    interpreter.GridExecutor.__call__ = _run_grid
    interpreter.InterpretedFunction.__call__ = _call_helper
    return True


def uninstall() -> None:
    interpreter.GridExecutor.__call__ = _grid_call
    interpreter.InterpretedFunction.__call__ = _helper_call


def installed() -> bool:
    return interpreter.InterpretedFunction.__call__ is _call_helper
