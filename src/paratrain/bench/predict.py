"""The planner's prediction for one concrete run config, for bench and doctor to show next to measurements.

The config becomes a plan Layout (the planner's description of a strategy), which plan/memory.py and
plan/time.py evaluate on this machine's hardware profile: the calibrated one when `paratrain plan
--calibrate` has saved it, else the catalog entry (a rough placeholder on CPU).
"""

from __future__ import annotations

import logging

log = logging.getLogger("paratrain")


def layout_for(cfg, world_size: int):
    """The plan Layout that runs exactly this config."""
    from paratrain.plan.layout import Layout, zero_stage_of
    from paratrain.train.trainer import dims_for, micro_batch_for

    dims = dims_for(cfg, world_size)
    micro = micro_batch_for(cfg, dims)
    if dims.pp > 1:
        microbatches = cfg.microbatches or dims.pp
    else:
        microbatches = max(1, cfg.global_batch // dims.dp // micro)
    return Layout(pp=dims.pp, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, cp=dims.cp, tp=dims.tp,
                  zero_stage=zero_stage_of(cfg.strategy) if dims.dp > 1 else 0,
                  sp=(cfg.sp or cfg.strategy == "tp-sp") and dims.tp > 1,
                  cp_impl="ulysses" if cfg.strategy == "cp-ulysses" else cfg.cp_impl,
                  pp_schedule=cfg.pp_schedule, virtual_stages=cfg.virtual_stages, micro_batch=micro,
                  microbatches=microbatches, ac=cfg.ac)


def predict_layout(cfg, world_size: int) -> dict | None:
    """{"step_time_s", "mem_gib", "comm_bytes", "hardware"} the planner predicts for this config, or None
    when the planner cannot evaluate it (then bench and doctor show measurements only)."""
    try:
        from paratrain.plan.auto import auto_hardware
        from paratrain.plan.memory import estimate_memory
        from paratrain.plan.time import estimate_time
        from paratrain.train.runtime import pick_device_type
        from paratrain.train.trainer import model_args_for

        layout = layout_for(cfg, world_size)
        args = model_args_for(cfg)
        device_type = pick_device_type(cfg.device)
        profile, where = auto_hardware(cfg.device)
        memory = estimate_memory(args, layout, cfg.seq_len, cfg.dtype, device_type)
        time = estimate_time(profile, args, layout, cfg.seq_len, cfg.dtype, device_type)
    except Exception as exc:  # noqa: BLE001 - a prediction is optional; measurements still stand
        log.debug("no planner prediction for %s x %d: %s", cfg.strategy, world_size, exc)
        return None
    return {"step_time_s": time.step_s, "mem_gib": memory.total / 2**30, "comm_bytes": time.comm_bytes,
            "hardware": where, "layout": layout.label()}
