"""Flake hunt: the numeric tests of the CPU suite under many session seeds, in one process.

    python tests/flake_hunt.py --seeds 200 --seed 1000            # the default numeric tests
    python tests/flake_hunt.py --seeds 50 tests/optim/test_core.py -k adamw

Each selected test runs once per seed ``seed, seed + 1, ...`` (``--seeds`` of
tests/conftest.py). The report (markdown, ``--out``) has the command, the machine, the
time taken and one row per test that failed under any seed: how often, the seeds that
reproduce it (``FUSER_TEST_SEED=<seed> python -m pytest <test>``) and the first line of
its message. Not run by CI: it takes tens of minutes on two cores.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The tests that compare numbers with references (float64, torch.optim, pytorch-optimizer,
# the model's own loss). Left out for time: tests/distributed (a process group per test) and
# the other framework integrations.
NUMERIC = [
    "tests/test_numerics.py",
    "tests/optim/test_core.py",
    "tests/optim/test_perturbation.py",
    "tests/optim/test_training.py",
    "tests/optim/test_builtins.py",
    "tests/optim/test_reductions.py",
    "tests/optim/test_scalar_state.py",
    "tests/optim/test_step_check.py",
    "tests/losses/test_loss_values.py",
    "tests/losses/test_loss_schedules.py",
    "tests/integrations/test_transformers_loss.py",
    "tests/optim/test_shaped.py",
    "tests/optim/test_factored.py",
    "tests/optim/test_launch_shape.py",
    "tests/optim/test_muon.py",
    "tests/optim/test_normuon.py",
    "tests/optim/test_multi_rule.py",
    "tests/optim/test_zoo.py",
    "tests/optim/test_schedule_free.py",
    "tests/optim/test_compressed.py",
    # (the distributed suites start process groups per test: hunt them by name)
    # Ten seconds a run or more through the interpreter (hundreds of tensors), or no numbers:
    "-k",
    "not global_norm_clipping and not 500_tensors and not renders",
]
SEED_ID = re.compile(r"seed(\d+)")


def parse(junit: Path) -> tuple[dict, dict]:
    """(runs per base test id, failures per base test id as [(seed, message)])."""
    runs, failures = defaultdict(int), defaultdict(list)
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "")
        found = SEED_ID.search(name)
        seed = int(found.group(1)) if found else None
        base = (
            SEED_ID.sub("", name).replace("[-", "[").replace("-]", "]").replace("--", "-").replace("[]", "")
        )
        test = f"{case.get('classname', '')}::{base}"
        if case.find("skipped") is not None:
            continue
        runs[test] += 1
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            message = (bad.get("message") or bad.text or "").strip().splitlines()
            failures[test].append((seed, message[0][:160] if message else ""))
    return runs, failures


def report(args, cmd, runs, failures, seconds, code) -> str:
    total = sum(runs.values())
    failed = sum(len(v) for v in failures.values())
    lines = [
        f"# Flake hunt, {datetime.date.today().isoformat()}",
        "",
        f"- command: `{shlex.join(cmd)}`",
        f"- machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"CPU tensors through Triton's interpreter",
        f"- seeds: {args.seed} .. {args.seed + args.seeds - 1} ({args.seeds})",
        f"- {len(runs)} tests, {total} runs, {failed} failed, in {seconds / 60:.1f} min (pytest exit {code})",
        "",
    ]
    if not failures:
        lines.append("No test failed under any seed.")
        return "\n".join(lines) + "\n"
    lines += ["| test | failed / runs | seeds | first message |", "|---|---|---|---|"]
    for test in sorted(failures, key=lambda t: -len(failures[t])):
        seeds = ", ".join(str(s) for s, _ in failures[test][:8])
        message = failures[test][0][1].replace("|", "\\|")
        lines.append(f"| `{test}` | {len(failures[test])} / {runs[test]} | {seeds} | {message} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=200, help="seeds per test (default 200)")
    parser.add_argument("--seed", type=int, default=None, help="first session seed (default: fresh)")
    parser.add_argument("--out", type=Path, default=None, help="markdown report (default: stdout only)")
    parser.add_argument(
        "--failure-log", type=Path, default=None, help="each failure as it happens (see tests/conftest.py)"
    )
    parser.add_argument("pytest_args", nargs="*", help="test paths and pytest options (default: NUMERIC)")
    args, more = parser.parse_known_args(argv)  # pytest's own options pass through
    args.pytest_args += more
    if args.seed is None:
        args.seed = int.from_bytes(os.urandom(4), "little") >> 1
    with tempfile.TemporaryDirectory(prefix="fuser-flake-hunt-") as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow and not gpu"]
        cmd += [f"--seeds={args.seeds}", f"--seed={args.seed}", f"--junitxml={junit}"]
        if args.failure_log:
            cmd.append(f"--failure-log={args.failure_log.resolve()}")
        cmd += args.pytest_args or NUMERIC
        start = time.monotonic()
        code = subprocess.call(cmd, cwd=REPO)
        seconds = time.monotonic() - start
        runs, failures = parse(junit)
    shown = [
        "python",
        "tests/flake_hunt.py",
        f"--seeds={args.seeds}",
        f"--seed={args.seed}",
        *args.pytest_args,
    ]
    text = report(args, shown, runs, failures, seconds, code)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
