"""Checks a run config against the world it will run on, before any process starts or file is written."""

from __future__ import annotations

import logging
import os

from paratrain.config import TrainConfig
from paratrain.errors import UserError
from paratrain.models.hf_files import is_hf_model, read_hf_config
from paratrain.models.lora import lora_spec_for
from paratrain.models.presets import model_args_for
from paratrain.models.speed import model_speed_for
from paratrain.parallel.checks import check_layout
from paratrain.parallel.layout import Layout
from paratrain.parallel.semi_sync.islands import check_semi_sync
from paratrain.parallel.strategies import resolve_layout, world_size_of
from paratrain.parallel.tp.tp_technique import check_tp_divides, check_tp_speed
from paratrain.train.capacity import check_fits_machine
from paratrain.train.data.source import make_train_data
from paratrain.train.hf_run_checks import check_hf_run, warn_unapplied_balancing_loss
from paratrain.train.loss_choice import check_fused_loss
from paratrain.train.lr_schedules import check_schedule
from paratrain.train.memory_snapshot import check_memory_snapshot
from paratrain.train.optim import check_optimizer_options
from paratrain.train.optimizer_graph import check_optimizer_graph
from paratrain.train.param_copies import check_bf16_param_copies
from paratrain.train.precision import check_precision
from paratrain.train.runtime import pick_device_type

log = logging.getLogger("paratrain")


def world_size_for(cfg: TrainConfig) -> int:
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return world_size_of(cfg.strategy, cfg.nproc)


def validate_run(cfg: TrainConfig, world_size: int) -> Layout:
    """Raise UserError naming the first problem; return the resolved Layout (what the workers will run)."""
    device_type = pick_device_type(cfg.device)
    check_memory_snapshot(cfg.memory_snapshot, device_type)
    if cfg.strategy == "auto":
        raise UserError("--strategy auto must be resolved by the planner before validation")
    args = model_args_for(cfg)
    check_fits_machine(args, cfg.seq_len, world_size, device_type)
    if cfg.tp:  # a model tp cannot split is the root problem, whatever the world size
        check_tp_divides(args, cfg.tp)
    layout = resolve_layout(cfg, world_size)
    check_semi_sync(cfg, layout)  # before the layout's checks: they would name DDP where islands run none
    check_layout(layout, args, cfg.seq_len, cfg.global_batch, device_type)
    check_tp_speed(model_speed_for(cfg), layout.tp)
    check_fused_loss(cfg, layout, hf=is_hf_model(cfg.model))
    if is_hf_model(cfg.model):  # what a transformers model cannot run, before any process starts
        check_hf_run(layout, cfg, args)
        warn_past_trained_positions(cfg)
        warn_unapplied_balancing_loss(layout, cfg)
    check_precision(cfg, layout, device_type)
    check_optimizer_graph(cfg, layout)
    check_optimizer_options(cfg)
    check_schedule(cfg)
    if cfg.deepspeed:
        from paratrain.interop.deepspeed_config import check_deepspeed_batch

        check_deepspeed_batch(cfg.deepspeed, cfg.global_batch, cfg.micro_batch, layout.dp)
    check_bf16_param_copies(cfg, layout)
    lora_spec_for(cfg, hf=is_hf_model(cfg.model))  # --lora-* refusals before any process starts (models/lora.py)
    make_train_data(cfg, args.vocab_size).check()
    from paratrain.train.evaluate import build_validator

    validator = build_validator(cfg, args.vocab_size)
    if validator is not None and hasattr(validator, "data"):  # document validation: its files and tokenizer
        validator.data.check()
    if cfg.init_from:
        from paratrain.interop.hf_import import check_hf_dir

        check_hf_dir(cfg.init_from, args)
    if cfg.ckpt_every and cfg.ckpt_every > cfg.steps:
        raise UserError(f"--ckpt-every {cfg.ckpt_every} is larger than --steps {cfg.steps}: no checkpoint would be saved")
    return layout


def warn_past_trained_positions(cfg: TrainConfig) -> None:
    """One warning when --seq-len runs a RoPE model past its max_position_embeddings. (A learned position
    table, GPT-2's n_positions, has no room beyond it: that is refused where the shape is read.)"""
    positions = read_hf_config(cfg.model).get("max_position_embeddings")
    if isinstance(positions, int) and cfg.seq_len > positions and os.environ.get("RANK", "0") == "0":
        log.warning("--seq-len %d is longer than the %d positions %s was trained on (max_position_embeddings): "
                    "fine from scratch, but pretrained weights may do worse past position %d",
                    cfg.seq_len, positions, cfg.model, positions)
