"""`paratrain train --strategy auto`: plan for the machine this runs on and take the first feasible candidate.

The hardware is the calibrated profile when one exists (`paratrain plan --calibrate`), else the catalog entry
of the detected GPU; the world is --nproc. Degrees or options the user gave stay fixed. The choice and the
planner's reasons are logged, so the run says why it uses what it uses.
"""

from __future__ import annotations

import logging
import os

from paratrain.errors import UserError

log = logging.getLogger("paratrain")


def auto_hardware(device: str):
    from paratrain.costs.hardware import default_profile_path, detect, load_profile, profile_from_spec
    from paratrain.gpu_catalog import get_gpu

    machine = detect()
    use_cuda = device == "cuda" or (device == "auto" and machine["device"] == "cuda")
    path = os.environ.get("PARATRAIN_HARDWARE") or str(default_profile_path())
    if os.path.exists(path):
        profile = load_profile(path)
        kind = "cpu" if profile.gpu.name == "cpu" else "cuda"
        if kind == ("cuda" if use_cuda else "cpu"):
            return profile, f"calibrated profile {path}"
    if use_cuda:
        if not machine.get("gpu"):
            raise UserError(f"--strategy auto: GPU {machine.get('device_name')!r} is not in the catalog; run "
                            "`paratrain plan --calibrate` first (no other GPU's figures are used instead)")
        return profile_from_spec(get_gpu(machine["gpu"])), f"catalog {machine['gpu']}"
    return profile_from_spec(get_gpu("cpu")), "catalog cpu placeholder (calibrate for real figures)"


def plan_for_auto(cfg):
    """(job, profile, where the profile came from, feasible candidates fastest first) for `--strategy auto`."""
    import dataclasses

    from paratrain.models.presets import model_args_for
    from paratrain.parallel.strategies import given_degrees
    from paratrain.plan.gc_pause import gc_paused
    from paratrain.plan.search import Job, search
    from paratrain.train.validate import world_size_for

    world = world_size_for(cfg.model_copy(update={"strategy": "ddp"}))
    profile, where = auto_hardware(cfg.device)
    if profile.gpu.gpus_per_node < world:
        profile = dataclasses.replace(profile, gpu=dataclasses.replace(profile.gpu, gpus_per_node=world))
    args = model_args_for(cfg.model_copy(update={"strategy": "ddp"}))
    device_type = "cpu" if profile.gpu.name == "cpu" else "cuda"
    job = Job(args=args, model_name=cfg.model, gpus=world, seq_len=cfg.seq_len, global_batch=cfg.global_batch,
              dtype=cfg.dtype, device_type=device_type, lora=lora_of(cfg, args))
    if cfg.dtype not in profile.gpu.peak_tflops:
        raise UserError(f"--strategy auto: the hardware profile has no {cfg.dtype} figures")
    fixed = {**given_degrees(cfg), "micro_batch": cfg.micro_batch, "ac": cfg.ac if cfg.ac != "none" else None}
    with gc_paused():
        feasible, infeasible, _ = search(job, profile, fixed)
    if not feasible:
        closest = infeasible[0].memory.total / 2**30 if infeasible else float("nan")
        raise UserError(f"--strategy auto: no layout of {cfg.model} fits {world} x {profile.gpu.name} "
                        f"({profile.gpu.mem_gib:g} GiB each; the closest needs {closest:.1f} GiB); try more devices "
                        f"or `paratrain plan` for details")
    from paratrain.train.hooks import default_hooks

    # the auto_candidates hooks (train/hooks.py) may re-price or re-rank them; none does unless a plugin asks
    return job, profile, where, default_hooks().apply_auto_candidates(feasible)


def lora_of(cfg, args):
    """The run's LoRA adapters as the planner prices them (plan/inputs/lora_count.py); None without --lora-r."""
    from paratrain.lora_options import LORA_FIELDS
    from paratrain.models.hf_files import is_hf_model
    from paratrain.plan.inputs.lora_count import lora_choice

    if not cfg.lora_r:
        return None
    hf_source = cfg.model if is_hf_model(cfg.model) else None
    return lora_choice({k: getattr(cfg, k) for k in LORA_FIELDS}, cfg.dtype, hf_source, args)


def resolve_auto_strategy(cfg):
    """cfg with strategy 'auto' -> the same config with the planner's first feasible layout filled in."""
    job, profile, where, feasible = plan_for_auto(cfg)
    best = feasible[0]
    lay = best.layout
    from paratrain.plan.plan_report import explain

    log.info("--strategy auto (%s, %s): %s, micro-batch %d, ac %s; predicted %.3g s/step, %.2f GiB/device",
             where, f"{job.gpus} x {profile.gpu.name}", lay.label(), lay.micro_batch, lay.ac, best.time.step_s,
             best.memory.total / 2**30)
    for reason in explain(job, profile, best):
        log.info("  because: %s", reason)
    from paratrain.parallel.strategies import config_fields

    return cfg.model_copy(update={**config_fields(lay), "probe": 0})
