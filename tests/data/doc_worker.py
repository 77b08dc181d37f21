# The checks of tests/data that need a process group, in ONE 2-rank launch (gloo, CPU).
"""Usage: torchrun --standalone --nproc-per-node 2 doc_worker.py SPEC.json -> rank 0 prints one JSON line.

SPEC: {"base": {TrainConfig fields}, "masks": [{"id", "strategy", "fault": bool, ...}],
       "fits": [{"id", "strategy", ...}], "vals": [{"id", "strategy", ...}], "verifies": [{"id", "strategy", ...}]}
masks: the first step's loss of packed rows under each strategy (every document's loss alone is the reference,
computed on rank 0 on one device). fits: per-step losses of an uninterrupted run (the SIGKILL tests' reference).
vals: val_loss after 2 steps. verifies: `paratrain verify`'s report (passed, first divergence) on packed rows.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
import torch.nn.functional as F

from paratrain.config import TrainConfig
from paratrain.models.hf_files import is_hf_model
from paratrain.models.hf_model import build_hf_model
from paratrain.models.presets import build_model, model_args_for
from paratrain.parallel.strategies import resolve_layout
from paratrain.train.data.packing import IGNORE
from paratrain.train.data.source import make_train_data
from paratrain.train.hooks import Hooks
from paratrain.train.runtime import init_runtime, shutdown
from paratrain.train.trainer import Trainer
from paratrain.train.validate import validate_run
from paratrain.verify.parity import verify_in_group


def document_alone_loss(model, rows: dict) -> float:
    """The mean over the real targets of every document of every row, each document run alone (no mask)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for r in range(rows["inputs"].shape[0]):
            docs = rows["doc_ids"][r]
            for d in np.unique(docs):
                idx = np.flatnonzero(docs == d)
                logits = model(torch.from_numpy(rows["inputs"][r, idx])[None])
                targets = torch.from_numpy(rows["targets"][r, idx])
                total += F.cross_entropy(logits[0], targets, reduction="sum").item()
                count += int((targets != IGNORE).sum())
    return total / count


def reference_model(cfg: TrainConfig):
    if is_hf_model(cfg.model):
        return build_hf_model(cfg.model, cfg.seed).eval()
    return build_model(model_args_for(cfg), "cpu", seed=cfg.seed).eval()


def trainer_for(rt, cfg: TrainConfig, fault: bool = False) -> Trainer:
    hooks = Hooks()
    if fault:
        from support.drop_doc_mask import plugin

        plugin(hooks)
    if cfg.strategy == "single":  # the one-device run inside the group: rank 0 alone
        return Trainer(cfg, rt, quiet=True, hooks=hooks, layout=resolve_layout(cfg, 1))
    validate_run(cfg, rt.world_size)
    return Trainer(cfg, rt, quiet=True, hooks=hooks)


def first_step_loss(rt, cfg: TrainConfig, fault: bool) -> float:
    trainer = trainer_for(rt, cfg, fault)
    loader = trainer.source.prefetcher()
    try:
        return trainer.train_step(loader.next_step()[0])["loss"]
    finally:
        loader.close()


def run(spec: dict) -> dict | None:
    """SPEC's cases in this process group: rank 0's results (None on the other ranks)."""
    rt = init_runtime("cpu", 120.0)
    base = {"nproc": rt.world_size, "device": "cpu", "metrics": False, "resume": "never", "timeout_s": 120.0,
            **spec["base"]}
    out: dict = {"masks": {}, "fits": {}, "vals": {}, "verifies": {}}
    try:
        for case in spec["masks"]:
            fields = {k: v for k, v in case.items() if k not in ("id", "fault")}
            cfg = TrainConfig(**{**base, "steps": 1, **fields})
            if case["strategy"] == "single" and rt.rank != 0:
                continue
            loss = first_step_loss(rt, cfg, case.get("fault", False))
            if rt.is_main:
                rows = make_train_data(cfg, model_args_for(cfg).vocab_size).open().next_global_batch(cfg.global_batch)
                model = reference_model(cfg)
                _, cols = np.nonzero(np.diff(rows["doc_ids"], axis=1))
                chunk = cfg.seq_len // 4  # cp=2: the ring's blocks are chunks of seq/4 (parallel/cp/ring_attention.py)
                out["masks"][case["id"]] = {"loss": loss, "reference": document_alone_loss(model, rows),
                                            "boundaries": len(cols),
                                            "inside_ring_blocks": int(((cols + 1) % chunk != 0).sum())}
        for case in spec["fits"]:
            cfg = TrainConfig(**{**base, **{k: v for k, v in case.items() if k != "id"}})
            validate_run(cfg, rt.world_size)
            summary = Trainer(cfg, rt, quiet=True).fit()
            out["fits"][case["id"]] = {"losses": summary["losses"], "tokens_per_source": summary["tokens_per_source"]}
        for case in spec["vals"]:
            cfg = TrainConfig(**{**base, **{k: v for k, v in case.items() if k != "id"}})
            if case["strategy"] == "single" and rt.rank != 0:
                continue
            summary = trainer_for(rt, cfg).fit()
            out["vals"][case["id"]] = summary["val_loss"]
        for case in spec.get("verifies", []):
            cfg = TrainConfig(**{**base, **{k: v for k, v in case.items() if k != "id"}})
            validate_run(cfg, rt.world_size)
            report = verify_in_group(cfg, rt)
            if rt.is_main:
                out["verifies"][case["id"]] = {"passed": report["passed"], "steps": report["steps"],
                                               "first_divergence": report["first_divergence"]}
    finally:
        shutdown()
    return json.loads(json.dumps(out)) if rt.is_main else None  # plain data, as a JSON line would carry


def main() -> None:
    out = run(json.loads(open(sys.argv[1]).read()))
    if out is not None:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
