"""Planner accuracy on this machine: calibrate, predict, measure, side by side.

    python benchmarks/planner_accuracy.py [--model small] [--seq-len 128] [--global-batch 8] [--micro-batch 2]
                                          [--steps 6] [--nproc 2] [--profile FILE] [--json]

1. `paratrain plan --calibrate` equivalent on `nproc` gloo ranks (or --profile FILE): microbenchmarks, then
   the fit to reference training steps of a model that is none of the presets (calibrate/fit.py).
2. The planner predicts step time and peak memory for each strategy at `nproc` ranks.
3. The real trainer runs every strategy in one process group, interleaved round by round (so a shared
   machine's changing load falls on all alike); each visit runs two steps and times the second (a steady-state
   step, not one that first reloads the caches the previous strategy evicted); the step time is the median
   round's. Peak memory comes from the live-tensor tracker in a separate pass.
Prints predicted / measured per strategy and Kendall's tau between the predicted and the measured order.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

STRATEGIES = [("ddp", {}), ("zero1", {}), ("zero2", {}), ("zero3", {}), ("tp", {}), ("tp-sp", {}),
              ("pp", {"pp_schedule": "1f1b"}), ("cp-ring", {}), ("cp-ulysses", {})]


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    """Kendall's tau-b between two orderings (ties counted as neither concordant nor discordant)."""
    conc = disc = tx = ty = 0
    n = len(xs)
    for i in range(n):
        for j in range(i + 1, n):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                tx += 1
            elif dy == 0:
                ty += 1
            elif (dx > 0) == (dy > 0):
                conc += 1
            else:
                disc += 1
    denom = ((conc + disc + tx) * (conc + disc + ty)) ** 0.5
    return (conc - disc) / denom if denom else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="measured rounds (after 2 warm-up rounds)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--profile", help="use this hardware profile instead of calibrating")
    parser.add_argument("--strategies", help="comma-separated subset")
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from paratrain.calibrate.harness import measure, measure_times
    from paratrain.calibrate.save_profile import calibrate
    from paratrain.config import TrainConfig
    from paratrain.costs.hardware import load_profile
    from paratrain.models.presets import model_args_for
    from paratrain.parallel.layout import Layout
    from paratrain.plan.costing.memory import estimate_memory
    from paratrain.plan.costing.time import estimate_time

    load_before = os.getloadavg()[0]
    t0 = time.time()
    profile = load_profile(opts.profile) if opts.profile else calibrate(opts.nproc, "cpu", 120.0)
    calibrate_s = time.time() - t0
    wanted = set(opts.strategies.split(",")) if opts.strategies else None
    cfgs = []
    for name, extra in STRATEGIES:
        if wanted and name not in wanted:
            continue
        fields = {"model": opts.model, "seq_len": opts.seq_len, "global_batch": opts.global_batch,
                  "micro_batch": opts.micro_batch, "strategy": name, "nproc": opts.nproc, "device": "cpu",
                  "dtype": opts.dtype, "timeout_s": 300, **extra}
        if name == "pp":
            fields["micro_batch"] = max(1, opts.global_batch // opts.nproc // opts.nproc)
        cfgs.append(TrainConfig(**fields))
    times = measure_times(cfgs, opts.nproc, rounds=opts.steps, warmup=2, timeout_s=600)
    mems = measure(cfgs, opts.nproc, steps=2, memory=True, timeout_s=300)
    rows = []
    for cfg, t_res, m_res in zip(cfgs, times, mems):
        if m_res["error"]:
            rows.append({"strategy": cfg.strategy, "error": m_res["error"]})
            continue
        layout = Layout.from_dict(m_res["layout"])  # exactly what the trainer ran
        args = model_args_for(cfg)
        est = estimate_time(profile, args, layout, cfg.seq_len, cfg.dtype, "cpu")
        mem = estimate_memory(args, layout, cfg.seq_len, cfg.dtype, "cpu")
        # the median of the interleaved rounds: a typical step under the load the calibration also saw
        measured = statistics.median(t_res["step_times"])
        peak = max(m_res["peak_bytes"])
        rows.append({"strategy": cfg.strategy, "layout": layout.label(), "predicted_step_s": est.step_s,
                     "measured_step_s": measured, "time_ratio": est.step_s / measured,
                     "predicted_mem_mib": mem.total / 2**20, "measured_mem_mib": peak / 2**20,
                     "mem_ratio": mem.total / peak})
    good = [r for r in rows if "error" not in r]
    tau = kendall_tau([r["predicted_step_s"] for r in good], [r["measured_step_s"] for r in good])
    within = sum(abs(r["time_ratio"] - 1) <= 0.15 for r in good)
    load_after = os.getloadavg()[0]
    out = sys.stderr if opts.json else sys.stdout
    print(f"planner accuracy: {opts.model}, seq {opts.seq_len}, global batch {opts.global_batch}, {opts.nproc} "
          f"gloo ranks, {opts.dtype}; calibration {calibrate_s:.0f} s; load average {load_before:.1f} -> "
          f"{load_after:.1f} on {os.cpu_count()} CPUs", file=out)
    print(f"{'strategy':<11} {'predicted s':>11} {'measured s':>11} {'pred/meas':>9}   {'pred MiB':>9} "
          f"{'meas MiB':>9} {'pred/meas':>9}", file=out)
    for r in rows:
        if "error" in r:
            print(f"{r['strategy']:<11} error: {r['error']}", file=out)
            continue
        print(f"{r['strategy']:<11} {r['predicted_step_s']:>11.4f} {r['measured_step_s']:>11.4f} "
              f"{r['time_ratio']:>9.2f}   {r['predicted_mem_mib']:>9.2f} {r['measured_mem_mib']:>9.2f} "
              f"{r['mem_ratio']:>9.3f}", file=out)
    print(f"step time within 15%: {within}/{len(good)}; Kendall tau (predicted vs measured order): {tau:.2f}",
          file=out)
    if opts.json:
        print(json.dumps({"rows": rows, "kendall_tau": tau, "within_15pct": within, "load_average": load_before,
                          "profile": profile.to_dict()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
