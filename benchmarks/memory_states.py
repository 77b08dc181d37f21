"""Measured per-rank model-state bytes (params + grads + optimizer states) against the ZeRO formulas.

Measured: paratrain.parallel.model_states (the tensors each rank really holds after a training step, plus
the unsharded parameters FSDP keeps from forward to backward), averaged over ranks. Formulas (Rajbhandari
et al. 2020), with this run's dtypes: P bytes per working parameter, G per gradient, K per parameter of
optimizer state (AdamW: m and v, 8 in fp32; plus a 4-byte fp32 master when the working copy is separate):
  DDP      (P + G + K) Psi
  stage 1  (P + G) Psi + K Psi / N          zero1: ZeroRedundancyOptimizer, K = 8
  stage 2  P Psi + (G + K) Psi / N          zero2: FSDP2 keeps the unsharded working params from forward
                                            to backward and a sharded fp32 master: K = 4 + 8
  stage 3  (P + G + K) Psi / N              zero3: the sharded params are the master, K = 8
Run: python benchmarks/memory_states.py [--model tiny] [--nproc 2,4]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

# strategy -> (stage, replicated coefficient, sharded coefficient) in bytes per parameter, fp32 AdamW
FORMULAS = {"ddp": ("DDP", 4 + 4 + 8, 0), "zero1": ("1", 4 + 4, 8), "zero2": ("2", 4, 4 + 4 + 8),
            "zero3": ("3", 0, 4 + 4 + 8)}


def measure_worker(cfg_dict: dict, steps: int) -> dict | None:
    from paratrain.config import TrainConfig
    from paratrain.models.presets import count_params
    from paratrain.train.runtime import init_runtime, shutdown
    from paratrain.train.trainer import Trainer

    cfg = TrainConfig(**cfg_dict)
    rt = init_runtime("cpu", cfg.timeout_s)
    trainer = Trainer(cfg, rt, quiet=True)
    for _ in range(steps):
        trainer.train_step(trainer.source.next_step())
    states, psi = trainer.verify_extras()["model_state_bytes"], count_params(trainer.args)
    trainer = None  # free DDP's reducer while the groups are registered (see train/worker.py)
    gc.collect()
    shutdown()
    return {**states, "params": psi} if rt.is_main else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--nproc", default="2,4")
    ns = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from paratrain.config import TrainConfig
    from paratrain.train.launch import run_workers

    rows = []
    for world in (int(n) for n in ns.nproc.split(",")):
        for strategy in FORMULAS:
            cfg = TrainConfig(model=ns.model, strategy=strategy, nproc=world, device="cpu", steps=100,
                              timeout_s=300, metrics=False)
            rows.append((strategy, world, run_workers(measure_worker, (cfg.model_dump(), 2), world, 0, 300)[0]))
            print(f"... {strategy} x{world} done", file=sys.stderr, flush=True)

    psi = rows[0][2]["params"]
    print(f"model {ns.model}: Psi = {psi:,} parameters, fp32 params and grads, AdamW; bytes per rank (mean over ranks)")
    header = (f"{'strategy':<8} {'stage':>5} {'N':>2} {'params B':>10} {'grads B':>10} {'optim B':>10} "
              f"{'total B':>10} {'formula B':>10} {'ratio':>6}")
    print(header)
    print("-" * len(header))
    for strategy, world, out in rows:
        stage, replicated, sharded = FORMULAS[strategy]
        formula = replicated * psi + sharded * psi / world
        mean = out["mean"]
        print(f"{strategy:<8} {stage:>5} {world:>2} {mean['params']:>10,.0f} {mean['grads']:>10,.0f} "
              f"{mean['optimizer']:>10,.0f} {mean['total']:>10,.0f} {formula:>10,.0f} {mean['total'] / formula:>6.3f}")


if __name__ == "__main__":
    main()
