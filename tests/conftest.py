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


@pytest.fixture
def cli_inproc(tmp_path, monkeypatch, capsys):
    """paratrain's main() in this process, cwd = tmp_path: no interpreter start, so fast. Only for inputs
    refused before any worker starts (a valid `train` would run here)."""
    from paratrain.cli import main

    monkeypatch.chdir(tmp_path)

    def _run(*args: str) -> CLIResult:
        with pytest.raises(SystemExit) as exc:
            main(list(args))
        out = capsys.readouterr()
        return CLIResult(exc.value.code, out.out, out.err)

    return _run
