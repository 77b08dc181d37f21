"""apply_tp: shard a model's matmuls over the "tp" mesh dimension with DTensor's parallelize_module.

The plan is the model family's own (models/plans.py) or one the user passes; it is checked first, so a
typo or an indivisible size is one clear error instead of a shape failure deep inside a forward.
"""

from __future__ import annotations

import logging
from fnmatch import fnmatch

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from paratrain.errors import UserError

log = logging.getLogger("paratrain")


def apply_tp(model: nn.Module, tp_mesh, sp: bool = False, plan: dict | None = None,
             loss_parallel: bool = False) -> nn.Module:
    """Shard `model` in place over the 1-D `tp_mesh` and return it.

    plan: {module path (fnmatch wildcards per component, e.g. "layers.*.mlp.up"): ParallelStyle}; None uses
    the model family's built-in plan with sequence parallel when `sp`, and vocab-sharded logits when
    `loss_parallel` (the loss must then be computed under torch.distributed.tensor.parallel.loss_parallel()).
    """
    tp = tp_mesh.size()
    if plan is None:
        from paratrain.models.plans import tp_plan_for

        plan = tp_plan_for(model, tp, sp=sp, loss_parallel=loss_parallel)
    check_plan(model, plan, tp)
    parallelize_module(model, tp_mesh, plan)
    settle_grad_layouts(model)
    log.info("tensor parallel: tp=%d%s%s, %d plan entries", tp, ", sequence parallel" if sp else "",
             ", loss parallel" if loss_parallel else "", len(plan))
    return model


def check_tp_layout(dims) -> None:
    """TP composes with FSDP (2-D) but not with DDP: DDP broadcasts and buckets plain tensors, not DTensors."""
    if dims.tp > 1 and dims.dp_shard == 1 and (dims.dp_replicate > 1 or dims.cp > 1):
        other = f"dp_replicate={dims.dp_replicate}" if dims.dp_replicate > 1 else f"cp={dims.cp}"
        raise UserError(f"tp={dims.tp} with {other} would need DDP over tensor-parallel (DTensor) parameters, "
                        "which PyTorch does not support: shard the data-parallel ranks instead (--dp-shard, FSDP)")


def settle_grad_layouts(model: nn.Module) -> None:
    """Give each DTensor gradient its parameter's layout once, at the end of its accumulation.

    DTensor leaves the grad of a Replicate parameter fed by sequence-sharded activations Partial (a pending
    sum), and that of the vocab-sharded embedding Replicate (full size). Left so, every optimizer op on a
    Partial grad would all-reduce it again. FSDP2 replaces these parameters and settles grads itself.
    """
    for p in model.parameters():
        if isinstance(p, DTensor):
            p.register_post_accumulate_grad_hook(_settle_grad)


def _settle_grad(param: DTensor) -> None:
    if param.grad is not None and param.grad.placements != param.placements:
        param.grad = param.grad.redistribute(param.device_mesh, param.placements)


class ReplicateParallel(ParallelStyle):
    """Keep a module whole on every tp rank, its parameters held as Replicate DTensors.

    For layers between the sharded ones (e.g. norms without sequence parallel): every parameter then is a
    DTensor on the same mesh, which foreach optimizers, grad-norm clipping and FSDP's 2-D sharding need.
    Costs no communication: inputs are wrapped as Replicate, outputs handed back as local tensors.
    """

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        # no partition_fn: distribute_module replicates every parameter (broadcast from tp rank 0)
        return distribute_module(module, device_mesh, input_fn=_inputs_as_replicate, output_fn=_output_as_local)


def _inputs_as_replicate(module: nn.Module, inputs: tuple, mesh) -> tuple:
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                 if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)


def _output_as_local(module: nn.Module, output, mesh):
    return output.to_local() if isinstance(output, DTensor) else output


def match_modules(model: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    """Submodules whose dotted name matches `path` component by component, as parallelize_module resolves it."""
    if path == "":
        return [("", model)]
    pattern = path.split(".")
    found = []
    for name, module in model.named_modules():
        parts = name.split(".") if name else []
        if len(parts) == len(pattern) and all(fnmatch(p, q) for p, q in zip(parts, pattern)):
            found.append((name, module))
    return found


def check_plan(model: nn.Module, plan: dict, tp: int) -> None:
    """Every entry must name a ParallelStyle, match a module, and split a size tp divides."""
    if not isinstance(plan, dict):
        raise UserError(f"tp_plan must be a dict of module path -> ParallelStyle, got {type(plan).__name__}")
    for path, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise UserError(f"tp_plan[{path!r}] is {type(style).__name__}, not a ParallelStyle "
                            "(e.g. ColwiseParallel(), RowwiseParallel())")
        matched = match_modules(model, path)
        if not matched:
            raise UserError(f"tp_plan entry {path!r} matches no submodule of {type(model).__name__}")
        for name, module in matched:
            dim = split_size(module, style)
            if dim is not None and dim[1] % tp:
                raise UserError(f"tp={tp} does not divide {name}'s {dim[0]} ({dim[1]})")


def split_size(module: nn.Module, style: ParallelStyle) -> tuple[str, int] | None:
    """(label, size) of the dimension a colwise/rowwise style cuts, for the layer types DTensor shards."""
    colwise, rowwise = isinstance(style, ColwiseParallel), isinstance(style, RowwiseParallel)
    if isinstance(module, nn.Linear):
        if colwise:
            return "out_features", module.out_features
        if rowwise:
            return "in_features", module.in_features
    if isinstance(module, nn.Embedding):
        if colwise:
            return "embedding_dim", module.embedding_dim
        if rowwise:
            return "num_embeddings", module.num_embeddings
    return None
