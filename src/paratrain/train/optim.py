"""The optimizers (--optimizer adamw | adam | sgd) and today's learning-rate formula (train/lr_schedules.py picks
the schedule)."""

from __future__ import annotations

import math

import torch

ADAM_KINDS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}


def build_optimizer(params, lr: float, betas: tuple[float, float], weight_decay: float, device_type: str,
                    optimizer_graph: bool = False, *, kind: str = "adamw", eps: float = 1e-8, momentum: float = 0.0):
    """AdamW (or Adam, or SGD with `momentum`): fused on CUDA, foreach on CPU (the default there, though torch
    2.13's fused CPU kernel steps gpt2-124m in a quarter of the time: benchmarks/optimizer_step.py).
    --optimizer-graph: fused on CPU too (the clip scale enters the fused kernel as its grad_scale:
    train/optimizer_graph.py), and on CUDA capturable, with gradients kept between steps (zeroed in place) so a
    CUDA graph can read them at fixed addresses."""
    fused = device_type == "cuda" or optimizer_graph
    capturable = optimizer_graph and device_type == "cuda"
    cls, hyper = optimizer_class(kind, capturable), hyperparameters(kind, lr, betas, eps, momentum, weight_decay)
    if kind in ADAM_KINDS:
        hyper["capturable"] = capturable
    opt = cls(params, **hyper, fused=fused or None, foreach=None if fused else True)
    keep_implementation(opt)
    return opt


def build_run_optimizer(params, cfg, device_type: str):
    """The optimizer a run config asks for (its optimizer, betas, eps, momentum, weight decay)."""
    return build_optimizer(params, cfg.lr, cfg.adam_betas, cfg.weight_decay, device_type, cfg.optimizer_graph,
                           kind=cfg.optimizer, eps=cfg.eps, momentum=cfg.momentum)


def run_optimizer_spec(cfg) -> tuple[type, dict]:
    """(class, constructor hyperparameters) of the run config's optimizer, for a wrapper that builds it (ZeRO-1)."""
    return optimizer_class(cfg.optimizer), hyperparameters(cfg.optimizer, cfg.lr, cfg.adam_betas, cfg.eps,
                                                           cfg.momentum, cfg.weight_decay)


def optimizer_class(kind: str, capturable: bool = False) -> type:
    if kind == "sgd":
        return torch.optim.SGD
    return KEPT_GRADS[kind] if capturable else ADAM_KINDS[kind]


def hyperparameters(kind: str, lr: float, betas: tuple[float, float], eps: float, momentum: float,
                    weight_decay: float) -> dict:
    """The constructor's arguments of `kind` (sgd takes no betas or eps; Adam(W) no momentum)."""
    if kind == "sgd":
        return {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
    return {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}


class KeptGrads:
    """An optimizer whose zero_grad() zeroes the gradients in place (never drops them): a captured step reads them
    where it was captured, as torch's compiled optimizer under CUDA graphs expects too."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=False)


class KeptGradsAdamW(KeptGrads, torch.optim.AdamW):
    pass


class KeptGradsAdam(KeptGrads, torch.optim.Adam):
    pass


KEPT_GRADS = {"adamw": KeptGradsAdamW, "adam": KeptGradsAdam}


def keep_implementation(opt) -> None:
    """A checkpoint's param groups carry the implementation they were saved with (fused, foreach, capturable), and
    torch's load_state_dict takes them over: keep this run's, and its step counters where the fused kernel reads
    them (on the parameters' device): a checkpoint saved with or without --optimizer-graph, or on another device,
    resumes with this run's (the foreach path would refuse --optimizer-graph's grad_scale)."""
    chosen = [{k: g[k] for k in ("fused", "foreach", "capturable") if k in g} for g in opt.param_groups]

    def restore(optimizer) -> None:
        for group, kept in zip(optimizer.param_groups, chosen, strict=True):
            group.update(kept)
            on_device = kept["fused"] or kept.get("capturable")  # else torch keeps the step counter on the host
            for p in group["params"]:
                state = optimizer.state.get(p)
                if state and torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].to(p.device if on_device else "cpu", torch.float32)

    opt.register_load_state_dict_post_hook(restore)


def lr_at(step: int, base_lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Learning rate for optimizer step `step` (0-based): --lr-schedule cosine, the schedule before there were
    others (linear warm-up, then a half cosine down to min_ratio x base_lr at `total`)."""
    if warmup and step < warmup:
        return base_lr * (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def loss_scaler(cfg, device_type: str):
    """fp16's dynamic loss scale: torch's GradScaler, started at --loss-scale-init and doubled after
    --loss-scale-window steps without an overflow (torch's defaults where unset); None for other dtypes."""
    if cfg.dtype != "fp16":
        return None
    given = {"init_scale": cfg.loss_scale_init, "growth_interval": cfg.loss_scale_window}
    return torch.amp.GradScaler(device_type, **{k: v for k, v in given.items() if v is not None})


def check_optimizer_options(cfg) -> None:
    """One line for an option the chosen optimizer or dtype would silently ignore."""
    from paratrain.errors import UserError
    from paratrain.training_options import DEFAULT_BETAS, DEFAULT_EPS, parse_betas

    if cfg.optimizer != "sgd" and cfg.momentum:
        raise UserError(f"--momentum applies to --optimizer sgd; {cfg.optimizer} takes its momentum from --betas "
                        f"B1,B2")
    if cfg.optimizer == "sgd" and (cfg.adam_betas != parse_betas(DEFAULT_BETAS) or cfg.eps != DEFAULT_EPS):
        raise UserError("--betas and --eps apply to --optimizer adamw and adam; sgd takes --momentum")
    if cfg.dtype != "fp16" and (cfg.loss_scale_init is not None or cfg.loss_scale_window is not None):
        raise UserError(f"--loss-scale-init and --loss-scale-window apply to --dtype fp16 (this run is "
                        f"{cfg.dtype}, which needs no loss scaling)")
