import hashlib
import os
import random
import secrets
import tempfile

import interpreter_calls
import numpy
import pytest
import torch
from seeds import set_case_seed

# A kernel's calls of its own helpers skip the interpreter's second patch of triton.language
# (interpreter_calls.py; bit-identical results, tests/test_interpreter_calls.py).
interpreter_calls.install()

# Kernels written by the tests go to a throwaway cache unless the caller chose one.
os.environ.setdefault("FUSER_CACHE_DIR", tempfile.mkdtemp(prefix="fuser-test-cache-"))

SEED_ENV = "FUSER_TEST_SEED"


def pytest_addoption(parser):
    group = parser.getgroup("fuser")
    group.addoption(
        "--seed",
        type=int,
        default=None,
        help=f"session seed of every random input (default: ${SEED_ENV}, else a fresh one per run)",
    )
    group.addoption(
        "--seeds",
        type=int,
        default=1,
        metavar="N",
        help="run every selected test under N session seeds (seed, seed+1, ...): a flake hunt",
    )
    group.addoption(
        "--failure-log",
        default=None,
        metavar="FILE",
        help="append each failure (test, seeds, message) to FILE as it happens",
    )


def session_seed(config) -> int:
    return config.stash[_SEED]


_SEED = pytest.StashKey[int]()


def pytest_configure(config):
    seed = config.getoption("seed")
    if seed is None and os.environ.get(SEED_ENV):
        seed = int(os.environ[SEED_ENV])
    if seed is None:
        seed = secrets.randbelow(2**31)
    config.stash[_SEED] = seed
    # Child processes (distributed ranks, CLI runs) see the same session seed.
    os.environ[SEED_ENV] = str(seed)


def _seed_line(config) -> str:
    seed = session_seed(config)
    return f"fuser test seed: {seed} (rerun with {SEED_ENV}={seed} or --seed {seed})"


def pytest_report_header(config):
    return _seed_line(config)


def pytest_sessionstart(session):
    # ``-q`` (the README's ``make test``) hides the header: the seed is printed anyway.
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and session.config.get_verbosity() < 0:
        reporter.write_line(_seed_line(session.config))


def pytest_generate_tests(metafunc):
    n = metafunc.config.getoption("seeds")
    if n > 1:
        base = session_seed(metafunc.config)
        metafunc.fixturenames.append("_session_seed")
        metafunc.parametrize("_session_seed", [base + i for i in range(n)], ids=lambda s: f"seed{s}")


def test_seed_for(session: int, nodeid: str) -> int:
    """The seed of one test: the session seed mixed with the test's id (without the flake
    hunt's ``[seedN]`` suffix), so one test re-run alone draws what it drew in the suite."""
    digest = hashlib.sha256(f"{session}:{nodeid}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _base_nodeid(item) -> str:
    session = _params(item).get("_session_seed")
    if session is None:
        return item.nodeid
    tag = f"seed{session}"
    nodeid = item.nodeid.replace(f"[{tag}]", "").replace(f"[{tag}-", "[").replace(f"-{tag}]", "]")
    return nodeid.replace(f"-{tag}-", "-")


def _params(item) -> dict:
    return getattr(getattr(item, "callspec", None), "params", {})


_TEST_SEED = pytest.StashKey[tuple]()


@pytest.fixture(autouse=True)
def _seed_everything(request):
    """Seeds torch, numpy and random from this test's seed before it runs."""
    item = request.node
    session = _params(item).get("_session_seed", session_seed(request.config))
    seed = test_seed_for(session, _base_nodeid(item))
    item.stash[_TEST_SEED] = (session, seed)
    set_case_seed(seed)
    torch.manual_seed(seed)
    numpy.random.seed(seed % 2**32)
    random.seed(seed)
    return seed


@pytest.fixture
def seed(_seed_everything) -> int:
    """This test's seed, for generators of its own and for child processes."""
    return _seed_everything


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and _TEST_SEED in item.stash:
        session, seed = item.stash[_TEST_SEED]
        log = item.config.getoption("failure_log")
        if log:
            message = str(report.longrepr).strip().splitlines()
            with open(log, "a") as f:
                f.write(
                    f"{item.nodeid}\tsession {session}\t{report.when}\t{message[-1] if message else ''}\n"
                )
        report.sections.append(
            (
                "fuser test seed",
                f"session seed {session}, test seed {seed}; rerun exactly with:\n"
                f"  {SEED_ENV}={session} python -m pytest '{_base_nodeid(item)}'",
            )
        )
    return report


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if terminalreporter.stats.get("failed"):
        seed = session_seed(config)
        terminalreporter.write_line(f"fuser test seed: {seed} (rerun the failures with {SEED_ENV}={seed})")


@pytest.fixture
def device() -> torch.device:
    """CUDA when there is a GPU; otherwise CPU tensors through Triton's interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_collection_modifyitems(config, items):
    _keep_sweep_slices(config, items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# -- sweeps: expensive exhaustive parametrizations, a slice per run ------------------------
ALL_ENV = "FUSER_TEST_ALL"


def sweep_all() -> bool:
    """Whether this run takes every item of every sweep (``make test-all``)."""
    return os.environ.get(ALL_ENV, "") not in ("", "0")


def sweep_slice(items: list, runs: int, session: int) -> list:
    """The items of a sweep that a run with session seed ``session`` takes: those whose
    index ``i`` has ``(i + session) % runs == 0``. Any ``runs`` consecutive seeds take every
    item once; ``FUSER_TEST_ALL=1`` takes them all."""
    if sweep_all() or runs <= 1:
        return list(items)
    return [x for i, x in enumerate(items) if (i + session) % runs == 0]


def _keep_sweep_slices(config, items):
    """Deselects, for each test marked ``sweep(runs=K)``, the parametrizations outside this
    run's slice (by the sorted ids of that test's cases, without the flake hunt's seeds)."""
    groups: dict[str, list] = {}
    for item in items:
        mark = item.get_closest_marker("sweep")
        if mark is not None:
            groups.setdefault(item.nodeid.split("[")[0], []).append(item)
    dropped = []
    for group in groups.values():
        runs = group[0].get_closest_marker("sweep").kwargs["runs"]
        ids = sorted({_base_nodeid(item) for item in group})
        kept = set(sweep_slice(ids, runs, session_seed(config)))
        dropped += [item for item in group if _base_nodeid(item) not in kept]
    if dropped:
        gone = set(dropped)
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item not in gone]


@pytest.fixture
def sweep(request):
    """``sweep(items, runs)``: this run's slice of a sweep inside one test (see sweep_slice)."""
    return lambda items, runs: sweep_slice(list(items), runs, session_seed(request.config))
