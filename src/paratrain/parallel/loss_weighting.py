"""The loss's weighting, owned in one place: the factor each micro-batch's loss is multiplied by, on every rank, so
that the step's gradient and its reported loss are those of one device's step over the global batch.

The invariant: a rank's per-micro-batch terms, summed over its micro-batches and then averaged over the
reducers (the dp x cp ranks whose gradients DDP / FSDP average and whose losses the trainer averages), are the
mean loss over every real token of the global batch.

- Dense data (every target real, every sequence seq_len long): a micro-batch's term is its mean loss x 1 / M
  (M micro-batches per step), or x reducers x its tokens / the global batch's tokens under --dp-batch-split.
- Document data (padding and cross-document targets are not real): its summed loss x reducers / the global real
  targets, which holds however unevenly the real targets are spread over ranks and micro-batches.
- A pipeline schedule with scale_grads divides every gradient by M itself: it is handed each term x M.
- The MoE balancing loss rides on each micro-batch's backward: it takes 1 / M (each rank's balancing loss is
  its own mean, averaged over the reducers like the language-model loss).
- Expert weights under --ep sum the tokens of all ep ranks and FSDP divides them by the other (rest) ranks only:
  they take rest / reducers once more.

Step runners (train/step.py, train/pipeline_step.py), validation (train/evaluate.py), the trainer's loss reduction
and expert parallelism (parallel/ep/) read their factors here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class LossWeighting:
    microbatches: int = 1  # micro-batches per optimizer step on this rank (M)
    reducers: int = 1  # ranks the loss and the gradients are averaged over: dp x cp
    # dense data: each micro-batch's mean-loss multiplier on this rank; None: 1 / M. --dp-batch-split sets
    # reducers x this rank's micro-batch / the global batch (the hooks' loss_weight may change it)
    dense_weight: float | None = None
    schedule_divides: bool = False  # a pipeline schedule divides the gradients by M itself (scale_grads)

    @classmethod
    def of(cls, layout, dp_rank: int) -> LossWeighting:
        """The weighting of data-parallel rank `dp_rank` of `layout` (only --dp-batch-split's weight differs by rank)."""
        weight = None
        if layout.dp_micro_batches:  # sequences all hold seq_len tokens: micro-batch / global batch is the token share
            weight = layout.dp * layout.cp * layout.dp_micro_batches[dp_rank] / layout.global_batch
        return cls(microbatches=layout.microbatches, reducers=layout.dp * layout.cp, dense_weight=weight,
                   schedule_divides=layout.splits_stages)

    @classmethod
    def on_this_rank(cls, layout) -> LossWeighting:
        """`of` for this process's data-parallel rank (a layout of one device: rank 0)."""
        return cls.of(layout, layout.dp_rank(dist.get_rank()) if layout.world > 1 else 0)

    def with_dense_weight(self, weight: float | None) -> LossWeighting:
        return dataclasses.replace(self, dense_weight=weight)

    # -- a micro-batch's term ------------------------------------------------------------------------------
    def dense_loss(self, mean_loss: torch.Tensor, count: int | None = None) -> torch.Tensor:
        """The loss to backpropagate for a micro-batch's mean over its tokens (dense data): its term, the mean x
        the dense weight, or / `count` (the micro-batches this step runs; default M). Under a schedule that
        divides by M itself, the mean as it is."""
        if self.schedule_divides:
            return mean_loss
        if self.dense_weight is not None:
            return mean_loss * self.dense_weight
        return mean_loss / (self.microbatches if count is None else count)

    def real_token_factor(self, real: torch.Tensor, global_tokens: int) -> torch.Tensor:
        """Document data: the multiplier of a micro-batch's mean over its `real` real targets, giving its term
        (its summed loss x reducers / the global batch's real targets)."""
        return real * self.reducers / global_tokens

    def summed_token_factor(self, global_tokens: int) -> float:
        """Document data: the multiplier of a micro-batch's summed loss over its real targets, giving its term."""
        return self.reducers / max(global_tokens, 1)

    def for_backward(self, term: torch.Tensor) -> torch.Tensor:
        """What a step runner backpropagates for a term: x M under a schedule that divides by M itself."""
        return term * self.microbatches if self.schedule_divides else term

    # -- the loss reported ---------------------------------------------------------------------------------
    def rank_share(self, recorded: torch.Tensor, dense: bool) -> torch.Tensor:
        """This rank's share of the global mean from what a pipeline schedule's loss function recorded per
        micro-batch: the mean of their mean losses (dense data: each term is the mean / M), else the sum of
        their terms."""
        return recorded.mean() if dense else recorded.sum()

    def global_mean(self, summed: torch.Tensor) -> torch.Tensor:
        """The global mean from the all-reduced sum of every reducer's share (in place)."""
        return summed.div_(self.reducers)

    # -- MoE ----------------------------------------------------------------------------------------------
    @property
    def aux_scale(self) -> float:
        """The MoE balancing loss's weight in one micro-batch's backward: 1 / M (a schedule divides by M itself)."""
        return 1.0 if self.schedule_divides else 1.0 / self.microbatches

    def expert_weight_grad_scale(self, fsdp_ranks: int) -> float:
        """--ep: the experts' weight gradients sum the tokens of all ep ranks, and FSDP divides them by its own
        `fsdp_ranks` (the rest of the data ranks): this makes them the mean over the reducers."""
        return fsdp_ranks / self.reducers
