"""Goodput under failures: a DDP run of R CPU replicas loses a rank every N steps (SIGKILL right after the step),
once recovered by checkpoint-and-restart (--ckpt-every C --max-restarts K: torch elastic restarts every rank,
--resume auto reloads the newest checkpoint and redoes the steps since) and once by replica healing
(--heal-replicas --max-restarts K: the others train on, the replacement copies a live replica's state). Both run
here, one after the other, with the same model, data, steps and kill schedule. Prints the useful steps (the run's
final step count) per wall-clock second of the whole command for each, and their ratio.

    python benchmarks/goodput.py [--replicas 3] [--steps 300] [--kill-every 60] [--ckpt-every 25]
                                 [--repeats N] [--quick] [--json]

The kills come from the tests' plugin (tests/support/replica_faults.py, PARATRAIN_TEST_KILL_EVERY): after every
Nth step, replica (or rank) (step / N) % R dies, once per step value, so a restart that redoes that step goes on.
Under healing a kill that falls on a replica not yet rejoined does not happen; the kills made are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = str(Path(__file__).resolve().parents[1] / "tests")


def run_mode(mode: str, args, root: Path, trial: int) -> dict:
    marks = root / f"{mode}-{trial}-marks"
    marks.mkdir(parents=True)
    kills = args.steps // args.kill_every
    cmd = [sys.executable, "-m", "paratrain.cli", "train", "--strategy", "ddp", "--nproc", str(args.replicas),
           "--steps", str(args.steps), "--global-batch", str(args.global_batch), "--seq-len", str(args.seq_len),
           "--model", args.model, "--timeout-s", "60", "--out", str(root / f"{mode}-{trial}"), "--json",
           "--max-restarts", str(kills + 1)]
    if mode == "restart":
        cmd += ["--ckpt-every", str(args.ckpt_every)]
    else:
        cmd += ["--heal-replicas"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get(
        "PYTHONPATH")])), "PARATRAIN_PLUGINS": "support.replica_faults:plugin",
           "PARATRAIN_TEST_REPLICA_DIR": str(marks), "PARATRAIN_TEST_KILL_EVERY": str(args.kill_every)}
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout,
                          stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"goodput: the {mode} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout)
    executed = sum(len(p.read_text().splitlines()) for p in marks.glob("steps-r*.txt"))
    return {"mode": mode, "trial": trial, "wall_s": wall, "useful_steps": summary["steps"],
            "useful_steps_per_s": summary["steps"] / wall, "kills": len(list(marks.glob("killed-at-*"))),
            "rank_steps_computed": executed, "samples_skipped": summary.get("samples_skipped", 0),
            "replica_restarts": summary.get("replica_restarts")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kill-every", type=int, default=60)
    parser.add_argument("--ckpt-every", type=int, default=25)
    parser.add_argument("--global-batch", type=int, default=24)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--quick", action="store_true", help="a short smoke run: 60 steps, a kill every 20")
    parser.add_argument("--repeats", type=int, default=1,
                        help="alternate the two modes this many times; the ratio is of the medians")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.kill_every, args.ckpt_every = 60, 20, 8
    with tempfile.TemporaryDirectory(prefix="goodput-") as tmp:
        rows = [run_mode(mode, args, Path(tmp), trial) for trial in range(args.repeats)
                for mode in ("restart", "heal")]
    medians = {mode: statistics.median(r["useful_steps_per_s"] for r in rows if r["mode"] == mode)
               for mode in ("restart", "heal")}
    ratio = medians["heal"] / medians["restart"]
    if args.json:
        print(json.dumps({"replicas": args.replicas, "steps": args.steps, "kill_every": args.kill_every,
                          "ckpt_every": args.ckpt_every, "runs": rows, "median_useful_steps_per_s": medians,
                          "heal_over_restart": ratio}, indent=1))
        return
    print(f"{args.replicas} CPU replicas, model {args.model}, {args.steps} steps, a rank killed every "
          f"{args.kill_every} steps (restart mode: checkpoint every {args.ckpt_every})")
    print(f"{'mode':<8} {'wall s':>8} {'kills':>6} {'rank-steps':>11} {'skipped':>8} {'useful steps/s':>15}")
    for r in rows:
        print(f"{r['mode']:<8} {r['wall_s']:8.1f} {r['kills']:6d} {r['rank_steps_computed']:11d} "
              f"{r['samples_skipped']:8d} {r['useful_steps_per_s']:15.2f}")
    print(f"median useful steps/s: restart {medians['restart']:.2f}, heal {medians['heal']:.2f}; "
          f"healing / checkpoint-and-restart: {ratio:.2f}x")


if __name__ == "__main__":
    main()
