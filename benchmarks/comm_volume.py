"""Measured data-parallel traffic per optimizer step against the theoretical optimum, side by side.

Measured: paratrain.parallel.collective_bytes.count_collectives over real training steps (DDP reducer, FSDP2, ZeRO
broadcasts, plus the loss and grad-norm scalars), as ring "wire" bytes per rank. Optimum (Rajbhandari et al.
2020, ZeRO): ring all-reduce of the gradients moves 2(N-1)/N * Psi * b bytes per rank; ZeRO-1 and ZeRO-2
move the same (reduce-scatter + all-gather); ZeRO-3 adds one more all-gather: 1.5x. torch's ZeRO-1
(ZeroRedundancyOptimizer) keeps DDP's full all-reduce and then broadcasts each shard, so its own algorithm's
optimum is 3(N-1)/N * Psi * b; that column is printed too.
Run: python benchmarks/comm_volume.py [--model tiny] [--nproc 2,4] [--steps 2]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
# wire bytes per rank as a multiple of (N-1)/N * Psi * b
PAPER_OPTIMUM = {"ddp": 2.0, "zero1": 2.0, "zero2": 2.0, "zero3": 3.0}
ALGORITHM_OPTIMUM = {"ddp": 2.0, "zero1": 3.0, "zero2": 2.0, "zero3": 3.0}


def measure_worker(cfg_dict: dict, warmup: int, steps: int) -> dict | None:
    """Train `warmup` steps (DDP rebuilds its buckets, FSDP initialises lazily), then count `steps` steps."""
    from paratrain.config import TrainConfig
    from paratrain.models.presets import count_params
    from paratrain.parallel.collective_bytes import count_collectives
    from paratrain.train.runtime import init_runtime, shutdown
    from paratrain.train.trainer import Trainer

    cfg = TrainConfig(**cfg_dict)
    rt = init_runtime("cpu", cfg.timeout_s)
    trainer = Trainer(cfg, rt, quiet=True)
    for _ in range(warmup):
        trainer.train_step(trainer.source.next_step())
    with count_collectives() as stats:
        for _ in range(steps):
            trainer.train_step(trainer.source.next_step())
    result = {**stats.per_step(steps), "params": count_params(trainer.args)}
    trainer = None  # free DDP's reducer while the groups are registered (see train/worker.py)
    gc.collect()
    shutdown()
    return result if rt.is_main else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--nproc", default="2,4")
    parser.add_argument("--steps", type=int, default=2)
    ns = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from paratrain.config import TrainConfig
    from paratrain.train.launch import run_workers

    rows = []
    for world in (int(n) for n in ns.nproc.split(",")):
        for strategy in STRATEGIES:
            cfg = TrainConfig(model=ns.model, strategy=strategy, nproc=world, device="cpu", steps=100,
                              timeout_s=300, metrics=False)
            out = run_workers(measure_worker, (cfg.model_dump(), 2, ns.steps), world, 0, cfg.timeout_s)[0]
            unit = (world - 1) / world * out["params"] * 4  # fp32 gradients and parameters: b = 4
            rows.append((strategy, world, out, unit))
            print(f"... {strategy} x{world} done", file=sys.stderr, flush=True)

    print(f"model {ns.model}: Psi = {rows[0][2]['params']:,} parameters, b = 4 bytes (fp32), "
          f"{ns.steps} measured step(s); bytes are per rank per optimizer step")
    header = (f"{'strategy':<8} {'N':>2} {'payload B':>11} {'wire B':>11} {'optimum B':>11} {'ratio':>6}  "
              f"{'torch-algo B':>12} {'ratio':>6}  by op (payload bytes)")
    print(header)
    print("-" * len(header))
    for strategy, world, out, unit in rows:
        paper, algo = PAPER_OPTIMUM[strategy] * unit, ALGORITHM_OPTIMUM[strategy] * unit
        wire = out["total_wire_bytes"]
        ops = ", ".join(f"{k} {v:,}" for k, v in out["bytes_by_op"].items())
        print(f"{strategy:<8} {world:>2} {out['total_bytes']:>11,.0f} {wire:>11,.0f} {paper:>11,.0f} "
              f"{wire / paper:>6.3f}  {algo:>12,.0f} {wire / algo:>6.3f}  {ops}")


if __name__ == "__main__":
    main()
