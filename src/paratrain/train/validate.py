"""Checks a run config against the world it will run on, before any process starts or file is written."""

from __future__ import annotations

import os

from paratrain.config import TrainConfig
from paratrain.errors import UserError
from paratrain.train.data import BatchSource, make_dataset
from paratrain.train.runtime import pick_device_type


def world_size_for(cfg: TrainConfig) -> int:
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return 1 if cfg.strategy == "single" else cfg.nproc


def validate_run(cfg: TrainConfig, world_size: int):
    """Raise UserError naming the first problem; return the resolved ParallelDims."""
    from paratrain.train.trainer import dims_for, micro_batch_for, model_args_for

    pick_device_type(cfg.device)
    if cfg.strategy == "auto":
        raise UserError("--strategy auto must be resolved by the planner before validation")
    dims = dims_for(cfg, world_size)
    args = model_args_for(cfg)
    dims.check_model(args, cfg.seq_len, cfg.virtual_stages)
    dataset = make_dataset(cfg.data, args.vocab_size, cfg.seq_len, cfg.seed)
    BatchSource(dataset, cfg.global_batch, 0, dims.dp, micro_batch_for(cfg, dims))
    if cfg.ckpt_every and cfg.ckpt_every > cfg.steps:
        raise UserError(f"--ckpt-every {cfg.ckpt_every} is larger than --steps {cfg.steps}: no checkpoint would be saved")
    return dims
