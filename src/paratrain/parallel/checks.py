"""check_layout(): can this Layout run this model? One check for `train` (before any process starts) and for
the planner's search, so that a layout the planner offers is one the trainer accepts, and vice versa.

Each parallel dimension's technique holds its own check (dims.py `Dim.technique`: tp/, pp/, cp/, ep/);
check_layout runs those of every technique the layout uses, then the batch and data-parallel option checks."""

from __future__ import annotations

from paratrain.errors import UserError
from paratrain.parallel.dims import all_dims
from paratrain.parallel.layout import Layout
from paratrain.parallel.uneven_split import refuse_uneven_dp


def check_layout(layout: Layout, args, seq_len: int, global_batch: int, device_type: str = "cpu") -> None:
    """Raise UserError naming the first problem. `args` is the model's ModelArgs (duck-typed)."""
    for dim in all_dims():
        if getattr(layout, dim.name) > 1:
            dim.technique.check(args, layout, seq_len)
    if getattr(args, "capacity_factor", 0) > 0 and layout.cp > 1:
        raise UserError("an MoE capacity factor with --cp is not supported: capacity is counted per sequence, and "
                        "each cp rank holds part of one; train dropless (no --moe-capacity-factor) or without --cp")
    if layout.dp_micro_batches:
        check_uneven_dp(layout, global_batch)
    elif global_batch % layout.dp:
        raise UserError(f"global batch {global_batch} is not divisible by the data-parallel degree {layout.dp}")
    elif layout.micro_batch * layout.microbatches * layout.dp != global_batch:
        raise UserError(f"micro-batch {layout.micro_batch} x {layout.microbatches} x dp {layout.dp} does not make "
                        f"the global batch {global_batch}")
    check_dp_options(layout, device_type)


def check_uneven_dp(layout: Layout, global_batch: int) -> None:
    """--dp-batch-split: one micro-batch size per dp rank, adding up to the global batch, in a layout it runs."""
    if len(layout.dp_micro_batches) != layout.dp:
        raise UserError(f"{len(layout.dp_micro_batches)} per-rank micro-batches for {layout.dp} data-parallel ranks")
    if layout.global_batch != global_batch:
        raise UserError(f"per-rank micro-batches {':'.join(map(str, layout.dp_micro_batches))} x "
                        f"{layout.microbatches} do not make the global batch {global_batch}")
    refuse_uneven_dp(layout)


def check_dp_options(layout: Layout, device_type: str) -> None:
    """Reject data-parallel option combinations that cannot run, with one line naming the fix."""
    name = layout.strategy
    if layout.cpu_offload and not layout.fsdp:
        raise UserError(f"--cpu-offload needs a sharded strategy (zero2, zero3, fsdp, hsdp); {name!r} does not "
                        "shard parameters with FSDP")
    if layout.cpu_offload and device_type != "cuda":
        raise UserError("--cpu-offload moves FSDP's parameters off the GPU, but this run has no CUDA device "
                        "(torch: 'Cannot access accelerator device when none is available')")
    hook = layout.ddp_comm_hook
    if hook != "none":
        if not layout.ddp:
            raise UserError(f"--ddp-comm-hook {hook} needs DDP with more than one replica (ddp or zero1); "
                            f"{name!r} with {layout.world} process(es) does not run DDP")
        if hook == "bf16" and device_type != "cuda":
            raise UserError("--ddp-comm-hook bf16 needs NCCL on CUDA (torch's bf16 hook refuses gloo); "
                            "use fp16 or powersgd on CPU")
    if layout.local_sgd_period:
        if layout.zero_stage != 0 or layout.dp_replicate < 2 or layout.world != layout.dp_replicate:
            raise UserError(f"--local-sgd-period needs plain ddp over >= 2 replicas (got {name!r} "
                            f"with {layout.world} process(es))")
        if hook != "none":
            raise UserError("--local-sgd-period and --ddp-comm-hook both install a DDP comm hook; pick one")
