"""The ``fuser`` command (also ``python -m fuser``).

    fuser precompile TARGET... [--target cuda:90]... [--dtype bf16[:fp32]]... [--builtins]
                     [--state-dtype fp32|bf16|fp16|param]... [--stochastic-rounding]
                     [--vocab-parallel]
    fuser show TARGET [--rule NAME] [--dtype fp32[:fp32]] [--state-dtype ...] [...]
    fuser cache ls | clear [--older-than DAYS] | explain KEY

TARGET is a ``.py`` file or a module name; every ``fuser.Rule`` bound at its module level
is used. The options after ``--dtype`` are the keywords of ``fuser.compile`` (and of the
built-ins) that change the generated kernels. Exit status: 0 on success, 1 when a rule, a
kernel or the cache fails (one line each on stderr, no traceback unless ``--verbose``), 2
for a usage error (one line too).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
import warnings

from fuser import clitools
from fuser.clitools import DEVICE_PROFILES, DTYPES, MASTER_WEIGHTS, STATE_DTYPES, TargetError, one_line

DEFAULT_TARGETS = ("cuda:80", "cuda:90")


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line, like every other error of the command."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see: {self.prog} --help)\n")


PLAN_HELP = (
    "storage dtypes: fp32, bf16 or fp16 for parameters and gradients alike, or PARAM:GRAD for "
    "optimizers whose gradients differ, e.g. bf16:fp32 (bf16 parameters, fp32 main_grad); "
    "loss rules use PARAM, the dtype of hidden and weight"
)
KERNEL_OPTIONS_NOTE = (
    "Optimizer keywords that change no kernel need no flag: grad_attr (only the gradients' "
    "dtype matters: give it in --dtype), seed and state key names."
)


def _kernel_options(p: argparse.ArgumentParser, repeat: bool) -> None:
    """The keywords that change generated kernels, repeatable for precompile."""
    many = dict(action="append") if repeat else {}
    p.add_argument("--state-dtype", dest="state_dtypes", choices=STATE_DTYPES, **many,
                   help="optimizers' state_dtype: a dtype, or param (each parameter's)"
                   + (", repeatable (default: fp32)" if repeat else " (default: fp32)")
                   + "; int8, uint8 (companded), int8_linear, uint8_linear, fp8e4m3, fp8e5m2: "
                   "8-bit blockwise; q8: uint8 for states the rule keeps non-negative, "
                   "int8 for the rest")  # fmt: skip
    p.add_argument("--master-weights", choices=MASTER_WEIGHTS,
                   help="optimizers' master_weights: bf16 parameters with an 8- or 16-bit low part "
                   "of their fp32 masters")  # fmt: skip
    p.add_argument("--stochastic-rounding", action="store_true",
                   help="optimizers built with stochastic_rounding=True (instead of without; "
                   "precompile twice for both)")  # fmt: skip
    p.add_argument("--device-profile", choices=DEVICE_PROFILES, default="",
                   help="optimizers: the launch shapes a step on that GPU renders (its step "
                   "kernels of some layouts differ from the defaults'); precompile once without "
                   "and once with it for a cache both take")  # fmt: skip
    p.add_argument("--vocab-parallel", action="store_true",
                   help="loss rules: accepted for older scripts; the kernels of calls with "
                   "process_group= are always compiled (one-device calls use them too)")  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="print tracebacks of failures")  # fmt: skip
    p = _Parser(prog="fuser", description="fuser: compile, cache and inspect fused kernels",
                parents=[common])  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    pre = sub.add_parser("precompile", help="compile rules ahead of time (no GPU needed)", parents=[common],
                         description="Render and compile every module-level fuser.Rule of each TARGET "
                         "for each GPU target, dtype plan and state dtype, into the cache "
                         "(FUSER_CACHE_DIR).", epilog=KERNEL_OPTIONS_NOTE)  # fmt: skip
    pre.add_argument("targets", nargs="*", metavar="TARGET", help="a .py file or a module name")
    pre.add_argument("--target", dest="gpu_targets", action="append", metavar="cuda:CC",
                     help=f"GPU target, repeatable (default: {' '.join(DEFAULT_TARGETS)})")  # fmt: skip
    pre.add_argument("--dtype", dest="dtypes", action="append", metavar="PLAN",
                     help=f"{PLAN_HELP}; repeatable (default: {' '.join(DTYPES)})")  # fmt: skip
    _kernel_options(pre, repeat=True)
    pre.add_argument("--builtins", action="store_true",
                     help="also every built-in rule of fuser (each variant that a built-in's "
                     "keywords such as amsgrad select)")  # fmt: skip
    pre.add_argument("-j", "--jobs", type=int, default=1, metavar="N",
                     help="compile in N processes (0: one per CPU; default 1)")  # fmt: skip

    show = sub.add_parser("show", help="print the generated Triton source of rules", parents=[common],
                          epilog=KERNEL_OPTIONS_NOTE)  # fmt: skip
    show.add_argument("target", metavar="TARGET", help="a .py file or a module name")
    show.add_argument("--rule", help="only the rule of this name (rule name or module attribute)")
    show.add_argument("--dtype", default="fp32", metavar="PLAN", help=f"{PLAN_HELP} (default: fp32)")
    _kernel_options(show, repeat=False)

    cache = sub.add_parser("cache", help="inspect or clear the cache", parents=[common])
    csub = cache.add_subparsers(dest="cache_command", required=True, metavar="ACTION")
    csub.add_parser("ls", help="one line per entry", parents=[common])
    clear = csub.add_parser("clear", help="remove entries", parents=[common])
    clear.add_argument("--older-than", type=float, metavar="DAYS", help="only entries created before")
    explain = csub.add_parser("explain", help="the fields of a key, each with its own hash", parents=[common])
    explain.add_argument("key", metavar="KEY", help="a key or a unique prefix of one (from `fuser cache ls`)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "precompile" and "triton" not in sys.modules:
        # Triton imported in interpreter mode cannot compile; precompiling never interprets.
        os.environ.pop("TRITON_INTERPRET", None)
    from fuser.cache.entries import CacheWarning
    from fuser.cache.store import CacheError

    with warnings.catch_warnings():
        warnings.simplefilter("always", CacheWarning)
        warnings.showwarning = _show_warning
        try:
            if args.command == "precompile":
                return precompile(args)
            if args.command == "show":
                return show(args)
            return cache(args)
        except TargetError as e:
            _err(f"error: {e}")
            return 2 if e.missing else 1
        except CacheError as e:
            _err(f"error: {e}")
            return 1
        except KeyboardInterrupt:
            _err("interrupted")
            return 130
        except BrokenPipeError:  # `fuser cache ls | head`
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0


def _err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    _err(f"warning: {message}")


def _fail(args, what: str, e: BaseException) -> None:
    if getattr(args, "verbose", False):
        traceback.print_exception(e, file=sys.stderr)
    _err(f"error: {what}: {one_line(e)}" if what else f"error: {one_line(e)}")


# --------------------------------------------------------------------------- precompile --
def precompile(args) -> int:
    """``fuser precompile``: check the options, collect the rules, render every variant,
    compile each distinct kernel once per target, then print the table and the summary."""
    from fuser.cache import cache_dir, parse_target

    if not args.targets and not args.builtins:
        _err("error: nothing to precompile: give a .py file or module, or --builtins")
        return 2
    try:
        gpu_targets = list(dict.fromkeys(parse_target(t) for t in args.gpu_targets or DEFAULT_TARGETS))
    except ValueError as e:
        _err(f"error: {e}")
        return 2
    try:
        plans = list(dict.fromkeys(clitools.parse_plan(t) for t in args.dtypes or DTYPES))
    except ValueError as e:
        _err(f"error: {e}")
        return 2
    state_dtypes = list(dict.fromkeys(args.state_dtypes or ["fp32"]))
    t0 = time.perf_counter()
    found, errors = clitools.collect(args.targets, args.builtins, _err)
    for e in errors:
        _err(f"error: {e}")
    if any(e.missing for e in errors):
        return 2
    unused = _unused_options(args, {f.rule.kind for f in found})
    if unused and not errors:
        _err(f"error: {unused}")
        return 2

    # Render everything first: rule errors show before any compiling, and the bar knows its total.
    failed: set[str] = set()
    work = _render_all(args, found, plans, state_dtypes, failed)
    tasks = _unique_tasks(work, failed)
    rows, counts = _compile_tasks(args, tasks, gpu_targets, failed)
    if rows:
        header = ["rule", "kernel", "target", "dtypes", "options", "status", "seconds"]
        print(clitools.table(header, rows, right={6}))
    total = time.perf_counter() - t0
    summary = (f"{len(rows)} binaries: {counts['compiled']} compiled, {counts['hit']} hits; "
               f"{len(failed) + len(errors)} failed; {total:.1f} s; cache {cache_dir()}")  # fmt: skip
    print(summary)
    return 1 if failed or errors else 0


def _render_all(args, found, plans, state_dtypes, failed: set[str]) -> list[tuple]:
    """(rule name, variant, sources) of every variant of every rule found; a rule that
    fails to render is reported once, added to ``failed``, and its later variants skipped."""
    from fuser.errors import RuleError

    work = []
    for f in found:
        for variant in clitools.variants(f.rule, plans, state_dtypes, args.stochastic_rounding,
                                         args.vocab_parallel, args.master_weights,
                                         args.device_profile):  # fmt: skip
            try:
                work.append((f.rule.name, variant, clitools.kernel_sources(f.rule, variant)))
            except Exception as e:  # noqa: BLE001 - every failure becomes one line per rule
                if isinstance(e, RuleError) and e.rule is None:
                    e = e.with_rule(f.rule.name)
                what = "" if isinstance(e, RuleError) else f"rule {f.rule.name!r} ({variant})"
                if f.rule.name not in failed:
                    _fail(args, what, e)
                failed.add(f.rule.name)
                break
    return work


def _unique_tasks(work: list[tuple], failed: set[str]) -> list[tuple]:
    """(rule name, variant, source) once per distinct kernel of the rules that rendered."""
    # A kernel that several variants share (or two rules that render alike) compiles once.
    unique: dict[str, tuple] = {}
    for name, variant, sources in work:
        if name in failed:
            continue
        for s in sources:
            unique.setdefault(s.digest, (name, variant, s))
    return [task for task in unique.values() if task[0] not in failed]


def _compile_tasks(args, tasks: list[tuple], gpu_targets, failed: set[str]) -> tuple[list, dict]:
    """Compile every task for every target with a progress bar: the summary table's rows in
    task order, and the count of each status; a rule whose kernel fails joins ``failed``."""
    progress = clitools.Progress(len(tasks) * len(gpu_targets))
    rows, counts = {}, {"compiled": 0, "hit": 0}
    for i, outcome in _compile_all([source for _, _, source in tasks], gpu_targets, args.jobs):
        name, variant, source = tasks[i]
        if isinstance(outcome, tuple):  # (one-line error, traceback text)
            progress.clear()
            if name not in failed:
                if getattr(args, "verbose", False):
                    _err(outcome[1].rstrip())
                _err(f"error: rule {name!r}: {outcome[0]}")
            failed.add(name)
            progress.done += len(gpu_targets)
            continue
        for r in outcome:
            counts[r.status] += 1
            dtypes_shown = dict(source.meta).get("dtypes", "-")
            rows[i, r.target] = [name, source.entry, r.target, dtypes_shown, variant.options, r.status,
                                 f"{r.seconds:.2f}"]  # fmt: skip
            progress.step(f"{name} {source.entry} {r.target} {r.status} {r.seconds:.2f}s")
    rows = [rows[k] for k in sorted(rows)]
    progress.clear()
    return rows, counts


def _unused_options(args, kinds: set[str]) -> str | None:
    """The usage error of an option that applies to no rule found, if any."""
    if not kinds:
        return None
    optim = ["--state-dtype"] if args.state_dtypes else []
    optim += ["--stochastic-rounding"] if args.stochastic_rounding else []
    optim += ["--master-weights"] if args.master_weights else []
    optim += ["--device-profile"] if args.device_profile else []
    if optim and "optim" not in kinds:
        return f"{optim[0]} applies to optimizer rules, and only loss rules were found"
    if args.vocab_parallel and "loss" not in kinds:
        return "--vocab-parallel applies to loss rules, and only optimizer rules were found"
    return None


def _compile_all(sources, targets, jobs: int):
    """Yield (index, results or (error line, traceback)) as each kernel finishes, in this
    process or in ``jobs`` worker processes."""
    if jobs == 1 or len(sources) < 2:
        for i, source in enumerate(sources):
            yield i, precompile_one(source, targets)
        return
    import concurrent.futures as cf
    import multiprocessing

    jobs = min(jobs or os.cpu_count() or 1, len(sources))
    # spawn: workers start clean (no forked Triton state), and without TRITON_INTERPRET.
    with cf.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(precompile_one, source, targets): i for i, source in enumerate(sources)}
        for future in cf.as_completed(futures):
            yield futures[future], future.result()


def precompile_one(source, targets):
    """Results of one kernel for every target, or (error line, traceback text); a
    ``CacheError`` (the cache is unusable) propagates."""
    from fuser.cache.entries import CacheWarning, precompile
    from fuser.cache.store import CacheError

    with warnings.catch_warnings():
        warnings.simplefilter("always", CacheWarning)
        warnings.showwarning = _show_warning
        try:
            return precompile([source], targets)
        except CacheError:
            raise
        except Exception as e:  # noqa: BLE001 - one line per failing rule
            return one_line(e), traceback.format_exc()


# --------------------------------------------------------------------------------- show --
def show(args) -> int:
    from fuser.errors import RuleError

    found, errors = clitools.collect([args.target], False, _err)
    if errors:
        raise errors[0]
    if args.rule:
        chosen = [f for f in found if args.rule in (f.rule.name, f.attr)]
        if not chosen:
            names = ", ".join(sorted({f.rule.name for f in found}))
            _err(f"error: {args.target} has no rule {args.rule!r} (it has: {names})")
            return 1
        found = chosen
    try:
        plan = clitools.parse_plan(args.dtype)
    except ValueError as e:
        _err(f"error: {e}")
        return 2
    unused = _unused_options(args, {f.rule.kind for f in found})
    if unused:
        _err(f"error: {unused}")
        return 2
    status = 0
    for f in found:
        for variant in clitools.variants(f.rule, [plan], [args.state_dtypes], args.stochastic_rounding,
                                         args.vocab_parallel, args.master_weights,
                                         args.device_profile):  # fmt: skip
            try:
                sources = clitools.kernel_sources(f.rule, variant)
            except Exception as e:  # noqa: BLE001
                _fail(args, "" if isinstance(e, RuleError) else f"rule {f.rule.name!r} ({variant})", e)
                status = 1
                break
            for s in sources:
                dtypes = dict(s.meta).get("dtypes", variant.dtype)
                extra = "" if variant.options == "-" else f", {variant.options}"
                print(f"# ===== rule {f.rule.name}, kernel {s.entry}, dtypes {dtypes}{extra} =====")
                print(s.text.rstrip("\n"))
                print()
    return status


# -------------------------------------------------------------------------------- cache --
def cache(args) -> int:
    from fuser.cache import manage
    from fuser.cache.store import cache_dir

    if args.cache_command == "ls":
        entries = manage.list_entries()
        now = time.time()
        rows = [[e.key[:16], e.rule, e.kernel, ",".join(e.targets) or "-", e.dtypes,
                 clitools.human_size(e.size), clitools.human_age(now - e.created),
                 f"DAMAGED: {e.problem}" if e.problem else ""] for e in entries]  # fmt: skip
        if rows:
            header = ["key", "rule", "kernel", "targets", "dtypes", "size", "age", ""]
            print(clitools.table(header, rows, right={5, 6}))
        total = sum(e.size for e in entries)
        print(f"{len(entries)} entries, {clitools.human_size(total)} in {cache_dir()}")
        return 0
    if args.cache_command == "clear":
        if args.older_than is not None and args.older_than < 0:
            _err("error: --older-than takes a number of days >= 0")
            return 2
        removed, freed = manage.clear(args.older_than)
        print(f"removed {removed} entries ({clitools.human_size(freed)}) from {cache_dir()}")
        return 0
    try:
        lines = manage.explain(args.key)
    except KeyError as e:
        _err(f"error: {e.args[0]}")
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
