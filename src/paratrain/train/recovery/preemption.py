"""Checkpoint and stop on a preemption signal (train --preempt-signal USR1; a Slurm job's --signal).

The signal only raises a flag. At each step boundary (the after_step hook) every rank all-reduces that flag, so
all ranks agree on one step even when the signal reached them at different steps; on that step they save a
checkpoint together (checkpoint.save, the same one --ckpt-every writes, into the run's checkpoint directory),
rank 0 writes RUNDIR/preempted.json, and the trainer stops. `--resume auto` (the default) continues from that
checkpoint: a requeued Slurm job resumes where it stopped (launchers/slurm.py requeues on preempted.json).

The save is synchronous: the run stops right after it, so an asynchronous save would only move the wait to
the exit. A save has the signal's lead time (Slurm: --signal=...@SECONDS) minus one step.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from paratrain.errors import UserError
from paratrain.parallel.collective_hooks import collective

log = logging.getLogger("paratrain")

MARKER = "preempted.json"  # in the run directory: the last run stopped on the signal, after this checkpoint
STOP_REASON = "preempted"
EXIT_PREEMPTED = 75  # sysexits EX_TEMPFAIL: stopped on the signal, checkpoint saved; run again to go on


# signal number -> time.monotonic() of a signal that came before a trainer attached (watch_early)
_EARLY: dict[int, float] = {}


def watch_early(name: str | None) -> None:
    """Watch for the signal from the worker's start, so one that comes while the runtime starts or the model
    loads (minutes for a large checkpoint) is kept for the trainer, which stops at its first step, instead of
    lost: a Slurm job's ranks ignore the signal until a handler is installed."""
    if not name or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal_number(name), lambda signum, frame: _EARLY.setdefault(signum, time.monotonic()))


def signal_number(name: str) -> int:
    number = getattr(signal, f"SIG{name.upper().removeprefix('SIG')}", None)
    if not isinstance(number, signal.Signals):
        raise UserError(f"--preempt-signal {name!r} is not a signal name (e.g. USR1)")
    return int(number)


class Preemption:
    """One trainer's watch for `signum`; attach() installs the handler and the after_step hook."""

    def __init__(self, signum: int):
        self.signum = signum
        self.received_at: float | None = None  # time.monotonic() of the first signal on this rank
        self._previous = None
        self._handles: list = []

    def _on_signal(self, signum, frame) -> None:
        if self.received_at is None:
            self.received_at = time.monotonic()

    def attach(self, trainer) -> Preemption:
        if threading.current_thread() is not threading.main_thread():
            log.warning("--preempt-signal: not the main thread, no signal handler installed")
            return self
        self._previous = signal.signal(self.signum, self._on_signal)
        self.received_at = _EARLY.pop(self.signum, self.received_at)
        self._handles.append(trainer.hooks.after_step(self.after_step))
        if trainer.rt.is_main and trainer.run_dir is not None:
            (trainer.run_dir / MARKER).unlink(missing_ok=True)  # this run has not been preempted yet
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._previous is not None:
            signal.signal(self.signum, self._previous)
            self._previous = None

    def agreed(self, trainer) -> bool:
        """True on every rank once any rank has seen the signal (one small all-reduce per step)."""
        flag = torch.tensor([0 if self.received_at is None else 1], dtype=torch.int32)
        if not (trainer.distributed and dist.is_initialized()):
            return bool(flag.item())
        flag = flag.to(trainer.rt.device)
        collective("preemption", "world", "all_reduce", None,
                   lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX), (flag,))
        return bool(flag.item())

    def after_step(self, trainer, record: dict) -> None:
        if trainer.stop_reason is not None or not self.agreed(trainer):
            return
        if trainer.ckpt_dir() is None:
            raise UserError("--preempt-signal needs a checkpoint directory: give --out or --ckpt-dir")
        path = trainer.save_checkpoint()
        trainer.stop_reason = STOP_REASON
        if trainer.rt.is_main:
            took = time.monotonic() - self.received_at if self.received_at is not None else None
            if trainer.run_dir is not None:
                (trainer.run_dir / MARKER).write_text(json.dumps(
                    {"step": trainer.step, "checkpoint": str(path), "signal": signal.Signals(self.signum).name}))
            log.info("preempted: signal %s, checkpoint %s at step %d%s; the run resumes from it (--resume auto)",
                     signal.Signals(self.signum).name, path, trainer.step,
                     f" ({took:.1f} s after the signal)" if took is not None else "")


def attach_preemption(trainer, name: str) -> Preemption:
    return Preemption(signal_number(name)).attach(trainer)


def was_preempted(run_dir: str | Path) -> dict | None:
    marker = Path(run_dir) / MARKER
    return json.loads(marker.read_text()) if marker.is_file() else None


def exit_status() -> int:
    """A preempted `paratrain train`: EXIT_PREEMPTED; but 0 in a process torchrun started, as torchrun would
    restart a worker that exits non-zero (the job reads RUNDIR/preempted.json instead)."""
    return 0 if os.environ.get("TORCHELASTIC_RUN_ID") else EXIT_PREEMPTED
