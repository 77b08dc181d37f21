"""Expert parallelism (--ep): each MoE layer's experts split over ep of the data-parallel ranks, tokens sent to
their experts and back with all_to_all_single (variable splits; once per rank, not per copy: ep_exchange.py),
expert weights FSDP-sharded over the rest.

An MoE layer is found by its swap points, never by its class (of models/ only moe_permute.py is used): `dispatch`,
`reduce_counts` and `aux_scale`. Its expert weights are its `experts` submodule (models/moe.py) or, where it has
none, the layer itself (a transformers experts module, models/hf_moe.py: `reduce_counts` None, no balancing
loss). `attach_moe` runs for every layout (the balancing loss counts tokens over all data ranks even without
--ep); `apply_ep` when ep > 1. Every collective passes paratrain's door (collective_hooks.py), with purpose
"moe_counts" here and the exchange's own (ep_exchange.py: "moe_splits", "moe_copies", "moe_gates",
"moe_dispatch", "moe_combine", the autograd ones' backward halves "..._backward"), so hooks and the hang
diagnosis see them.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from paratrain.errors import UserError
from paratrain.parallel.collective_hooks import collective
from paratrain.parallel.ep.ep_exchange import AllToAllDispatch

log = logging.getLogger("paratrain")


def moe_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if all(hasattr(m, a) for a in ("dispatch", "reduce_counts", "aux_scale"))]


def expert_weights(moe: nn.Module) -> nn.Module:
    """The module holding the layer's (E, ...) expert tensors: its `experts` submodule, or the layer itself."""
    experts = getattr(moe, "experts", None)
    return experts if isinstance(experts, nn.Module) else moe


def check_ep(args, layout, seq_len: int | None = None) -> None:
    """ep > 1: a paratrain MoE model whose experts split ep ways, sharded by FSDP (no replicas)."""
    if not getattr(args, "moe", False):
        raise UserError(f"--ep {layout.ep} needs a Mixture-of-Experts model (e.g. --model moe-tiny); "
                        f"{args.name} has no experts")
    if args.n_experts % layout.ep:
        raise UserError(f"--ep {layout.ep} does not divide the model's {args.n_experts} experts")
    if layout.dp_replicate > 1:
        raise UserError("--ep with --dp-replicate (HSDP) is not supported: give the ranks to --dp-shard")
    if layout.tp > 1 and layout.sp:
        raise UserError("--ep with sequence parallelism is not supported: use --strategy tp (no SP) with --ep")


# -- every MoE run: global balancing-loss counts and the micro-batch weight ----------------------------------
def attach_moe(model: nn.Module, layout, weighting) -> None:
    """Make the balancing loss count tokens over all data ranks (dp x cp) and weigh it like one micro-batch
    (`weighting`: the run's LossWeighting, parallel/loss_weighting.py)."""
    group_mesh = layout.submesh("dp_cp") if layout.world > 1 else None
    for moe in moe_modules(model):
        moe.aux_scale = weighting.aux_scale
        if group_mesh is not None and moe.reduce_counts is not None:
            moe.reduce_counts = CountReducer(group_mesh.get_group())


class CountReducer:
    """Sum per-expert token counts (and the routing fingerprint) over the data ranks: one small all-reduce."""

    def __init__(self, group):
        self.group = group

    def __call__(self, counts: torch.Tensor) -> torch.Tensor:
        counts = counts.detach().clone()
        collective("moe_counts", "dp_cp", "all_reduce", self.group,
                   lambda: dist.all_reduce(counts, group=self.group), (counts,))
        return counts


# -- ep > 1 ---------------------------------------------------------------------------------------------------
def apply_ep(model: nn.Module, ep_mesh, rest_mesh, weighting, reshard_after_forward: bool = True,
             mp_policy=None) -> nn.Module:
    """Split each MoE layer's experts over `ep_mesh` (Shard(0) on the expert dim), send tokens through the
    all-to-all, and FSDP-shard the experts over `rest_mesh` (the other ranks of dp_shard x cp). Their gradients
    sum the tokens of all ep ranks; `weighting` (the run's LossWeighting) scales them to the global mean."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    layers = moe_modules(model)
    for moe in layers:
        experts = expert_weights(moe)
        for name, p in list(experts.named_parameters(recurse=False)):
            whole = p.detach().to_local() if hasattr(p, "to_local") else p.detach()  # TP keeps experts whole
            split = distribute_tensor(whole, ep_mesh, [Shard(0)])
            experts.register_parameter(name, nn.Parameter(split, requires_grad=p.requires_grad))
        # in the token path: gloo has no pre-multiplied reduce-scatter
        weight_grad_scale = weighting.expert_weight_grad_scale(rest_mesh.size())
        moe.dispatch = AllToAllDispatch(ep_mesh.get_group(), ep_mesh.size(), weight_grad_scale)
        kwargs = {"mesh": rest_mesh, "reshard_after_forward": reshard_after_forward}
        if mp_policy is not None:
            kwargs["mp_policy"] = mp_policy
        fully_shard(experts, **kwargs)
    log.info("applied expert parallelism: %d MoE layer(s), experts split %d ways, FSDP over %d", len(layers),
             ep_mesh.size(), rest_mesh.size())
    return model


def forward_runs_collectives(model: nn.Module) -> bool:
    """True when the model's forward itself talks to other ranks (MoE layers counting tokens over the data
    ranks, or sending them to their experts): it cannot run on one rank while the others wait."""
    return any(isinstance(m.reduce_counts, CountReducer) or isinstance(m.dispatch, AllToAllDispatch)
               for m in moe_modules(model))
