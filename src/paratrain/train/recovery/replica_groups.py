"""How a --heal-replicas run is cut into replicas: ddp's one-process replicas, or hsdp's replicate groups, each
FSDP over its --dp-shard ranks (the supervisor, train/recovery/replica_launch.py, and each process,
replica_worker.py, read it)."""

from __future__ import annotations

from paratrain.parallel.dp.dp_technique import DATA_PARALLEL
from paratrain.parallel.layout import DEGREE_DIMS
from paratrain.parallel.strategies import resolve_layout

# hsdp's degrees (the replicate groups, the ranks each shards over): the data-parallel ones
GROUP_DIMS = tuple(d for d in DEGREE_DIMS if d.technique is DATA_PARALLEL)


def heal_groups(cfg, world: int) -> tuple[int, int]:
    """(replicas, processes per replica) of a --heal-replicas run: ddp's one-process replicas, or hsdp's replicate
    groups of --dp-shard ranks each."""
    if cfg.strategy != "hsdp":
        return world, 1
    layout = resolve_layout(cfg, world)
    return layout.dp_replicate, layout.dp_shard


def group_layout(cfg, size: int):
    """The Layout one replicate group of `size` ranks trains on: FSDP over them (the replicate dimension is torchft's,
    across the groups' processes: train/recovery/replica_heal.py)."""
    return resolve_layout(cfg.model_copy(update={"strategy": "zero3", "nproc": size,
                                                 **{d.name: None for d in GROUP_DIMS}}), size)
