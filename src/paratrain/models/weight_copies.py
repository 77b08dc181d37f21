"""Linears that compute with bf16 copies of their parameters under bf16 autocast (--bf16-param-copies: the trainer
attaches the copies and writes them after each optimizer step, train/param_copies.py).

Autocast would cast each fp32 weight and bias to bf16 in every forward (every micro-batch, every recomputation);
a Linear carrying copies hands F.linear the copy instead, which autocast leaves as it is. The copy holds exactly
what that cast computes (round to nearest even), so the forward is bit-identical, and so is the backward: the
copy's gradient goes to the fp32 parameter cast back to its dtype, as the cast's own backward does. The
parameters stay the masters (their names, .grad, the optimizer state, checkpoints and exports are unchanged).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

COPIES = "bf16_copies"  # the attribute a Linear carries them in: (weight copy, bias copy or None)


class FromCopy(torch.autograd.Function):
    """The copy in the forward; in the backward its gradient, cast to the master's dtype, to the master."""

    @staticmethod
    def forward(ctx, master: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.dtype = master.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype), None


def bf16_autocast(device_type: str) -> bool:
    return torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == torch.bfloat16


def linear_operands(module: nn.Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight and bias `module` computes with on input x: its bf16 copies under bf16 autocast where it
    carries them, else its parameters."""
    copies = getattr(module, COPIES, None)
    if copies is None or not bf16_autocast(x.device.type):
        return module.weight, module.bias
    return tuple(None if master is None else _from_copy(master, copy)
                 for master, copy in zip((module.weight, module.bias), copies, strict=True))


def _from_copy(master: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
    if master.requires_grad and torch.is_grad_enabled():
        return FromCopy.apply(master, copy)
    return copy


def _forward_from_copies(self: nn.Linear, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if args or kwargs:  # not the plain linear (the output head given targets: the fused loss): its own forward
        return type(self).forward(self, x, *args, **kwargs)
    return F.linear(x, *linear_operands(self, x))


def give_copies(module: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """From now on `module` computes with these copies under bf16 autocast (its own forward, this instance only;
    called with more than its input, it runs its class's forward)."""
    setattr(module, COPIES, (weight, bias))
    module.forward = types.MethodType(_forward_from_copies, module)
