"""Does `paratrain doctor` report the run as `paratrain train` runs it? Side by side, alternating, in one run.

For each strategy the same configuration runs under `train` and under `doctor` (CLI subprocesses, as a user
runs them), alternating round by round so the machine's load hits both alike, and prints:
    step ratio   doctor's reported step time / train's measured step time (mean over the same post-warm-up
                 steps: train's from RUNDIR/metrics.jsonl)
    fastest      the same for the fastest step of each (doctor's step_time_fastest_s): on a shared machine the
                 mean follows the other load, the fastest step much less
    peak ratio   doctor's reported peak memory / train's peak (rank 0; CPU: peak RSS, CUDA: allocator peak)
    monitor      `train --monitor`'s step time / plain train's (same steps, from each run's metrics.jsonl)
    control      a second plain `train` run / the first: the noise floor, what the same command measures twice
                 on this machine; a doctor or monitor ratio inside it is not a difference the run can show
Target: step and peak ratios 1.00 +- 0.05; monitor <= 1.02.

    python benchmarks/doctor_overhead.py [--strategies ddp,zero3,tp,pp] [--rounds 3] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WARMUP = 2
# two layers so pp has a layer per stage; big enough that a step is tens of ms, not timer noise
RUN = ["--model", "tiny", "--seq-len", "64", "--global-batch", "8", "--nproc", "2", "--timeout-s", "120"]
PER_STRATEGY = {"pp": ["--microbatches", "4"]}


def paratrain(*args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "paratrain.cli", *args, "--json"], capture_output=True, text=True,
                          env=env, stdin=subprocess.DEVNULL, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"paratrain {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def train_figures(strategy: str, steps: int, out: Path, *extra: str) -> tuple[float, float, float]:
    summary = paratrain("train", "--strategy", strategy, *RUN, *PER_STRATEGY.get(strategy, []),
                        "--steps", str(WARMUP + steps), "--out", str(out), "--resume", "never", *extra)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if r["step"] > WARMUP and "event" not in r]
    return statistics.fmean(times), summary["peak_mem_gib"], min(times)


def doctor_figures(strategy: str, steps: int) -> tuple[float, float, float]:
    report = paratrain("doctor", "--strategy", strategy, *RUN, *PER_STRATEGY.get(strategy, []),
                       "--warmup", str(WARMUP), "--steps", str(steps))
    return report["step_time_s"], report["peak_mem_gib"], report["step_time_fastest_s"]


VARIANTS = ("train", "doctor", "monitor", "control")


def run_variant(name: str, strategy: str, steps: int, out: Path) -> tuple[float, float, float]:
    if name == "doctor":
        return doctor_figures(strategy, steps)
    extra = ("--monitor", "--monitor-every", "2") if name == "monitor" else ()  # control: plain train again
    return train_figures(strategy, steps, out, *extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default="ddp,zero3,tp,pp")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    opts = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="paratrain-doctor-overhead-") as tmp:
        for strategy in opts.strategies.split(","):
            step_ratios, peak_ratios, monitor_ratios, fast_ratios, fast_monitor, control, fast_control = (
                [], [], [], [], [], [], [])
            for i in range(opts.rounds):
                # rotate the order, so no variant always runs on the warmer (or busier) machine
                k = i % len(VARIANTS)
                order = list(VARIANTS[k:] + VARIANTS[:k])
                got = {name: run_variant(name, strategy, opts.steps, Path(tmp) / f"{strategy}-{i}-{name}")
                       for name in order}
                (t_step, t_peak, t_fast), (d_step, d_peak, d_fast), (m_step, _, m_fast), (c_step, _, c_fast) = (
                    got["train"], got["doctor"], got["monitor"], got["control"])
                control.append(c_step / t_step)
                fast_control.append(c_fast / t_fast)
                step_ratios.append(d_step / t_step)
                peak_ratios.append(d_peak / t_peak)
                monitor_ratios.append(m_step / t_step)
                fast_ratios.append(d_fast / t_fast)
                fast_monitor.append(m_fast / t_fast)
                print(f"{strategy} round {i + 1}: train {t_step * 1e3:.1f} ms {t_peak:.3f} GiB; doctor "
                      f"{d_step * 1e3:.1f} ms {d_peak:.3f} GiB; train --monitor {m_step * 1e3:.1f} ms; train again "
                      f"{c_step * 1e3:.1f} ms",
                      file=sys.stderr, flush=True)
            rows.append((strategy, *(statistics.median(v) for v in (step_ratios, fast_ratios, peak_ratios,
                                                                   monitor_ratios, fast_monitor, control,
                                                                   fast_control))))
    print(f"{' '.join(RUN)}; {WARMUP} warm-up + {opts.steps} steps, {opts.rounds} rounds alternating (median ratio)")
    print(f"{'strategy':<10} {'step doctor/train':>18} {'fastest':>8} {'peak doctor/train':>18} "
          f"{'step monitor/train':>19} {'fastest':>8} {'control train/train':>20} {'fastest':>8}")
    for strategy, step, fast, peak, monitor, fast_mon, ctrl, fast_ctrl in rows:
        print(f"{strategy:<10} {step:>18.3f} {fast:>8.3f} {peak:>18.3f} {monitor:>19.3f} {fast_mon:>8.3f} "
              f"{ctrl:>20.3f} {fast_ctrl:>8.3f}")
    print("target: doctor 1.00 +- 0.05, monitor <= 1.02")


if __name__ == "__main__":
    main()
