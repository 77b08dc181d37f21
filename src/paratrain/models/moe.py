"""A Mixture-of-Experts feed-forward (router, routed experts, optional shared experts) and the decoder using it.

Plain PyTorch, like llama.py. Three swap points let parallel/ep/expert_parallel.py act from outside:
`MoE.dispatch` (the routed copies to their experts and each token's gated sum back; local by default, an
all-to-all over the expert-parallel ranks under --ep), `MoE.reduce_counts`
(identity by default; the all-reduce that makes the load-balancing loss global over the data ranks) and
`MoE.aux_scale` (the weight of one micro-batch's loss). Routing is dropless token choice unless the model
sets a capacity factor.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.models.args import ModelArgs
from paratrain.models.llama import FeedForward, Transformer
from paratrain.models.moe_permute import expert_counts, inverse_permutation, permute, sorted_copies
from paratrain.models.speed import ModelSpeed


def local_weight(w: torch.Tensor) -> torch.Tensor:
    """The experts this rank holds: under --ep the weights are DTensors split on the expert dim."""
    return w.to_local() if hasattr(w, "to_local") else w


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """torch._grouped_mm runs on Hopper-class GPUs in bf16: tokens already in bf16, or bf16 autocast on (the
    residual stream stays fp32 under autocast, and autocast has no rule for _grouped_mm, so grouped_mm_inputs
    casts). Elsewhere the experts run as a loop."""
    if not (x.is_cuda and hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(x.device)[0] >= 9):
        return False
    return x.dtype == torch.bfloat16 or (torch.is_autocast_enabled("cuda")
                                         and torch.get_autocast_dtype("cuda") == torch.bfloat16)


def grouped_mm_inputs(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(torch.bfloat16) for t in tensors]


class Experts(nn.Module):
    """n SwiGLU experts stored as (n, in, out) tensors: one grouped GEMM per matrix over tokens sorted by expert."""

    def __init__(self, n: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n, dim, hidden))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: (tokens, dim) sorted by expert; counts: tokens per (local) expert."""
        w1, w2, w3 = local_weight(self.w1), local_weight(self.w2), local_weight(self.w3)
        if grouped_mm_supported(x):
            x, w1, w2, w3 = grouped_mm_inputs(x, w1, w2, w3)
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            h = F.silu(torch._grouped_mm(x, w1, offs=offs)) * torch._grouped_mm(x, w3, offs=offs)
            return torch._grouped_mm(h, w2, offs=offs)
        return expert_loop(x, counts, w1, w2, w3)


@torch.compiler.disable  # the split sizes are read on the host: the rest of the model still compiles
def expert_loop(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                w3: torch.Tensor) -> torch.Tensor:
    # unbind, not w1[e]: indexing's backward writes a zero gradient of all n experts per expert (n^2 traffic)
    outs = [F.silu(chunk @ a) * (chunk @ c) @ b
            for chunk, a, b, c in zip(torch.split(x, counts.tolist()), w1.unbind(0), w2.unbind(0), w3.unbind(0))]
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[-1])


class Router(nn.Module):
    """Top-k gating: softmax over experts (Mixtral, Qwen3-MoE) or per-expert sigmoid (DeepSeek-V3). The bias
    (auxiliary-loss-free balancing) shifts which experts are chosen, never the gate values."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = nn.Linear(args.dim, args.n_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(args.n_experts), persistent=True)
        self.kind, self.top_k, self.norm_topk = args.router, args.top_k, args.norm_topk

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gates (T, k), expert ids (T, k), the scores the balancing loss reads (T, E), each row summing to 1)."""
        logits = self.gate(x).float()
        scores = torch.sigmoid(logits) if self.kind == "sigmoid" else torch.softmax(logits, dim=-1)
        ids = torch.topk(scores + self.expert_bias, self.top_k, dim=-1).indices
        gates = scores.gather(-1, ids)
        if self.norm_topk and self.top_k > 1:
            gates = gates / gates.sum(-1, keepdim=True)
        probs = scores / scores.sum(-1, keepdim=True) if self.kind == "sigmoid" else scores
        return gates.type_as(x), ids, probs


def routed_input(x: torch.Tensor) -> torch.Tensor:
    """The tokens the experts receive. Under autocast the experts compute in its dtype, so the copies are cast
    once before they are gathered, sorted and sent: half the bytes of the fp32 residual stream, same numerics."""
    device = x.device.type
    return x.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else x


def combine(y: torch.Tensor, gates: torch.Tensor, tokens: torch.Tensor, n_tokens: int, top_k: int) -> torch.Tensor:
    """Each token's output: its copies' results (rows in routed order) weighted by their gates. Dropless routing
    keeps every token's k copies side by side, so this is a (1 x k) @ (k x dim) product per token: one read of
    y, no atomics; with copies dropped over capacity, an index_add."""
    if top_k and y.shape[0] == n_tokens * top_k:
        return torch.bmm(gates.view(n_tokens, 1, top_k).to(y.dtype), y.view(n_tokens, top_k, -1)).view(n_tokens, -1)
    out = y.new_zeros(n_tokens, y.shape[-1], dtype=torch.promote_types(y.dtype, gates.dtype))
    return out.index_add(0, tokens, y * gates[:, None])


def local_dispatch(x: torch.Tensor, tokens: torch.Tensor, experts_ids: torch.Tensor, gates: torch.Tensor,
                   experts: Experts, n_experts: int, top_k: int = 0) -> torch.Tensor:
    """Every expert on this rank: the routed copies sorted by expert, one grouped GEMM, results back in routed
    order, each token's gated sum (T, dim). Copy i is token tokens[i]'s choice of expert experts_ids[i] with
    weight gates[i]. top_k: each token's copies are its k adjacent ones (dropless routing); 0 when copies were
    dropped."""
    order = experts_ids.argsort(stable=True)
    inverse = inverse_permutation(order)
    y = experts(sorted_copies(x, tokens, order, inverse, top_k), expert_counts(experts_ids, n_experts))
    return combine(permute(y, inverse, order), gates, tokens, x.shape[0], top_k)


class AddAuxLoss(torch.autograd.Function):
    """Passes `out` (the gates) through; in backward, adds the balancing loss's gradient (weight `scale`) and
    applies the bias update once per backward (not again when activation checkpointing replays the forward)."""

    @staticmethod
    def forward(ctx, out, aux, scale, on_backward):
        ctx.scale, ctx.on_backward = scale, on_backward
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        if ctx.on_backward is not None:
            ctx.on_backward()
        return grad, torch.full((), ctx.scale, device=grad.device, dtype=torch.float32), None, None


def identity_counts(counts: torch.Tensor) -> torch.Tensor:
    return counts


class MoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_experts, self.top_k = args.n_experts, args.top_k
        self.router = Router(args)
        self.experts = Experts(args.n_experts, args.dim, args.expert_dim)
        self.shared = FeedForward(args.dim, args.expert_dim * args.n_shared_experts) if args.n_shared_experts else None
        self.aux_coeff, self.bias_rate, self.capacity_factor = args.aux_loss_coeff, args.bias_update_rate, \
            args.capacity_factor
        self.dispatch = local_dispatch  # parallel/ep/expert_parallel.py swaps in the all-to-all
        self.reduce_counts = identity_counts  # ... and the all-reduce over the data ranks
        self.aux_scale = 1.0  # the weight of one micro-batch's loss (1 / micro-batches)
        self.last_load: torch.Tensor | None = None  # tokens per expert over all data ranks, last forward
        self.last_dropped = 0
        self.last_routing: torch.Tensor | None = None  # this rank's (counts, feature sums) per expert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        gates, ids, probs = self.router(x)
        tokens = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.top_k)
        experts_ids, gates = ids.flatten(), gates.flatten()
        if self.capacity_factor > 0:  # a (batch, seq, dim) input: capacity per sequence; (tokens, dim): one sequence
            seq_len = shape[-2] if len(shape) == 3 else x.shape[0]
            tokens, experts_ids, gates = self._drop_over_capacity(tokens, experts_ids, gates, seq_len)
        # the routing fingerprint verify compares: per expert, its token count and the sum of its tokens'
        # first feature (a misrouted token changes both); reduce_counts sums them over the data ranks
        local = torch.stack([expert_counts(experts_ids, self.n_experts).to(x.dtype),
                             torch.zeros(self.n_experts, dtype=x.dtype, device=x.device).index_add(
                                 0, experts_ids, x[tokens, 0].detach())])
        self.last_routing = local.detach().float()  # this rank's share; verify sums the ranks' itself
        routing = self.reduce_counts(local.float())
        counts, tokens_total = routing[0], routing[0].sum()
        self.last_load = counts.detach()
        if self.training and torch.is_grad_enabled():
            # Switch/GShard balancing loss over the tokens of all data ranks: E * sum_i f_i * P_i, with f_i the
            # global fraction of routed copies at expert i and P_i this rank's mean score (the ranks' losses are
            # averaged like the language-model loss, so each rank's mean stands for its share of the global mean).
            # It rides on the gates, a tensor made here: on the block's output, which --compile may hand over
            # from another graph, AOT autograd replays the pass-through view outside the Function and the loss's
            # gradient is lost
            f = counts / tokens_total.clamp(min=1)
            aux = self.aux_coeff * self.n_experts * (f * probs.mean(0)).sum()
            update = (lambda: self._update_bias(counts)) if self.bias_rate > 0 else None
            gates = AddAuxLoss.apply(gates, aux, self.aux_scale, update)
        dropless = tokens.numel() == x.shape[0] * self.top_k
        out = self.dispatch(routed_input(x), tokens, experts_ids, gates, self.experts, self.n_experts,
                            self.top_k if dropless else 0)
        if self.shared is not None:
            out = out + self.shared(x)
        return out.view(shape)

    @torch.compiler.disable  # which copies survive, and how many, depends on the data
    def _drop_over_capacity(self, tokens, experts_ids, gates, seq_len: int):
        """Keep, per sequence and expert, the first `capacity = ceil(factor x S x k / E)` copies in token order (a
        capacity factor is not dropless). Per sequence, not per micro-batch: which copies drop depends on the
        sequence alone, so every layout that keeps sequences whole (dp, ep, tp, pp, gradient accumulation)
        drops the ones one device drops, and verify compares like with like."""
        capacity = max(1, math.ceil(self.capacity_factor * seq_len * self.top_k / self.n_experts - 1e-9))
        group = torch.div(tokens, seq_len, rounding_mode="floor") * self.n_experts + experts_ids
        order = group.argsort(stable=True)  # by (sequence, expert), token order kept within
        counts = torch.bincount(group)
        starts = torch.cumsum(counts, 0) - counts
        rank_in_group = torch.empty_like(order)
        rank_in_group[order] = torch.arange(order.numel(), device=order.device) - starts[group[order]]
        keep = rank_in_group < capacity
        self.last_dropped = int((~keep).sum())
        return tokens[keep], experts_ids[keep], gates[keep]

    @torch.no_grad()
    def _update_bias(self, counts: torch.Tensor) -> None:
        """Auxiliary-loss-free balancing: raise the bias of under-loaded experts, lower the over-loaded ones'."""
        self.router.expert_bias.add_(self.bias_rate * torch.sign(counts.mean() - counts))


class MoETransformer(Transformer):
    """The Llama decoder with MoE feed-forwards after the first n_dense_layers blocks (same names otherwise)."""

    def __init__(self, args: ModelArgs, speed: ModelSpeed = ModelSpeed()):
        super().__init__(args, speed)
        for index, block in self.layers.items():
            if args.is_moe_layer(int(index)):
                block.feed_forward = MoE(args)

    def init_weights(self, seed: int) -> None:
        super().init_weights(seed)
        for module in self.modules():
            if isinstance(module, Router):
                module.expert_bias.zero_()


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def load_carriers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every MoE layer that keeps its last forward's load: paratrain's MoE, and the experts
    module of a transformers MoE under paratrain's forward (models/hf_moe.py), found by the fields both keep."""
    return [(name, m) for name, m in model.named_modules()
            if hasattr(m, "last_load") and hasattr(m, "last_dropped") and hasattr(m, "dispatch")]


def expert_load_record(model_parts) -> dict:
    """The metrics.jsonl fields of this rank's MoE layers, from their last forward: per layer the routed copies
    per expert, their max / mean, and the copies dropped over capacity (this rank). paratrain's MoE counts over
    all data ranks (its balancing loss sums them); a transformers MoE (no balancing loss, no count all-reduce)
    counts this rank's own tokens."""
    layers = []
    for part in model_parts:
        for name, moe in load_carriers(part):
            if moe.last_load is None:
                continue
            load = [int(v) for v in moe.last_load.tolist()]
            mean = sum(load) / len(load) if load else 0.0
            layers.append({"layer": ".".join(p for p in name.split(".") if not p.startswith("_") and p != "module"),
                           "tokens_per_expert": load, "max_over_mean": max(load) / mean if mean else None,
                           "dropped": moe.last_dropped})
    return {"expert_load": layers} if layers else {}
