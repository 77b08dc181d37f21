# Resharding, in ONE launch of 2 ranks (gloo, CPU): a checkpoint saved at layout A resumes at layout B with the
# same next-step loss as resuming at A. Pairs: dp_shard2 -> single, tp2 -> dp_shard2, pp2 -> single.
"""Usage: torchrun --standalone --nproc-per-node 2 reshard_worker.py DIR -> rank 0 prints one JSON line."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

from paratrain.config import TrainConfig
from paratrain.parallel.strategies import resolve_layout
from paratrain.train.runtime import init_runtime, shutdown
from paratrain.train.trainer import Trainer

LAYOUTS = {"dp_shard2": {"strategy": "zero3"}, "tp2": {"strategy": "tp"}, "pp2": {"strategy": "pp", "microbatches": 2},
           "single": {"strategy": "single"}}
PAIRS = [("dp_shard2", "single"), ("tp2", "dp_shard2"), ("pp2", "single")]


def config(rt, root: Path, name: str, resume: str) -> TrainConfig:
    return TrainConfig(**{"nproc": rt.world_size, "device": "cpu", "steps": 3, "metrics": False, "model": "tiny4",
                          "global_batch": 8, "seq_len": 32, "timeout_s": 60.0, "resume": resume,
                          "ckpt_dir": str(root / name), **LAYOUTS[name]})


def trainer_for(rt, cfg: TrainConfig) -> Trainer:
    world = 1 if cfg.strategy == "single" else rt.world_size
    return Trainer(cfg, rt, quiet=True, layout=resolve_layout(cfg, world))


def next_loss(rt, root: Path, saved_at: str, resume_at: str) -> float:
    trainer = trainer_for(rt, config(rt, root, resume_at, str(root / saved_at / "step-2")))
    trainer.maybe_resume()
    assert trainer.step == 2
    loss = trainer.train_step(trainer.source.next_step())["loss"]
    del trainer
    gc.collect()
    return loss


def fresh_loss(rt, root: Path, layout: str) -> float:
    """Fault injected: the same step 3 at the new layout without loading the checkpoint (fresh weights)."""
    trainer = trainer_for(rt, config(rt, root, layout, "never"))
    trainer.source.step = 2
    loss = trainer.train_step(trainer.source.next_step())["loss"]
    del trainer
    gc.collect()
    return loss


def main() -> None:
    rt = init_runtime("cpu", 60.0)
    out = run_checks(rt, Path(sys.argv[1]))
    if rt.is_main:
        print(json.dumps(out), flush=True)
    shutdown()


def run_checks(rt, root: Path) -> dict:
    """Every pair, in the current 2-rank group (the suite runs them in tests/groups.py's shared one)."""
    out = {}
    for name in sorted({a for a, _ in PAIRS}):
        trainer = trainer_for(rt, config(rt, root, name, "never"))
        for _ in range(2):
            trainer.train_step(trainer.source.next_step())
        trainer.save_checkpoint()
        del trainer
        gc.collect()
    for a, b in PAIRS:
        out[f"{a}->{b}"] = {"original": next_loss(rt, root, a, a), "resharded": next_loss(rt, root, a, b),
                            "not_loaded": fresh_loss(rt, root, b)}
    return out


if __name__ == "__main__":
    main()
