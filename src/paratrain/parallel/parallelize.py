"""parallelize(): apply every parallel technique to a plain model, in one fixed order.

Order: pipeline split (done by the caller, per stage) -> TP/SP -> CP -> EP -> activation checkpointing ->
compile -> FSDP/ZeRO or DDP. Data parallelism wraps last so it sees the already-sharded parameters.
"""

from __future__ import annotations

from torch import nn

from paratrain.parallel.layout import Layout


def parallelize(model: nn.Module, layout: Layout, tp_plan: dict | None = None) -> nn.Module:
    """Return the model ready to train on this rank. `layout` must hold its mesh (`layout.with_mesh()`)
    when it spans more than one rank; `tp_plan` (module path -> ParallelStyle) is needed when tp > 1."""
    if layout.tp_enabled:
        from paratrain.parallel.tensor_parallel import apply_tp

        model = apply_tp(model, layout.submesh("tp"), sp=layout.sp, plan=tp_plan)
    if layout.cp_enabled:
        from paratrain.parallel.context_parallel import apply_cp

        model = apply_cp(model, layout.submesh("cp"), impl=layout.cp_impl)
    from paratrain.parallel.expert_parallel import attach_moe, moe_modules

    if moe_modules(model):
        attach_moe(model, layout)
    if getattr(layout, "ep", 1) > 1:
        from paratrain.parallel.data_parallel import mixed_precision_policy
        from paratrain.parallel.expert_parallel import apply_ep

        model = apply_ep(model, layout.submesh("ep"), layout.submesh("ep_rest"), layout.group_size("dp_cp"),
                         reshard_after_forward=layout.zero_stage != 2, mp_policy=mixed_precision_policy(layout.dtype))
    if layout.ac != "none":
        from paratrain.parallel.activation_checkpoint import apply_ac

        model = apply_ac(model, layout.ac)
    if layout.compile:
        from paratrain.parallel.compile import apply_compile
        from paratrain.parallel.expert_parallel import moe_modules

        # ring attention's P2P sends, and an MoE layer's host reads (the expert loop's split sizes, the
        # all-to-all's), cannot be traced: let dynamo compile around them (a graph break)
        # on one device (no DDP/FSDP hooks to keep outside the compiled code) the whole model, else per block
        breaks = (layout.cp_enabled and layout.cp_impl == "ring") or bool(moe_modules(model))
        model = apply_compile(model, fullgraph=not breaks, whole=layout.world == 1)

    # FSDP2 (ZeRO-2/3, HSDP) when dp_shard > 1, else DDP (+ comm hook / local SGD) over dp_cp
    from paratrain.parallel.data_parallel import apply_data_parallel

    return apply_data_parallel(model, layout)
