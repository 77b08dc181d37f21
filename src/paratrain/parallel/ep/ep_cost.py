"""Expert parallelism's step-time term: each MoE layer's token exchange (ep_exchange.py) priced as all-to-alls
over the ep group, and the experts' share of the parameters (which FSDP shards apart: dp/dp_cost.py)."""

from __future__ import annotations

from paratrain.costs.collectives import collective_time
from paratrain.costs.expert_spread import ranks_per_token

ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}


def ep_placement(layout, gpus_per_node: int) -> tuple[str, int]:
    """Where an expert-parallel group sits: its ranks are ep neighbours of dp_shard x cp, tp ranks apart."""
    span = layout.ep * layout.tp
    members = max(1, min(layout.ep, gpus_per_node // layout.tp))
    return ("intra" if span <= gpus_per_node else "inter"), members


def moe_all_to_all(profile, args, layout, seq_len: int, dtype: str, layers: int, est=None,
                   routing: str = "random") -> float:
    """Seconds per micro-batch of --ep's token exchange on `layers` MoE blocks, balanced routing
    (parallel/ep/ep_exchange.py): each layer sends each token once to every rank holding any of its k experts
    (r ranks per token: expert_spread.py, by `routing`) and gets one gated sum per (token, rank) back, forward
    and backward (4 all-to-alls of T*r rows of dim values); each copy's row number and gate go along (T*k x 2
    fp64, their gradients back in backward), after the split counts. Activation checkpointing (full or
    selective) replays the block's forward in the backward, exchanges included (they are autograd functions
    around all_to_all_single, which no AC policy saves): the forward's exchanges again. Not overlapped with
    compute (as torchtitan runs it)."""
    if layout.ep <= 1 or not args.moe or layers <= 0:
        return 0.0
    tokens = layout.micro_batch * seq_len // layout.cp
    rows = tokens * ranks_per_token(args.n_experts, args.top_k, layout.ep, routing)
    payload = rows * args.dim * ACTIVATION_BYTES.get(dtype, 4)
    where, rails = ep_placement(layout, profile.gpu.gpus_per_node)
    one = collective_time(profile, "all_to_all", payload, layout.ep, where, rails)
    copies = tokens * args.top_k
    forwards = 2 if layout.ac != "none" else 1
    exchanges = 2 * forwards + 2
    # (bytes, calls per micro-batch and layer): the split counts each forward, the routing also in backward
    small = [((args.n_experts + layout.ep) * 8, forwards), (copies * 16, forwards + 1)]
    if est is not None:
        est.add_comm("all_to_all", payload, layout.ep, exchanges * layers * layout.microbatches)
        for nbytes, calls in small:
            est.add_comm("all_to_all", nbytes, layout.ep, calls * layers * layout.microbatches)
    metadata = sum(calls * collective_time(profile, "all_to_all", nbytes, layout.ep, where, rails)
                   for nbytes, calls in small)
    return layers * (exchanges * one + metadata)


def expert_param_share(args) -> float:
    """The experts' fraction of the model's parameters (0 for a dense model)."""
    if not args.moe:
        return 0.0
    from paratrain.models.presets import count_params, expert_params

    return expert_params(args) / count_params(args)
