"""Each rank's black box for hangs: its recent collectives and phases, written under RUNDIR/hang/ when it stops.

Collectives are recorded at the process-group level by PyTorch's own flight recorder (TORCH_FR_BUFFER_SIZE;
on gloo and NCCL alike since torch 2.8), so DDP's bucket all-reduces, FSDP2's all-gathers and reduce-scatters,
DTensor's redistributions and the pipeline's send/recv are all there, each with its group, its sequence number
in that group, its sizes and the time it was issued. Ours adds what torch cannot know: the step and phase
(train/hooks.py on_phase), paratrain's own collectives by purpose, with entry and exit times
(parallel/collective_hooks.py), and which mesh dimension each group is.

A rank writes `rank-N.json` when it has made no progress for `stall_after_s` (a watchdog thread: a rank stuck
in a hook, a sleep or a collective still writes) and again, final, when its collective timed out
(train/worker.py). train/recovery/hang_report.py reads the files; `paratrain doctor --hang RUNDIR` and the launcher's
last line are built from it.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import threading
import time
from pathlib import Path

from paratrain.parallel.collective_hooks import add_interceptor, current_step
from paratrain.train.recovery import p2p_trace

FR_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
_FAILED_ITSELF = ("timeout", "lost_peer")  # a record a rank writes about its own failure, just before it exits
DEFAULT_ENTRIES = 256
# the state a rank is in after each on_phase mark (the marks name the phase that just ended)
_NEXT_PHASE = {"start": "forward_backward", "forward_backward": "optimizer", "optimizer": "loss_sync",
               "loss_sync": "data/checkpoint"}
_FR_FIELDS = ("record_id", "collective_seq_id", "p2p_seq_id", "is_p2p", "profiling_name", "process_group",
              "input_sizes", "output_sizes", "state", "retired", "time_created_ns")


def enable_torch_recorder(hang_dir: Path | None) -> None:
    """Before the process group exists: turn PyTorch's flight recorder on (a user's own setting wins). Under
    NCCL its watchdog also dumps on a timeout, to files beside ours."""
    os.environ.setdefault(FR_BUFFER_ENV, str(DEFAULT_ENTRIES))
    if hang_dir is not None:
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(hang_dir / "nccl_trace_rank_"))


def torch_entries() -> list[dict]:
    """PyTorch's flight-recorder entries of this process (oldest first), trimmed to what a report reads."""
    try:
        import torch

        raw = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, False))
    except Exception:  # noqa: BLE001 - no recorder in this build, or the group is gone: we still have ours
        return []
    return [{k: e.get(k) for k in _FR_FIELDS} for e in raw.get("entries", [])]


def mesh_groups(layout) -> dict[str, dict]:
    """{process-group name: {"dim", "ranks"}} for every group of the layout's mesh."""
    import torch.distributed as dist

    from paratrain.parallel.layout import GROUP_DIMS

    out = {}
    for name in GROUP_DIMS:
        try:
            mesh = layout.submesh(name)
        except RuntimeError:
            continue
        if mesh is None:
            continue
        group = mesh.get_group()
        out.setdefault(group.group_name, {"dim": name, "ranks": dist.get_process_group_ranks(group)})
    if dist.is_initialized():
        world = dist.group.WORLD
        out.setdefault(world.group_name, {"dim": "world", "ranks": list(range(dist.get_world_size()))})
    return out


class FlightRecorder:
    """One per rank: attach(hooks) records phases and paratrain's collectives; the watchdog writes on a stall."""

    def __init__(self, rank: int, hang_dir: Path | None, stall_after_s: float, entries: int = DEFAULT_ENTRIES):
        self.rank, self.hang_dir, self.stall_after_s = rank, hang_dir, stall_after_s
        self.phases: collections.deque = collections.deque(maxlen=entries)
        self.collectives: collections.deque = collections.deque(maxlen=entries)
        self.p2p: collections.deque = collections.deque(maxlen=entries)
        self.groups: dict[str, dict] = {}
        self.phase, self.progress_at, self.stalled_since = "setup", time.time(), None
        self.completed_step: int | None = None  # the last step this rank finished (its "loss_sync" mark)
        self._step_fd: int | None = None  # rank-N.step: that step, rewritten in place as each one ends
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._handles: list = []
        self._thread: threading.Thread | None = None

    # -- recording -------------------------------------------------------------------------------------------
    def attach(self, hooks) -> None:
        self._handles = [hooks.on_phase(self.on_phase), hooks.after_parallelize(self.on_parallelize)]
        self._remove_interceptor = add_interceptor(self.on_collective)
        p2p_trace.install(self.on_p2p)
        if self.hang_dir is not None:
            self._thread = threading.Thread(target=self._watch, name="paratrain-flight-recorder", daemon=True)
            self._thread.start()

    def on_phase(self, mark: str) -> None:
        now = time.time()
        self.phase = _NEXT_PHASE.get(mark, mark)
        self.phases.append((current_step(), self.phase, now))
        self.progress_at = now
        if mark == "loss_sync":
            self.completed_step = current_step()
            self._write_step(self.completed_step)
        if len(self.phases) == 1 and self.hang_dir is not None:
            self.write("started")  # once: its pid tells the others, should this rank die, that it did

    def on_p2p(self, record: dict) -> None:
        record["step"] = current_step()
        self.p2p.append(record)
        self.progress_at = record["entered"]

    def on_parallelize(self, module, layout) -> None:
        self.groups.update(mesh_groups(layout))

    def on_collective(self, call, proceed):
        entry = {"purpose": call.purpose, "dim": call.dim, "op": call.op, "step": call.step,
                 "entered": time.time(), "left": None}
        self.collectives.append(entry)
        self.progress_at = entry["entered"]
        result = proceed()
        entry["left"] = self.progress_at = time.time()
        return result

    def detach(self) -> None:
        """Stop recording and writing; what was written stays."""
        self._stop.set()
        if self._step_fd is not None:
            os.close(self._step_fd)
            self._step_fd = None
        if self._thread is not None:
            self._thread.join(timeout=2)
        for handle in self._handles:
            handle.remove()
        if self._handles:
            self._remove_interceptor()
            p2p_trace.install(None)
        self._handles = []

    def close(self) -> None:
        """After a run that ended well: detach, and take back what a slow phase made the watchdog write."""
        self.detach()
        if self.hang_dir is not None:
            (self.hang_dir / f"rank-{self.rank}.json").unlink(missing_ok=True)
            (self.hang_dir / f"rank-{self.rank}.step").unlink(missing_ok=True)
            try:
                self.hang_dir.rmdir()  # the last rank out removes the emptied directory
            except OSError:
                pass  # another rank's file is still there, or the directory never existed

    # -- writing ---------------------------------------------------------------------------------------------
    def snapshot(self, reason: str, error: str | None = None) -> dict:
        return {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "reason": reason,
                "error": error, "time": time.time(),
                "dead_peers": self.dead_peers() if reason == "lost_peer" else [],
                "step": current_step(), "completed_step": self.last_completed(), "phase": self.phase,
                "progress_at": self.progress_at,
                "phases": [{"step": s, "phase": p, "at": t} for s, p, t in list(self.phases)[-32:]],
                "collectives": list(self.collectives)[-64:], "p2p": list(self.p2p)[-64:], "groups": self.groups,
                "torch": torch_entries()}

    def last_completed(self) -> int | None:
        """The last step finished here; before this process finished one, the step it resumed from."""
        if self.completed_step is not None:
            return self.completed_step
        return current_step() - 1 if current_step() > 0 else None

    def dead_peers(self, settle_s: float = 1.0) -> list[int]:
        """Ranks on this host whose process is gone (their "started" record names the pid): on a lost peer,
        what tells a dead rank from a stalled one. Ranks on other hosts cannot be checked from here.

        A killed process closes its sockets before it becomes a zombie, so the loss can be seen first: look again
        for up to `settle_s` until one is gone. A peer that wrote its own failure (a timeout, a lost peer) before
        it exited did not die."""
        deadline = time.monotonic() + settle_s
        while True:
            peers = {}
            for path in self.hang_dir.glob("rank-*.json") if self.hang_dir is not None else ():
                try:
                    other = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue
                if other.get("rank") != self.rank and other.get("host") == socket.gethostname() \
                        and other.get("reason") not in _FAILED_ITSELF:
                    peers[int(other["rank"])] = int(other.get("pid", 0))
            dead = sorted(rank for rank, pid in peers.items() if not _process_alive(pid))
            if dead or not peers or time.monotonic() >= deadline:
                return dead
            time.sleep(0.02)

    def _write_step(self, step: int) -> None:
        """Each step's end, in one pwrite (no JSON, no rename: it runs every step): the launcher reports the
        run's last completed step from these even when no rank lived to write its record."""
        if self.hang_dir is None:
            return
        try:
            if self._step_fd is None:
                self.hang_dir.mkdir(parents=True, exist_ok=True)
                self._step_fd = os.open(self.hang_dir / f"rank-{self.rank}.step", os.O_WRONLY | os.O_CREAT, 0o644)
            os.pwrite(self._step_fd, f"{step:>20}\n".encode(), 0)
        except OSError:
            pass  # the run directory is gone or full: the records that matter are written elsewhere

    def write(self, reason: str, error: str | None = None) -> Path | None:
        """Write rank-N.json (atomically: a reader never sees half a file); None without a run directory."""
        if self.hang_dir is None:
            return None
        with self._lock:
            self.hang_dir.mkdir(parents=True, exist_ok=True)
            path = self.hang_dir / f"rank-{self.rank}.json"
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(self.snapshot(reason, error)))
            os.replace(tmp, path)
            return path

    def _watch(self) -> None:
        tick = max(0.1, min(1.0, self.stall_after_s / 4))
        while not self._stop.wait(tick):
            since = self.progress_at
            if time.time() - since >= self.stall_after_s and self.stalled_since != since:
                self.stalled_since = since  # once per stop: the record stays until the rank moves again
                try:
                    self.write("stalled")
                except OSError:
                    return  # the run directory is gone: nothing left to tell


def _process_alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a killed child stays one until its parent reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        if pid <= 0:
            return True  # unknown: do not call it dead
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
