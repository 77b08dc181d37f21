"""Checks a run config against the world it will run on, before any process starts or file is written."""

from __future__ import annotations

import os

from paratrain.config import TrainConfig
from paratrain.errors import UserError
from paratrain.parallel.data_parallel import check_dp_options
from paratrain.parallel.dims import check_tp_divides
from paratrain.train.data import BatchSource, make_dataset
from paratrain.train.memory_snapshot import check_memory_snapshot
from paratrain.train.runtime import pick_device_type


def world_size_for(cfg: TrainConfig) -> int:
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return 1 if cfg.strategy == "single" else cfg.nproc


def validate_run(cfg: TrainConfig, world_size: int):
    """Raise UserError naming the first problem; return the resolved ParallelDims."""
    from paratrain.train.trainer import dims_for, micro_batch_for, model_args_for

    check_memory_snapshot(cfg.memory_snapshot, pick_device_type(cfg.device))
    if cfg.strategy == "auto":
        raise UserError("--strategy auto must be resolved by the planner before validation")
    args = model_args_for(cfg)
    if cfg.tp:  # a model tp cannot split is the root problem, whatever the world size
        check_tp_divides(args, cfg.tp)
    dims = dims_for(cfg, world_size)
    dims.check_model(args, cfg.seq_len, cfg.virtual_stages)
    if dims.tp_enabled:
        from paratrain.parallel.tensor_parallel import check_tp_layout

        check_tp_layout(dims)
    if dims.cp_enabled:
        from paratrain.parallel.context_parallel import check_cp
        from paratrain.parallel.options import ParallelOptions

        check_cp(args, dims, ParallelOptions.from_config(cfg, "cpu").cp_impl)
    if dims.pp_enabled:
        from paratrain.parallel.pipeline_split import check_pipeline_layout

        check_pipeline_layout(cfg.strategy, cfg.pp_schedule, dims.pp, cfg.virtual_stages, args.n_layers,
                              cfg.global_batch, dims.dp, cfg.microbatches, cfg.micro_batch, dims.cp, cfg.dtype)
    dataset = make_dataset(cfg.data, args.vocab_size, cfg.seq_len, cfg.seed)
    BatchSource(dataset, cfg.global_batch, 0, dims.dp, micro_batch_for(cfg, dims))
    check_dp_options(cfg.strategy, dims, pick_device_type(cfg.device), cfg.ddp_comm_hook, cfg.local_sgd_period,
                     cfg.cpu_offload)
    if cfg.ckpt_every and cfg.ckpt_every > cfg.steps:
        raise UserError(f"--ckpt-every {cfg.ckpt_every} is larger than --steps {cfg.steps}: no checkpoint would be saved")
    return dims
