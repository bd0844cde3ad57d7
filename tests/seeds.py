"""The running test's seed, for code that re-seeds on purpose: helpers that build the same
model twice within one test, and child processes (distributed ranks, CLI runs), which
inherit it through the environment. ``tests/conftest.py`` sets it before every test."""

import os

CASE_SEED_ENV = "FUSER_TEST_CASE_SEED"


def set_case_seed(seed: int) -> None:
    os.environ[CASE_SEED_ENV] = str(seed)


def session_seed(offset: int = 0) -> int:
    """The run's seed plus ``offset``: for what a module-scoped fixture builds once and every
    test of the module shares."""
    return (int(os.environ.get("FUSER_TEST_SEED", "0")) + offset) % 2**63


def case_seed(offset: int = 0) -> int:
    """The running test's seed plus ``offset`` (0 outside pytest), a valid torch seed."""
    return (int(os.environ.get(CASE_SEED_ENV, "0")) + offset) % 2**63
