"""Per-step metrics: RUNDIR/metrics.jsonl, and the progress display on rank 0 (stderr only)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def peak_memory_gib(device: torch.device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return None


def current_rss_gib() -> float:
    """Peak resident set size of this process (CPU runs: the only honest memory figure we have)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class StepLog:
    """Writes one JSON line per logged step and shows progress. Only rank 0 creates one."""

    def __init__(self, run_dir: Path | None, total_steps: int, floor: float | None, enabled: bool = True,
                 quiet: bool = False, start_step: int = 0):
        """`start_step`: the step this run resumes after. Lines already there past it (logged by an attempt that
        died before its next checkpoint: the steps this run replays) are dropped, so the file reads as one run."""
        self.path = run_dir / "metrics.jsonl" if (run_dir and enabled) else None
        if self.path and (start_step or _restarted()):
            _keep_steps_through(self.path, start_step)
        self.file = self.path.open("a") if self.path else None
        self.total, self.floor, self.quiet = total_steps, floor, quiet
        self.progress = None
        if not quiet and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                                     console=Console(stderr=True))
            self.task = self.progress.add_task("train", total=total_steps, info="")
            self.progress.start()
        self.last_plain = 0.0

    def log(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.quiet:
            return
        floor = f" (floor {self.floor:.3f})" if self.floor is not None else ""
        info = f"loss {record['loss']:.4f}{floor}  {record['tokens_per_s']:.0f} tok/s"
        if record.get("val_loss") is not None:
            info += f"  val {record['val_loss']:.4f} (ppl {record['val_ppl']:.2f})"
        if self.progress:
            self.progress.update(self.task, completed=record["step"], info=info)
        else:
            print(f"step {record['step']:>5}/{self.total}  {info}  lr {record['lr']:.2e}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.progress:
            self.progress.stop()
        if self.file:
            self.file.close()


def _restarted() -> bool:
    """An elastic restart (--max-restarts) that found no checkpoint starts over at step 0: replaying every step."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"


def _keep_steps_through(path: Path, last_step: int) -> None:
    """Rewrite metrics.jsonl without the records of steps after `last_step` (and any line cut short)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if not isinstance(step, int) or step <= last_step:
            kept.append(line + "\n")
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)
