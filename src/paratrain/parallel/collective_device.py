"""Where a small tensor must live to go through the default process group: the current GPU under NCCL (which
takes no CPU tensors), the CPU under gloo."""

from __future__ import annotations

import torch
import torch.distributed as dist


def collective_device() -> torch.device:
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
