"""What the ``fuser`` command needs besides argument parsing: finding the rules in a file
or module, turning rules into kernel sources, and plain-text progress and tables."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from fuser.codegen.source import KernelSource
from fuser.errors import RuleError
from fuser.rules import Rule

BUILTIN_MODULES = ("fuser.optim.builtins", "fuser.losses.builtins")
DTYPES = ("fp32", "bf16", "fp16")
QFORMATS = ("int8", "uint8", "int8_linear", "uint8_linear", "fp8e4m3", "fp8e5m2")
STATE_DTYPES = (*DTYPES, "param", *QFORMATS, "q8")
MASTER_WEIGHTS = ("bf16+int8", "bf16+int16")
DEVICE_PROFILES = ("h200",)  # render.LAUNCH_PROFILES's keys (the CLI imports no codegen)


class TargetError(Exception):
    """A file or module that cannot be loaded, or that holds no rules; one line.
    ``missing``: there is no such file or module (a usage error)."""

    def __init__(self, message: str, missing: bool = False):
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class Found:
    """A module-level rule and where it came from."""

    origin: str  # the file or module it was found in
    attr: str  # its name in that module
    rule: Rule


def one_line(e: BaseException) -> str:
    """An error as one line: the first line of its message (RuleError carries the source
    line and a caret after it), with its type unless it is a RuleError."""
    from fuser.cache.errors import CompileError

    text = str(e).strip().splitlines()
    head = text[0] if text else ""
    if isinstance(e, (RuleError, CompileError)):
        return head
    if isinstance(e, SyntaxError):
        return f"SyntaxError: {e.msg} (line {e.lineno})"
    return f"{type(e).__name__}: {head}" if head else type(e).__name__


def load_module(target: str):
    """Import a ``.py`` file (run as a module of its own) or a module by name."""
    is_file = target.endswith(".py") or os.sep in target or Path(target).is_file()
    if is_file:
        path = Path(target).resolve()
        if not path.is_file():
            raise TargetError(f"{target}: no such file", missing=True)
        name = f"fuser_user_{path.stem}_{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.parent))  # the file may import its neighbours
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - any failure of a user's file is reported, not raised
            raise TargetError(f"{target}: {one_line(e)}") from None
        finally:
            sys.path.remove(str(path.parent))
        return module
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name and target.startswith(e.name):
            raise TargetError(f"{target}: no such file or module", missing=True) from None
        raise TargetError(f"{target}: {one_line(e)}") from None
    except Exception as e:  # noqa: BLE001
        raise TargetError(f"{target}: {one_line(e)}") from None


def rules_in(module, origin: str) -> list[Found]:
    """Every ``fuser.Rule`` bound at module level, once each, in definition order."""
    seen, found = set(), []
    for attr, value in vars(module).items():
        if isinstance(value, Rule) and id(value) not in seen:
            seen.add(id(value))
            found.append(Found(origin, attr, value))
    return found


def collect(targets: list[str], builtins: bool, note) -> tuple[list[Found], list[TargetError]]:
    """Rules of every target, and the error of each target that fails to load."""
    found, errors = [], []
    if builtins:
        for name in BUILTIN_MODULES:
            try:
                module = importlib.import_module(name)
            except ModuleNotFoundError as e:
                if e.name and name.startswith(e.name):
                    note(f"note: {name} is not part of this installation; its rules are skipped")
                    continue
                raise
            found += rules_in(module, name)
    for target in targets:
        try:
            rules = rules_in(load_module(target), target)
        except TargetError as e:
            errors.append(e)
            continue
        if not rules:
            errors.append(TargetError(f"{target}: no fuser.Rule at module level (fuser.rule or fuser.loss)"))
        found += rules
    return found, errors


@dataclass(frozen=True)
class Variant:
    """One setting of the keywords that change a rule's kernels, as a job uses it.

    Optimizers: parameters in ``dtype``, gradients in ``grad_dtype`` (``None``: ``dtype``),
    states per ``state_dtype`` (fuser.compile's keyword: ``None`` is fp32, ``"param"`` each
    parameter's dtype, an 8-bit format or ``"q8"``), ``stochastic_rounding`` and
    ``master_weights``; ``profile``: the launch shapes of a GPU that has its own
    (``render.LAUNCH_PROFILES``, ``""`` the defaults). Losses: ``hidden`` and ``weight`` in
    ``dtype``; ``vocab_parallel`` for the kernels of a call with ``process_group=``.
    """

    dtype: str = "fp32"
    grad_dtype: str | None = None
    state_dtype: str | None = None
    stochastic_rounding: bool = False
    vocab_parallel: bool = False
    master_weights: str | None = None
    profile: str = ""

    @property
    def options(self) -> str:
        """The keywords besides dtypes, as the summary table shows them."""
        names = ["stochastic rounding"] if self.stochastic_rounding else []
        names += [f"master {self.master_weights}"] if self.master_weights else []
        names += ["vocab-parallel"] if self.vocab_parallel else []
        names += [f"{self.profile} launch shapes"] if self.profile else []
        return ", ".join(names) or "-"

    def __str__(self) -> str:
        text = self.dtype if self.grad_dtype in (None, self.dtype) else f"{self.dtype}:{self.grad_dtype}"
        if self.state_dtype not in (None, "fp32"):
            text += f", states {self.state_dtype}"
        return text if self.options == "-" else f"{text}, {self.options}"


def parse_plan(text: str) -> tuple[str, str | None]:
    """``(param dtype, grad dtype or None)`` of a ``--dtype`` value: ``bf16`` (gradients
    alike) or ``PARAM:GRAD`` such as ``bf16:fp32``. Raises ``ValueError`` with a message."""
    parts = text.split(":")
    if len(parts) > 2 or any(p not in DTYPES for p in parts):
        raise ValueError(f"--dtype {text!r}: use one of {', '.join(DTYPES)}, or PARAM:GRAD such as bf16:fp32")
    return parts[0], (parts[1] if len(parts) == 2 else None)


def variants(
    rule: Rule,
    plans: list[tuple[str, str | None]],
    state_dtypes: list[str | None] = (None,),
    stochastic_rounding: bool = False,
    vocab_parallel: bool = False,
    master_weights: str | None = None,
    profile: str = "",
) -> list[Variant]:
    """Every variant of ``rule`` to compile: for an optimizer, each dtype plan with each
    state dtype; for a loss, each plan's parameter dtype (its kernels include those of
    calls with ``process_group=``, so ``vocab_parallel`` adds nothing)."""
    if rule.kind == "loss":
        return [Variant(d) for d in dict.fromkeys(param for param, _ in plans)]
    return [
        Variant(param, grad, sd, stochastic_rounding, master_weights=master_weights, profile=profile)
        for param, grad in plans
        for sd in state_dtypes
    ]


def kernel_sources(rule: Rule, variant: Variant = Variant()) -> list[KernelSource]:
    """Every kernel the front-end of ``rule.kind`` launches in ``variant``."""
    if rule.kind == "optim":
        from fuser.optim.factory import kernel_sources as sources
        from fuser.rules.matrices import is_matrix_rule

        if is_matrix_rule(rule):  # its one kernel: the update after the matrix phase
            from fuser.optim.matrix_rules import MatrixProgram, update_options
            from fuser.runtime.plans import parse_options

            program = MatrixProgram(rule)
            asked = parse_options(state_dtype=variant.state_dtype, master_weights=variant.master_weights)
            try:  # (the update kernel's: element states as asked, its buffers fp32)
                state_dtype = update_options(rule, program, asked).state_dtype
            except ValueError as e:
                raise RuleError(str(e), rule=rule.name) from None
            rule, state_dtype = program.update_rule, dict(state_dtype) if state_dtype else None
        else:
            state_dtype = variant.state_dtype
        found = sources(
            rule,
            variant.dtype,
            grad_dtype=variant.grad_dtype,
            state_dtype=state_dtype,
            stochastic_rounding=variant.stochastic_rounding,
            master_weights=variant.master_weights,
            profile=variant.profile,
        )
        return list(found)
    if rule.kind == "loss":
        try:
            from fuser.losses import kernel_sources as sources
        except ImportError:
            raise RuleError("loss rules cannot be compiled ahead of time by this installation "
                            "(fuser.losses.kernel_sources is missing)", rule=rule.name) from None  # fmt: skip
        return list(sources(rule, variant.dtype, vocab_parallel=variant.vocab_parallel))
    raise RuleError(f"unknown rule kind {rule.kind!r}", rule=rule.name)


# ---------------------------------------------------------------------------- terminal --
class Progress:
    """A one-line bar on a terminal; one line per step in a log (CI)."""

    def __init__(self, total: int, stream=None):
        self.total = total
        self.done = 0
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start = time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        if self.tty:
            width = 24
            filled = width * self.done // max(self.total, 1)
            bar = "#" * filled + "." * (width - filled)
            self.stream.write(f"\r[{bar}] {self.done}/{self.total} {label[:60]:<60}")
            if self.done == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(f"[{self.done}/{self.total}] {label}\n")
        self.stream.flush()

    def clear(self) -> None:
        if self.tty and self.done < self.total:
            self.stream.write("\n")
            self.stream.flush()


def table(header: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def fmt(row):
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths))]  # fmt: skip
        return "  ".join(cells).rstrip()

    return "\n".join([fmt(header), *(fmt(r) for r in rows)])


def human_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def human_age(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"
