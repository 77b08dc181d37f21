"""transformers' Mixture-of-Experts layers (Qwen3-MoE, Mixtral, OLMoE, ...) under paratrain's expert swap points.

transformers 5 stores each MoE layer's experts fused in one module: `gate_up_proj` (E, 2 * I, H), gate rows
first, and `down_proj` (E, H, I), computed as `act(x W_gate^T) * (x W_up^T) W_down^T`; the block's own router
chooses the top-k experts and hands the experts module (tokens, expert ids, gates). We keep the router and
the weights exactly as they are (names, shapes, checkpoints, export) and replace only how the experts module
computes, through transformers' documented experts interface: `experts_implementation="paratrain"`
(integrations/moe.py's ExpertsInterface, as `attn_implementation` is for attention). The registered forward
is paratrain's: the routed copies sorted by expert, one grouped GEMM (or a loop), through the swap points
`dispatch` (local here; parallel/ep/expert_parallel.py swaps in the all-to-all under --ep) and, under --tp,
the experts split over the tp ranks by expert (SplitExpertsOverTP below). It also keeps each layer's routing
fingerprint (`last_routing`) that verify compares, as models/moe.py does.

The balancing loss is transformers' own: `router_aux_loss_coef` times its `load_balancing_loss_func` of every
layer's router logits, added when the config sets `output_router_logits` (as transformers adds it to its `labels`
loss then, and only then). Its routed-copy fractions are counted over all data ranks (`reduce_counts`, the
all-reduce parallel/ep/expert_parallel.py installs), as paratrain's own MoE counts them, so a layout computes what
one device computes; each rank's mean router probabilities are averaged like the language-model loss. As for
paratrain's own MoE it rides on the backward (`AddAuxLoss`): the reported loss is the next-token loss. Without
`output_router_logits`, `reduce_counts` is None: the router's counts never leave the rank.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from paratrain.models.moe import (
    AddAuxLoss,
    grouped_mm_inputs,
    grouped_mm_supported,
    identity_counts,
    local_dispatch,
    local_weight,
    routed_input,
)
from paratrain.models.moe_permute import expert_counts

IMPLEMENTATION = "paratrain"


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every experts module that takes transformers' experts interface (its decorator sets
    `is_concatenated` and the other layout flags on each instance)."""
    return [(name, m) for name, m in model.named_modules() if hasattr(m, "is_concatenated")]


def computes_here(module: nn.Module) -> bool:
    """transformers 5's fused layout this forward computes: 3-D gate_up_proj / down_proj, gate and up
    concatenated, not transposed, no biases, no norm after the experts."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3
            and getattr(module, "has_gate", False) and module.is_concatenated
            and not getattr(module, "is_transposed", True) and not getattr(module, "has_bias", True)
            and not getattr(module, "has_post_expert_norm", True))


def install_paratrain_experts(hf_model: nn.Module) -> int:
    """Route every experts module of `hf_model` through paratrain's forward; returns how many. A model with an
    experts module in another layout keeps transformers' own forward (one implementation serves the config)."""
    modules = experts_modules(hf_model)
    if not modules or not all(computes_here(m) for _, m in modules):
        return 0
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, paratrain_experts_forward)
    hf_model.set_experts_implementation(IMPLEMENTATION)
    for _, module in modules:
        module.dispatch = local_dispatch  # parallel/ep/expert_parallel.py: the all-to-all under --ep
        # counted over the data ranks only for the balancing loss (module docstring)
        module.reduce_counts = identity_counts if balancing_coef(hf_model.config) else None
        module.aux_scale = 1.0
        module.tp_mesh = None  # SplitExpertsOverTP: the tp ranks' mesh when the experts are split over it
        module.last_routing = None
        module.routing_forwards = 0  # forwards since verify last read last_routing (verify/routing_match.py)
        module.last_load = None
        module.last_dropped = 0
    return len(modules)


def balancing_coef(config) -> float:
    """The weight transformers gives the balancing loss in its own training loss: router_aux_loss_coef when the
    config sets output_router_logits, else none."""
    if not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def add_balancing_loss(hf_model: nn.Module, logits: torch.Tensor, router_logits, coef: float) -> torch.Tensor:
    """`logits` unchanged; in backward, the gradient of coef x transformers' load_balancing_loss_func of the
    layers' router logits, with the routed-copy fractions counted over all data ranks."""
    carrier = experts_modules(hf_model)[0][1]
    n_experts, k = router_logits[0].shape[-1], hf_model.config.num_experts_per_tok
    counts = torch.zeros(n_experts + 1, device=logits.device)  # copies per expert, then the rows routed
    probs = torch.zeros(n_experts, device=logits.device)
    for layer in router_logits:
        p = torch.softmax(layer.float(), dim=-1)
        counts[:n_experts] += torch.bincount(p.topk(k, dim=-1).indices.flatten(), minlength=n_experts)
        counts[n_experts] += p.shape[0]
        probs = probs + p.sum(0)
    total = carrier.reduce_counts(counts)
    aux = coef * n_experts * (total[:n_experts] / total[n_experts] * probs / counts[n_experts]).sum()
    return AddAuxLoss.apply(logits, aux, carrier.aux_scale, None)


def grouped_swiglu(module: nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x: (copies, H) sorted by expert, counts: copies per expert this rank holds -> (copies, H)."""
    gate_up, down = local_weight(module.gate_up_proj), local_weight(module.down_proj)
    if grouped_mm_supported(x):
        x, gate_up, down = grouped_mm_inputs(x, gate_up, down)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = module._apply_gate(torch._grouped_mm(x, gate_up.transpose(1, 2), offs=offs))
        return torch._grouped_mm(h, down.transpose(1, 2), offs=offs)
    return _expert_loop(module, x, counts, gate_up, down)


@torch.compiler.disable  # the split sizes are read on the host: the rest of the model still compiles
def _expert_loop(module: nn.Module, x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor) -> torch.Tensor:
    # unbind, not gate_up[e]: indexing's backward writes a zero gradient of all experts per expert
    outs = [F.linear(module._apply_gate(F.linear(chunk, a)), b)
            for chunk, a, b in zip(torch.split(x, counts.tolist()), gate_up.unbind(0), down.unbind(0))]
    return torch.cat(outs) if outs else x.new_zeros(0, down.shape[1])


def paratrain_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts module's forward (transformers' signature): (T, H), (T, k) ids, (T, k) gates -> (T, H)."""
    n_experts, k = self.num_experts, top_k_index.shape[-1]
    tokens = torch.arange(hidden_states.shape[0], device=hidden_states.device).repeat_interleave(k)
    experts_ids, gates = top_k_index.reshape(-1), top_k_weights.reshape(-1)
    # verify's fingerprint (models/moe.py): per expert, its copies and the sum of their tokens' first feature
    self.last_routing = torch.stack([
        expert_counts(experts_ids, n_experts).float(),
        torch.zeros(n_experts, device=hidden_states.device).index_add(0, experts_ids,
                                                                      hidden_states[tokens, 0].detach().float())])
    self.last_load = self.last_routing[0]
    self.routing_forwards += 1
    compute = functools.partial(grouped_swiglu, self)
    if self.tp_mesh is not None:
        return _tp_split_forward(self, hidden_states, tokens, experts_ids, gates, compute)
    out = self.dispatch(routed_input(hidden_states), tokens, experts_ids, gates, compute, n_experts, k)
    return out.to(hidden_states.dtype)


# -- --tp: the experts split over the tp ranks by expert -------------------------------------------------------
def _grad_summed_over(x: torch.Tensor, mesh) -> torch.Tensor:
    """Identity forward; in backward the ranks' partial gradients are summed (a column-parallel entry)."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _summed_over(x: torch.Tensor, mesh) -> torch.Tensor:
    """The ranks' partial results summed (a row-parallel exit): all-reduce forward, identity backward."""
    return DTensor.from_local(x, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()


def _tp_split_forward(self, x, tokens, experts_ids, gates, compute) -> torch.Tensor:
    """Every tp rank has every token (TP without SP replicates the block's input) and E / tp of the experts: it
    computes the copies routed to its own experts, once, and the partial outputs are summed like a row-parallel
    linear's. The gates' and the inputs' gradients are partial on each rank (only its experts' copies reach
    them) and summed in backward, so the router's gradient is whole on every rank, as its Replicate weight needs."""
    mesh = self.tp_mesh
    local = local_weight(self.gate_up_proj).shape[0]
    first = mesh.get_local_rank() * local
    mine = (experts_ids >= first) & (experts_ids < first + local)
    x_in, gates = _grad_summed_over(x, mesh), _grad_summed_over(gates, mesh)
    tokens, ids, gates = tokens[mine], experts_ids[mine] - first, gates[mine]
    out = local_dispatch(routed_input(x_in), tokens, ids, gates, compute, local).to(x.dtype)
    return _summed_over(out, mesh)


class SplitExpertsOverTP(ParallelStyle):
    """transformers' "moe_tp_experts" (with "packed_colwise" gate_up_proj and "rowwise" down_proj), done as an
    expert split: gate_up_proj and down_proj become Shard(0) DTensors (E / tp experts per rank, whole), and the
    forward above computes each routed copy once, on the rank holding its expert."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(module, name)
            module.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), device_mesh, [Shard(0)]),
                                                         requires_grad=p.requires_grad))
        module.tp_mesh = device_mesh
        return module


class ReplicateRouter(ParallelStyle):
    """The router (a linear to the expert logits, then top-k) whole on every tp rank: its weight a Replicate
    DTensor, its input wrapped as Replicate, its outputs (logits, gates, ids) handed back as local tensors."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def inputs(_module, args, mesh):
            return tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                         if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a for a in args)

        def outputs(_module, out, mesh):
            local = [o.to_local() if isinstance(o, DTensor) else o for o in (out if isinstance(out, tuple) else (out,))]
            return tuple(local) if isinstance(out, tuple) else local[0]

        return distribute_module(module, device_mesh, input_fn=inputs, output_fn=outputs)
