"""A model whose blocks are not all alike: a Mixture of Experts with dense blocks among its MoE ones (DeepSeek-V3's
first three, a Llama 4 or Qwen2-MoE dense layer). Each kind of block is traced on its own (units.py traces one
block) and the part composes as many of each as it holds (compose.py): the MoE block as the unit "block", the
dense one as "dense", beside the embedding ("pre") and the head.

Which blocks a pipeline part holds: the dense ones are counted where ModelArgs puts them, first (n_dense_layers);
a part without the embedding holds none of them unless the first part cannot hold them all, then the dense ones
left are spread over the later parts in proportion to their blocks.
"""

from __future__ import annotations

import dataclasses

from paratrain.models.args import ModelArgs
from paratrain.plan.tracing.units import Segment, UnitTrace

DEFAULT_ARGS = ModelArgs()
# the fields that make a block an MoE one; a dense block keeps the model's defaults for them
MOE_FIELDS = ("n_experts", "top_k", "moe_ffn_dim", "n_shared_experts", "n_dense_layers", "router", "norm_topk",
              "aux_loss_coeff", "bias_update_rate", "capacity_factor")


def mixed(args: ModelArgs) -> bool:
    """Whether the model has both kinds of block."""
    return args.moe and 0 < args.n_dense_layers < args.n_layers


def moe_block_args(args: ModelArgs) -> ModelArgs:
    """The shape whose one traced block is the model's MoE block (its first block is MoE)."""
    return dataclasses.replace(args, n_dense_layers=0) if args.moe else args


def dense_block_args(args: ModelArgs) -> ModelArgs:
    """The shape whose one traced block is the model's dense block (ffn_dim wide)."""
    return dataclasses.replace(args, **{f: getattr(DEFAULT_ARGS, f) for f in MOE_FIELDS})


def dense_blocks(args: ModelArgs, part: str, layers: int) -> int:
    """The dense blocks among the `layers` blocks of a pipeline part ("whole", "first", "middle", "last")."""
    if not mixed(args):
        return 0
    if part == "whole":
        return args.n_dense_layers
    if part == "first":
        return min(layers, args.n_dense_layers)
    later = args.n_layers - layers if part == "last" else args.n_layers
    spill = max(0, args.n_dense_layers - layers) if part != "last" else 0
    return min(layers, round(spill * layers / later)) if later > 0 else 0


def with_dense_unit(moe: UnitTrace, dense: UnitTrace) -> UnitTrace:
    """`moe` (embedding, one MoE block, head) with `dense`'s block added as the unit "dense"."""
    out = dataclasses.replace(moe, params=dict(moe.params), param_count=dict(moe.param_count),
                              param_tensors=dict(moe.param_tensors), trainable=dict(moe.trainable), segments=dict(moe.segments), ops=dict(moe.ops),
                              comm=dict(moe.comm), exit_freed=dict(moe.exit_freed))
    for table in ("params", "param_count", "param_tensors", "trainable", "exit_freed"):
        source = getattr(dense, table)
        if "block" in source:
            getattr(out, table)["dense"] = source["block"]
    for name, seg in dense.segments.items():
        pas, unit, direction = name.split("/")
        if unit == "block":
            out.segments[f"{pas}/dense/{direction}"] = Segment(**dataclasses.asdict(seg))
    for table in ("ops", "comm"):
        for name, entries in getattr(dense, table).items():
            unit, phase = name.split("/")
            if unit == "block":
                getattr(out, table)[f"dense/{phase}"] = list(entries)
    return out
