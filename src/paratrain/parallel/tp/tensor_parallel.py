"""apply_tp: shard a model's matmuls over the "tp" mesh dimension with DTensor's parallelize_module.

The plan comes from the caller: the model family's own (models/plans.py) or one the user passes; it is checked first, so a
typo or an indivisible size is one clear error instead of a shape failure deep inside a forward.
"""

from __future__ import annotations

import logging
from fnmatch import fnmatch

from torch import nn
from torch.distributed.tensor import DTensor
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

    plan: {module path (fnmatch wildcards per component, e.g. "layers.*.mlp.up"): ParallelStyle}, from the
    caller: a model family's own (models/plans.py, with sequence parallel when `sp` and vocab-sharded logits
    when `loss_parallel`) or the user's. `sp` and `loss_parallel` only label the log line here.
    """
    tp = tp_mesh.size()
    if plan is None:
        raise UserError(f"tensor parallel needs a plan for {type(model).__name__}: pass "
                        "tp_plan={'module.path': ColwiseParallel(), ...} to paratrain.parallelize")
    check_plan(model, plan, tp)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    parallelize_module(model, tp_mesh, plan)
    for name, p in model.named_parameters():  # torch's styles make every parameter they distribute trainable
        if name in frozen:
            p.requires_grad_(False)
    settle_grad_layouts(model)
    log.info("tensor parallel: tp=%d%s%s, %d plan entries", tp, ", sequence parallel" if sp else "",
             ", loss parallel" if loss_parallel else "", len(plan))
    return model


def settle_grad_layouts(model: nn.Module) -> None:
    """Give each DTensor gradient its parameter's layout once, at the end of its accumulation.

    DTensor leaves the grad of a Replicate parameter fed by sequence-sharded activations Partial (a pending
    sum), and that of the vocab-sharded embedding Replicate (full size). Left so, every optimizer op on a
    Partial grad would all-reduce it again. FSDP2 replaces these parameters and settles grads itself.
    """
    for p in model.parameters():
        if isinstance(p, DTensor) and p.requires_grad:
            p.register_post_accumulate_grad_hook(_settle_grad)


def _settle_grad(param: DTensor) -> None:
    if param.grad is not None and param.grad.placements != param.placements:
        param.grad = param.grad.redistribute(param.device_mesh, param.placements)


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
