"""Refuse a model this machine cannot even hold, before anything is allocated.

A typo such as `--vocab-size 92233720368547758080` would otherwise reach torch as a tensor size and fail
deep inside model construction (an overflow or an allocator error per rank). The bound is generous: the
fp32 weights alone, sharded over every rank, against the memory of one device (CUDA) or of the machine's
share per rank (CPU). Whether the whole run fits is the planner's question (`paratrain plan`).
"""

from __future__ import annotations

import os

from paratrain.errors import UserError
from paratrain.models.presets import count_params

FP32_BYTES = 4


def device_memory_bytes(device_type: str, ranks_here: int) -> int | None:
    """Memory one rank can have at most: a GPU's, or the machine's RAM shared by the local ranks."""
    if device_type == "cuda":
        import torch

        return torch.cuda.get_device_properties(0).total_memory
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: no bound
        return None
    return ram // max(1, ranks_here)


def check_fits_machine(args, seq_len: int, world_size: int, device_type: str) -> None:
    weights = count_params(args) + seq_len * args.head_dim  # + the rotary table, sized by the sequence
    per_rank = FP32_BYTES * weights // max(1, world_size)
    limit = device_memory_bytes(device_type, world_size)
    if limit is not None and per_rank > limit:
        raise UserError(f"the model has {weights:.3g} parameters: its fp32 weights alone need "
                        f"{per_rank / 2**30:.3g} GiB per rank even sharded {world_size} way(s), more than the "
                        f"{limit / 2**30:.3g} GiB a rank has here; check --model, --vocab-size, --seq-len and the "
                        f"shape keys (dim, n_layers, ffn_dim) of the --config TOML "
                        f"(`paratrain plan` sizes a run for a cluster)")
