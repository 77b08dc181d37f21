"""Shared fixtures. Helpers live in tests/helpers.py (tests/ is on pytest's pythonpath)."""

from __future__ import annotations

import pytest

from helpers import CLIResult, run_cli

__all__ = ["CLIResult", "run_cli"]


@pytest.fixture
def cli(tmp_path):
    """run_cli with the working directory set to a fresh temporary folder."""

    def _run(*args: str, timeout: float = 240, env: dict | None = None) -> CLIResult:
        return run_cli(*args, timeout=timeout, cwd=str(tmp_path), env=env)

    return _run
