"""A tied embedding under pipeline parallelism, Megatron's way: the first stage (token table) and the last stage
(output head) each hold a copy of the one shared weight, built identical, and after every backward their
gradients are summed over a group of exactly those two pipeline ranks. Both copies then take the same optimizer
step and stay identical. The head's copy is marked so the global grad norm counts the shared weight once.

The first stage sits on pp rank 0 and the last on pp rank pp-1 (parallel/pp/pipeline_split.py's "loop" placement),
so with pp > 1 the two copies never share a rank.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.distributed as dist
from torch import nn

from paratrain.parallel.collective_hooks import collective

log = logging.getLogger("paratrain")

PURPOSE = "tied_embedding_grads"  # its name at the collective door (parallel/collective_hooks.py)
_COPY_MARK = "_paratrain_tied_copy"


def tied_table_name(model: nn.Module) -> str | None:
    """The name, inside `model.tok_embeddings`, of the parameter the output head shares ("weight", or GPT-2's
    "tokens.weight"); None when the model's head has its own weight."""
    table, head = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    if table is None or head is None:
        return None
    shared = getattr(head, "weight", None)
    return next((name for name, p in table.named_parameters() if p is shared), None)


def untied_head(head: nn.Module) -> nn.Module:
    """A copy of the output head holding its own copy of the shared weight (same values; the table untouched)."""
    return copy.deepcopy(head)


def mark_copy(param: torch.Tensor) -> None:
    """The head's copy of a tied weight: counted once, with the table's, in the global grad norm."""
    setattr(param, _COPY_MARK, True)


def is_tied_copy(param: torch.Tensor) -> bool:
    return getattr(param, _COPY_MARK, False)


def end_stage_groups(mesh, pp_dim: str, device_type: str):
    """The group of the first and the last pp rank at this rank's (dp, tp, cp) coordinate, or None when this rank
    is on neither end. With pp == 2 that is the pp group itself; otherwise one new group per coordinate, which
    every rank creates in the same order (new_group is collective over the world), with the pp group's timeout."""
    pp_mesh = mesh[pp_dim]
    if pp_mesh.size() == 2:
        return pp_mesh.get_group()
    ranks = mesh.mesh.movedim(mesh.mesh_dim_names.index(pp_dim), 0)
    pairs = list(zip(ranks[0].flatten().tolist(), ranks[-1].flatten().tolist()))
    timeout = pp_mesh.get_group()._get_backend(torch.device(device_type)).options._timeout
    me, mine = dist.get_rank(), None
    for pair in pairs:
        group = dist.new_group(list(pair), timeout=timeout)
        if me in pair:
            mine = group
    return mine


class TiedGradSum:
    """After backward: sum this rank's copy's gradient with the other end stage's (a no-op on middle ranks)."""

    def __init__(self, param: torch.Tensor | None, group):
        self.param, self.group = param, group

    def __call__(self) -> None:
        if self.param is None or self.group is None:
            return
        grad = self.param.grad
        if grad is None:  # a stage that saw no micro-batch still sums: its partner waits on it
            grad = self.param.grad = torch.zeros_like(self.param)
        if hasattr(grad, "placements") and grad.placements != self.param.placements:
            # a DTensor gradient in another layout than its parameter (e.g. Replicate for a vocab-sharded table)
            grad = self.param.grad = grad.redistribute(grad.device_mesh, self.param.placements)
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        group = self.group
        collective(PURPOSE, "pp", "all_reduce", group, lambda: dist.all_reduce(local, group=group), (local,))
