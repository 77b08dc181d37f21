"""A TP plan with LoRA adapters: each plan entry whose linear carries adapters (models/lora.py) is wrapped so that
the base is sharded by its own style and the adapters as torchtitan and PEFT's DTensor support place them:
a column-parallel base gets A replicated and B column-sharded (Shard(0) of B's weight), a row-parallel base A
row-sharded (Shard(1) of A's weight) and B replicated. The replicated factor's gradient comes out of DTensor as a
pending sum over tp and is reduced there (parallel/tp/'s settle_grad_layouts)."""

from __future__ import annotations

from fnmatch import fnmatch

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from paratrain.models.lora import ADAPTER_MODULES, has_adapter


class WithAdapters(ParallelStyle):
    """`base` on the linear itself; its adapters distributed beside it (torch's styles would walk into them)."""

    def __init__(self, base: ParallelStyle):
        super().__init__()
        self.base = base

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not has_adapter(module):
            return parallelize_module(module, device_mesh, self.base)
        children = dict(module.named_children())
        for name in children:  # the base style sees the linear alone
            delattr(module, name)
        out = parallelize_module(module, device_mesh, self.base)
        for name, child in children.items():
            setattr(module, name, child)
        a_place, b_place = adapter_placements(self.base)
        for part, place in ((module.lora_A, a_place), (module.lora_B, b_place)):
            part.weight = nn.Parameter(distribute_tensor(part.weight.detach(), device_mesh, [place]),
                                       requires_grad=part.weight.requires_grad)
        return out


def adapter_placements(style: ParallelStyle) -> tuple:
    """(A's, B's) placement under a base linear's style."""
    if isinstance(style, ColwiseParallel):
        return Replicate(), Shard(0)
    if isinstance(style, RowwiseParallel):
        return Shard(1), Replicate()
    return Replicate(), Replicate()


def with_adapter_styles(model: nn.Module, plan: dict) -> dict:
    """`plan` with the entries that reach an adapted linear wrapped in WithAdapters, and none for the adapters."""
    adapted = [name.split(".") for name, m in model.named_modules() if has_adapter(m)]

    def reaches(path: str) -> bool:
        pattern = path.split(".")
        return any(len(parts) == len(pattern) and all(map(fnmatch, parts, pattern)) for parts in adapted)

    # a plan that covers every parameter (hf_tp_plan.py replicates the ones its table leaves out) would reach the
    # adapters themselves: their placement is their base's style's, above
    return {path: WithAdapters(style) if reaches(path) and not isinstance(style, WithAdapters) else style
            for path, style in plan.items() if path.rsplit(".", 1)[-1] not in ADAPTER_MODULES}
