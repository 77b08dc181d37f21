"""The one door paratrain's own collectives go through, so a registered interceptor can delay, drop or alter one.

Each of paratrain's collectives (the trainer's loss all-reduce, the pipeline's loss broadcast, the grad-norm
all-reduce over pipeline stages, ZeRO-1's parameter broadcast, context parallelism's ring shifts and all-to-alls,
the checkpoints' barriers, ...; docs/hooks.md lists them) is issued as

    collective("loss", "dp_cp", "all_reduce", group, lambda: dist.all_reduce(t, group=group), tensors=(t,))

which names what it is for and the mesh dimension it runs over. With no interceptor (always, unless a plugin
or a test registered one: train/hooks.py, docs/hooks.md) it only calls `run`. An interceptor is
`fn(call: Collective, proceed) -> result`: it may sleep before `proceed()` (a stall), return without calling it
(a dropped collective: return None, the site then acts as if nothing moved), or change `call.tensors` in place
before or after it. Interceptors act process-wide: a collective deep inside an optimizer or an attention
function knows no trainer. Collectives issued inside torch (DDP's bucket all-reduces, FSDP's all-gathers,
DTensor's redistributions) do not pass here; they are reached through the trainer's after_parallelize hook, and
PyTorch's flight recorder sees them at the process-group level (train/recovery/flight_recorder.py). tests/test_imports.py
fails on a torch.distributed collective called anywhere else, beyond its allow-list.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_interceptors: list[Callable] = []
_step = [0]  # the optimizer step being run, set by the trainer: an interceptor can aim at step N


@dataclass(frozen=True)
class Collective:
    """What an interceptor sees: one call of one of paratrain's collectives."""

    purpose: str  # "loss", "grad_norm", "zero1_params", "zero1_state", ...
    dim: str  # the mesh dimension(s) it runs over: "dp", "dp_cp", "pp", "tp", "cp", "ep", "world", "replicas"
    op: str  # "all_reduce", "broadcast", "all_gather", "all_to_all", ...
    group: Any  # its torch ProcessGroup
    tensors: tuple  # the tensors it reads and writes
    rank: int  # this process's global rank
    step: int  # the optimizer step being run (1 for the first; 0 before training)
    src: int | None = None  # a broadcast's source, as a rank within `group`


def add_interceptor(fn: Callable) -> Callable[[], None]:
    """Register fn(call, proceed) -> result for every later collective; returns a function that removes it."""
    _interceptors.append(fn)

    def remove() -> None:
        if fn in _interceptors:
            _interceptors.remove(fn)

    return remove


def set_step(step: int) -> None:
    _step[0] = step


def current_step() -> int:
    """The optimizer step being run (1 for the first; 0 before training)."""
    return _step[0]


def collective(purpose: str, dim: str, op: str, group, run: Callable, tensors: tuple = (), src: int | None = None):
    """run(), through the registered interceptors (outermost: the first registered)."""
    if not _interceptors:
        return run()
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    call = Collective(purpose, dim, op, group, tuple(tensors), rank, _step[0], src)
    proceed = run
    for fn in reversed(_interceptors):
        proceed = functools.partial(fn, call, proceed)
    return proceed()
