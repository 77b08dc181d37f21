"""The function every training process runs (spawned by our launcher, torchrun or srun)."""

from __future__ import annotations

import gc
import logging
import os
import sys
from pathlib import Path

from paratrain.errors import CheckFailed, UserError
from paratrain.train.recovery.flight_recorder import FlightRecorder, enable_torch_recorder
from paratrain.train.recovery.preemption import watch_early
from paratrain.train.recovery.run_failures import CollectiveFailure, describe_collective_failure

log = logging.getLogger("paratrain")


def setup_logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format="paratrain: %(message)s", stream=sys.stderr, force=True)


def train_worker(cfg_dict: dict, run_dir: str | None, quiet: bool, custom=None,
                 predicted_peak_gib: float | None = None) -> dict | None:
    """`custom`: a user's own model (train/custom.py CustomModel, or its "FILE.py:FUNCTION" --script spec).
    `predicted_peak_gib`: the memory check's prediction, logged against the measured peak at step 2."""
    from paratrain.config import TrainConfig
    from paratrain.train.runtime import init_runtime, shutdown
    from paratrain.train.trainer import Trainer

    cfg = TrainConfig(**cfg_dict)
    watch_early(cfg.preempt_signal)
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(rank)
    trainer, error, summary = None, None, None
    recorder = start_flight_recorder(rank, run_dir, cfg.timeout_s) if cfg.flight_recorder else None
    try:
        rt = init_runtime(cfg.device, cfg.timeout_s)
        if isinstance(custom, str):
            from paratrain.train.custom import load_script

            custom = load_script(custom)
        trainer = Trainer(cfg, rt, Path(run_dir) if run_dir else None, quiet=quiet, custom=custom,
                          predicted_peak_gib=predicted_peak_gib)
        summary = trainer.fit()
    except UserError as exc:
        error = str(exc)
    except CollectiveFailure:
        detach(recorder)
        raise
    except CheckFailed as exc:  # a failed run (loss diverged, data loader stalled): one line, exit 1
        detach(recorder)
        step = completed_step(trainer)
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:  # alone, nobody can be blocked on us: clean up
            trainer = None
            gc.collect()
            shutdown()
        raise CollectiveFailure(str(exc), rank=rank, step=step) from None
    except RuntimeError as exc:
        step = trainer.step + 1 if trainer is not None else 0
        message = describe_collective_failure(exc, rank, step, cfg.timeout_s)
        if message is None:
            raise
        if recorder is not None:
            write_quietly(recorder, "timeout" if " timed out " in message else "lost_peer", message)
        detach(recorder)
        # no shutdown(): destroying a group whose peer is gone can block; the launcher reaps this process
        raise CollectiveFailure(message, rank=rank, step=completed_step(trainer)) from None
    # Drop the model (and DDP's reducer) while the process groups are still registered. Otherwise the
    # reducer can hold the last reference to a gloo group, whose destructor then joins gloo's threads with
    # the GIL held while one of them waits for the GIL to free a finished work's tensors: a deadlock at
    # exit (seen with 2 nodes x 2 ranks). Freed from the registry by shutdown(), a group is destroyed
    # without the GIL.
    if recorder is not None:
        recorder.close()
    trainer = None
    gc.collect()
    shutdown()
    if error is not None:
        raise UserError(error)  # our launcher and the CLI turn it into one line and exit 2
    if summary is not None:  # which attempt finished: torch elastic (ours, torchrun) counts the restarts
        summary["restarts"] = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return summary if rank == 0 else None


def completed_step(trainer) -> int | None:
    """The last optimizer step this rank finished (a resumed run counts its checkpoint's); None before a trainer."""
    return trainer.step if trainer is not None else None


def start_flight_recorder(rank: int, run_dir: str | None, timeout_s: float, torch_dumps: bool = True) -> FlightRecorder:
    """This rank's recorder, attached to the process's hooks before the process group exists (so torch's
    recorder is on). It writes well before the peers' timeout: a stalled rank is found by what it wrote.
    torch_dumps=False: no file of torch's own (a --heal-replicas replica: torchft dumps one at every quorum)."""
    from paratrain.train.hooks import default_hooks

    hang_dir = Path(run_dir) / "hang" if run_dir else None
    enable_torch_recorder(hang_dir if torch_dumps else None)
    recorder = FlightRecorder(rank, hang_dir, stall_after_s=max(0.5, min(10.0, timeout_s / 3)))
    recorder.attach(default_hooks())
    return recorder


def detach(recorder: FlightRecorder | None) -> None:
    if recorder is not None:
        recorder.detach()


def write_quietly(recorder: FlightRecorder, reason: str, message: str) -> None:
    try:
        recorder.write(reason, message)
    except OSError as exc:  # the run dir may be gone or full: the failure itself is what must be reported
        log.warning("could not write the flight recorder: %s", exc)
