"""parallelize(): apply every parallel technique to a plain model, in one fixed order.

Order: pipeline split (done by the caller, per stage) -> TP/SP -> CP -> activation checkpointing ->
compile -> FSDP/ZeRO or DDP. Data parallelism wraps last so it sees the already-sharded parameters.
"""

from __future__ import annotations

from torch import nn

from paratrain.errors import UserError
from paratrain.parallel.dims import ParallelDims
from paratrain.parallel.options import ParallelOptions


def parallelize(model: nn.Module, dims: ParallelDims, options: ParallelOptions | None = None,
                tp_plan: dict | None = None) -> nn.Module:
    """Return the model ready to train on this rank. `dims.build_mesh()` must have been called."""
    options = options or ParallelOptions(strategy="ddp" if dims.dp > 1 else "single")

    if dims.tp_enabled:
        raise UserError("tensor parallelism is not available in this build yet")
    if dims.cp_enabled:
        raise UserError("context parallelism is not available in this build yet")
    if options.ac != "none":
        raise UserError("activation checkpointing is not available in this build yet")
    if options.compile:
        raise UserError("--compile is not available in this build yet")

    if dims.dp_shard > 1:
        raise UserError(f"strategy {options.strategy!r} (sharded data parallel) is not available in this build yet")
    if dims.dp_replicate > 1:
        from paratrain.parallel.data_parallel import apply_ddp

        model = apply_ddp(model, dims.submesh("dp"), options.device_type)
    return model
