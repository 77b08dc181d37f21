"""What the planner traces for an MoE layer: routing of fixed shape, every expert taking an equal share.

The runtime's routing (models/moe.py) sorts and counts tokens, whose output sizes depend on the data and cannot
be traced on fake tensors. The stand-in does the same work with the balanced router the planner assumes: the
router matmul and top-k, each token copied k times, one batched GEMM per expert matrix over T*k/E tokens each,
the weighted combine. Under --ep the same FLOPs run on the rank's E/ep experts (each then takes ep times the
tokens), around the exchange's gathers and sums; the all-to-alls that move them are priced apart
(parallel/ep/ep_cost.py: moe_all_to_all).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.costs.expert_spread import ranks_per_token
from paratrain.models.moe import combine, routed_input
from paratrain.models.moe_permute import inverse_permutation, permute, sorted_copies


def balanced_forward(moe: nn.Module, ep: int = 1, log=None):
    """Under --ep the rank sends each token once to every rank holding any of its experts (T*r rows, r for a
    uniformly random choice: costs/expert_spread.py), and its E/ep experts run the T*k copies of the ep
    group's tokens they receive (as many as it sends, balanced), reading and accumulating gradients into only
    those experts' weights; the gated sums go back one per row (parallel/ep/ep_exchange.py)."""
    experts, k, n = moe.experts, moe.top_k, moe.n_experts // ep
    if ep > 1:
        split_experts(experts, ep)
    w1, w2, w3 = (getattr(experts, name if ep == 1 else f"{name}_0") for name in ("w1", "w2", "w3"))

    def grouped(copies: torch.Tensor) -> torch.Tensor:
        per_expert = math.ceil(copies.shape[0] / n)
        pad = per_expert * n - copies.shape[0]  # balanced routing fills every expert alike: usually none
        padded = (F.pad(copies, (0, 0, 0, pad)) if pad else copies).view(n, per_expert, -1)
        hidden = F.silu(torch.bmm(padded, w1)) * torch.bmm(padded, w3)
        return torch.bmm(hidden, w2).reshape(n * per_expert, -1)[: copies.shape[0]]

    def forward(x: torch.Tensor) -> torch.Tensor:
        # the runtime's ops (models/moe.py: local_dispatch; parallel/ep/ep_exchange.py under --ep) with the
        # data-dependent ones at their balanced sizes: same tensors alive, same bytes moved
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if ep > 1 and torch.is_autocast_enabled(flat.device.type):
            flat = flat.to(torch.get_autocast_dtype(flat.device.type))  # FSDP2's bf16 block input
        scores = torch.softmax(moe.router.gate(flat).float(), dim=-1)
        top = torch.topk(scores, k, dim=-1)
        gates, ids = top.values.type_as(flat).flatten(), top.indices.flatten()
        tokens = torch.arange(flat.shape[0], device=flat.device).repeat_interleave(k)
        order = ids.argsort(stable=True)
        if ep > 1:
            out = exchanged_experts(routed_input(flat), tokens, order, gates, moe.n_experts, k, ep, grouped, log)
        else:
            inverse = inverse_permutation(order)
            routed = grouped(sorted_copies(routed_input(flat), tokens, order, inverse, k))
            out = combine(permute(routed, inverse, order), gates, tokens, flat.shape[0], k)
        if moe.shared is not None:
            out = out + moe.shared(flat)
        return out.view(shape)

    return forward


def exchanged_experts(x, tokens, order, gates, n_experts: int, k: int, ep: int, grouped, log) -> torch.Tensor:
    """ep_exchange.AllToAllDispatch at balanced sizes: T*r rows out, T*k copies (their row numbers and gates)
    expanded from what arrives, the gated sums accumulated per row, sent back and summed per token."""
    n_tokens = x.shape[0]
    n_rows = max(1, round(n_tokens * ranks_per_token(n_experts, k, ep)))
    row_token = torch.arange(n_rows, device=x.device) % n_tokens
    routing = exchanged(torch.stack([(tokens[order] % n_rows).to(torch.float64), gates[order].to(torch.float64)], 1),
                        log)
    copy_row, gate = routing[:, 0].long(), routing[:, 1]
    received = exchanged(x.index_select(0, row_token), log)
    regroup = copy_row.argsort(stable=True)
    y = grouped(sorted_copies(received, copy_row, regroup, inverse_permutation(regroup), 0))
    weighted = y * permute(gate[:, None].to(y.dtype), regroup, inverse_permutation(regroup))
    summed = y.new_zeros(n_rows, y.shape[-1]).index_add(0, copy_row[regroup], weighted)
    back = exchanged(summed, log)
    return back.new_zeros(n_tokens, y.shape[-1]).index_add(0, row_token, back)


def exchanged(x: torch.Tensor, log) -> torch.Tensor:
    """The all-to-all's output buffer: allocated like the runtime's, its transfer priced by moe_all_to_all."""
    if log is None:
        return x.clone()
    with log.simulating():
        return x.clone()


def split_experts(experts: nn.Module, ep: int) -> None:
    """Each expert matrix as ep parameters of E/ep experts (the bytes FSDP holds are unchanged): the rank's own
    share is the first; the others, another rank's experts, get no gradient here, as under --ep."""
    for name in ("w1", "w2", "w3"):
        whole = getattr(experts, name)
        delattr(experts, name)
        for i, part in enumerate(whole.detach().chunk(ep, 0)):
            experts.register_parameter(f"{name}_{i}", nn.Parameter(part.clone()))


def trace_balanced_moe(model: nn.Module, ep: int = 1, log=None) -> None:
    """Swap every MoE layer of a model the planner traces for its balanced stand-in (`log`: the trace's CommLog)."""
    from paratrain.models.moe import moe_layers

    for _, moe in moe_layers(model):
        moe.forward = balanced_forward(moe, ep, log)
