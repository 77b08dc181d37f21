"""Moving an MoE layer's routed copies between token order and expert order, as gathers both ways.

Routing sorts the T*k copies (token t's j-th choice is copy t*k + j) by expert, and puts the experts' results
back in copy order. Written as `x[index]` and `zeros.index_copy(...)`, autograd's backward is a zero fill
plus an atomic scatter-add (index_put with accumulate), and each un-sort writes a zero buffer first. A sort is
a permutation, so each direction is a gather by the permutation or by its inverse: one read and one write,
forward and backward, no atomics. A token's gradient is the sum over its k copies, side by side in copy
order: one reduction, or an index_add when copies were dropped over capacity.
"""

from __future__ import annotations

import torch


def expert_counts(experts_ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Copies per expert. Unlike bincount, its size never depends on the data, so torch.compile traces it."""
    return experts_ids.new_zeros(n_experts).scatter_add_(0, experts_ids, torch.ones_like(experts_ids))


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


class _Permute(torch.autograd.Function):
    """x's rows in the order `index` (a permutation); backward gathers by its inverse."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class _CopiesInOrder(torch.autograd.Function):
    """The routed copies of x's rows, sorted: x[tokens[order]]. Backward: the copies' gradients back in copy order
    (a gather by the inverse of `order`), summed per token."""

    @staticmethod
    def forward(ctx, x, tokens, order, inverse, top_k):
        ctx.save_for_backward(tokens, inverse)
        ctx.n_tokens, ctx.top_k = x.shape[0], top_k
        return x.index_select(0, tokens.index_select(0, order))

    @staticmethod
    def backward(ctx, grad):
        tokens, inverse = ctx.saved_tensors
        copies = grad.index_select(0, inverse)
        if ctx.top_k and copies.shape[0] == ctx.n_tokens * ctx.top_k:  # dropless: a token's k copies are adjacent
            return copies.view(ctx.n_tokens, ctx.top_k, -1).sum(1), None, None, None, None
        summed = copies.new_zeros(ctx.n_tokens, copies.shape[-1]).index_add_(0, tokens, copies)
        return summed, None, None, None, None


def permute(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """x[index] for a permutation `index` whose inverse is `inverse`."""
    return _Permute.apply(x, index, inverse)


def sorted_copies(x: torch.Tensor, tokens: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor,
                  top_k: int) -> torch.Tensor:
    """x[tokens[order]]: each routed copy of a token's row, in the order `order` (its inverse: `inverse`).
    top_k > 0 says tokens is arange(T).repeat_interleave(top_k) (dropless routing); 0: anything else."""
    return _CopiesInOrder.apply(x, tokens, order, inverse, top_k)
