"""Measure what the planner predicts, on this machine: per-rank peak memory (live-tensor tracker on CPU,
torch.cuda.max_memory_allocated on GPU) and step time, for a list of configs in one process group.

    run_workers(measure_worker, ([cfg.model_dump(), ...], {"steps": 4, "memory": True}), nproc)

Every config runs on ranks 0..world-1 of that config (a 1-rank config only on rank 0; the rest wait).
Returns, on rank 0, one dict per config: {"peak_bytes": [per rank], "step_times": [...], "error": ...}.
"""

from __future__ import annotations

import gc
import os
import time

import torch
import torch.distributed as dist


def _measure_one(cfg, rt, steps: int, memory: bool, opts_breakdown: bool = False) -> dict:
    from paratrain.parallel.strategies import resolve_layout, world_size_of
    from paratrain.plan.tracing.tracker import LiveTensorTracker
    from paratrain.train.trainer import Trainer

    world = world_size_of(cfg.strategy, rt.world_size)
    layout = resolve_layout(cfg, world)
    cuda = rt.device_type == "cuda"
    holder: dict = {}

    def breakdown() -> dict:
        """What the peak is made of (CPU tracker only): parameters, gradients, optimizer state, the rest."""
        trainer = holder.get("trainer")
        if trainer is None:
            return {}
        params = [p for part in trainer.step_runner.model_parts for p in part.parameters()]
        states = [t for opt in trainer.optimizers for s in getattr(opt, "optim", opt).state.values()
                  for t in s.values() if torch.is_tensor(t)]
        return {"params": tracker.bytes_of(params), "grads": tracker.bytes_of([p.grad for p in params]),
                "optimizer": tracker.bytes_of(states)}

    tracker = LiveTensorTracker(on_peak=breakdown if opts_breakdown else None) if (memory and not cuda) else None
    if tracker is not None:
        tracker.__enter__()
    try:
        trainer = Trainer(cfg, rt, None, quiet=True, layout=layout)
        holder["trainer"] = trainer
        times = []
        for step in range(steps):
            micro = trainer.source.next_step()
            if step == steps - 1:  # the last step, with every buffer and optimizer state in place
                if tracker is not None:
                    tracker.reset_peak()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            trainer.train_step(micro)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        peak = tracker.peak if tracker is not None else (torch.cuda.max_memory_allocated() if cuda else None)
    finally:
        if tracker is not None:
            tracker.__exit__(None, None, None)
    info = tracker.peak_info if tracker is not None else None
    holder.clear()
    del trainer
    gc.collect()
    return {"peak_bytes": peak, "step_times": times, "peak_breakdown": info, "layout": layout.to_dict()}


def measure_worker(cfg_dicts: list[dict], opts: dict | None = None) -> list[dict] | None:
    from paratrain.config import TrainConfig
    from paratrain.errors import UserError
    from paratrain.parallel.strategies import world_size_of
    from paratrain.train.runtime import init_runtime, shutdown

    opts = opts or {}
    steps, memory = int(opts.get("steps", 3)), bool(opts.get("memory", True))
    torch.manual_seed(0)
    rt = init_runtime(opts.get("device", "cpu"), float(opts.get("timeout_s", 120)))
    out = []
    try:
        for cfg_dict in cfg_dicts:
            cfg = TrainConfig(**{**cfg_dict, "resume": "never", "ckpt_every": 0, "metrics": False})
            world = world_size_of(cfg.strategy, rt.world_size)
            row: dict = {"strategy": cfg.strategy, "world": world}
            if rt.rank < world:
                try:
                    row.update(_measure_one(cfg, rt, steps, memory, bool(opts.get("breakdown"))))
                except UserError as exc:
                    row["error"] = str(exc)
            rows = [None] * rt.world_size if rt.world_size > 1 else [row]
            if rt.world_size > 1:
                dist.all_gather_object(rows, row)
            if rt.rank == 0:
                ranks = [r for r in rows[:world] if r]
                merged = {"strategy": cfg.strategy, "world": world,
                          "peak_bytes": [r.get("peak_bytes") for r in ranks],
                          "step_times": [r.get("step_times") for r in ranks],
                          "peak_breakdown": [r.get("peak_breakdown") for r in ranks],
                          "error": next((r["error"] for r in ranks if "error" in r), None),
                          "layout": next((r["layout"] for r in ranks if "layout" in r), None)}
                out.append(merged)
    finally:
        shutdown()
    return out if rt.rank == 0 else None


def measure(cfgs: list, nproc: int, steps: int = 3, memory: bool = True, timeout_s: float = 120.0,
            breakdown: bool = False) -> list[dict]:
    """Run measure_worker over `nproc` local processes; one result dict per config (see module doc)."""
    from paratrain.train.launch import run_workers

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dicts = [c.model_dump() if hasattr(c, "model_dump") else dict(c) for c in cfgs]
    results = run_workers(measure_worker, (dicts, {"steps": steps, "memory": memory, "timeout_s": timeout_s,
                                                   "breakdown": breakdown}), nproc,
                          0, timeout_s)
    return results[0]


def interleaved_step_times(trainers: list, rt, rounds: int, warmup: int, per_visit: int = 2) -> list[list[float]]:
    """Step seconds of several trainers (the slowest rank's, per round), measured in interleaved rounds so a
    shared machine's changing load falls on every one alike. Each visit runs `per_visit` consecutive steps
    and times the last: the first ones bring that model back into the caches the previous trainer's step
    evicted, so the timed step is a steady-state one, as in a real run of one config. The steps are launched
    as fit() launches them (no host read inside a step) and timed as fit() times them (train/step_record.py:
    on CUDA two events around the step's work, which the GPU reaches back to back while the host runs ahead),
    so the profile is fitted to the step a training run reports."""
    from paratrain.train.step_record import StepTiming

    times: list[list[float]] = [[] for _ in trainers]
    cuda = rt.device_type == "cuda"
    for r in range(warmup + rounds):
        for i, trainer in enumerate(trainers):
            timing = None
            for _ in range(max(1, per_visit)):
                micro = trainer.source.next_step()
                if rt.world_size > 1 and (timing is None or not cuda):  # on CUDA a barrier would stall the queue
                    dist.barrier()
                timing = StepTiming(rt.device)
                trainer.launch_step(micro)
                timing.stop()
            if r >= warmup:
                times[i].append(timing.seconds())
            elif cuda:
                torch.cuda.synchronize()
    if rt.world_size > 1:  # a step ends when its slowest rank ends
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        times = slowest.tolist()
    return times


def timing_worker(cfg_dicts: list[dict], opts: dict) -> list[dict] | None:
    """Step times of several configs (interleaved_step_times). Every config must use the whole world."""
    from paratrain.config import TrainConfig
    from paratrain.train.runtime import init_runtime, shutdown
    from paratrain.train.trainer import Trainer

    rt = init_runtime(opts.get("device", "cpu"), float(opts.get("timeout_s", 120)))
    try:
        trainers = [Trainer(TrainConfig(**{**d, "resume": "never", "ckpt_every": 0, "metrics": False}), rt, None,
                            quiet=True) for d in cfg_dicts]
        times = interleaved_step_times(trainers, rt, int(opts.get("rounds", 5)), int(opts.get("warmup", 2)),
                                       int(opts.get("per_visit", 2)))
        del trainers
    finally:
        shutdown()
    if rt.rank != 0:
        return None
    return [{"strategy": c["strategy"], "step_times": t} for c, t in zip(cfg_dicts, times)]


def measure_times(cfgs: list, nproc: int, rounds: int = 5, warmup: int = 2, timeout_s: float = 300.0,
                  per_visit: int = 2) -> list[dict]:
    from paratrain.train.launch import run_workers

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dicts = [c.model_dump() if hasattr(c, "model_dump") else dict(c) for c in cfgs]
    opts = {"rounds": rounds, "warmup": warmup, "timeout_s": timeout_s, "per_visit": per_visit}
    return run_workers(timing_worker, (dicts, opts), nproc, 0, timeout_s)[0]
