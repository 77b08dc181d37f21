"""Does `paratrain doctor` report the run as `paratrain train` runs it, and what do `train --monitor` and the
flight recorder cost?

For each strategy the same configuration runs as five CLI launches per round (2 ranks, as a user runs them):
    train     plain `train` (the flight recorder is on by default: train/recovery/flight_recorder.py)
    doctor    `doctor` on the same steps
    monitor   `train --monitor` (its default window: a breakdown every 10 steps)
    control   plain `train` again: the noise floor, what the same command measures against itself
    norec     `train --no-flight-recorder`: the recorder's cost is train / norec (1 / the norec ratios)
R rounds, the order rotated each round so no variant always runs first (or on the busier machine). Every
ratio is taken within a round (variant / that round's `train`) and summarised as the median over rounds with
its range [min-max]; a ratio is only a finding where its range sits outside the control's.
    step      the step time each reports for the same post-warm-up steps: train's and monitor's `step_time_s`
              from RUNDIR/metrics.jsonl (data wait + step), doctor's reported `step_time_s`
    wall      wall time per step between the per-step `wall_s` stamps of metrics.jsonl over the same steps, so
              the monitor's per-window all-reduce and file writes (after `step_time_s` ends) are inside it
    cpu       rank 0's CPU seconds per step (all its threads) over the same steps: train/monitor from the
              `cpu_s` stamps, doctor from getrusage over its measured steps. Less moved than wall time by other
              load on the machine (which takes cores away but does not add this process's CPU time)
    peak      doctor's reported peak / train's (rank 0; CPU: peak RSS, CUDA: allocator peak)
    self      not a ratio: the monitor's own time, the mean of its windows' `monitor_overhead` (rank 0's seconds
              inside the monitor, its collective's wait included, over the window's wall time). It is timed
              inside the one run, so launch-to-launch noise does not touch it; it misses indirect costs (caches)
Targets: doctor step and peak 1.00 +- 0.05; monitor <= 1.02; norec >= 0.99 (the recorder costs at most 1%).

    python benchmarks/doctor_overhead.py [--strategies ddp,zero3,tp,pp] [--rounds 5] [--steps 150]
        [--variants train,control,norec]   # a subset (train is always run: every ratio is to it)
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
VARIANTS = ("train", "doctor", "monitor", "control", "norec")


def paratrain(*args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "paratrain.cli", *args, "--json"], capture_output=True, text=True,
                          env=env, stdin=subprocess.DEVNULL, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"paratrain {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def train_figures(strategy: str, steps: int, out: Path, *extra: str) -> dict:
    """Steps WARMUP+1 .. WARMUP+steps; one more step runs so its wall_s/cpu_s stamp closes the last one."""
    summary = paratrain("train", "--strategy", strategy, *RUN, *PER_STRATEGY.get(strategy, []),
                        "--steps", str(WARMUP + steps + 1), "--out", str(out), "--resume", "never", *extra)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = {r["step"]: r for r in lines if "event" not in r}
    windows = [r["monitor_overhead"] for r in lines if r.get("event") == "monitor"]
    first, last = rows[WARMUP + 1], rows[WARMUP + steps + 1]
    return {"step": statistics.fmean(rows[s]["step_time_s"] for s in range(WARMUP + 1, WARMUP + steps + 1)),
            "wall": (last["wall_s"] - first["wall_s"]) / steps, "cpu": (last["cpu_s"] - first["cpu_s"]) / steps,
            "peak": summary["peak_mem_gib"], "self": statistics.fmean(windows) if windows else None}


def doctor_figures(strategy: str, steps: int) -> dict:
    report = paratrain("doctor", "--strategy", strategy, *RUN, *PER_STRATEGY.get(strategy, []),
                       "--warmup", str(WARMUP), "--steps", str(steps))
    return {"step": report["step_time_s"], "cpu": report["cpu_s_per_step"], "peak": report["peak_mem_gib"]}


def run_variant(name: str, strategy: str, steps: int, out: Path) -> dict:
    if name == "doctor":
        return doctor_figures(strategy, steps)
    extra = {"monitor": ("--monitor",), "norec": ("--no-flight-recorder",)}.get(name, ())  # control: train again
    return train_figures(strategy, steps, out, *extra)


# (label, variant, figure): each a ratio variant/train within a round
COLUMNS = [("doctor step", "doctor", "step"), ("doctor cpu", "doctor", "cpu"), ("doctor peak", "doctor", "peak"),
           ("monitor wall", "monitor", "wall"), ("monitor cpu", "monitor", "cpu"), ("monitor step", "monitor", "step"),
           ("control step", "control", "step"), ("control wall", "control", "wall"), ("control cpu", "control", "cpu"),
           ("norec step", "norec", "step"), ("norec wall", "norec", "wall"), ("norec cpu", "norec", "cpu")]


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default="ddp,zero3,tp,pp")
    parser.add_argument("--rounds", type=int, default=5)
    # a 2-rank CPU step jitters about 20% step to step (gloo on 2 cores): 150 steps bring a launch's mean to ~2%
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    opts = parser.parse_args()
    variants = ("train", *(v for v in VARIANTS if v in opts.variants.split(",") and v != "train"))
    columns = [c for c in COLUMNS if c[1] in variants]
    table = []
    with tempfile.TemporaryDirectory(prefix="paratrain-doctor-overhead-") as tmp:
        for strategy in opts.strategies.split(","):
            ratios: dict[str, list[float]] = {label: [] for label, _, _ in columns}
            own: list[float] = []
            load_before = load()
            for i in range(opts.rounds):
                k = i % len(variants)
                order = variants[k:] + variants[:k]
                got = {name: run_variant(name, strategy, opts.steps, Path(tmp) / f"{strategy}-{i}-{name}")
                       for name in order}
                for label, variant, figure in columns:
                    ratios[label].append(got[variant][figure] / got["train"][figure])
                if "monitor" in got:
                    own.append(got["monitor"]["self"])
                t = got["train"]
                print(f"{strategy} round {i + 1} ({','.join(order)}; load {load()}): train step {t['step'] * 1e3:.1f} "
                      f"wall {t['wall'] * 1e3:.1f} cpu {t['cpu'] * 1e3:.1f} ms; "
                      + "; ".join(f"{label} {ratios[label][-1]:.3f}" for label, _, _ in columns)
                      + (f"; monitor self {own[-1]:.2%}" if own else ""), file=sys.stderr, flush=True)
            table.append((strategy, f"{load_before}->{load()}", ratios, own))
    print(f"{' '.join(RUN)}; {WARMUP} warm-up + {opts.steps} steps; {opts.rounds} rounds, order rotated; "
          f"each cell: median of the per-round ratios to that round's plain train [min-max]")
    print(f"{'strategy':<9} {'load':>9} " + " ".join(f"{label:>20}" for label, _, _ in columns)
          + (f" {'monitor self':>22}" if "monitor" in variants else ""))
    for strategy, loads, ratios, own in table:
        cells = [f"{statistics.median(v):.3f} [{min(v):.2f}-{max(v):.2f}]" for v in ratios.values()]
        if own:
            cells.append(f"{statistics.median(own):.2%} [{min(own):.2%}-{max(own):.2%}]")
        print(f"{strategy:<9} {loads:>9} " + " ".join(f"{c:>20}" for c in cells))
    print("target: doctor step and peak 1.00 +- 0.05, monitor <= 1.02, norec >= 0.99; a ratio whose range overlaps the "
          "control's is not distinguishable from no effect on this machine; monitor self is the monitor's own "
          "share of the wall time, timed inside the run")


if __name__ == "__main__":
    main()
