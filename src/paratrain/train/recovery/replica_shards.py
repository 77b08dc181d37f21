"""A replica's state as this rank holds it, for healing (train/recovery/replica_heal.py): under hsdp's replicate groups
(FSDP2 over each group's --dp-shard ranks) every parameter, gradient and optimizer state is a DTensor whose local
shard is all this rank has. A joiner rank copies the same rank of a live group, whose layout is its own, so the state
travels as plain local tensors (no mesh or placement crosses the wire, and the transport's description keeps to its
allow-list: replica_transport.py) and is put back under the joiner's own parameters' placements. Whole-model
replicas (ddp) hold no DTensor: their state passes through unchanged."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map


def local(value):
    """A DTensor's local shard (a view: writing it writes the DTensor); anything else as it is."""
    return value.to_local() if isinstance(value, DTensor) else value


def local_state(state):
    """`state` (a module's or an optimizer's state_dict) with every DTensor replaced by its local shard."""
    return tree_map(local, state)


def _shard_like(template, value):
    """`value`, a local shard received from a peer, as a DTensor placed like `template` (when that is one)."""
    if not isinstance(template, DTensor) or not isinstance(value, torch.Tensor):
        return value
    mine = template.to_local()
    return DTensor.from_local(value.to(mine.device), template.device_mesh, template.placements, run_check=False,
                              shape=template.shape, stride=template.stride())


def module_state_like(module: torch.nn.Module, saved: dict) -> dict:
    """A peer's module state (local shards) for module.load_state_dict: each entry placed like this module's own."""
    own = module.state_dict()
    return {key: _shard_like(own.get(key), value) for key, value in saved.items()}


def optimizer_state_like(optimizer: torch.optim.Optimizer, saved: dict) -> dict:
    """A peer's optimizer state (local shards) for optimizer.load_state_dict: a state tensor shaped like its
    parameter's local shard (Adam's moments, SGD's momentum; not a scalar step count) is placed like that parameter,
    as the optimizer created it (zeros_like(param))."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = [i for group in saved["param_groups"] for i in group["params"]]
    by_id = dict(zip(ids, params, strict=True))

    def placed(param, value):
        if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0 \
                and value.shape == param.to_local().shape:
            return _shard_like(param, value)
        return value

    state = {i: {key: placed(by_id[i], value) for key, value in entry.items()} for i, entry in saved["state"].items()}
    return {**saved, "state": state}
