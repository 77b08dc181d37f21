"""Capture what doctor needs from a real run: per-phase timers, a torch.profiler window, probes, telemetry.

Each rank trains `warmup + steps` steps through Trainer.fit (so the data path and metrics logging are the
real ones). Warm-up steps are not measured; the last one counts collective bytes. The measured steps
run under the profiler with the phase timers attached. Rank 0 gathers every rank's numbers.
"""

from __future__ import annotations

import gc
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from paratrain.doctor import probes
from paratrain.doctor.nvml import NvmlSampler
from paratrain.doctor.profile_stats import summarize_events
from paratrain.doctor.timers import PHASES, PhaseTimer
from paratrain.errors import UserError

CALIBRATION_ITERATIONS = 50


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class CaptureSession:
    """The on_step callback that drives warm-up, calibration and the profiled window on one rank."""

    def __init__(self, trainer, warmup: int, steps: int, trace_path: Path | None):
        self.trainer, self.warmup, self.steps, self.trace_path = trainer, warmup, steps, trace_path
        self.device = trainer.rt.device
        self.timer = PhaseTimer(self.device.type, annotate=True)
        self.handles = self.timer.attach(trainer)
        self.records: list[dict] = []
        self.calibration: dict = {}
        self.comm: dict | None = None
        self.profiler = None
        self.nvml = NvmlSampler(self.device.index or 0) if self.device.type == "cuda" else None
        self._counting = None
        self._stats = None
        self._last_end: float | None = None
        self._rusage0 = None

    # -- the capture, in order ---------------------------------------------------------------------------------
    # Nothing pauses between measured steps: a pause would let a slow loader catch up and hide its cost.
    def before_training(self) -> None:
        """Unprofiled probes, and collective counting for step 1 (the prefetcher does not exist yet)."""
        self.calibration = {
            "matmul_flops_per_s": probes.matmul_flops_per_s(self.device, self.trainer.cfg.dtype),
            "tiny_program_s": probes.time_tiny_program(self.device),
            "metrics_record_s": probes.metrics_record_cost_s(),
        }
        if self.trainer.distributed:
            self._start_counting()
        if self.warmup == 0:
            self._start_profiler()

    def on_step(self, trainer, record: dict) -> None:
        now = time.perf_counter()
        step = record["step"]
        if self.warmup < step <= self.warmup + self.steps:
            # a pipeline stage's idle time inside the schedule, as PipelineStep measured it (None without pp)
            timing = getattr(trainer.step_runner, "last_timing", None) or {}
            self.records.append({"step": step, "step_time_s": record["step_time_s"],
                                 "data_wait_s": record["data_wait_s"], "iteration_s": now - self._last_end,
                                 "pipeline_idle_s": timing.get("idle_s"),
                                 **{f"{p}_s": self.timer.current.get(p, 0.0) for p in PHASES}})
        if step == 1:
            self._stop_counting()
        if step == max(1, self.warmup - 1):
            # started before the last warm-up step, so that step absorbs the profiler's start-up
            self._start_profiler()
        if step == self.warmup:
            self._rusage0 = resource.getrusage(resource.RUSAGE_SELF)
        if step == self.warmup + self.steps:
            self._stop_profiler()
        self._last_end = time.perf_counter()

    def _start_counting(self) -> None:
        try:
            from paratrain.parallel.comm import count_collectives
        except ImportError:
            return
        self._counting = count_collectives()
        self._stats = self._counting.__enter__()

    def _stop_counting(self) -> None:
        if self._counting is None:
            return
        self._counting.__exit__(None, None, None)
        self.comm = self._stats.per_step(1)
        self._counting = None

    def _start_profiler(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        if self.profiler is not None:
            return
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.profiler = profile(activities=activities)
        self.profiler.start()
        if self.nvml is not None:
            self.nvml.start()

    def _stop_profiler(self) -> None:
        self.rusage = resource.getrusage(resource.RUSAGE_SELF)
        # the tiny program under the profiler: how many ops it is, and what profiling adds per op
        x, w = probes.op_probe_tensors(self.device)
        with torch.profiler.record_function("paratrain.calibration"):
            for _ in range(CALIBRATION_ITERATIONS):
                probes.tiny_autograd_program(x, w)
        self.profiler.stop()

    # -- results --------------------------------------------------------------------------------------------
    def finish(self) -> dict:
        for h in self.handles:
            h.remove()
        self.trainer.phase_timer = None
        if self.profiler is None:
            raise UserError(f"doctor needs at least {self.warmup + 1} steps to measure anything")
        prof = summarize_events(self.profiler.events(), last_steps=len(self.records))
        iterations = CALIBRATION_ITERATIONS
        if prof.get("calibration_ops"):
            self.calibration["tiny_program_ops"] = prof["calibration_ops"] / iterations
            self.calibration["tiny_program_profiled_s"] = prof["calibration_s"] / iterations
            self.calibration["tiny_program_busy_s"] = prof["calibration_busy_s"] / iterations
        trace_file = None
        if self.trace_path is not None:
            trace_file = self.trace_path.with_name(f"{self.trace_path.stem}.rank{self.trainer.rt.rank}.json")
            self.profiler.export_chrome_trace(str(trace_file))
        self.profiler = None
        t = self.trainer
        n = max(1, len(self.records))
        local = {
            "rank": t.rt.rank,
            "steps": self.records,
            "profile": prof,
            "calibration": self.calibration,
            "flops_per_step": t.flops_per_step / t.layout.world,
            "tokens_per_step": t.tokens_per_step / max(1, t.layout.dp),
            "memory_gib": t.memory_gib(),
            "model_state_bytes": _model_states(t),
            "threads": torch.get_num_threads(),
            "cores": usable_cores(),
            "involuntary_switches_per_step": (self.rusage.ru_nivcsw - self._rusage0.ru_nivcsw) / n,
            "comm": self.comm,
            "nvml": self.nvml.stop() if self.nvml is not None else None,
            "trace_file": str(trace_file) if trace_file else None,
            "micro_batches": t.source.accumulation_steps,
        }
        if t.rt.device_type == "cuda":
            local["memory_reserved_gib"] = torch.cuda.max_memory_reserved(t.rt.device) / 2**30
        return local


def _model_states(trainer) -> dict | None:
    try:
        from paratrain.parallel.model_states import model_state_bytes
    except ImportError:
        return None
    return model_state_bytes(trainer.step_runner.model_parts, trainer.optimizers)


def gather_to_rank0(obj):
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    bucket = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, bucket, dst=0)
    return bucket


def doctor_worker(cfg_dict: dict, run_dir: str, warmup: int, steps: int, trace: str | None) -> dict | None:
    """Train warmup + steps steps, measuring; rank 0 returns {"ranks": [...], "summary": fit summary}."""
    from paratrain.config import TrainConfig
    from paratrain.train.runtime import init_runtime, shutdown
    from paratrain.train.trainer import Trainer
    from paratrain.train.worker import setup_logging

    cfg = TrainConfig(**cfg_dict)
    setup_logging(int(os.environ.get("RANK", "0")))
    rt = init_runtime(cfg.device, cfg.timeout_s)
    try:
        trainer = Trainer(cfg, rt, Path(run_dir), quiet=True)
        session = CaptureSession(trainer, warmup, steps, Path(trace) if trace else None)
        session.before_training()
        summary = trainer.fit(on_step=session.on_step)
        local = session.finish()
        ranks = gather_to_rank0(local)
        # free the profiler and the model while the process group still exists: left to the frame's
        # teardown after shutdown(), a worker sometimes never exited
        del session, trainer
        gc.collect()
    except UserError as exc:
        if rt.is_main:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        shutdown()
        sys.exit(2)
    shutdown()
    if not rt.is_main:
        return None
    summary = {k: v for k, v in summary.items() if k != "losses"}
    return {"ranks": sorted(ranks, key=lambda r: r["rank"]), "summary": summary}
