"""Kill soak: N times, SIGKILL a rank (0 and 1 in turn) at a random step between checkpoints of a 2-rank CPU run,
let torch elastic restart it (--max-restarts 1, --resume auto) and compare the final parameters with an
uninterrupted run of the same command, bit for bit. Prints how many trials were bit-identical.

    python benchmarks/kill_soak.py [--trials 20] [--strategies ddp,zero3] [--seed S]
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from paratrain.train.recovery.checkpoint import load_params

# the kill comes from the tests' plugin (tests/support/kill_stall.py), loaded through PARATRAIN_PLUGINS
TESTS = str(Path(__file__).resolve().parents[1] / "tests")

STEPS, EVERY = 8, 2


def train(
    strategy: str, out: Path, extra_env: dict | None = None, restarts: int = 0
) -> tuple[int, float, str]:
    args = [
        sys.executable,
        "-m",
        "paratrain.cli",
        "train",
        "--strategy",
        strategy,
        "--nproc",
        "2",
        "--steps",
        str(STEPS),
        "--ckpt-every",
        str(EVERY),
        "--ckpt-dir",
        str(out / "ck"),
        "--out",
        str(out),
        "--seq-len",
        "32",
        "--global-batch",
        "8",
        "--timeout-s",
        "60",
        "--no-metrics",
        "--max-restarts",
        str(restarts),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra_env or {})}
    start = time.perf_counter()
    done = subprocess.run(
        args, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL
    )
    return done.returncode, time.perf_counter() - start, done.stderr


def identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--strategies", default="ddp,zero3")
    parser.add_argument("--seed", type=int, default=None)
    opts = parser.parse_args()
    seed = opts.seed if opts.seed is not None else random.SystemRandom().randrange(1 << 30)
    rng = random.Random(seed)
    strategies = opts.strategies.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        reference = {}
        for strategy in strategies:
            code, wall, err = train(strategy, root / f"ref-{strategy}")
            if code != 0:
                sys.exit(f"reference {strategy} run failed:\n{err[-2000:]}")
            reference[strategy] = load_params(root / f"ref-{strategy}" / "ck" / f"step-{STEPS}")
            print(f"reference {strategy}: {wall:.1f} s", flush=True)
        same, walls = 0, []
        for trial in range(opts.trials):
            strategy = strategies[trial % len(strategies)]
            step = rng.choice([s for s in range(EVERY + 1, STEPS) if s % EVERY])
            rank = (trial // len(strategies)) % 2  # every strategy loses rank 0 and rank 1 in turn
            out = root / f"trial-{trial}"
            kill = {"PARATRAIN_PLUGINS": "support.kill_stall:plugin", "PARATRAIN_FAULT_KILL": f"{rank}:{step}",
                    "PYTHONPATH": TESTS}
            code, wall, err = train(strategy, out, kill, restarts=1)
            final = out / "ck" / f"step-{STEPS}"
            ok = code == 0 and final.is_dir() and identical(reference[strategy], load_params(final))
            same += ok
            walls.append(wall)
            verdict = "bit-identical" if ok else ("DIFFERENT" if code == 0 else f"FAILED (exit {code})")
            print(
                f"trial {trial + 1:2d}: {strategy:5s} kill rank {rank} after step {step}: {verdict} "
                f"({wall:.1f} s incl. restart)",
                flush=True,
            )
            if code != 0:
                print("  " + "\n  ".join(err.strip().splitlines()[-3:]), flush=True)
    print(
        f"kill soak: {same}/{opts.trials} trials bit-identical to the uninterrupted run "
        f"(seed {seed}; {sum(walls) / max(len(walls), 1):.1f} s per trial)"
    )


if __name__ == "__main__":
    main()
