"""Hang: one rank stalls (tests/support/kill_stall.py, through the trainer's hooks); every rank must exit within --timeout-s plus a
margin, non-zero, with one message naming the operation, and no process of the run may linger."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from helpers import plugin_env
from reliability.runs import run_train

TIMEOUT_S = 5


def processes_with(tag: str) -> list[int]:
    """Live processes whose environment carries tag (the run's workers and forkserver inherit it)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if tag.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.timeout(TIMEOUT_S + 30 + 15)
def test_stalled_rank_makes_every_rank_exit(tmp_path):
    tag = f"PARATRAIN_TEST_TAG={uuid.uuid4().hex}"
    env = plugin_env("support.kill_stall:plugin", PARATRAIN_FAULT_STALL="1:2", **{tag.split("=")[0]: tag.split("=")[1]})
    run = run_train(
        [
            "--nproc",
            "2",
            "--steps",
            "6",
            "--timeout-s",
            str(TIMEOUT_S),
            "--seq-len",
            "32",
            "--global-batch",
            "8",
            "--out",
            "run",
        ],
        tmp_path,
        env=env,
        timeout=TIMEOUT_S + 30,
    )
    assert run.returncode == 1, run.stderr[-3000:]
    lines = [ln for ln in run.stderr.splitlines() if ln.startswith("failed:")]
    assert len(lines) == 1, run.stderr[-3000:]
    assert lines[0].startswith(f"failed: rank 0 timed out after {TIMEOUT_S} s in "), lines[0]
    assert "forward/backward" in lines[0] and "at step 3" in lines[0], lines[0]
    assert "Traceback" not in run.stderr
    deadline = time.monotonic() + 10  # the forkserver's interpreter teardown takes a moment
    while (left := processes_with(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == [], [open(f"/proc/{p}/cmdline").read().replace("\0", " ") for p in left]
