"""CUDA memory snapshots for https://pytorch.org/memory_viz, and the message a CUDA out-of-memory error becomes.

--memory-snapshot records the caching allocator's history (with stack traces) from before the model is built
and dumps it when training ends. An OOM dumps the allocator state too (with history when recording) and
turns into one line naming the snapshot and the `paratrain plan` command that finds a layout that fits.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from paratrain.errors import UserError
from paratrain.parallel.strategies import holds_whole_parameters

log = logging.getLogger("paratrain")

# The allocator keeps the newest events in a ring buffer; each costs a few KB in the dump.
MAX_ENTRIES = 100_000
VIEWER = "https://pytorch.org/memory_viz"


def check_memory_snapshot(enabled: bool, device_type: str) -> None:
    if enabled and device_type != "cuda":
        raise UserError(f"--memory-snapshot records the CUDA caching allocator; this run is on {device_type} "
                        f"(use --device cuda on a GPU machine, or drop the flag)")


class MemorySnapshot:
    """Owns the allocator history of one rank: start() before the model exists, dump() on OOM, finish()."""

    def __init__(self, out_dir: Path, rank: int, device_type: str, record: bool):
        self.out_dir, self.rank, self.device_type, self.record = Path(out_dir), rank, device_type, record
        self.dumped: Path | None = None

    @classmethod
    def start(cls, enabled: bool, device_type: str, out_dir: Path | None, rank: int) -> MemorySnapshot:
        check_memory_snapshot(enabled, device_type)
        snap = cls(out_dir or Path.cwd(), rank, device_type, enabled)
        if enabled:
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)
        return snap

    def dump(self, kind: str) -> Path | None:
        """Write RUNDIR/<kind>-rank<R>.pickle; None (with a warning) when there is nothing or it fails."""
        if self.device_type != "cuda":
            return None
        path = self.out_dir / f"{kind}-rank{self.rank}.pickle"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
        except Exception as exc:  # noqa: BLE001 - a failed dump must not hide the error that caused it
            log.warning("could not write the memory snapshot %s: %s", path, exc)
            return None
        self.dumped = path
        return path

    def finish(self) -> Path | None:
        """End of training: dump the recorded history (unless an OOM dump already did) and stop recording."""
        if not self.record:
            return None
        path = self.dumped or self.dump("memory-snapshot")
        torch.cuda.memory._record_memory_history(enabled=None)
        self.record = False
        if path is not None and self.rank == 0:
            log.info("memory snapshot: %s (open it at %s)", path, VIEWER)
        return path


def plan_command(cfg, world_size: int, gpu: str | None) -> str:
    """The planner invocation for this run's model and cluster, held to its batch shape."""
    gpu_arg = gpu or "NAME"  # unknown to the catalog: the user picks one (or gives custom hardware flags)
    return (f"paratrain plan --model {cfg.model} --gpu {gpu_arg} --gpus {world_size} --seq-len {cfg.seq_len} "
            f"--global-batch {cfg.global_batch} --dtype {cfg.dtype}")


def quick_fixes(cfg, world_size: int, micro_batch: int) -> list[str]:
    fixes = []
    if cfg.ac != "full":
        fixes.append("--ac full")
    if micro_batch > 1:
        fixes.append(f"--micro-batch {max(1, micro_batch // 2)}")
    if world_size > 1 and holds_whole_parameters(cfg.strategy):
        fixes.append("--strategy fsdp")
    return fixes


def cuda_memory_summary(device: torch.device) -> str:
    try:
        used = torch.cuda.max_memory_allocated(device) / 2**30
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
    except Exception:  # noqa: BLE001 - best effort inside an error path
        return ""
    return f" (peak {used:.1f} of {total:.1f} GiB)"


def out_of_memory_error(cfg, world_size: int, micro_batch: int, step: int, rank: int, snapshot: Path | None,
                        gpu: str | None, memory: str = "") -> UserError:
    """One line: where it ran out, where the snapshot is, and what to run next."""
    where = f"CUDA out of memory on rank {rank} in step {step + 1}{memory}"
    if snapshot is not None:
        dumped = f"memory snapshot written to {snapshot} (open it at {VIEWER})"
        if not cfg.memory_snapshot:
            dumped += "; re-run with --memory-snapshot to see which code allocated what"
    else:
        dumped = "no memory snapshot could be written"
    fixes = quick_fixes(cfg, world_size, micro_batch)
    quick = f"; or try {', '.join(fixes)}" if fixes else ""
    return UserError(f"{where}; {dumped}; find a layout that fits with: {plan_command(cfg, world_size, gpu)}"
                     f"{quick}")
