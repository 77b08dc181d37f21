"""Optimizer and learning-rate schedule: AdamW with linear warm-up then cosine decay to a floor."""

from __future__ import annotations

import math

import torch


def build_optimizer(params, lr: float, betas: tuple[float, float], weight_decay: float, device_type: str,
                    optimizer_graph: bool = False):
    """AdamW: fused on CUDA, foreach on CPU (the default there, though torch 2.13's fused CPU kernel steps gpt2-124m
    in a quarter of the time: benchmarks/optimizer_step.py). --optimizer-graph: fused on CPU too (the clip
    scale enters the fused kernel as its grad_scale: train/optimizer_graph.py), and on CUDA capturable, with
    gradients kept between steps (zeroed in place) so a CUDA graph can read them at fixed addresses."""
    fused = device_type == "cuda" or optimizer_graph
    capturable = optimizer_graph and device_type == "cuda"
    kind = KeptGradsAdamW if capturable else torch.optim.AdamW
    opt = kind(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=fused or None,
               foreach=None if fused else True, capturable=capturable)
    keep_implementation(opt)
    return opt


class KeptGradsAdamW(torch.optim.AdamW):
    """AdamW whose zero_grad() zeroes the gradients in place (never drops them): a captured step reads them where
    it was captured, as torch's compiled optimizer under CUDA graphs expects too."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=False)


def keep_implementation(opt) -> None:
    """A checkpoint's param groups carry the implementation they were saved with (fused, foreach, capturable), and
    torch's load_state_dict takes them over: keep this run's, and its step counters where the fused kernel reads
    them (on the parameters' device): a checkpoint saved with or without --optimizer-graph, or on another device,
    resumes with this run's (the foreach path would refuse --optimizer-graph's grad_scale)."""
    chosen = [{k: g[k] for k in ("fused", "foreach", "capturable")} for g in opt.param_groups]

    def restore(optimizer) -> None:
        for group, kept in zip(optimizer.param_groups, chosen, strict=True):
            group.update(kept)
            on_device = kept["fused"] or kept["capturable"]  # else torch keeps the step counter on the host
            for p in group["params"]:
                state = optimizer.state.get(p)
                if state and torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].to(p.device if on_device else "cpu", torch.float32)

    opt.register_load_state_dict_post_hook(restore)


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
