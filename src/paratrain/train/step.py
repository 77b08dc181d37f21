"""One optimizer step's forward and backward for the non-pipelined strategies, plus global grad clipping."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paratrain.train.data import Batch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def autocast_context(device_type: str, dtype: str, enabled: bool = True):
    if dtype == "fp32" or not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=AUTOCAST_DTYPES[dtype])


def _no_grad_sync(model: nn.Module, last: bool):
    """Skip the gradient all-reduce on all but the last micro-batch of an accumulation."""
    if last:
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


class PlainStep:
    """Forward + backward over the micro-batches of one step, for every strategy without a pipeline."""

    def __init__(self, model: nn.Module, device: torch.device, dtype: str, use_autocast: bool, scaler=None,
                 prepare_batch=None, loss_fn=lm_loss):
        self.model, self.device, self.dtype = model, device, dtype
        self.use_autocast, self.scaler = use_autocast, scaler
        self.loss_fn = loss_fn  # lm_loss, or its torch.compile'd version under --compile
        self.prepare_batch = prepare_batch  # e.g. context parallelism's sequence sharding

    @property
    def model_parts(self) -> list[nn.Module]:
        return [self.model]

    def forward_backward(self, micro_batches: list[Batch]) -> torch.Tensor:
        """Mean loss over this rank's tokens (detached); leaves gradients in .grad."""
        total = torch.zeros((), device=self.device)
        n = len(micro_batches)
        fsdp_sync = getattr(self.model, "set_requires_gradient_sync", None)
        for i, mb in enumerate(micro_batches):
            last = i == n - 1
            if fsdp_sync is not None:
                fsdp_sync(last)
            inputs, targets, extra = mb.inputs, mb.targets, {}
            if self.prepare_batch is not None:
                inputs, targets, extra = self.prepare_batch(inputs, targets)
            with _no_grad_sync(self.model, last):
                with autocast_context(self.device.type, self.dtype, self.use_autocast):
                    logits = self.model(inputs, **extra)
                loss = self.loss_fn(logits, targets) / n
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += loss.detach()
        return total


def clip_grad_norm(parameters: list[torch.Tensor], max_norm: float, pp_group=None) -> torch.Tensor:
    """Global L2 norm of all gradients (across DTensor shards and pipeline stages); clip if max_norm > 0."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if grads:
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    else:
        norm = torch.zeros(())
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    if pp_group is not None:
        squared = norm.float() ** 2
        dist.all_reduce(squared, group=pp_group)
        norm = squared.sqrt()
    if max_norm > 0 and grads:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm, foreach=True)
    return norm
