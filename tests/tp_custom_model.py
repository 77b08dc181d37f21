"""A custom model with its own TP plan, for tests/test_examples.py (train --script ... --strategy tp)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 64)
        self.down = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x))).sum(-1)


def build() -> nn.Module:
    return TwoLayer()


tp_plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}


def data(indices: np.ndarray):
    x = np.stack([np.random.default_rng(int(i)).standard_normal(8) for i in indices])
    return torch.tensor(x, dtype=torch.float32), torch.tensor(np.tanh(x.sum(1)), dtype=torch.float32)


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(outputs, targets)
