# Validation loss under every strategy, in ONE launch of 2 ranks (gloo, CPU): each strategy's val loss at
# the initial weights and after 2 training steps must equal a single-device trainer's (built on rank 0).
"""Usage: torchrun --standalone --nproc-per-node 2 val_worker.py -> rank 0 prints one JSON line."""

from __future__ import annotations

import gc
import json

import torch.distributed as dist

from paratrain.config import TrainConfig
from paratrain.parallel.strategies import resolve_layout
from paratrain.train.evaluate import evaluate
from paratrain.train.runtime import init_runtime, shutdown
from paratrain.train.trainer import Trainer

STRATEGIES = [{"strategy": "ddp"}, {"strategy": "zero3"}, {"strategy": "tp"}, {"strategy": "pp", "microbatches": 4},
              {"strategy": "cp-ring"}]


def config(rt, **overrides) -> TrainConfig:
    base = {"strategy": "ddp", "nproc": rt.world_size, "device": "cpu", "steps": 2, "metrics": False,
            "resume": "never", "timeout_s": 60.0, "eval_every": 1, "val_batches": 2, "global_batch": 8,
            "seq_len": 32, "model": "tiny4"}
    return TrainConfig(**{**base, **overrides})


def val_curve(trainer) -> list[float]:
    """Val loss at the initial weights, then after each of 2 training steps."""
    out = [evaluate(trainer)]
    for _ in range(2):
        trainer.train_step(trainer.source.next_step())
        out.append(evaluate(trainer))
    return out


def main() -> None:
    rt = init_runtime("cpu", 60.0)
    results = run_checks(rt)
    if rt.is_main:
        print(json.dumps(results), flush=True)
    gc.collect()
    shutdown()


def run_checks(rt) -> dict:
    """Every curve, in the current 2-rank group (the suite runs them in tests/groups.py's shared one)."""
    results = {}
    if rt.is_main:
        ref_cfg = config(rt, strategy="single")
        results["single"] = val_curve(Trainer(ref_cfg, rt, quiet=True, layout=resolve_layout(ref_cfg, 1)))
    for spec in STRATEGIES:
        trainer = Trainer(config(rt, **spec), rt, quiet=True)
        curve = val_curve(trainer)
        everyone = [None] * rt.world_size
        dist.all_gather_object(everyone, curve)
        results[spec["strategy"]] = everyone
        if spec["strategy"] == "ddp":  # fault injected: skip the cross-rank reduction; the comparison must see it
            trainer.global_loss = lambda local: float(local)
            unreduced = [None] * rt.world_size
            dist.all_gather_object(unreduced, evaluate(trainer))
            results["ddp_unreduced"] = unreduced
        del trainer
        gc.collect()
    return results


if __name__ == "__main__":
    main()
