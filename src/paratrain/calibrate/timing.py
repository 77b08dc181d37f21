"""Timing helpers shared by the calibration microbenchmarks: one call, a collective every rank runs alike,
agreeing on a figure across ranks, and the collective latencies measured so far."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn, device, min_s: float = 0.05, max_reps: int = 200) -> float:
    """Seconds per call, averaged over a window of at least min_s after one warm-up call: a typical call
    under the machine's current load, as a training step meets it."""
    fn()
    sync(device)
    reps, t0 = 0, time.perf_counter()
    while True:
        fn()
        reps += 1
        sync(device)
        elapsed = time.perf_counter() - t0
        if elapsed >= min_s or reps >= max_reps:
            return elapsed / reps


def time_together(fn, device, budget_s: float, max_reps: int = 50) -> float:
    """Seconds per call of a collective: every rank runs the same number of calls (agreed first)."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    once = max(time.perf_counter() - t0, 1e-7)
    reps = torch.tensor([min(max_reps, max(3, int(budget_s / once)))], device=device)
    dist.all_reduce(reps, op=dist.ReduceOp.MIN)
    n = int(reps.item())
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / n


def agree_max(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


LATENCIES: dict[str, float] = {}


def collective_latency(kind: str) -> float:
    return LATENCIES.get(kind, 0.0)


def record_latencies(collectives: dict) -> None:
    """Remember each collective's measured latency (seconds) for the framework benchmarks that follow."""
    LATENCIES.update({k: v["latency_us"] * 1e-6 for k, v in collectives.items()})
