"""Per-rank model-state memory: the local bytes of parameters, gradients and optimizer states.

Counted from the tensors this rank really holds (DTensor shards count their local part; views of one
storage count once). "params" adds the unsharded parameters FSDP keeps from forward to backward when it
does not reshard after forward (ZeRO-2), recorded by data_parallel.track_unsharded_params at each step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from paratrain.parallel.collective_device import collective_device
from paratrain.parallel.collective_hooks import collective
from paratrain.parallel.dp.data_parallel import unsharded_bytes_held


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        t = _local(t)
        if t.numel() == 0:
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def _optimizer_tensors(opt):
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps its shard in a local optimizer
    for state in inner.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                yield value


def model_state_bytes(model_parts, optimizers) -> dict[str, int]:
    """{"params", "grads", "optimizer", "total", "unsharded_params_held"} in bytes, for this rank."""
    params = [p for part in model_parts for p in part.parameters()]
    held = sum(unsharded_bytes_held(part) for part in model_parts)
    out = {"params": _bytes(params) + held, "grads": _bytes(p.grad for p in params),
           "optimizer": _bytes(t for opt in optimizers for t in _optimizer_tensors(opt))}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    out["unsharded_params_held"] = held
    return out


def gather_model_state_bytes(model_parts, optimizers) -> dict:
    """This rank's counts on every rank, plus the mean and max over ranks (a collective when distributed)."""
    mine = model_state_bytes(model_parts, optimizers)
    keys = list(mine)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        rows = [mine]
    else:
        local = torch.tensor([mine[k] for k in keys], dtype=torch.float64, device=collective_device())
        table = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
        collective("model_state_bytes", "world", "all_gather", None, lambda: dist.all_gather(table, local),
                   (local, *table))
        rows = [{k: int(v) for k, v in zip(keys, row.tolist())} for row in table]
    return {"per_rank": rows, "mean": {k: sum(r[k] for r in rows) / len(rows) for k in keys},
            "max": {k: max(r[k] for r in rows) for k in keys}}
