# `paratrain generate` under every layout, inside the suite's shared process groups (tests/groups.py, dp_worker.py's
# "generate"): the 2-rank group trains tiny (ddp) and moe-tiny (ep) on the Markov data and saves them, then
# generates the same prompts on one device and under tp, dp (ddp), dp_shard (zero3) and ep, greedy (with the KV
# cache, and under tp without) and sampled (dp, ep), and runs verify --generate's comparison clean and with a fault
# planted through the next_token_logits hook (tests/support/generate_faults.py); the 4-rank group generates from
# the tiny checkpoint under dp_shard 2 x tp 2 (greedy and sampled) and dp=4. Pipeline generation (issue 50): pp=2
# greedy with and without the KV cache and sampled, pp 2 x dp_shard 2 greedy (4 ranks), and verify --generate under
# pp=2 and pp 2 x dp_shard 2 (its default prompts give one replica a filler micro-batch and a filler round).
# tests/infer/test_generate_layouts.py compares every output with one device's.
"""run_checks(rt, root) -> {"cases": {name: [outputs]}, "new_tokens", "prompts", "verify": {"clean", "fault", "pp"}
(4 ranks: {"pp2xdp_shard2"})} on rank 0 (None elsewhere)."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

from paratrain.config import TrainConfig
from paratrain.infer.generate import GenerateOptions
from paratrain.infer.generate_run import default_prompts, generate_in_group
from paratrain.infer.prompts import Prompt, to_prompts
from paratrain.infer.sampling import Sampling
from paratrain.infer.source_loader import load_for_inference, resolve_source
from paratrain.parallel.strategies import resolve_layout
from paratrain.train.hooks import default_hooks
from paratrain.train.trainer import Trainer
from paratrain.verify.generate_parity import verify_generate_rank

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: support.*

from support.generate_faults import FAULT_STEP, flip_runner_up  # noqa: E402

TRAIN = {"global_batch": 8, "seq_len": 32, "lr": 0.01, "device": "cpu", "timeout_s": 120.0, "metrics": False}
TRAINED_STEPS = {"tiny": 30, "moe": 20}
NEW_TOKENS = 32
# a batch of 4: four prompts of one length
PROMPTS = [[17, 3, 250, 96, 41, 8, 77, 120], [5, 5, 5, 5, 5, 5, 5, 5], [201, 13, 64, 2, 190, 33, 7, 99],
           [0, 1, 2, 3, 4, 5, 6, 7]]
GREEDY = GenerateOptions(NEW_TOKENS)
SAMPLED = GenerateOptions(NEW_TOKENS, Sampling(temperature=0.8, top_k=40, top_p=0.9, seed=7))
NO_CACHE = GenerateOptions(NEW_TOKENS, use_cache=False)
VERIFY = GenerateOptions(8)  # the planted fault acts at step FAULT_STEP
SINGLE = {"strategy": "single", "nproc": 1}
PP = {"strategy": "pp"}
PP_FSDP = {"strategy": "pp", "pp": 2, "dp_shard": 2}
# name -> (checkpoint, layout flags, options)
CASES = {
    2: {"single": ("tiny", SINGLE, GREEDY), "tp": ("tiny", {"strategy": "tp"}, GREEDY),
        "dp": ("tiny", {"strategy": "ddp"}, GREEDY), "dp_shard": ("tiny", {"strategy": "zero3"}, GREEDY),
        "tp-no-cache": ("tiny", {"strategy": "tp"}, NO_CACHE),
        "single-sampled": ("tiny", SINGLE, SAMPLED), "dp-sampled": ("tiny", {"strategy": "ddp"}, SAMPLED),
        "moe-single": ("moe", SINGLE, GREEDY), "moe-ep": ("moe", {"strategy": "ep", "ep": 2}, GREEDY),
        "moe-single-sampled": ("moe", SINGLE, SAMPLED), "moe-ep-sampled": ("moe", {"strategy": "ep", "ep": 2}, SAMPLED),
        # a batch of 4 cut into 2 micro-batches, one a stage (infer/pipeline_generate.py)
        "pp": ("tiny", PP, GREEDY), "pp-no-cache": ("tiny", PP, NO_CACHE), "pp-sampled": ("tiny", PP, SAMPLED)},
    # against the 2-rank group's one-device outputs (the same checkpoint and prompts)
    4: {"dp_shard2xtp2": ("tiny", {"strategy": "tp", "dp_shard": 2, "tp": 2}, GREEDY),
        "dp_shard2xtp2-sampled": ("tiny", {"strategy": "tp", "dp_shard": 2, "tp": 2}, SAMPLED),
        "dp4": ("tiny", {"strategy": "ddp"}, GREEDY),
        "pp2xdp_shard2": ("tiny", PP_FSDP, GREEDY)},
}


def train_and_save(rt, ckpt_dir: Path, steps: int, **run) -> None:
    cfg = TrainConfig(**TRAIN, **run, nproc=rt.world_size, steps=steps, ckpt_every=steps, ckpt_dir=str(ckpt_dir),
                      resume="never")
    trainer = Trainer(cfg, rt, quiet=True)
    trainer.fit()
    del trainer
    gc.collect()


def source_config(rt, step_dir: Path, layout: dict) -> TrainConfig:
    """generate's own path: the CLI's config of the checkpoint (resolve_source) with the layout's flags."""
    flags = {k: v for k, v in TRAIN.items() if k not in ("lr", "metrics")}
    return resolve_source(str(step_dir), {**flags, "nproc": rt.world_size, **layout})


def generate_case(rt, step_dir: Path, layout: dict, options: GenerateOptions, prompts: list[Prompt]) -> list | None:
    cfg = source_config(rt, step_dir, layout)
    world = 1 if cfg.strategy == "single" else rt.world_size  # one device: each rank a whole copy
    result = generate_in_group(cfg, rt, prompts, options, resolve_layout(cfg, world))
    return None if result is None else result["outputs"]


def verify_run(rt, step_dir: Path, fault: bool, layout: dict | None = None) -> dict | None:
    """verify --generate's comparison (default: dp_shard=2 against one device, its default prompts), with the fault
    planted or not. The default prompts' lengths (6, 6, 6, 9) give rank 0 one batch and rank 1 two: rank 0 decodes a
    filler round, its forwards joining rank 1's parameter all-gathers."""
    cfg = source_config(rt, step_dir, layout or {"strategy": "zero3"})
    prompts = to_prompts(default_prompts(cfg), 256, None)
    handle = default_hooks().next_token_logits(flip_runner_up(FAULT_STEP)) if fault else None
    loaded = load_for_inference(cfg, rt)
    try:
        return verify_generate_rank(loaded, [p.to_dict() for p in prompts], VERIFY)
    finally:
        if handle is not None:
            handle.remove()
        del loaded
        gc.collect()


def run_checks(rt, root: Path) -> dict | None:
    ckpts = {name: root / name / f"step-{steps}" for name, steps in TRAINED_STEPS.items()}
    out = {"cases": {}, "new_tokens": NEW_TOKENS, "prompts": len(PROMPTS)}
    if rt.world_size == 2:
        train_and_save(rt, root / "tiny", TRAINED_STEPS["tiny"], strategy="ddp")
        train_and_save(rt, root / "moe", TRAINED_STEPS["moe"], model="moe-tiny", strategy="ep", ep=2)
    prompts = [Prompt(i, tuple(ids)) for i, ids in enumerate(PROMPTS)]
    for name, (ckpt, layout, options) in CASES[rt.world_size].items():
        out["cases"][name] = generate_case(rt, ckpts[ckpt], layout, options, prompts)
    if rt.world_size == 2:
        out["verify"] = {"clean": verify_run(rt, ckpts["tiny"], fault=False),
                         "fault": verify_run(rt, ckpts["tiny"], fault=True),
                         "pp": verify_run(rt, ckpts["tiny"], fault=False, layout=PP)}
    else:
        out["verify"] = {"pp2xdp_shard2": verify_run(rt, ckpts["tiny"], fault=False, layout=PP_FSDP)}
    return out if rt.is_main else None
