"""The one place that picks the device and backend, and joins the process group."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from paratrain.errors import UserError
from paratrain.train.rendezvous import in_launched_process, pin_to_loopback, worker_store


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device_type(preference: str) -> str:
    if preference == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was requested but no CUDA device is available")
    if preference == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return preference


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_runtime(device_preference: str, timeout_s: float, store=None) -> Runtime:
    """Join (or, for a lone process, create) the process group. Every group gets `timeout_s`. `store`: where a
    launched process (RANK, WORLD_SIZE set) meets its peers, when its launcher made one (a --heal-replicas replica
    group's loopback store: train/recovery/replica_worker.py)."""
    if not in_launched_process():
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_loopback_port()))
        store = dist.HashStore()  # a lone process needs no store socket at all
        pin_to_loopback()  # and its gloo/NCCL listener stays on loopback
    if "SLURM_PROCID" in os.environ and "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device_type = pick_device_type(device_preference)
    if device_type == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = backend_for(device_type)
    if not dist.is_initialized():
        store = worker_store(timeout_s) if store is None else store
        rendezvous = {"store": store, "rank": rank, "world_size": world} if store is not None else {}
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s),
                                device_id=device if device_type == "cuda" else None, **rendezvous)
    return Runtime(rank, world, local_rank, device, backend)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
