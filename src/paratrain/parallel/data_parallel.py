"""Data parallelism: DDP (torch's DistributedDataParallel). The sharded family builds on this file."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger("paratrain")


def apply_ddp(model: nn.Module, dp_mesh, device_type: str, bucket_cap_mb: float = 25.0) -> nn.Module:
    device_ids = [torch.cuda.current_device()] if device_type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids, process_group=dp_mesh.get_group(),
                                  bucket_cap_mb=bucket_cap_mb)
    log.info("applied DDP over %d ranks", dp_mesh.size())
    return ddp
