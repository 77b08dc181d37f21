"""The interface between the Trainer and what runs one step's forward and backward: PlainStep (train/step.py)
for every strategy without a pipeline, PipelineStep (train/pipeline_step.py) for pp > 1."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class StepRunner(Protocol):
    # micro-batches a step is split into inside the runner (a pipeline schedule); None: one per batch handed in
    microbatches: int | None
    # the last step's busy/idle timing where the runner measures it (a pipeline), else None
    last_timing: dict | None

    @property
    def model_parts(self) -> list[nn.Module]:
        """The modules this rank trains (one, or one per pipeline stage it holds)."""
        ...

    def forward_backward(self, micro_batches: list) -> torch.Tensor:
        """Run one step's micro-batches; leave gradients in .grad; return this rank's mean loss (detached)."""
        ...

    def build_optimizers(self, cfg) -> list | None:
        """The runner's own optimizers, or None for the trainer's default (AdamW, or ZeRO-1's)."""
        ...

    def reduce_loss(self, local: torch.Tensor) -> torch.Tensor | float | None:
        """The global mean loss from this rank's, or None for the trainer's default (the mean over dp x cp).
        A tensor left on the device lets fit() read it one step late; a float is a host sync every step."""
        ...

    def after_optimizer_step(self) -> None:
        """Runs after every optimizer step (e.g. local SGD's periodic parameter averaging)."""
        ...

    def verify_extras(self) -> dict:
        """Extra `verify --json` fields (a collective: every rank calls it)."""
        ...


def run_after_optimizer_step(parts: list[nn.Module]) -> None:
    """The model parts' own after-step work: data_parallel.attach_local_sgd gives a DDP module one."""
    for part in parts:
        after_step = getattr(part, "after_optimizer_step", None)
        if after_step is not None:
            after_step()
