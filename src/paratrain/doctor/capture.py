"""Capture what doctor needs from a real run: per-phase timers, a torch.profiler window, probes, telemetry.

Each rank trains `warmup + steps + PROFILED_STEPS` steps through Trainer.fit (so the data path and metrics
logging are the real ones), in three windows:
    warm-up    unmeasured; step 1 counts collective bytes
    measured   the phase timers only (perf counters; CUDA: a sync per phase boundary): step time, phases,
               data wait and peak memory come from these steps, which run as under `paratrain train`
    profiled   torch.profiler on, only to split each phase into compute, exposed collectives and host time
               (as fractions) and for the trace file; its time and memory never enter the figures
The counterfactual probes (doctor/counterfactual.py) run between the measured and the profiled window.
Rank 0 gathers every rank's numbers.
"""

from __future__ import annotations

import gc
import os
import resource
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
# the first profiled step also absorbs the profiler's start-up; both attribute, neither is timed
PROFILED_STEPS = 2


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class CaptureSession:
    """The on_step callback that drives warm-up, calibration and the profiled window on one rank."""

    def __init__(self, trainer, warmup: int, steps: int, trace_path: Path | None, probe_rounds: int = 3):
        self.trainer, self.warmup, self.steps, self.trace_path = trainer, warmup, steps, trace_path
        self.probe_rounds = probe_rounds
        self.device = trainer.rt.device
        # profiler ranges are opened only in the profiled window (annotate is switched on there)
        self.timer = PhaseTimer(self.device.type, annotate=False)
        self.handles = self.timer.attach(trainer)
        self.records: list[dict] = []
        self.profiled_records: list[dict] = []
        self.memory: dict = {}
        self.staged: list | None = None
        self.probes: dict | None = None
        self._remember_batches()
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

    def _remember_batches(self) -> None:
        """Keep the latest step's micro-batches on the device: the probes' pre-staged data."""
        def remembering(trainer, micro_batches, step):
            self.staged = [mb.to(self.device, non_blocking=True) for mb in micro_batches]
            return step(micro_batches)

        self.handles.append(self.trainer.hooks.wrap_step(remembering))

    def on_step(self, trainer, record: dict) -> None:
        now = time.perf_counter()
        step = record["step"]
        measured_end = self.warmup + self.steps
        if self.warmup < step <= measured_end + PROFILED_STEPS:
            # a pipeline stage's idle time inside the schedule, as PipelineStep measured it (None without pp)
            timing = trainer.step_runner.last_timing or {}
            row = {"step": step, "step_time_s": record["step_time_s"], "data_wait_s": record["data_wait_s"],
                   "iteration_s": now - self._last_end, "pipeline_idle_s": timing.get("idle_s"),
                   **{f"{p}_s": self.timer.current.get(p, 0.0) for p in PHASES},
                   **({"expert_load": record["expert_load"]} if "expert_load" in record else {})}
            (self.records if step <= measured_end else self.profiled_records).append(row)
        if step == 1:
            self._stop_counting()
        if step == self.warmup:
            self._rusage0 = resource.getrusage(resource.RUSAGE_SELF)
        if step == measured_end:
            self.rusage = resource.getrusage(resource.RUSAGE_SELF)
            self.memory = self._memory_now()
            self._run_probes()
            self.timer.annotate = True
            self._start_profiler()
        if step == measured_end + PROFILED_STEPS:
            self._stop_profiler()
        self._last_end = time.perf_counter()

    def _memory_now(self) -> dict:
        """Peak memory of the measured steps, before the profiler can add its own."""
        from paratrain.train.metrics import current_rss_gib

        out = {"memory_gib": self.trainer.memory_gib(), "rss_gib": current_rss_gib()}
        if self.device.type == "cuda":
            out["memory_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / 2**30
        return out

    def _run_probes(self) -> None:
        """The counterfactual probes, on the last measured step's batch, before the profiler ever starts
        (after a profiler session, the optimizer step of a DDP run was measured 2-4x slower)."""
        from paratrain.doctor.counterfactual import run_probes

        self.probes = run_probes(self.trainer, self.staged, self.probe_rounds)

    def _start_counting(self) -> None:
        try:
            from paratrain.parallel.collective_bytes import count_collectives
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
        if self.profiler is None:
            raise UserError(f"doctor needs at least {self.warmup + 1} steps to measure anything")
        prof = summarize_events(self.profiler.events(), last_steps=len(self.profiled_records))
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
            "profiled_steps": self.profiled_records,
            "profile": prof,
            "probes": self.probes,
            "calibration": self.calibration,
            "flops_per_step": t.flops_per_step / t.layout.world,
            "tokens_per_step": t.tokens_per_step / max(1, t.layout.dp),
            **self.memory,
            "model_state_bytes": _model_states(t),
            "threads": torch.get_num_threads(),
            "cores": usable_cores(),
            "involuntary_switches_per_step": (self.rusage.ru_nivcsw - self._rusage0.ru_nivcsw) / n,
            # this process's CPU seconds (all threads) per measured step, between-step work included: what train's
            # metrics.jsonl cpu_s stamps give over the same steps
            "cpu_s_per_step": (_cpu_s(self.rusage) - _cpu_s(self._rusage0)) / n,
            "comm": self.comm,
            "nvml": self.nvml.stop() if self.nvml is not None else None,
            "trace_file": str(trace_file) if trace_file else None,
            "micro_batches": t.source.accumulation_steps,
        }
        return local


def _cpu_s(usage) -> float:
    return usage.ru_utime + usage.ru_stime


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


def doctor_worker(cfg_dict: dict, run_dir: str, warmup: int, steps: int, trace: str | None,
                  probe_rounds: int = 3) -> dict | None:
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
        session = CaptureSession(trainer, warmup, steps, Path(trace) if trace else None, probe_rounds)
        session.before_training()
        summary = trainer.fit(on_step=session.on_step)
        local = session.finish()
        ranks = gather_to_rank0(local)
        # free the profiler and the model while the process group still exists: left to the frame's
        # teardown after shutdown(), a worker sometimes never exited
        del session, trainer
        gc.collect()
    except UserError:  # raised on: the launcher makes it the run's one last line (exit 2)
        shutdown()
        raise
    shutdown()
    if not rt.is_main:
        return None
    summary = {k: v for k, v in summary.items() if k != "losses"}
    return {"ranks": sorted(ranks, key=lambda r: r["rank"]), "summary": summary}
