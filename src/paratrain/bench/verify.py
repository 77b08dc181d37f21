"""Parity harness: a strategy on N processes against a single-device reference, step by step.

Same seed, same initial weights (built once on CPU, then sharded), same global batches. Compares the loss
of every step, then the gradients of the last step and the parameters after it.
"""

from __future__ import annotations

import gc
import os
import sys
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from paratrain.errors import UserError

# wrapper path components (DDP, torch.compile, activation checkpointing, FSDP1) that are not part of the model
STRIP = ("module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


@dataclass(frozen=True)
class Tolerance:
    loss_atol: float
    loss_rtol: float
    param_atol: float
    param_rtol: float
    grad_rtol: float

    @classmethod
    def for_dtype(cls, dtype: str, lr: float = 3e-3, steps: int = 5) -> Tolerance:
        # Adam divides by sqrt(v) + eps: where a gradient element is near eps (~1e-8), fp32 rounding in the
        # reduction order can swing that element's update by up to ~lr per step. So the parameter bound has
        # a term 2% of lr*steps; a real strategy bug (a shard not updated, a wrong scale) moves parameters by
        # ~lr per step, 50x more, and loss and gradients are held to tight bounds independently.
        adam_noise = 0.02 * lr * steps
        if dtype == "fp32":
            return cls(loss_atol=1e-6, loss_rtol=1e-5, param_atol=1e-5 + adam_noise, param_rtol=1e-4,
                       grad_rtol=1e-4)
        # low precision: reduction order changes rounding at the 1e-3 level, and Adam amplifies it
        return cls(loss_atol=1e-2, loss_rtol=2e-2, param_atol=5e-3 + adam_noise, param_rtol=5e-2, grad_rtol=5e-2)


def clean_name(name: str) -> str:
    # whole components only: replacing the substring "module." would eat "_checkpoint_wrapped_module."
    return ".".join(part for part in name.split(".") if part not in STRIP)


def full_tensors(model_parts, kind: str) -> dict[str, torch.Tensor]:
    """{fqn: full CPU tensor} of this rank's parameters (kind="param") or gradients (kind="grad").

    DTensors are gathered with full_tensor(), a collective over their mesh, so every rank holding a
    shard of the same module must call this in the same order (named_parameters order guarantees it).
    """
    out = {}
    for part in model_parts:
        for name, p in part.named_parameters():
            t = p if kind == "param" else p.grad
            if t is None:
                continue
            t = t.detach()
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()
            out[clean_name(name)] = t.float().cpu().clone()
    return out


def gather_to_rank0(local: dict) -> dict | None:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    bucket = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, bucket, dst=0)
    if dist.get_rank() != 0:
        return None
    merged = {}
    for d in bucket:
        merged.update(d)
    return merged


def compare_tensors(ref: dict, got: dict, atol: float, rtol: float) -> tuple[float, float, bool, list[str]]:
    """(max abs diff, max relative diff per tensor, all close, missing names)."""
    missing = sorted(set(ref) - set(got))
    max_abs, max_rel, ok = 0.0, 0.0, not missing
    for name, r in ref.items():
        if name not in got:
            continue
        g = got[name]
        if g.shape != r.shape:
            return float("inf"), float("inf"), False, [f"{name} shape {tuple(g.shape)} != {tuple(r.shape)}"]
        diff = (g - r).abs()
        max_abs = max(max_abs, float(diff.max()))
        max_rel = max(max_rel, float(diff.max() / r.abs().max().clamp_min(1e-12)))
        ok = ok and bool((diff <= atol + rtol * r.abs()).all())
    return max_abs, max_rel, ok, missing


def run_steps(trainer, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        losses.append(trainer.train_step(trainer.source.next_step())["loss"])
    return losses


def verify_worker(cfg_dict: dict, tol_dict: dict | None = None) -> dict | None:
    from paratrain.config import TrainConfig
    from paratrain.train.runtime import init_runtime, shutdown
    from paratrain.train.worker import setup_logging

    # true fp32 on CUDA (no TF32): TF32's ~1e-3 rounding would swamp the fp32 tolerances
    cfg = TrainConfig(**{**cfg_dict, "resume": "never", "ckpt_every": 0, "metrics": False, "tf32": False})
    setup_logging(int(os.environ.get("RANK", "0")))
    rt = init_runtime(cfg.device, cfg.timeout_s)
    tol = Tolerance(**tol_dict) if tol_dict else Tolerance.for_dtype(cfg.dtype, cfg.lr, cfg.steps)
    try:
        result = verify_in_group(cfg, rt, tol)
    except UserError as exc:
        if rt.is_main:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        shutdown()
        sys.exit(2)
    gc.collect()  # free the trainers (DDP reducers) while the groups are registered: see train/worker.py
    shutdown()
    return result


def verify_in_group(cfg, rt, tol: Tolerance) -> dict | None:
    """One verify run inside an already joined process group; rank 0 returns the report, others None.

    Tests call it several times in one group (one launch for many strategies)."""
    from paratrain.parallel.strategies import resolve_layout
    from paratrain.train.trainer import Trainer

    reference = None
    if rt.is_main:
        ref_cfg = cfg.model_copy(update={"strategy": "single", "micro_batch": None, "dp_replicate": None,
                                         "dp_shard": None, "tp": None, "pp": None, "cp": None,
                                         "ac": "none", "compile": False, "cpu_offload": False,
                                         "ddp_comm_hook": "none", "local_sgd_period": 0})
        ref = Trainer(ref_cfg, rt, quiet=True, layout=resolve_layout(ref_cfg, 1))
        ref_losses = run_steps(ref, cfg.steps)
        reference = (ref_losses, full_tensors(ref.step_runner.model_parts, "grad"),
                     full_tensors(ref.step_runner.model_parts, "param"))
        del ref
    trainer = Trainer(cfg, rt, quiet=True)
    losses = run_steps(trainer, cfg.steps)
    grads = gather_to_rank0(full_tensors(trainer.step_runner.model_parts, "grad"))
    params = gather_to_rank0(full_tensors(trainer.step_runner.model_parts, "param"))
    extra = getattr(trainer, "verify_extras", lambda: {})()
    if not rt.is_main:
        return None
    return build_result(cfg, trainer.layout, tol, reference, losses, grads, params, extra)


def build_result(cfg, layout, tol: Tolerance, reference, losses, grads, params, extra: dict) -> dict:
    ref_losses, ref_grads, ref_params = reference
    per_step, loss_ok, max_loss = [], True, 0.0
    for i, (lr_, l_) in enumerate(zip(ref_losses, losses), start=1):
        diff = abs(l_ - lr_)
        max_loss = max(max_loss, diff)
        loss_ok = loss_ok and diff <= tol.loss_atol + tol.loss_rtol * abs(lr_)
        per_step.append({"step": i, "loss_ref": lr_, "loss": l_})
    _, grad_rel, _, grad_missing = compare_tensors(ref_grads, grads, float("inf"), 0.0)
    param_abs, _, param_ok, param_missing = compare_tensors(ref_params, params, tol.param_atol, tol.param_rtol)
    grad_ok = not grad_missing and grad_rel <= tol.grad_rtol
    return {"strategy": cfg.strategy, "dims": layout.degrees(), "world_size": layout.world, "steps": cfg.steps,
            "dtype": cfg.dtype, "model": cfg.model, "tolerance": asdict(tol),
            "max_loss_abs_diff": max_loss, "max_grad_rel_diff": grad_rel, "max_param_abs_diff": param_abs,
            "passed": bool(loss_ok and grad_ok and param_ok),
            "checks": {"loss": loss_ok, "grads": grad_ok, "params": param_ok},
            "missing": grad_missing + param_missing, "per_step": per_step, **extra}
