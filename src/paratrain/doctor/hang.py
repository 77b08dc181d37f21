"""`paratrain doctor --hang RUNDIR`: after a run hung or died, name the rank from its flight-recorder files
(RUNDIR/hang/rank-N.json, train/recovery/flight_recorder.py), as the launcher's last line did."""

from __future__ import annotations

from pathlib import Path

from paratrain.errors import UserError
from paratrain.train.recovery.hang_report import diagnose, group_dim, pending, pending_p2p, read_dumps


def hang_report(run_dir: Path) -> dict:
    """The doctor's JSON (breakdown and trace are null: nothing was measured), findings of cause "hang"."""
    hang_dir = Path(run_dir) / "hang"
    dumps = read_dumps(hang_dir) if hang_dir.is_dir() else {}
    if not dumps:
        raise UserError(f"no flight-recorder records under {hang_dir}: the run did not hang, or it ran without "
                        "a run directory")
    findings = [{"cause": "hang", "severity": "high", "evidence": line,
                 "fix": "look at what that rank runs at that point (a data stall, a rank-dependent branch, a "
                        "dead host); `--timeout-s` bounds how long the others wait"} for line in diagnose(dumps)]
    ranks = {}
    for rank, dump in sorted(dumps.items()):
        ranks[str(rank)] = {"reason": dump.get("reason"), "step": dump.get("step"), "phase": dump.get("phase"),
                            "waiting_in": waiting_in(dump, dumps)}
    return {"breakdown": None, "findings": findings, "trace": None, "hang": {"dir": str(hang_dir), "ranks": ranks}}


def waiting_in(dump: dict, dumps: dict[int, dict]) -> str | None:
    p2p = pending_p2p(dump)
    if p2p is not None:
        return ", ".join(f"{op['op']} #{op['n']} with rank {op['peer']} on {group_dim(op['group'], dumps)}"
                         for op in p2p["ops"])
    wait = pending(dump)
    return None if wait is None else f"{wait.op} #{wait.seq} on {group_dim(wait.group, dumps)}"


def format_hang(report: dict) -> str:
    lines = [f"hang records in {report['hang']['dir']}:"]
    for rank, info in report["hang"]["ranks"].items():
        waiting = f", waiting in {info['waiting_in']}" if info["waiting_in"] else ""
        lines.append(f"  rank {rank}: {info['reason']} at step {info['step']} in {info['phase']}{waiting}")
    lines += [f"HANG: {f['evidence']}" for f in report["findings"]] or ["no rank stands out as the cause"]
    return "\n".join(lines) + "\n"
