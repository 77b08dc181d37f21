"""What per-step metrics (RUNDIR/metrics.jsonl, on by default) cost, measured side by side in one process.

Runs the same single-device training with --metrics and --no-metrics, alternating, several rounds, and
prints the step-time ratio (wall time per step, logging included). Also prints the direct cost of logging
one record against the step time, which is the same figure without the run-to-run noise. Target: <= 2%.

    python benchmarks/monitoring_overhead.py [--steps 20] [--rounds 8] [--model tiny] [--global-batch 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def timed_fit(cfg, rt, run_dir: Path | None, warmup: int) -> float:
    """Fastest wall time per step after the warm-up (between consecutive steps, so logging counts).

    The minimum is the estimator least disturbed by other processes taking the CPU away for a while."""
    from paratrain.train.trainer import Trainer

    stamps: list[float] = []
    trainer = Trainer(cfg, rt, run_dir, quiet=True)
    trainer.fit(on_step=lambda t, record: stamps.append(time.perf_counter()))
    gaps = [b - a for a, b in zip(stamps, stamps[1:])][warmup:]
    return min(gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    opts = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from paratrain.config import load_config
    from paratrain.doctor.probes import metrics_record_cost_s
    from paratrain.train.runtime import init_runtime, shutdown

    base = {"model": opts.model, "strategy": "single", "nproc": 1, "steps": opts.steps, "resume": "never",
            "global_batch": opts.global_batch, "seq_len": opts.seq_len}
    on_cfg = load_config(None, {**base, "metrics": True})
    off_cfg = load_config(None, {**base, "metrics": False})
    rt = init_runtime("cpu", 60)
    ratios, on_times, off_times = [], [], []
    try:
        with tempfile.TemporaryDirectory(prefix="paratrain-monitoring-") as tmp:
            for i in range(opts.rounds):
                run_dir = Path(tmp) / f"on-{i}"
                run_dir.mkdir()
                on = timed_fit(on_cfg, rt, run_dir, warmup=3)
                off = timed_fit(off_cfg, rt, None, warmup=3)
                lines = sum(1 for _ in (run_dir / "metrics.jsonl").open())
                assert lines == opts.steps, f"expected {opts.steps} metrics lines, found {lines}"
                on_times.append(on)
                off_times.append(off)
                ratios.append(on / off)
                print(f"round {i + 1}: metrics on {on * 1e3:.2f} ms/step, off {off * 1e3:.2f} ms/step, "
                      f"ratio {on / off:.4f}", file=sys.stderr)
    finally:
        shutdown()
    record = metrics_record_cost_s(500)
    step = statistics.median(off_times)
    ratio = statistics.median(ratios)
    print(f"model {opts.model}, global batch {opts.global_batch} x seq {opts.seq_len}, {opts.steps} steps x "
          f"{opts.rounds} rounds, alternating")
    print(f"fastest step with metrics / without (median over rounds): {ratio:.4f}  -> overhead {ratio - 1:+.2%}")
    print(f"one metrics record: {record * 1e6:.1f} us = {record / step:.3%} of a {step * 1e3:.2f} ms step "
          f"(target <= 2%)")


if __name__ == "__main__":
    main()
