"""User-facing errors: every bad input becomes one line on stderr and exit code 2."""

from __future__ import annotations


def flag_of(name: str) -> str:
    """The command-line flag of a config field, as errors and commands name it: `seq_len` -> `--seq-len`."""
    return "--" + name.replace("_", "-")


class UserError(Exception):
    """Bad input from the user (config, CLI, files, checkpoints). Exit code 2, no traceback."""

    exit_code = 2


class CheckFailed(Exception):
    """A check ran and failed (e.g. a verify mismatch). Exit code 1. A failed training run also names the failing
    `rank` and the last completed `step` where they are known (train --json reports both)."""

    exit_code = 1

    def __init__(self, *args, rank: int | None = None, step: int | None = None):
        super().__init__(*args)
        self.rank, self.step = rank, step


def require(condition: bool, message: str) -> None:
    if not condition:
        raise UserError(message)


def read_json_file(path, label: str):
    """Parse a JSON file the user named; any failure is one UserError line mentioning `label`."""
    import json
    from pathlib import Path

    try:
        return json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {label} {path}: {getattr(exc, 'strerror', None) or exc}") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{label} {path} is not valid JSON: {exc}") from None
