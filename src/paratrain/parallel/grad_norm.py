"""The L2 norm of gradients that live on different device meshes (or on none)."""

from __future__ import annotations

import torch


def by_mesh(tensors) -> list[list]:
    """The tensors grouped by mesh. Meshes compare by value: DTensor's sharding cache can hand a gradient an equal
    mesh object from an earlier model, and grouping by identity would cost an all-reduce per object."""
    groups: dict = {}
    for t in tensors:
        groups.setdefault(getattr(t, "device_mesh", None), []).append(t)
    return list(groups.values())


def clip_with_norm(parameters: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """torch's clip_grads_with_norm_, one mesh at a time (its foreach multiply takes one mesh)."""
    for members in by_mesh(p for p in parameters if p.grad is not None):
        torch.nn.utils.clip_grads_with_norm_(members, max_norm, norm, foreach=True)


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """sqrt of the summed squares, one group per mesh: torch's get_total_norm stacks the per-tensor norms,
    which DTensors on different meshes (FSDP's blocks and --ep's experts, sharded over other ranks) refuse."""
    groups = by_mesh(grads)
    if len(groups) <= 1:
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    squares = []
    for members in groups:
        norm = torch.nn.utils.get_total_norm(members, norm_type=2.0, foreach=True)
        squares.append((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).float() ** 2)
    return torch.stack(squares).sum().sqrt()
