"""Test helpers (importable as `helpers`): run the CLI in a subprocess, as a user would, with a bounded time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")


@dataclass
class CLIResult:
    returncode: int
    stdout: str
    stderr: str

    def json(self) -> dict:
        return json.loads(self.stdout)


def cli_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CI=env.get("CI", ""))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.update(extra or {})
    return env


def plugin_env(*plugins: str, **settings: str) -> dict:
    """Environment that loads tests/support plugins into a `paratrain` subprocess and its workers:
    plugin_env("support.faults:plugin", PARATRAIN_TEST_FAULT="dp-grad-sum"). Puts tests/ on PYTHONPATH."""
    path = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH", "")) if p)
    return {"PARATRAIN_PLUGINS": ",".join(plugins), "PYTHONPATH": path, **settings}


def run_cli(*args: str, timeout: float = 240, cwd: str | None = None, env: dict | None = None) -> CLIResult:
    proc = subprocess.run([sys.executable, "-m", "paratrain.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=cli_env(env), stdin=subprocess.DEVNULL)
    return CLIResult(proc.returncode, proc.stdout, proc.stderr)


