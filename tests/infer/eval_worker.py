# `paratrain eval` under every strategy, inside the suite's shared process groups (tests/groups.py, dp_worker.py):
# the 2-rank group trains tiny4 under tp (and moe-tiny under ep) with validation at the saved step, then evaluates
# each checkpoint under every 2-rank layout and on one device; the 4-rank group evaluates the tiny4 checkpoint under
# its meshes. tests/infer/test_eval_layouts.py compares every loss with the training run's own val_loss.
"""run_checks(rt, root) -> {"val_loss", "not_loaded", "moe", "evals", "tokens", "checkpoints", "degrees"} on every
rank."""

from __future__ import annotations

import gc
from pathlib import Path

from paratrain.config import TrainConfig
from paratrain.infer.eval_run import eval_config, eval_rank
from paratrain.infer.source_loader import load_for_inference
from paratrain.parallel.strategies import resolve_layout
from paratrain.train.evaluate import evaluate
from paratrain.train.trainer import Trainer

RUN = {"model": "tiny4", "global_batch": 8, "seq_len": 32, "val_batches": 2, "device": "cpu", "timeout_s": 120.0}
SAVED_AT = 2
LAYOUTS = {
    2: {"single": {"strategy": "single", "nproc": 1}, "ddp": {"strategy": "ddp"}, "zero1": {"strategy": "zero1"},
        "zero2": {"strategy": "zero2"}, "zero3": {"strategy": "zero3"}, "tp": {"strategy": "tp"},
        "tp-sp": {"strategy": "tp-sp"}, "pp": {"strategy": "pp", "microbatches": 2},
        "cp-ring": {"strategy": "cp-ring"},
        # uneven: 5 and 3 of each global batch's 8 sequences; every sample on exactly one rank
        "ddp-5:3": {"strategy": "ddp", "dp_batch_split": "5:3"},
        "as-saved": {}},  # no layout flag: the layout the checkpoint was saved under (tp=2)
    4: {"fsdp2xtp2": {"strategy": "tp", "dp_shard": 2, "tp": 2}, "hsdp2x2": {"strategy": "hsdp", "dp_replicate": 2,
                                                                             "dp_shard": 2},
        "ddp-5:1:1:1": {"strategy": "ddp", "dp_batch_split": "5:1:1:1"}},
}
MOE = {"model": "moe-tiny", "global_batch": 8, "seq_len": 32, "val_batches": 2, "device": "cpu", "timeout_s": 120.0}


def train_and_save(rt, run: dict, ckpt_dir: Path, **layout) -> float:
    """SAVED_AT steps with validation at the last one, saved there: that validation's loss."""
    cfg = TrainConfig(**run, **layout, nproc=rt.world_size, steps=SAVED_AT, eval_every=SAVED_AT, ckpt_every=SAVED_AT,
                      ckpt_dir=str(ckpt_dir), resume="never", metrics=False)
    trainer = Trainer(cfg, rt, quiet=True)
    val_loss = trainer.fit()["val_loss"]
    del trainer
    gc.collect()
    return val_loss


def eval_under(rt, step_dir: Path, run: dict, layout: dict) -> dict:
    """eval's own path: the CLI's config (resolve_source), each rank's load, each rank's evaluation."""
    flags = {k: v for k, v in run.items() if k != "model"}
    cfg = eval_config(str(step_dir), {**flags, **({"nproc": rt.world_size} if layout else {}), **layout})
    world = 1 if cfg.strategy == "single" else rt.world_size  # one device: each rank a whole copy
    loaded = load_for_inference(cfg, rt, resolve_layout(cfg, world))
    doc = eval_rank(loaded)
    del loaded
    gc.collect()
    return doc


def not_loaded(rt, run: dict) -> float:
    """Fault injected: the same eval at fresh weights (the checkpoint not read); the comparison must see it."""
    cfg = TrainConfig(**run, nproc=rt.world_size, strategy="ddp", eval_every=1, resume="never", metrics=False)
    trainer = Trainer(cfg, rt, quiet=True)
    loss = evaluate(trainer)
    del trainer
    gc.collect()
    return loss


def run_checks(rt, root: Path) -> dict:
    out = {}
    step_dir = root / "tiny4" / f"step-{SAVED_AT}"
    if rt.world_size == 2:
        out["val_loss"] = train_and_save(rt, RUN, root / "tiny4", strategy="tp")
        out["not_loaded"] = not_loaded(rt, RUN)
        moe_val = train_and_save(rt, MOE, root / "moe", strategy="ep")
        moe_step = root / "moe" / f"step-{SAVED_AT}"
        out["moe"] = {"val_loss": moe_val, "evals": {name: eval_under(rt, moe_step, MOE, layout)["loss"] for name, layout
                                                     in {"ep": {"strategy": "ep"}, "single": {"strategy": "single",
                                                                                               "nproc": 1}}.items()}}
    docs = {name: eval_under(rt, step_dir, RUN, layout) for name, layout in LAYOUTS[rt.world_size].items()}
    out["evals"] = {name: doc["loss"] for name, doc in docs.items()}
    out["tokens"] = {name: doc["tokens"] for name, doc in docs.items()}
    out["checkpoints"] = {name: doc["checkpoint"] for name, doc in docs.items()}
    out["degrees"] = {name: {k: v for k, v in doc["layout"].items() if k in ("dp_replicate", "dp_shard", "tp", "pp",
                                                                             "cp")} for name, doc in docs.items()}
    return out
