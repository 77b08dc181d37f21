"""Validation loss: the same held-out batches, reduced the same way, under every strategy.

The held-out set is a fixed list of `batches` global batches (sample indices 0, 1, ... of the validation
data set), cut into data-parallel slices and micro-batches exactly like training batches. Each rank computes
the mean loss of its slice without gradients; the global value then goes through the trainer's own loss
reduction (over dp x cp, and from the last pipeline stage). So single, ddp, zero*, tp, cp and pp all report the
mean over the same tokens.
"""

from __future__ import annotations

import math

import torch

from paratrain.errors import UserError
from paratrain.train.data import Batch, BatchSource, make_val_dataset
from paratrain.train.step import autocast_context, plain_loss


class Validator:
    def __init__(self, dataset, global_batch: int, dp_rank: int, dp: int, micro_batch: int, batches: int,
                 shares: tuple[int, ...] = ()):
        self.source = BatchSource(dataset, global_batch, dp_rank, dp, micro_batch, shares)
        self.batches = batches

    def micro_batches(self, index: int) -> list[Batch]:
        batch = self.source.rank_batch(index)
        mb = self.source.micro_batch
        return [Batch(i, t) for i, t in zip(batch.inputs.split(mb), batch.targets.split(mb))]


def validation_batches(cfg, dataset) -> int:
    """How many global batches one validation uses: --val-batches, fewer if the held-out data is short."""
    if not hasattr(dataset, "num_windows"):
        return cfg.val_batches
    available = dataset.num_windows() // cfg.global_batch
    if available == 0:
        raise UserError(f"the held-out data ({dataset.path}, {dataset.num_tokens()} tokens) holds "
                        f"{dataset.num_windows()} windows of seq_len+1 tokens; one validation batch needs "
                        f"global_batch={cfg.global_batch} of them (raise --val-fraction or lower --global-batch)")
    return min(cfg.val_batches, available)


def build_validator(cfg, vocab_size: int, dp_rank: int = 0, dp: int = 1, micro_batch: int | None = None,
                    shares: tuple[int, ...] = ()):
    """The run's Validator, or None when it does not validate. Raises UserError on bad validation options."""
    dataset = make_val_dataset(cfg.data, cfg.val_data, cfg.val_fraction, cfg.eval_every, vocab_size, cfg.seq_len,
                               cfg.seed)
    if dataset is None:
        return None
    micro = micro_batch or cfg.global_batch // dp
    return Validator(dataset, cfg.global_batch, dp_rank, dp, micro, validation_batches(cfg, dataset), shares)


def _plain_loss(runner, micro: list[Batch]) -> torch.Tensor:
    total = torch.zeros((), device=runner.device)
    for mb in micro:
        inputs, targets, extra = mb.inputs, mb.targets, {}
        if runner.prepare_batch is not None:
            inputs, targets, extra = runner.prepare_batch(inputs, targets)
        with runner.loss_context():  # TP: the logits stay vocab-sharded, as in training
            with autocast_context(runner.device.type, runner.dtype, runner.use_autocast):
                logits = runner.model(inputs, **extra)
            loss = runner.loss_fn(logits, targets).detach().float()
        # --dp-batch-split: weighted by this rank's share, as in training (PlainStep.loss_weight)
        weight = runner.loss_weight
        total += plain_loss(loss) / len(micro) if weight is None else plain_loss(loss) * weight
    return total


def _pipeline_loss(runner, micro: list[Batch]) -> torch.Tensor:
    inputs = torch.cat([mb.inputs for mb in micro])
    targets = torch.cat([mb.targets for mb in micro])
    runner._losses = []
    args = (inputs,) if runner.has_first else ()
    runner.schedule.eval(*args, target=targets if runner.has_last else None)
    if runner.has_last:
        return torch.stack(runner._losses[-runner.microbatches:]).float().mean()
    return torch.zeros((), device=runner.device)


def evaluate(trainer) -> float:
    """Mean validation loss over the held-out batches (a collective: every rank calls it)."""
    runner, validator = trainer.step_runner, trainer.validator
    local_loss = _pipeline_loss if hasattr(runner, "schedule") else _plain_loss
    losses = []
    with torch.no_grad():
        for index in range(validator.batches):
            micro = [mb.to(trainer.rt.device) for mb in validator.micro_batches(index)]
            losses.append(trainer.global_loss(local_loss(runner, micro)))
    return sum(losses) / len(losses)


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf
