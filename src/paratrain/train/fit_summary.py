"""What Trainer.fit() tells the user: the lines at the start of a run, and the summary dict it returns (what
`train --json` prints, docs/train.md)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from paratrain.train.metrics import StepLog
from paratrain.train.readable_numbers import plural, readable_count

log = logging.getLogger("paratrain")


@dataclass
class FitRun:
    """Where fit()'s completed records go, and what they add up to."""
    steplog: StepLog | None
    monitor: object
    on_step: object
    history: list = field(default_factory=list)
    total_time: float = 0.0  # seconds of the measured steps (those after the first)
    measured_steps: int = 0
    tokens_per_s: float = 0.0  # the latest record's


def log_run_start(trainer) -> None:
    """On the main rank, unless quiet: what trains on what (and the entropy floor), then the data's size."""
    if not trainer.rt.is_main or trainer.quiet:
        return
    floor = f", entropy floor {trainer.floor:.4f} nats" if trainer.floor is not None else ""
    # a --heal-replicas replica (data_shard) is one device (or one replicate group of layout.world ranks) of a run
    # of data_shard[1] processes: describe the run
    shape, world = (trainer.layout.describe(), trainer.layout.world)
    if trainer.data_shard:
        world, size = trainer.data_shard[1], trainer.layout.world
        shape = f"{world} replicas, --heal-replicas" if size == 1 else \
            f"{world // size} replica groups x {size} shards, --heal-replicas"
    log.info("training %s (%s params) with %s [%s] on %d x %s%s", trainer.model_name,
             readable_count(trainer.param_count), trainer.cfg.strategy, shape, world, trainer.rt.device_type, floor)
    if trainer.data_tokens is not None:
        log_data_size(trainer)


def log_data_size(trainer) -> None:
    """One line: how big the data file is against the run (tokens, documents, steps per epoch)."""
    meta = getattr(getattr(trainer.source, "dataset", None), "meta", None)  # a token file's sidecar
    docs = meta.get("documents") if meta else None
    per_epoch = trainer.data_tokens / trainer.tokens_per_step
    log.info("data %s: %s tokens%s; one epoch = %.1f steps of %s tokens (this run: %.2f epochs)",
             trainer.cfg.data, f"{trainer.data_tokens:,}", f", {plural(docs, 'document')}" if docs else "", per_epoch,
             f"{trainer.tokens_per_step:,}", trainer.cfg.steps / per_epoch)


def fit_summary(trainer, run: FitRun) -> dict:
    """The run's summary: its last loss, mean throughput and MFU over the measured steps, and where it left
    things (checkpoint, run directory), plus the last validation and what the data gave."""
    history, total_time, measured_steps = run.history, run.total_time, run.measured_steps
    layout = trainer.layout
    loss = history[-1]["loss"] if history else None  # nothing left to train (resumed at --steps): no loss
    avg_tps = trainer.tokens_per_step * measured_steps / total_time if total_time else run.tokens_per_s
    avg_mfu = (trainer.flops_per_step * measured_steps / total_time / (trainer.peak_tflops * 1e12 * layout.world)
               if (trainer.peak_tflops and total_time) else None)
    return {"steps": trainer.step, "final_loss": loss, "loss_floor": trainer.floor, "tokens_per_s": avg_tps,
            "mfu": avg_mfu, "peak_mem_gib": trainer.memory_gib(),
            "checkpoint": str(trainer.last_checkpoint) if trainer.last_checkpoint else None,
            "run_dir": str(trainer.run_dir) if trainer.run_dir else None, "strategy": trainer.cfg.strategy,
            "dims": layout.degrees(), "world_size": layout.world, "layout": layout.to_dict(),
            "losses": [r["loss"] for r in history], "predicted_peak_gib": trainer.predicted_peak_gib,
            "stopped": trainer.stop_reason,
            **trainer.last_val, **data_summary(trainer)}


def data_summary(trainer) -> dict:
    """Document data: the tokens each --data source gave; a token file: its size and the epochs trained."""
    drawn = trainer.source.tokens_drawn()
    if drawn is not None:
        return {"tokens_per_source": drawn}
    if trainer.data_tokens is None:
        return {}
    return {"data_tokens": trainer.data_tokens, "epochs": trainer.step * trainer.tokens_per_step / trainer.data_tokens}
