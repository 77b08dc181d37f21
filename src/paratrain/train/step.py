"""One optimizer step's forward and backward for the non-pipelined strategies, plus global grad clipping."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paratrain.parallel.collective_hooks import collective
from paratrain.parallel.loss_weighting import LossWeighting
from paratrain.parallel.tied_weights import is_tied_copy
from paratrain.train.data.indexed_sets import Batch
from paratrain.train.loss_choice import FusedLoss
from paratrain.train.step_runner import run_after_optimizer_step

# fp8: torchao's float8 linears do their own casts; everything around them runs as under bf16
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over the real targets (IGNORE = -100 marks cross-document and padding positions: train/data/packing.py)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def head_loss(loss: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss function under the fused loss (train/loss_choice.py FusedLoss): the model's head already took the
    mean over the real targets (models/fused_loss.py, chunked over the tokens)."""
    return loss


def autocast_context(device_type: str, dtype: str, enabled: bool = True):
    if dtype == "fp32" or not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=AUTOCAST_DTYPES[dtype])


def batch_inputs(prepare_batch, mb: Batch) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(inputs, targets, model kwargs) of a micro-batch after `prepare_batch` (context parallel's sharding, the
    hooks'). Packed rows add per-document positions and document ids: a sharded sequence keeps its local
    tokens' positions (selected by the global index the sharder returns) and the whole row's document ids (the
    distributed attention builds its blocks' masks from them)."""
    inputs, targets, extra = mb.inputs, mb.targets, {}
    if prepare_batch is not None:
        inputs, targets, extra = prepare_batch(inputs, targets)
    if mb.doc_ids is not None:
        index = extra.get("positions")
        extra = {**extra, "positions": mb.positions if index is None else mb.positions.index_select(1, index),
                 "doc_ids": mb.doc_ids}
    return inputs, targets, extra


def real_token_loss(loss_fn, logits, targets, mb: Batch, weighting: LossWeighting) -> torch.Tensor:
    """This micro-batch's term of the mean over the global batch's real tokens (parallel/loss_weighting.py)."""
    count = (targets != -100).sum()
    if int(count) == 0:  # every target here is padding or a boundary: no loss, but a graph for backward
        return plain_loss(logits).float().sum() * 0.0
    return loss_fn(logits, targets) * weighting.real_token_factor(count, mb.global_tokens)


def _no_grad_sync(model: nn.Module, last: bool):
    """Skip the gradient all-reduce on all but the last micro-batch of an accumulation."""
    if last:
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


def plain_loss(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a plain tensor: under loss parallel it is a Replicate DTensor (so this needs no comm)."""
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


class PlainStep:
    """Forward + backward over the micro-batches of one step, for every strategy without a pipeline.
    A StepRunner (train/step_runner.py)."""

    microbatches = None  # one forward per micro-batch handed in
    last_timing = None

    def __init__(self, model: nn.Module, device: torch.device, dtype: str, use_autocast: bool, scaler=None,
                 prepare_batch=None, loss_fn=lm_loss, loss_parallel: bool = False, mark_graph_steps: bool = False,
                 loss_weighting: LossWeighting | None = None, hooks=None, fused_loss: FusedLoss | None = None):
        self.model, self.device, self.dtype = model, device, dtype
        self.use_autocast, self.scaler = use_autocast, scaler
        self.loss_fn = loss_fn  # lm_loss, or its torch.compile'd version under --compile; head_loss when fused
        self.fused_loss = fused_loss  # --fused-loss: the model takes the targets and returns the loss
        self.loss_parallel = loss_parallel  # TP: vocab-sharded logits; loss and backward under loss_parallel()
        self.mark_graph_steps = mark_graph_steps  # --cuda-graphs: each forward starts a new captured step
        self.prepare_batch = prepare_batch  # e.g. context parallelism's sequence sharding
        # each micro-batch's loss multiplier (parallel/loss_weighting.py); default: one rank, 1 / micro-batches
        self.loss_weighting = loss_weighting or LossWeighting()
        self.hooks = hooks  # train/hooks.py: around_compute wraps each micro-batch's forward + backward

    def loss_context(self):
        if not self.loss_parallel:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    @property
    def model_parts(self) -> list[nn.Module]:
        return [self.model]

    def build_optimizers(self, cfg) -> None:
        return None  # the trainer's default

    def reduce_loss(self, local: torch.Tensor) -> None:
        return None  # the trainer's default

    def after_optimizer_step(self) -> None:
        run_after_optimizer_step(self.model_parts)

    def verify_extras(self) -> dict:
        return {}

    def model_output(self, inputs: torch.Tensor, targets: torch.Tensor, extra: dict) -> torch.Tensor:
        """What loss_fn takes: the model's logits, or under the fused loss its loss over `targets`."""
        if self.fused_loss is None:
            return self.model(inputs, **extra)
        return self.model(inputs, **extra, **self.fused_loss.model_kwargs(targets))

    def forward_backward(self, micro_batches: list[Batch]) -> torch.Tensor:
        """Mean loss over this rank's tokens (detached); leaves gradients in .grad. Under --dp-batch-split, this
        rank's share of the global mean x dp (the trainer's average over dp then gives the global mean)."""
        total = torch.zeros((), device=self.device)
        n = len(micro_batches)
        fsdp_sync = getattr(self.model, "set_requires_gradient_sync", None)
        for i, mb in enumerate(micro_batches):
            last = i == n - 1
            if fsdp_sync is not None:
                fsdp_sync(last)
            inputs, targets, extra = batch_inputs(self.prepare_batch, mb)
            if self.mark_graph_steps:
                torch.compiler.cudagraph_mark_step_begin()
            with self.compute_context(i), _no_grad_sync(self.model, last), self.loss_context():
                with autocast_context(self.device.type, self.dtype, self.use_autocast):
                    out = self.model_output(inputs, targets, extra)  # logits, or the fused loss
                if mb.global_tokens is not None:
                    loss = real_token_loss(self.loss_fn, out, targets, mb, self.loss_weighting)
                else:
                    loss = self.loss_weighting.dense_loss(self.loss_fn(out, targets), n)
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            loss = loss.detach()
            total += plain_loss(loss)
        return total

    def compute_context(self, index: int):
        return self.hooks.compute(index) if self.hooks is not None else contextlib.nullcontext()


def clip_grad_norm(parameters: list[torch.Tensor], max_norm: float, pp_group=None) -> torch.Tensor:
    """Global L2 norm of all gradients (across DTensor shards and pipeline stages); clip if max_norm > 0.
    A tied embedding's second copy (the last pipeline stage's head: parallel/tied_weights.py) holds the same
    gradient as the first stage's table and is left out of the norm, so the shared weight counts once."""
    grads = [p.grad for p in parameters if p.grad is not None]
    counted = [p.grad for p in parameters if p.grad is not None and not is_tied_copy(p)]
    if counted:
        from paratrain.parallel.grad_norm import total_norm  # grads on several meshes (--ep's experts)

        norm = total_norm(counted)
    else:
        norm = torch.zeros(())
    if pp_group is not None:
        squared = norm.float() ** 2
        collective("grad_norm", "pp", "all_reduce", pp_group, lambda: dist.all_reduce(squared, group=pp_group),
                   (squared,))
        norm = squared.sqrt()
    if max_norm > 0 and grads:
        from paratrain.parallel.grad_norm import clip_with_norm

        clip_with_norm(parameters, max_norm, norm)
    return norm
