"""Reduce one rank's torch.profiler events to a few numbers per step: ops, busy time, exposed collectives.

Exposed communication is the time a collective is in flight while the training thread runs no op (CPU:
gloo works on its own threads while ours waits) or, on GPU, communication kernels not overlapped by
compute kernels. Intervals are in microseconds, as the profiler reports them.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable

import torch

COLLECTIVE_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::", "gloo:", "nccl:", "record_param_comms")


def is_collective(name: str) -> bool:
    return name.startswith(COLLECTIVE_PREFIXES) or "nccl" in name.lower()


def merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intersection of two merged interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Parts of merged list a not covered by merged list b."""
    out = []
    j = 0
    for start, end in a:
        cur = start
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def total(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def _range(e) -> tuple[float, float]:
    return float(e.time_range.start), float(e.time_range.end)


def _inside(ranges: list[tuple[float, float]], t: float) -> bool:
    i = bisect.bisect_right(ranges, (t, math.inf)) - 1
    return i >= 0 and ranges[i][0] <= t < ranges[i][1]


def _annotated(annotations, name: str) -> list[tuple[float, float]]:
    return merge(_range(e) for e in annotations if e.name == name)


def summarize_events(events, last_steps: int | None = None) -> dict:
    """Per-step averages (seconds) over the last `last_steps` profiled training steps (all when None).

    Phases come from the timer's `paratrain.*` ranges: forward_backward, then optimizer and loss_sync.
    """
    cuda = getattr(torch.autograd.DeviceType, "CUDA", None)
    annotations = [e for e in events if e.is_user_annotation and e.name.startswith("paratrain.")]
    fb = _annotated(annotations, "paratrain.forward_backward")
    if not fb:
        return {"profiled_steps": 0}
    if last_steps:
        fb = fb[-last_steps:]
    first = fb[0][0]
    tail = merge(_annotated(annotations, "paratrain.optimizer") + _annotated(annotations, "paratrain.loss_sync"))
    tail = [r for r in tail if r[0] >= first]
    thread = next(e.thread for e in annotations if e.name == "paratrain.forward_backward")
    windows = merge(fb + tail + list(zip([e for _, e in fb], [s for s, _ in tail])))  # close the tiny gaps
    calib = _annotated(annotations, "paratrain.calibration")

    busy, comm, device_compute, device_comm, calib_busy = [], [], [], [], []
    ops = {"fb": 0, "tail": 0, "calibration": 0}
    for e in events:
        start, end = _range(e)
        if cuda is not None and e.device_type == cuda:
            (device_comm if is_collective(e.name) else device_compute).append((start, end))
            continue
        if is_collective(e.name):  # gloo's own ranges run on its threads, flagged as async annotations
            comm.append((start, end))
            continue
        if e.is_user_annotation or e.thread != thread:
            continue
        if _inside(calib, start):
            ops["calibration"] += 1
            calib_busy.append((start, end))
            continue
        busy.append((start, end))
        if _inside(fb, start):
            ops["fb"] += 1
        elif _inside(tail, start):
            ops["tail"] += 1
    busy, comm = merge(busy), merge(comm)
    n = max(1, len(fb))
    per_step = 1e6 * n
    out = {
        "profiled_steps": len(fb),
        "window_s": total(windows) / per_step,
        "ops_per_step": (ops["fb"] + ops["tail"]) / n,
        "ops_forward_backward": ops["fb"] / n,
        "ops_optimizer": ops["tail"] / n,
        "busy_s": total(intersect(busy, windows)) / per_step,
        "busy_forward_backward_s": total(intersect(busy, fb)) / per_step,
        "busy_optimizer_s": total(intersect(busy, tail)) / per_step,
        "comm_in_flight_s": total(intersect(comm, windows)) / per_step,
        "comm_exposed_s": total(subtract(intersect(comm, windows), busy)) / per_step,
        "calibration_ops": ops["calibration"],
        "calibration_s": total(calib) / 1e6,
        "calibration_busy_s": total(merge(calib_busy)) / 1e6,
        "device_compute_s": None,
        "device_comm_exposed_s": None,
    }
    if device_compute or device_comm:
        dev_compute, dev_comm = merge(device_compute), merge(device_comm)
        out["device_compute_s"] = total(intersect(dev_compute, windows)) / per_step
        out["device_comm_exposed_s"] = total(subtract(intersect(dev_comm, windows), dev_compute)) / per_step
    return out
