"""Planted MoE / expert-parallel bugs, attached through paratrain's hooks (tests/moe/): each must fail
`paratrain verify` at its first step, neither hanging nor crashing.

    with planted("moe-wrong-splits"):          # in-process
        verify_in_group(cfg, rt)
    PARATRAIN_PLUGINS=support.moe_faults:plugin PARATRAIN_TEST_MOE_FAULT=moe-biased-router paratrain doctor ...
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from paratrain.parallel.ep.ep_exchange import split_counts
from paratrain.train.hooks import Hooks
from support.planting import FaultSet

FAULT_ENV = "PARATRAIN_TEST_MOE_FAULT"
FAULTS = {
    "moe-wrong-splits": "rank 1 reads the all-to-all split counts of each source in reverse expert order: "
                        "as many rows arrive, but at the wrong local experts",
    "moe-swapped-ids": "rank 1's router sends expert 0's tokens to expert 1 and expert 1's to expert 0",
    "moe-dropped-expert-grad": "rank 1 drops its gradient of the experts' w2 / down_proj (layer 0)",
    "moe-aux-per-rank": "the balancing loss counts this rank's tokens only (its all-reduce is dropped)",
    "moe-biased-router": "every router prefers expert 0 by a large margin (a collapsed router; for doctor)",
    "moe-biased-first-router": "the first MoE layer's router (paratrain's or a transformers one) makes expert 0 "
                               "every token's first choice; the other layers route as they do (for doctor)",
}


def _is_router(module) -> bool:
    return hasattr(module, "expert_bias") and hasattr(module, "top_k")


def _is_hf_router(module) -> bool:
    """A transformers 5 MoE router (Qwen3-MoE, Mixtral, OLMoE): returns (logits, gates, expert ids)."""
    return hasattr(module, "top_k") and hasattr(module, "num_experts") and isinstance(
        getattr(module, "weight", None), torch.Tensor)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _wrong_splits(hooks: Hooks) -> list:
    def on_collective(call, proceed):
        out = proceed()
        if call.purpose == "moe_splits" and call.rank == 1:
            # each source's copies per local expert, then its row count (parallel/ep/ep_exchange.py)
            per_expert, _ = split_counts(call.tensors[1], dist.get_world_size(call.group))
            per_expert.copy_(per_expert.flip(1))
        return out

    return [hooks.on_collective(on_collective)]


def _swap_ids(module, args, output):
    gates, ids, probs = output
    swapped = torch.where(ids == 0, 1, torch.where(ids == 1, 0, ids))
    return gates, swapped, probs


def _swap_hf_ids(module, args, output):
    logits, gates, ids = output
    return logits, gates, torch.where(ids == 0, 1, torch.where(ids == 1, 0, ids))


def _swapped_ids(hooks: Hooks) -> list:
    def after_parallelize(module, layout):
        if _rank() != 1:
            return
        for m in module.modules():
            if _is_router(m):
                m.register_forward_hook(_swap_ids)
            elif _is_hf_router(m):
                m.register_forward_hook(_swap_hf_ids)

    return [hooks.after_parallelize(after_parallelize)]


def _dropped_expert_grad(hooks: Hooks) -> list:
    def on_gradients(trainer):
        if _rank() != 1:
            return
        for part in trainer.step_runner.model_parts:
            for name, p in part.named_parameters():
                # paratrain's experts.w2, or a transformers MoE's fused experts.down_proj
                if name.endswith(("experts.w2", "experts.down_proj")) and ".0." in f".{name}" and p.grad is not None:
                    (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).zero_()

    return [hooks.on_gradients(on_gradients)]


def _aux_per_rank(hooks: Hooks) -> list:
    def on_collective(call, proceed):
        if call.purpose == "moe_counts":
            return None  # dropped: each rank keeps its own counts
        return proceed()

    return [hooks.on_collective(on_collective)]


def _bias_to_expert_0(module, args, output):
    return output + torch.nn.functional.one_hot(torch.zeros((), dtype=torch.long), output.shape[-1]).to(output) * 8


def _biased_router(hooks: Hooks) -> list:
    def after_parallelize(module, layout):
        for m in module.modules():
            if _is_router(m):
                m.gate.register_forward_hook(_bias_to_expert_0)

    return [hooks.after_parallelize(after_parallelize)]


def _first_choice_expert_0(module, args, output):
    """A transformers router's (logits, gates, ids) with expert 0 first in every token's ids, still distinct."""
    logits, gates, ids = output
    first = ids[..., :1].expand_as(ids)
    ids = torch.where(ids == 0, first, ids)  # where 0 was chosen later, it trades places with the first choice
    return logits, gates, torch.cat([torch.zeros_like(ids[..., :1]), ids[..., 1:]], dim=-1)


def _biased_first_router(hooks: Hooks) -> list:
    def after_parallelize(module, layout):
        for m in module.modules():
            if _is_router(m):
                m.gate.register_forward_hook(_bias_to_expert_0)
                return
            if _is_hf_router(m):
                m.register_forward_hook(_first_choice_expert_0)
                return

    return [hooks.after_parallelize(after_parallelize)]


PLANTERS = {"moe-wrong-splits": _wrong_splits, "moe-swapped-ids": _swapped_ids,
            "moe-dropped-expert-grad": _dropped_expert_grad, "moe-aux-per-rank": _aux_per_rank,
            "moe-biased-router": _biased_router, "moe-biased-first-router": _biased_first_router}


_FAULTS = FaultSet(PLANTERS, FAULT_ENV, "MoE fault")
plant, planted, plugin = _FAULTS.plant, _FAULTS.planted, _FAULTS.plugin
