"""Merge the per-rank Chrome traces into one file that opens in Perfetto (ui.perfetto.dev) or chrome://tracing.

Each rank becomes a process named "rank N"; the time each step waited for data is added as a
`paratrain.data_wait` slice just before the step's `paratrain.forward_backward` slice.
"""

from __future__ import annotations

import json
from pathlib import Path


def _rank_events(doc: dict, rank: int, shift_us: float, data_waits: list[float]) -> list[dict]:
    events = doc.get("traceEvents", [])
    pids = {e.get("pid") for e in events if "pid" in e}
    out = []
    for e in events:
        if shift_us and "ts" in e:
            e = {**e, "ts": e["ts"] + shift_us}
        if e.get("ph") == "M" and e.get("name") == "process_name":
            e = {**e, "args": {"name": f"rank {rank}"}}
        elif e.get("ph") == "M" and e.get("name") == "process_sort_index":
            e = {**e, "args": {"sort_index": rank}}
        out.append(e)
    for pid in pids - {e.get("pid") for e in out if e.get("ph") == "M" and e.get("name") == "process_name"}:
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"rank {rank}"}})
    steps = sorted((e for e in out if e.get("ph") == "X" and e.get("name") == "paratrain.forward_backward"),
                   key=lambda e: e["ts"])
    for step, wait_s in zip(steps, data_waits):
        if wait_s > 0:
            dur = wait_s * 1e6
            out.append({"ph": "X", "cat": "user_annotation", "name": "paratrain.data_wait", "pid": step["pid"],
                        "tid": step["tid"], "ts": step["ts"] - dur, "dur": dur, "args": {}})
    return out


def merge_traces(rank_files: list[tuple[int, str, list[float]]], out_path: str | Path) -> Path:
    """rank_files: (rank, chrome trace path, data-wait seconds per measured step). Deletes the inputs."""
    merged: list[dict] = []
    base = None
    header: dict = {}
    for rank, path, waits in sorted(rank_files):
        p = Path(path)
        if not p.exists():  # another node's rank: its file is not on this machine
            continue
        doc = json.loads(p.read_text())
        b = doc.get("baseTimeNanoseconds", 0)
        if base is None:
            base = b
            header = {k: v for k, v in doc.items() if k in ("schemaVersion", "deviceProperties", "baseTimeNanoseconds")}
        merged.extend(_rank_events(doc, rank, (b - base) / 1000.0, waits))
        p.unlink()
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**header, "displayTimeUnit": "ms", "traceEvents": merged,
                               "otherData": {"producer": "paratrain doctor"}}))
    return out
