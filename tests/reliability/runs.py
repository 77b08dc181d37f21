"""Run `paratrain train` in a subprocess for the reliability tests, optionally watching its sockets."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from helpers import cli_env
from reliability.procnet import listening_by_process

# Small and fast: fp32 CPU, two checkpoints between which a kill can land.
KILL_STEPS, KILL_EVERY = 8, 2


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    listeners: set = field(default_factory=set)
    listeners_by_process: dict = field(default_factory=dict)  # {pid: {(address, port)}}, the same sockets by owner

    def json(self) -> dict:
        import json

        return json.loads(self.stdout)


def run_train(
    args: list[str], cwd, env: dict | None = None, timeout: float = 240, watch: bool = False
) -> Run:
    """`python -m paratrain.cli train ARGS`; with watch=True, record every listening socket of its tree."""
    seen: set = set()
    by_process: dict = {}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "paratrain.cli", "train", *args],
            cwd=cwd,
            env=cli_env(env),
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            while proc.poll() is None:
                if time.monotonic() - start > timeout:
                    raise TimeoutError(f"paratrain train {' '.join(args)} ran past {timeout} s")
                if watch:
                    for pid, found in listening_by_process(proc.pid).items():
                        by_process.setdefault(pid, set()).update(found)
                        seen |= found
                time.sleep(0.1 if watch else 0.2)
        finally:
            if proc.poll() is None:  # the whole session: the launcher's workers and forkserver too
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        wall = time.monotonic() - start
        out.seek(0)
        err.seek(0)
        return Run(proc.returncode, out.read(), err.read(), wall, seen, by_process)


def kill_args(strategy: str, out: str, metrics: bool = False) -> list[str]:
    return [
        "--strategy",
        strategy,
        "--nproc",
        "2",
        "--steps",
        str(KILL_STEPS),
        "--ckpt-every",
        str(KILL_EVERY),
        "--ckpt-dir",
        f"{out}/ck",
        "--out",
        out,
        "--seq-len",
        "32",
        "--global-batch",
        "8",
        "--timeout-s",
        "60",
        "--metrics" if metrics else "--no-metrics",
    ]
