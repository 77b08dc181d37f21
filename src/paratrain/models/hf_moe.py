"""transformers' Mixture-of-Experts layers (any family whose experts take transformers' experts interface: Qwen2/3-MoE,
Mixtral, OLMoE, DeepSeek-V2/V3, GPT-OSS, GLM-4.5, ...) under paratrain's expert swap points.

transformers 5 stores each MoE layer's experts fused in one module (models/hf_moe_layout.py finds it by its shape):
`gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I), or transposed ((E, H, 2I), (E, I, H): GPT-OSS, Aria), with
optional per-expert biases (GPT-OSS), an optional norm after the experts, and the family's own gate
(`_apply_gate`: SwiGLU on concatenated or interleaved halves, GPT-OSS's clamped variant) or none (`up_proj` and
the activation); the block's own router (softmax, sigmoid, group-limited, with or without a routing bias) chooses
the top-k experts and hands the experts module (tokens, expert ids, gates). We keep the router, the shared experts
and the weights exactly as they are (names, shapes, checkpoints, export) and replace only how the experts module
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


def install_paratrain_experts(hf_model: nn.Module) -> int:
    """Route every experts module of `hf_model` through paratrain's forward; returns how many. Where any layer's
    experts cannot be split (hf_moe_layout.py's split_refusal: another layout, or a router with other choices),
    the model keeps transformers' own forward (one implementation serves the config)."""
    from paratrain.models.hf_moe_layout import moe_layers

    layers = moe_layers(hf_model)
    modules = experts_modules(hf_model)
    splittable = {layer.experts for layer in layers if layer.split_refusal() is None}
    if not modules or not layers or any(name not in splittable for name, _ in modules) or \
            len(splittable) != len(layers):
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


def expert_tensors(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The experts module's own (E, ...) parameters: what --ep and --tp split by expert."""
    n = module.num_experts
    return [(name, p) for name, p in module.named_parameters(recurse=False) if p.dim() >= 1 and p.shape[0] == n]


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


def grouped_experts(module: nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x: (copies, H) sorted by expert, counts: copies per expert this rank holds -> (copies, H), in the module's
    own layout (its flags: transposed weights, biases, its gate or the plain activation, a norm after)."""
    up_name = "gate_up_proj" if module.has_gate else "up_proj"
    up, down = local_weight(getattr(module, up_name)), local_weight(module.down_proj)
    if not module.is_transposed:  # (E, out, in) -> (E, in, out): every GEMM below is x @ w[e]
        up, down = up.transpose(1, 2), down.transpose(1, 2)
    if grouped_mm_supported(x):
        x, up, down = grouped_mm_inputs(x, up, down)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = _add_bias(module, up_name, torch._grouped_mm(x, up, offs=offs), counts)
        h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
        y = _add_bias(module, "down_proj", torch._grouped_mm(h, down, offs=offs), counts)
    else:
        y = _expert_loop(module, up_name, x, counts, up, down)
    return module.post_expert_norm(y) if module.has_post_expert_norm else y


def _add_bias(module: nn.Module, name: str, y: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    if not module.has_bias:
        return y
    bias = local_weight(getattr(module, name + "_bias"))
    return y + bias.to(y.dtype).repeat_interleave(counts, dim=0, output_size=y.shape[0])


@torch.compiler.disable  # the split sizes are read on the host: the rest of the model still compiles
def _expert_loop(module: nn.Module, up_name: str, x: torch.Tensor, counts: torch.Tensor, up: torch.Tensor,
                 down: torch.Tensor) -> torch.Tensor:
    biases = [local_weight(getattr(module, f"{name}_bias")).unbind(0) if module.has_bias else [None] * up.shape[0]
              for name in (up_name, "down_proj")]
    outs = []
    # unbind, not up[e]: indexing's backward writes a zero gradient of all experts per expert
    for chunk, a, b, bias_a, bias_b in zip(torch.split(x, counts.tolist()), up.unbind(0), down.unbind(0), *biases):
        h = chunk @ a if bias_a is None else torch.addmm(bias_a, chunk, a)
        h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
        outs.append(h @ b if bias_b is None else torch.addmm(bias_b, h, b))
    return torch.cat(outs) if outs else x.new_zeros(0, down.shape[-1])


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
    compute = functools.partial(grouped_experts, self)
    if self.tp_mesh is not None:
        return _tp_split_forward(self, hidden_states, tokens, experts_ids, gates, compute)
    out = self.dispatch(routed_input(hidden_states), tokens, experts_ids, gates, compute, n_experts, k)
    return out.to(hidden_states.dtype)


# -- --tp: the experts split over the tp ranks by expert -------------------------------------------------------
def grad_summed_over(x: torch.Tensor, mesh) -> torch.Tensor:
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
    local = local_weight(self.down_proj).shape[0]
    first = mesh.get_local_rank() * local
    mine = (experts_ids >= first) & (experts_ids < first + local)
    x_in, gates = grad_summed_over(x, mesh), grad_summed_over(gates, mesh)
    tokens, ids, gates = tokens[mine], experts_ids[mine] - first, gates[mine]
    out = local_dispatch(routed_input(x_in), tokens, ids, gates, compute, local).to(x.dtype)
    return _summed_over(out, mesh)


class SplitExpertsOverTP(ParallelStyle):
    """transformers' "moe_tp_experts" (with "packed_colwise" gate_up_proj and "rowwise" down_proj), done as an
    expert split: every (E, ...) tensor of the experts module (projections and their biases) becomes a Shard(0)
    DTensor (E / tp experts per rank, whole), and the forward above computes each routed copy once, on the rank
    holding its expert. Also the split of a model whose tp plan leaves its experts out (GPT-OSS)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for name, p in expert_tensors(module):
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
