"""User-facing errors: every bad input becomes one line on stderr and exit code 2."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user (config, CLI, files, checkpoints). Exit code 2, no traceback."""

    exit_code = 2


class CheckFailed(Exception):
    """A check ran and failed (e.g. a verify mismatch). Exit code 1."""

    exit_code = 1


def require(condition: bool, message: str) -> None:
    if not condition:
        raise UserError(message)
