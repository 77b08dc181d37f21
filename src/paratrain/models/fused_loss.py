"""The output head's linear and the next-token cross-entropy fused (--fused-loss, --loss-chunks N), as Liger-Kernel's
FusedLinearCrossEntropy and llm.c's fused classifier do it: over chunks of the tokens, each chunk's logits are
computed, turned into their loss and their gradient at once, and the gradient goes straight into the hidden
states' and the head weight's gradients. No logits are kept for the backward, and the fp32 logits of every token
x the whole vocabulary never exist at once (one chunk's do, while it is computed).

The gradient is written in the forward because a mean cross-entropy's gradient wrt its logits does not depend on
anything that comes later but one factor (the backward's grad_output: the loss weighting's, parallel/
loss_weighting.py), which the backward applies to the stored gradients in place.

Arithmetic, per chunk: logits = hidden @ W^T in the compute dtype (autocast's, else the hidden states'), the
log-sum-exp and the loss in fp32 (as train/step.lm_loss's `.float()` then cross_entropy), the logits' gradient
(softmax - one-hot) / real targets in fp32, cast to the compute dtype for the two gradient GEMMs; the head
weight's gradient is summed over the chunks in fp32 and held in the compute dtype, as the plain path's GEMM gives
it. Targets -100 (padding, document boundaries: train/data/packing.py) add no loss and no gradient.
"""

from __future__ import annotations

import math

import torch
from torch import nn

IGNORE = -100
# one chunk's fp32 logits (tokens x vocabulary x 4 bytes) stay under this when the chunk count is not given
CHUNK_LOGITS_BYTES = 256 * 2**20


def loss_chunks_for(tokens: int, vocab: int) -> int:
    """The fewest chunks whose fp32 logits each stay under CHUNK_LOGITS_BYTES (1 for small batches)."""
    return max(1, math.ceil(tokens * vocab * 4 / CHUNK_LOGITS_BYTES))


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


def _fused_pass(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunks: int,
                dtype: torch.dtype, grad_hidden: bool, grad_weight: bool):
    """(mean loss over the real targets in fp32, d loss / d hidden or None, d loss / d weight in the compute dtype or
    None) of hidden (tokens, dim) x weight (vocab, dim) against targets (tokens,)."""
    w = weight.to(dtype)
    real_count = (targets != IGNORE).sum().clamp_min(1)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    d_hidden = torch.empty_like(hidden) if grad_hidden else None
    d_weight = None  # summed over the chunks in fp32, then held in the compute dtype as the plain GEMM gives it
    start = 0
    for x, t in zip(hidden.chunk(chunks), targets.chunk(chunks), strict=True):
        stop = start + x.shape[0]
        x = x.to(dtype)
        # one fp32 buffer of the chunk's logits, worked on in place: shifted by their max, exponentiated, then
        # (for the gradient) divided by their sum, the softmax
        probs = (x @ w.T).float()
        probs.sub_(probs.amax(dim=-1, keepdim=True))
        real = t != IGNORE
        target = torch.where(real, t, 0)
        picked = probs.gather(1, target[:, None]).squeeze(1)
        sums = probs.exp_().sum(dim=-1)
        total += torch.where(real, sums.log() - picked, 0.0).sum()  # log-sum-exp - target logit, both shifted
        if grad_hidden or grad_weight:
            probs.div_(sums[:, None])
            probs.scatter_add_(1, target[:, None], torch.full_like(picked[:, None], -1.0))
            grad = probs.mul_(real[:, None] / real_count).to(dtype)  # the logits' gradient
            del probs  # its fp32 buffer (unless the compute dtype is fp32)
            if grad_hidden:
                d_hidden[start:stop] = grad @ w
            if grad_weight:
                if d_weight is None:
                    d_weight = (grad.T @ x).float() if chunks > 1 else grad.T @ x
                elif d_weight.dtype == dtype:
                    d_weight.addmm_(grad.T, x)
                else:
                    d_weight.add_(grad.T @ x)
        start = stop
    return total / real_count, d_hidden, None if d_weight is None else d_weight.to(dtype)


class LinearCrossEntropy(torch.autograd.Function):
    """mean cross-entropy(hidden @ weight^T, targets), its gradients taken in the forward and stored."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunks: int, dtype: torch.dtype):
        with torch.autocast(hidden.device.type, enabled=False):
            loss, d_hidden, d_weight = _fused_pass(hidden, weight, targets, chunks, dtype,
                                                   ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        ctx.stored, ctx.weight_dtype = (d_hidden is not None, d_weight is not None), weight.dtype
        ctx.save_for_backward(*(g for g in (d_hidden, d_weight) if g is not None))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        stored = iter(ctx.saved_tensors)
        d_hidden = next(stored) if ctx.stored[0] else None
        d_weight = next(stored).to(ctx.weight_dtype) if ctx.stored[1] else None
        # in place where no cast copied them: the stored gradients are this graph's own, used once (a second
        # backward fails on their version counter)
        return (None if d_hidden is None else d_hidden.mul_(grad_loss),
                None if d_weight is None else d_weight.mul_(grad_loss), None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunks: int | None = None) -> torch.Tensor:
    """The mean next-token cross-entropy over the real targets of logits = hidden @ weight^T, fused over `chunks`
    chunks of the tokens (None: loss_chunks_for's count). hidden (..., dim), targets (...) of the same leading
    shape. Equal to train/step.lm_loss of the head's logits up to fp32 summation order."""
    flat, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    chunks = min(chunks or loss_chunks_for(flat.shape[0], weight.shape[0]), max(flat.shape[0], 1))
    dtype = _compute_dtype(hidden)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return LinearCrossEntropy.apply(flat, weight, flat_targets, chunks, dtype)
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):  # validation: the loss alone
        return _fused_pass(flat, weight, flat_targets, chunks, dtype, False, False)[0]


class OutputHead(nn.Linear):
    """The LM head (vocab x dim, no bias): logits, or given the targets their loss through linear_cross_entropy.
    The loss is taken inside this module's forward so that a sharded head weight (FSDP's unit) is whole there."""

    def __init__(self, dim: int, vocab_size: int):
        super().__init__(dim, vocab_size, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None,
                loss_chunks: int | None = None) -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        return linear_cross_entropy(x, self.weight, targets, loss_chunks)
