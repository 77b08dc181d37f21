"""Optimizer and learning-rate schedule: AdamW with linear warm-up then cosine decay to a floor."""

from __future__ import annotations

import math

import torch


def build_optimizer(params, lr: float, betas: tuple[float, float], weight_decay: float, device_type: str):
    # fused kernels exist only for accelerators; foreach is the fast path on CPU
    fused = device_type == "cuda"
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay,
                             fused=fused or None, foreach=None if fused else True)


def lr_at(step: int, base_lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    if warmup and step < warmup:
        return base_lr * (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
