"""parallelize(): apply every parallel technique to a plain model, in one fixed order.

Order: pipeline split (done by the caller, per stage) -> TP/SP -> CP -> activation checkpointing ->
compile -> FSDP/ZeRO or DDP. Data parallelism wraps last so it sees the already-sharded parameters.
"""

from __future__ import annotations

from torch import nn

from paratrain.parallel.dims import ParallelDims
from paratrain.parallel.options import ParallelOptions


def parallelize(model: nn.Module, dims: ParallelDims, options: ParallelOptions | None = None,
                tp_plan: dict | None = None) -> nn.Module:
    """Return the model ready to train on this rank. `dims.build_mesh()` must have been called."""
    options = options or ParallelOptions(strategy="ddp" if dims.dp > 1 else "single")

    if dims.tp_enabled:
        from paratrain.parallel.tensor_parallel import apply_tp, check_tp_layout

        check_tp_layout(dims)
        model = apply_tp(model, dims.submesh("tp"), sp=options.sp, plan=tp_plan)
    if dims.cp_enabled:
        from paratrain.parallel.context_parallel import apply_cp

        model = apply_cp(model, dims.submesh("cp"), impl=options.cp_impl)
    if options.ac != "none":
        from paratrain.parallel.activation_checkpoint import apply_ac

        model = apply_ac(model, options.ac)
    if options.compile:
        from paratrain.parallel.compile import apply_compile

        # ring attention's P2P sends cannot be traced: let dynamo compile around them (a graph break)
        model = apply_compile(model, fullgraph=not (dims.cp_enabled and options.cp_impl == "ring"))

    # FSDP2 (ZeRO-2/3, HSDP) when dp_shard > 1, else DDP (+ comm hook / local SGD) over dp_cp
    from paratrain.parallel.data_parallel import apply_data_parallel

    model = apply_data_parallel(model, dims, options)
    return model
