"""Run by test_straggler.py: one 2-rank launch trains ddp, zero3 and tp one after the other in the same process
group, each with rank 1 slowed in its optimizer phase (tests/support/slow_phase.py), and ddp once more clean, all
under --monitor; the test reads each run's metrics.jsonl."""

from __future__ import annotations

import sys
from pathlib import Path

STRATEGIES = ("ddp", "zero3", "tp")
SLOW_S = 0.15  # several times a step (about 25 ms here; 10 ms steps jitter by 50% on a busy host): load cannot hide it or fake it


def run_cases(out_dir: str) -> None:
    from paratrain.config import TrainConfig
    from paratrain.train.hooks import Hooks
    from paratrain.train.runtime import init_runtime, shutdown
    from paratrain.train.trainer import Trainer
    from support.slow_phase import attach

    rt = init_runtime("cpu", 60)
    for strategy in STRATEGIES:
        for case in ("slow", "clean") if strategy == "ddp" else ("slow",):
            hooks = Hooks()
            if case == "slow":
                attach(hooks, rank=1, phase="optimizer", seconds=SLOW_S)
            cfg = TrainConfig(strategy=strategy, nproc=2, device="cpu", steps=7, seq_len=64, global_batch=16,
                              monitor=True, monitor_every=2, monitor_windows=2, timeout_s=60)
            run_dir = Path(out_dir) / f"{strategy}-{case}"
            run_dir.mkdir(parents=True, exist_ok=True)
            trainer = Trainer(cfg, rt, run_dir, quiet=True, hooks=hooks)
            trainer.fit()
            del trainer
    shutdown()


def main(out_dir: str) -> None:
    from paratrain.train.launch import run_workers

    run_workers(run_cases, (out_dir,), 2, 0, 60)


if __name__ == "__main__":
    main(sys.argv[1])
