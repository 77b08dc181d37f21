"""Per-step metrics: RUNDIR/metrics.jsonl, and the progress display on rank 0 (stderr only)."""

from __future__ import annotations

import json
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
                 quiet: bool = False):
        self.path = run_dir / "metrics.jsonl" if (run_dir and enabled) else None
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

