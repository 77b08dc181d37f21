"""Turn the captured numbers into a time breakdown: where each step's wall time went, as fractions.

Step time, data wait and the phases P = forward + backward + optimizer + loss sync come from the measured
steps, which ran without the profiler. The profiled steps split P: each category below is measured there in
seconds, the profiler's own cost removed, and scaled to the unprofiled P (its share of P is kept).
Per rank and per measured step (seconds):
    communication_exposed  collectives in flight while the training thread ran no op (GPU: NCCL kernels
                           not overlapped by compute kernels)
    host_overhead          CPU: time between ops on the training thread (Python, framework) plus ops per
                           step x the fixed cost inside one op, measured on a tiny autograd program
                           (dispatch, allocation, autograd bookkeeping); GPU: time no kernel ran
    bubble                 pipeline idle time as the pipeline step measured it (schedule wall time minus the
                           stage's own forward/backward/loss work), taken out of the exposed p2p waits (then
                           out of host time), where a stage sits in its bubble
    compute                CPU: time inside ops beyond their fixed cost; for forward+backward at most 10x
                           the time the step's FLOPs take at this device's measured matmul rate (the
                           optimizer is memory-bound, so it has no such ceiling); GPU: compute kernels ran
    data_wait              waiting for the next batch
    other                  the step loop outside P and the work between steps (metrics logging, checkpoints)
The profiler's own cost (ops x the per-op cost it adds, measured on the same tiny program) is removed.
"""

from __future__ import annotations

import statistics

from paratrain.doctor.counterfactual import communication_split, counterfactual_costs

MATH_CEILING = 10.0
PHASES = ("forward", "backward", "optimizer", "loss_sync")
CATEGORIES = ("compute", "communication_exposed", "data_wait", "host_overhead", "bubble", "other")


def _mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else 0.0


def op_costs(calibration: dict) -> tuple[float | None, float]:
    """(fixed cost inside one op, cost the profiler adds per op), seconds, from the tiny-program probe.

    The probe's ops do almost no math, so the time inside them is the per-op fixed cost (dispatch,
    allocation, autograd bookkeeping); profiled minus plain run time is what profiling adds.
    """
    ops = calibration.get("tiny_program_ops")
    if not ops:
        return None, 0.0
    inside = calibration.get("tiny_program_busy_s", calibration["tiny_program_s"]) / ops
    profiled = calibration.get("tiny_program_profiled_s", calibration["tiny_program_s"]) / ops
    return inside, max(0.0, profiled - calibration["tiny_program_s"] / ops)


def _phases(rows: list[dict]) -> float:
    return sum(_mean(rows, f"{k}_s") for k in PHASES)


def profiled_split(capture: dict) -> dict:
    """Seconds per step of a profiled step's phases: exposed collectives, compute, host, profiler cost."""
    profiled = capture.get("profiled_steps") or capture["steps"]
    prof = capture.get("profile") or {}
    phases = _phases(profiled)
    ops = prof.get("ops_per_step", 0.0)
    op_s, profiler_per_op = op_costs(capture.get("calibration", {}))
    device_comm = prof.get("device_comm_exposed_s")
    comm = min(phases, prof.get("comm_exposed_s", 0.0) + (device_comm or 0.0))
    on_gpu = prof.get("device_compute_s") is not None
    profiler_cost = 0.0 if on_gpu else min(phases - comm, ops * profiler_per_op)
    work = phases - comm - profiler_cost
    if on_gpu:
        compute = min(work, prof["device_compute_s"])
    else:
        # inside ops the fixed cost per op is overhead and the rest is compute; between ops is all overhead
        fixed = op_s or 0.0
        fb = max(0.0, prof.get("busy_forward_backward_s", 0.0) - prof.get("ops_forward_backward", 0.0) * fixed)
        rate = capture.get("calibration", {}).get("matmul_flops_per_s")
        if rate and capture.get("flops_per_step"):
            # the math ceiling: no reasonable kernel mix needs 10x the matmul-rate time for the forward and
            # backward FLOPs; ops slower than that are dominated by fixed costs (the probe's ops are cheap ones)
            fb = min(fb, MATH_CEILING * capture["flops_per_step"] / rate)
        # the optimizer is memory-bound work on every parameter: no FLOP ceiling
        tail = max(0.0, prof.get("busy_optimizer_s", 0.0) - prof.get("ops_optimizer", 0.0) * fixed)
        compute = min(work, fb + tail)
    return {"comm": comm, "compute": compute, "host": work - compute, "profiler_cost": profiler_cost,
            "ops": ops, "op_s": op_s, "in_flight": prof.get("comm_in_flight_s", 0.0)}


def rank_breakdown(capture: dict) -> dict:
    """Seconds per step in each category for one rank, plus the evidence numbers behind them.

    Times come from the unprofiled measured steps; the profiled steps only say how each second of the
    phases splits (their fractions, after removing what the profiler itself cost)."""
    steps = capture["steps"]
    iteration = _mean(steps, "iteration_s")
    step_time = _mean(steps, "step_time_s")
    data = _mean(steps, "data_wait_s")
    phases = _phases(steps)
    split = profiled_split(capture)
    attributed = split["comm"] + split["compute"] + split["host"]
    scale = phases / attributed if attributed > 0 else 0.0
    comm, compute = split["comm"] * scale, split["compute"] * scale
    host = max(0.0, phases - comm - compute) if attributed > 0 else phases
    # a pipeline stage idles in its bubble waiting on a p2p receive (exposed communication) or, on GPU,
    # with no kernel to run (idle): move the measured idle time out of those
    expected = min(_mean(steps, "pipeline_idle_s"), phases)
    from_comm = min(comm, expected)
    from_host = min(host, expected - from_comm)
    comm, host, bubble_s = comm - from_comm, host - from_host, from_comm + from_host
    # the step as `train` times it (metrics.jsonl step_time_s: data wait + the step); the work between steps
    # (the metrics line, the loop) is reported apart, as between_steps_s, and is not in the step time
    other = max(0.0, step_time - data - phases)
    seconds = {"compute": compute, "communication_exposed": comm, "data_wait": data, "host_overhead": host,
               "bubble": bubble_s, "other": other}
    return {"rank": capture["rank"], "seconds": seconds, "step_time_s": sum(seconds.values()),
            "measured_step_time_s": step_time, "between_steps_s": max(0.0, iteration - step_time),
            "profiler_overhead_s": split["profiler_cost"],
            "profiled_phases_s": _phases(capture.get("profiled_steps") or steps),
            "phases_s": {k: _mean(steps, f"{k}_s") for k in PHASES},
            "ops_per_step": split["ops"], "op_cost_s": split["op_s"],
            "comm_in_flight_s": split["in_flight"] * scale}


def breakdown(captures: list[dict]) -> dict:
    """{"fractions": {category: fraction}, "seconds": {...}, "step_time_s", "per_rank": [...]} over all ranks."""
    per_rank = [rank_breakdown(c) for c in captures]
    seconds = {k: statistics.fmean(r["seconds"][k] for r in per_rank) for k in CATEGORIES}
    step = sum(seconds.values())
    fractions = {k: (v / step if step > 0 else 0.0) for k, v in seconds.items()}
    # the fastest measured step against the fastest probe round: a mean against a minimum is never zero
    costs = [counterfactual_costs(c.get("probes"), min(s["step_time_s"] for s in c["steps"])) for c in captures]
    causes = set.intersection(*(set(c) for c in costs)) if costs else set()
    cf_seconds = {k: statistics.fmean(c[k] for c in costs) for k in sorted(causes)}
    counterfactual = {"seconds": cf_seconds, "fractions": {k: v / step if step > 0 else 0.0
                                                           for k, v in cf_seconds.items()}}
    splits = [communication_split(c.get("probes")) for c in captures]
    if splits and all(s is not None for s in splits):
        # mean over ranks of the sync, the peer contention and their sum (None where no alone probe ran)
        counterfactual["communication_split"] = {
            k: (None if any(s[k] is None for s in splits) else statistics.fmean(s[k] for s in splits))
            for k in splits[0]}
    return {"fractions": fractions, "seconds": seconds, "step_time_s": step, "per_rank": per_rank,
            "counterfactual": counterfactual}
