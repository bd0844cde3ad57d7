"""FUSER_LOG switches on fuser's logger."""

import logging
import subprocess
import sys

import pytest
from childenv import child_env


def test_fuser_log_reports_table_rebuilds():
    code = (
        "import torch, fuser\n"
        "p = torch.randn(7); p.grad = torch.randn(7)\n"
        "fuser.optim.SGD([p], lr=0.1).step()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(FUSER_LOG="info"),
        capture_output=True,
        text=True,
        check=True,
    )
    assert "fuser INFO: SGD: tables rebuilt for 1 tensors" in out.stderr


def test_bad_fuser_log_level_is_refused(monkeypatch):
    from fuser.log import configure_from_env

    monkeypatch.setenv("FUSER_LOG", "loud")
    with pytest.raises(ValueError, match="FUSER_LOG"):
        configure_from_env()
    monkeypatch.setenv("FUSER_LOG", "debug")
    configure_from_env()
    assert logging.getLogger("fuser").level == logging.DEBUG
