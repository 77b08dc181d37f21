"""Name the rank that hung a run: read every rank's flight-recorder file (train/recovery/flight_recorder.py) and find who
never entered the collective the others wait in.

A rank that waits in a collective is not the culprit, even when others wait for it: the culprit is a member of
a collective someone waits in that never issued it and waits in nothing itself (it is stuck in its own work),
or a rank that died. The launcher prints the result as the run's last line; `paratrain doctor --hang` reads the
same files afterwards.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path

_BLOCKED_REASONS = ("timeout", "lost_peer")


@dataclass(frozen=True)
class Pending:
    """A collective one rank waits in."""

    rank: int
    group: str
    op: str
    seq: int
    p2p: bool


def read_dumps(hang_dir: Path) -> dict[int, dict]:
    """{rank: its last written record}; unreadable files are skipped (a rank killed mid-write leaves none)."""
    dumps = {}
    for path in sorted(Path(hang_dir).glob("rank-*.json")):
        try:
            data = json.loads(path.read_text())
            dumps[int(data["rank"])] = data
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return dumps


def _seq(entry: dict) -> int:
    return int(entry.get("p2p_seq_id") or 0) if entry.get("is_p2p") else int(entry.get("collective_seq_id") or 0)


def _op(entry: dict) -> str:
    return str(entry.get("profiling_name") or "collective").split(":")[-1]


def pending(dump: dict) -> Pending | None:
    """The collective this rank waits in: its newest torch entry not completed; None when it waits in none."""
    entries = dump.get("torch") or []
    open_entries = [e for e in entries if not e.get("retired")]
    if not open_entries and dump.get("reason") in _BLOCKED_REASONS and entries:
        open_entries = entries[-1:]  # a backend that retires a failed work too: the last one issued
    if not open_entries:
        return None
    entry = open_entries[-1]
    return Pending(dump["rank"], str((entry.get("process_group") or ["?"])[0]), _op(entry), _seq(entry),
                   bool(entry.get("is_p2p")))


def _groups(dumps: dict[int, dict]) -> dict[str, dict]:
    groups: dict[str, dict] = {}
    for dump in dumps.values():
        for name, info in (dump.get("groups") or {}).items():
            groups.setdefault(name, info)
    return groups


def _dim(group: str, dumps: dict[int, dict], groups: dict[str, dict]) -> str:
    if group in groups:
        return groups[group]["dim"]
    for dump in dumps.values():  # no mesh recorded (a group of our own): torch's description of it
        for entry in dump.get("torch") or []:
            name, desc = (list(entry.get("process_group") or []) + ["", ""])[:2]
            if name == group and desc and desc != "undefined":
                return "world" if desc == "default_pg" else desc.removeprefix("mesh_")
    return f"group {group}"


def group_dim(group: str, dumps: dict[int, dict]) -> str:
    """The mesh dimension (or torch's description) of a process group named in the records."""
    return _dim(group, dumps, _groups(dumps))


def _reached(dump: dict, wait: Pending) -> int:
    """The highest sequence number this rank issued on the waited group (of the same kind: p2p or not)."""
    seqs = [_seq(e) for e in dump.get("torch") or []
            if str((e.get("process_group") or ["?"])[0]) == wait.group and bool(e.get("is_p2p")) == wait.p2p]
    return max(seqs, default=0)


def _where(dump: dict | None, peer_step: int | None = None) -> str:
    if dump is None:
        return "it wrote no record"
    own = dump.get("step")
    # a rank stopped (SIGSTOP) writes nothing more: its own record is stale, its peers' give its step
    if peer_step is not None and own is not None and own < peer_step:
        return f"step {peer_step} by its peers' records; its own stops at step {own}, in {dump.get('phase')}"
    return f"step {own}, last seen in {dump.get('phase')}"


def dead_ranks(exits: dict[int, int | None], dumps: dict[int, dict]) -> dict[int, str]:
    """{rank: how we know} for ranks that died: killed by a signal the launcher did not send (it stops the rest
    with SIGTERM), or found gone by a peer that lost its connection (flight_recorder.py dead_peers)."""
    out = {}
    for rank, code in exits.items():
        if code is not None and code < 0 and -code not in (signal.SIGTERM, signal.SIGINT):
            try:
                out[rank] = signal.Signals(-code).name
            except ValueError:
                out[rank] = f"signal {-code}"
    # only the first rank that lost a peer: it looked before any rank exited, so before the launcher stopped the
    # rest (a later one would find those gone too)
    lost = sorted((d for d in dumps.values() if d.get("reason") == "lost_peer"), key=lambda d: d.get("time", 0))
    # stopped by the launcher: with SIGTERM, or killed as a stopped (SIGSTOP) rank once a peer timed out (exit None)
    stopped = {rank for rank, code in exits.items() if code is None or -code in (signal.SIGTERM, signal.SIGINT)}
    for rank in lost[0].get("dead_peers") or [] if lost else []:
        # on a loaded machine that look can come after the launcher stopped a peer, or after a peer wrote its own
        # failure and exited
        own = dumps.get(int(rank), {}).get("reason")
        if int(rank) not in stopped and own not in _BLOCKED_REASONS:
            out.setdefault(int(rank), "its process is gone")
    return out


def pending_p2p(dump: dict) -> dict | None:
    """The newest send/recv this rank issued and has not seen complete, or None."""
    open_records = [r for r in dump.get("p2p") or [] if r.get("left") is None]
    return open_records[-1] if open_records else None


def _p2p_reached(dump: dict, group: str, peer: int) -> int:
    return max((op["n"] for r in dump.get("p2p") or [] for op in r["ops"]
                if op["group"] == group and op["peer"] == peer), default=0)


def _waits(dumps: dict[int, dict]) -> dict[int, list[tuple[str, str, int, int]]]:
    """{rank: [(op, group, sequence number, rank it waits for or -1: any member)]} for the ranks that wait."""
    waits = {}
    for rank, dump in dumps.items():
        p2p = pending_p2p(dump)
        if p2p is not None:  # ours are exact; torch's recorder retires a failed work on some backends
            waits[rank] = [(op["op"], op["group"], op["n"], op["peer"]) for op in p2p["ops"]]
        elif (wait := pending(dump)) is not None:
            waits[rank] = [(wait.op, wait.group, wait.seq, -1 if not wait.p2p else -2)]
    return waits


def diagnose(dumps: dict[int, dict], exits: dict[int, int | None] | None = None) -> list[str]:
    """One phrase per culprit rank, e.g. "rank 3 never reached all_reduce #37 on dp_shard (step 3, last seen in
    optimizer)" or "rank 3 died (SIGKILL; ...)"; [] when nobody is to blame."""
    return [phrase for _, phrase in culprits(dumps, exits)]


def culprits(dumps: dict[int, dict], exits: dict[int, int | None] | None = None) -> list[tuple[int, str]]:
    """diagnose()'s phrases, each with the rank it blames."""
    dead = dead_ranks(exits or {}, dumps)
    waits = _waits(dumps)
    groups = _groups(dumps)
    where_waited = next((f"{op} #{seq} on {_dim(group, dumps, groups)}, step {dumps[r].get('step')}"
                         for r, ws in sorted(waits.items()) for op, group, seq, _ in ws[:1]), None)
    if dead:  # the others' waits follow from the deaths: name only those
        waited = f"; the others were in {where_waited}" if where_waited else ""
        return [(r, f"rank {r} died ({how}{waited})") for r, how in sorted(dead.items())]
    lines, blamed = [], set()
    for rank, ws in sorted(waits.items()):
        for op, group, seq, peer in ws:
            candidates = [peer] if peer >= 0 else groups.get(group, {}).get("ranks") or sorted(dumps)
            for member in candidates:
                if member in blamed or member in waits or member == rank:
                    continue
                dump = dumps.get(member)
                if peer >= 0:
                    reached = _p2p_reached(dump, group, rank) if dump else 0
                    what = f"the {'recv' if op == 'send' else 'send'} #{seq} with rank {rank}"
                else:
                    reached = _reached(dump, Pending(rank, group, op, seq, peer == -2)) if dump else 0
                    what = f"{op} #{seq}"
                if reached >= seq:
                    continue
                blamed.add(member)
                where = _where(dump, dumps[rank].get("step"))
                lines.append((member, f"rank {member} never reached {what} on {_dim(group, dumps, groups)} ({where})"))
    return lines


def hang_line(hang_dir: Path | None, exits: dict[int, int | None] | None = None) -> str | None:
    """The launcher's last line: the culprits joined, or None when the files name nobody."""
    lines = diagnose(_dumps_in(hang_dir), exits)
    return "; ".join(lines) if lines else None


def _dumps_in(hang_dir: Path | None) -> dict[int, dict]:
    return read_dumps(hang_dir) if hang_dir is not None and Path(hang_dir).is_dir() else {}


def hang_verdict(hang_dir: Path | None, exits: dict[int, int | None] | None = None) -> tuple[str | None,
                                                                                              int | None, int | None]:
    """(hang_line's text, the first rank it blames, the run's last completed step), each None when unknown."""
    dumps = _dumps_in(hang_dir)
    found = culprits(dumps, exits)
    return ("; ".join(p for _, p in found) or None, found[0][0] if found else None,
            last_completed_step(hang_dir, dumps))


def last_completed_step(hang_dir: Path | None, dumps: dict[int, dict]) -> int | None:
    """The newest optimizer step any rank finished: from each rank's rank-N.step (rewritten as each step ends)
    and its record's "completed_step" (flight_recorder.py)."""
    steps = [int(d["completed_step"]) for d in dumps.values() if d.get("completed_step") is not None]
    for path in Path(hang_dir).glob("rank-*.step") if hang_dir is not None else ():
        try:
            steps.append(int(path.read_text().strip()))
        except (OSError, ValueError):
            continue
    return max(steps, default=None)
