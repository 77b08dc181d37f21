"""parallelize(): apply every parallel technique to a plain model, in one fixed order.

Order: pipeline split (done by the caller, per stage) -> TP/SP -> CP -> EP -> activation checkpointing ->
compile -> FSDP/ZeRO or DDP. Data parallelism wraps last so it sees the already-sharded parameters. Each
dimension's technique (dims.py) carries its place in that order (`apply_order`); activation checkpointing and
compile, which are options of every layout rather than dimensions, sit between EP and data parallelism.
"""

from __future__ import annotations

from torch import nn

from paratrain.parallel.dims import techniques
from paratrain.parallel.layout import Layout

ACTIVATION_CHECKPOINT_ORDER, COMPILE_ORDER = 40, 50


def parallelize(model: nn.Module, layout: Layout, tp_plan: dict | None = None) -> nn.Module:
    """Return the model ready to train on this rank. `layout` must hold its mesh (`layout.with_mesh()`)
    when it spans more than one rank; `tp_plan` (module path -> ParallelStyle) is needed when tp > 1."""
    steps = [(t.apply_order, t.apply) for t in techniques() if t.apply_order is not None]
    steps += [(ACTIVATION_CHECKPOINT_ORDER, checkpoint_activations), (COMPILE_ORDER, compile_model)]
    for _, step in sorted(steps, key=lambda s: s[0]):
        model = step(model, layout, tp_plan)
    return model


def checkpoint_activations(model: nn.Module, layout: Layout, tp_plan: dict | None = None) -> nn.Module:
    if layout.ac == "none":
        return model
    from paratrain.parallel.activation_checkpoint import apply_ac

    return apply_ac(model, layout.ac)


def compile_model(model: nn.Module, layout: Layout, tp_plan: dict | None = None) -> nn.Module:
    if not layout.compile:
        return model
    from paratrain.parallel.compile import apply_compile

    # what a technique runs that dynamo cannot trace (ring attention's P2P sends, an MoE layer's host reads)
    # gets compiled around (a graph break); on one device (no DDP/FSDP hooks to keep outside the compiled code)
    # the whole model, else per block
    breaks = any(t.breaks_compiled_graph(model, layout) for t in techniques())
    return apply_compile(model, fullgraph=not breaks, whole=layout.world == 1)
