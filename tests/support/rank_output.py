"""Each rank's own output and pid in files, for a multi-rank run launched from the test process (the `cli_here`
fixture's ranks=True): its ranks fork from the session's forkserver, so they write to whatever that server
started with, not to the call's capture. Loaded in every rank, it points the rank's stdout and stderr (and so
those of the processes it starts, such as data-loader workers) at $PARATRAIN_TEST_RANK_OUTPUT/rank-N.log and
adds its pid to rank-N.pid:

    PARATRAIN_PLUGINS=support.rank_output:plugin PARATRAIN_TEST_RANK_OUTPUT=DIR
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

OUTPUT_ENV = "PARATRAIN_TEST_RANK_OUTPUT"


def plugin(hooks) -> None:
    out, rank = os.environ.get(OUTPUT_ENV), os.environ.get("RANK")
    # the launcher loads plugins too, and a lone rank runs in the test process itself: only a forked rank redirects
    if not out or rank is None or "LOCAL_RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(folder / f"rank-{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    with open(folder / f"rank-{rank}.pid", "a") as pids:  # appended: a restarted rank is a new process
        pids.write(f"{os.getpid()}\n")


def rank_logs(folder: Path) -> str:
    """Every rank's output, rank by rank."""
    logs = sorted(folder.glob("rank-*.log"), key=lambda p: int(p.stem.split("-")[1])) if folder.is_dir() else []
    return "".join(p.read_text(errors="replace") for p in logs)


def rank_pids(folder: Path) -> list[int]:
    """Every rank process the run started."""
    return [int(pid) for p in folder.glob("rank-*.pid") for pid in p.read_text().split()] if folder.is_dir() else []


def alive(pid: int) -> bool:
    """A process that has not exited (a zombie has: it waits only for its parent to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
