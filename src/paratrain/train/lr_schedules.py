"""--lr-schedule: the learning rate of each optimizer step (docs/training-options.md).

cosine, linear, constant: paratrain's own. The warm-up the run always had (step s < W at lr x (s+1)/W), then down
to the floor (--min-lr) at --steps along a half cosine or a line, or flat at --lr.
warmup-log, warmup-decay, one-cycle, and cosine with a `warmup_type`: DeepSpeed's WarmupLR, WarmupDecayLR, OneCycle
and WarmupCosineLR, as its engine runs them. The engine builds its scheduler before the first step (which sets the
start value) and steps it after each optimizer step, so step s runs at the scheduler's value for iteration s - 1
(deepspeed/runtime/lr_schedules.py; engine.py, _take_model_step). Its warm-ups last max(2, W) iterations.
"""

from __future__ import annotations

import math

from paratrain.errors import UserError
from paratrain.train.optim import lr_at


def lr_at_step(cfg, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based) under the run config's schedule."""
    name, peak, warmup, total = cfg.lr_schedule, cfg.lr, cfg.warmup_steps, cfg.steps
    if name == "cosine" and cfg.warmup_type is None:  # the ratio itself when no --min-lr: bit-identical to before
        ratio = cfg.min_lr_ratio if cfg.min_lr is None else cfg.min_lr / peak
        return lr_at(step, peak, warmup, total, ratio)
    if name in ("linear", "constant"):
        if warmup and step < warmup:
            return peak * (step + 1) / warmup
        if name == "constant":
            return peak
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return cfg.floor_lr + (peak - cfg.floor_lr) * (1.0 - progress)
    i = step - 1  # DeepSpeed's last_batch_iteration when step `step` runs
    if name == "one-cycle":
        return one_cycle_lr(i, cfg.floor_lr, peak, warmup, cfg.cooldown_steps, cfg.decay_lr_rate, cfg.decay_step_size)
    kind = cfg.warmup_type or "log"
    if name == "cosine":
        start = cfg.floor_lr / peak if cfg.warmup_start_ratio is None else cfg.warmup_start_ratio
        return warmup_cosine_lr(i, peak, start, cfg.floor_lr / peak, warmup, total, kind)
    return warmup_decay_lr(i, cfg.floor_lr, peak, warmup, total if name == "warmup-decay" else None, kind)


def warmup_fraction(i: int, warmup: int, kind: str) -> float:
    """How far through DeepSpeed's warm-up iteration i is (0 at i = 0): log(i+1) / log(W), or i / W."""
    if kind == "log":
        return 1.0 / math.log(warmup) * math.log(i + 1)
    return i / warmup


def warmup_decay_lr(i: int, low: float, peak: float, warmup: int, total: int | None, kind: str) -> float:
    """WarmupLR (total None: flat at the peak after the warm-up) or WarmupDecayLR (then a line down to `low` at
    iteration `total`)."""
    if i < 0:
        return low
    warmup = max(2, warmup)
    if i < warmup:
        gamma = warmup_fraction(i, warmup, kind)
    elif total is None:
        gamma = 1.0
    else:
        gamma = max(0.0, (total - i) / max(1.0, total - warmup))
    return low + (peak - low) * gamma


def warmup_cosine_lr(i: int, peak: float, start_ratio: float, end_ratio: float, warmup: int, total: int,
                     kind: str) -> float:
    """WarmupCosineLR: from start_ratio x peak up to the peak, then a half cosine down to end_ratio x peak at
    iteration `total`; its first step runs at 0 (the scheduler sets 0 before it has started)."""
    if i < 0:
        return 0.0
    warmup = max(2, warmup)
    if i < warmup:
        return peak * (start_ratio + warmup_fraction(i, warmup, kind) * (1.0 - start_ratio))
    progress = (i - warmup + 1) / max(1, total - warmup)
    return peak * max(0.0, end_ratio + (1.0 - end_ratio) * (1 + math.cos(math.pi * progress)) / 2)


def one_cycle_lr(i: int, low: float, peak: float, rise: int, fall: int | None, decay_rate: float,
                 decay_every: int) -> float:
    """OneCycle: a line from `low` up to `peak` over `rise` iterations and back down over `fall` (default: rise),
    then low / (1 + decay_rate x iterations past the cycle / decay_every) (no decay when either is 0)."""
    if i < 0:
        return low
    fall = rise if fall is None else fall
    size = float(rise + fall)
    if i < size:
        cycle = math.floor(1 + (i + 1) / size)
        x = 1.0 + (i + 1) / size - cycle  # where in the cycle: 0 at its start and its end
        up = rise / size
        scale = x / up if x <= up else (x - 1) / (up - 1)
        return low + (peak - low) * scale
    if decay_every == 0 or decay_rate == 0:
        return low
    return low / (1 + decay_rate * (i - size + 1) / decay_every)


def check_schedule(cfg) -> None:
    """One line for a schedule knob that does not apply to --lr-schedule, or a cycle of no length."""
    name = cfg.lr_schedule
    if cfg.warmup_type is not None and name not in ("cosine", "warmup-log", "warmup-decay"):
        raise UserError(f"warmup_type applies to --lr-schedule cosine, warmup-log and warmup-decay (DeepSpeed's "
                        f"warm-ups), not {name}")
    if cfg.warmup_start_ratio is not None and not (name == "cosine" and cfg.warmup_type):
        raise UserError("warmup_start_ratio applies to --lr-schedule cosine with a warmup_type (DeepSpeed's "
                        "WarmupCosineLR); the other DeepSpeed warm-ups start at --min-lr")
    one_cycle_keys = {"cooldown_steps": cfg.cooldown_steps is not None, "decay_lr_rate": cfg.decay_lr_rate != 0,
                      "decay_step_size": cfg.decay_step_size != 0}
    if name != "one-cycle" and any(one_cycle_keys.values()):
        given = ", ".join(k for k, v in one_cycle_keys.items() if v)
        raise UserError(f"{given} applies to --lr-schedule one-cycle, not {name}")
    if name == "one-cycle" and cfg.warmup_steps == 0:
        raise UserError("--lr-schedule one-cycle needs --warmup-steps >= 1 (the cycle's rising half)")
