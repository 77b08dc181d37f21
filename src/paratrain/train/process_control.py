"""The launcher's hold on its ranks' processes (Linux; elsewhere a no-op): each rank named in `ps`, the orphans a
dead rank leaves (its data-loader workers) adopted and stopped before they write into the user's terminal, and a
rank stopped by SIGSTOP killed as soon as its peers time out waiting for it (a stopped process cannot act on the
SIGTERM the elastic agent sends, which would then wait 30 s before its SIGKILL)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
from pathlib import Path

log = logging.getLogger("paratrain")

PR_SET_NAME, PR_SET_CHILD_SUBREAPER = 15, 36
_BLOCKED_REASONS = ("timeout", "lost_peer")  # a peer's record that says the run is already failing


def _prctl(option: int, value) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def name_rank_process(rank: int, world: int) -> None:
    """`ps -o comm` (and /proc/PID/comm) shows e.g. "pt-rank1/4" for this process: 15 bytes at most."""
    _prctl(PR_SET_NAME, ctypes.c_char_p(f"pt-rank{rank}/{world}".encode()[:15]))


def _children() -> set[int]:
    """This process's children (zombies included: they still need reaping)."""
    me = os.getpid()
    try:
        tasks = os.listdir(f"/proc/{me}/task")
        return {int(p) for task in tasks for p in Path(f"/proc/{me}/task/{task}/children").read_text().split()}
    except OSError:  # a kernel without /proc/PID/task/TID/children: every process's parent, read one by one
        found = set()
        for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else ()):
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == me:
                    found.add(int(pid))
        return found


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


class LaunchWatch:
    """Around one elastic launch: adopt orphans (PR_SET_CHILD_SUBREAPER) and kill them, and kill ranks found
    stopped once a peer wrote a timeout or lost-peer record to `hang_dir`. `stopped_ranks`: those it killed.
    Enter it once this process's own helpers (the forkserver, the resource tracker) run: any child that appears
    later is taken for an orphan."""

    def __init__(self, hang_dir: Path | None, interval_s: float = 0.1):
        self.hang_dir, self.interval_s = hang_dir, interval_s
        self.stopped_ranks: set[int] = set()
        self._before: set[int] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._adopting = False
        self._dumps: dict[int, dict] = {}
        self._dumps_mtime: int | None = None

    def __enter__(self) -> LaunchWatch:
        self._before = _children()
        self._adopting = _prctl(PR_SET_CHILD_SUBREAPER, 1)
        if self._adopting or self.hang_dir is not None:
            self._thread = threading.Thread(target=self._watch, name="paratrain-launch-watch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.stop_orphans()
        if self._adopting:
            _prctl(PR_SET_CHILD_SUBREAPER, 0)
            self.stop_orphans()  # any adopted in between

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.stop_orphans()
            self.kill_stopped_ranks()

    def stop_orphans(self) -> None:
        """Kill and reap the processes adopted since the launch began: each outlived the rank that started it."""
        if not self._adopting:
            return
        for pid in _children() - self._before:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)

    def kill_stopped_ranks(self) -> None:
        from paratrain.train.recovery.hang_report import read_dumps

        try:
            mtime = self.hang_dir.stat().st_mtime_ns if self.hang_dir is not None else None
        except OSError:
            return
        if mtime is None:
            return
        if mtime != self._dumps_mtime:  # a record is written by a rename: re-read only when one was
            self._dumps, self._dumps_mtime = read_dumps(self.hang_dir), mtime
        dumps = self._dumps
        if not any(d.get("reason") in _BLOCKED_REASONS for d in dumps.values()):
            return
        for rank, dump in dumps.items():
            pid = int(dump.get("pid") or 0)
            if rank in self.stopped_ranks or pid <= 0 or _state(pid) not in ("T", "t"):
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self.stopped_ranks.add(rank)
            log.warning("rank %d (pid %d) is stopped (SIGSTOP) and cannot exit: killed it", rank, pid)
