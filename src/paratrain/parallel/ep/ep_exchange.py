"""--ep's token exchange, deduplicated by rank: a token travels once to each rank that holds any of its chosen
experts, not once per chosen expert. That rank expands it into the copies its own experts take, runs them in one
grouped GEMM, sums their gated outputs, and sends one row per (token, rank) back.

Why not one all-to-all of the routed copies (torchtitan's and Megatron's plain all-to-all dispatcher): with top-k
routing a token's k copies often share a rank, and every shared one is the same row sent again. Balanced random
top-8 of 128 experts over 8 ranks reaches 5.3 ranks per token (8 copies), and routers that keep a token's experts
together (DeepSeek-V3's node-limited routing, or NeMo AutoModel's balanced benchmark gate, whose k consecutive
experts sit on one or two ranks) reach 1-2. DeepEP does the same per rank inside a node; this is it with
all_to_all_single, on every backend (gloo included).

Per MoE layer and forward, four all-to-alls over the ep group, each through paratrain's door (collective_hooks.py):
  moe_splits    per destination: copies per local expert, then the row count (ep x (E/ep + 1) int64)
  moe_routing   per copy (sorted by local expert): its row within what its source sends, and its gate, as one
                (copies x 2) fp64 tensor (integers below 2^53 are exact) so that one call, not two, pays the
                latency; autograd: the gates' gradients come back in backward
  moe_dispatch  the rows (autograd)
  moe_combine   the gated sums, one per row, home (autograd)
The autograd ones run reversed in backward, purpose + "_backward".
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from paratrain.models.moe_permute import expert_counts, inverse_permutation, permute, sorted_copies
from paratrain.parallel.collective_hooks import collective


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits whose backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, purpose):
        ctx.splits, ctx.group, ctx.purpose = (out_splits, in_splits), group, purpose
        return exchange(x, out_splits, in_splits, group, purpose)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return exchange(grad, in_splits, out_splits, ctx.group, ctx.purpose + "_backward"), None, None, None, None


def exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, purpose: str) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    collective(purpose, "ep", "all_to_all", group,
               lambda: dist.all_to_all_single(out, x, out_splits, in_splits, group=group), (x, out))
    return out


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` in backward."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def split_counts(received: torch.Tensor, ep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The moe_splits buffer as (copies per source and local expert (ep, E/ep), rows per source (ep,))."""
    table = received.view(ep, -1)
    return table[:, :-1], table[:, -1]


class AllToAllDispatch:
    """MoE.dispatch under --ep (module docstring): (T, dim) tokens and their routed copies -> (T, dim), each token's
    gated sum over its experts, wherever they live."""

    def __init__(self, group, ep: int, weight_grad_scale: float = 1.0):
        self.group, self.ep, self.weight_grad_scale = group, ep, weight_grad_scale

    @torch.compiler.disable  # the all-to-all's split sizes are read on the host
    def __call__(self, x: torch.Tensor, tokens: torch.Tensor, experts_ids: torch.Tensor, gates: torch.Tensor,
                 experts: nn.Module, n_experts: int, top_k: int = 0) -> torch.Tensor:
        ep, local, n_tokens = self.ep, n_experts // self.ep, x.shape[0]
        dest = experts_ids // local
        # one row per (destination, token), sorted by destination: the send buffer's order
        rows, row_of_copy = torch.unique(dest * n_tokens + tokens, return_inverse=True)
        row_token, rows_to = rows % n_tokens, expert_counts(rows // n_tokens, ep)
        counts = torch.cat([expert_counts(experts_ids, n_experts).view(ep, local), rows_to[:, None]], 1)
        received_counts = torch.empty_like(counts)
        collective("moe_splits", "ep", "all_to_all", self.group,
                   lambda: dist.all_to_all_single(received_counts, counts, group=self.group),
                   (counts, received_counts))
        copies_in, rows_in = split_counts(received_counts, ep)
        copies_out = counts[:, :-1].sum(1)
        sizes = torch.stack([copies_out, copies_in.sum(1), rows_to, rows_in]).tolist()  # the one host read
        copies_out_n, copies_in_n, rows_out_n, rows_in_n = sizes
        # copies sorted by expert (by destination, then local expert); each names its row within its destination's
        order = experts_ids.argsort(stable=True)
        first_row = torch.cumsum(rows_to, 0) - rows_to
        copy_row = (row_of_copy - first_row[dest])[order]
        routing = torch.stack([copy_row.to(torch.float64), gates[order].to(torch.float64)], 1)
        arrived = _AllToAll.apply(routing, copies_in_n, copies_out_n, self.group, "moe_routing")
        arrived_row, arrived_gate = arrived[:, 0].long(), arrived[:, 1]
        received = _AllToAll.apply(x.index_select(0, row_token), rows_in_n, rows_out_n, self.group, "moe_dispatch")
        # arrivals come by source rank (each source's copies by local expert): rows numbered across sources, then
        # every copy regrouped by local expert for one GEMM
        arrivals = sum(copies_in_n)  # given, so that the two repeats below need no second host read on a GPU
        source = torch.repeat_interleave(torch.arange(ep, device=x.device), copies_in.sum(1), output_size=arrivals)
        arrived_row = arrived_row + (torch.cumsum(rows_in, 0) - rows_in)[source]
        expert_of = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(copies_in.reshape(-1),
                                                                                      output_size=arrivals)
        regroup = expert_of.argsort(stable=True)
        ungroup = inverse_permutation(regroup)
        scale = self.weight_grad_scale
        # the experts' weight gradients take `scale` (apply_ep); the inputs' gradients are left as they are
        grouped = _ScaleGrad.apply(sorted_copies(received, arrived_row, regroup, ungroup, 0), 1.0 / scale)
        y = _ScaleGrad.apply(experts(grouped, expert_counts(expert_of, local)), scale)
        gate = permute(arrived_gate[:, None].to(y.dtype), regroup, ungroup)
        # summed in the experts' dtype (bf16 under autocast): at most E/ep copies per row here and ep rows per
        # token at home; an fp32 sum would write a (copies x dim) fp32 temporary, twice the bf16 copies' bytes
        summed = y.new_zeros(received.shape[0], y.shape[-1]).index_add(0, arrived_row[regroup], y * gate)
        back = _AllToAll.apply(summed, rows_out_n, rows_in_n, self.group, "moe_combine")
        return back.new_zeros(n_tokens, y.shape[-1]).index_add(0, row_token, back)
