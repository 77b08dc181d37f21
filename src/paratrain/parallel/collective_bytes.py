"""Collective accounting: count the bytes each collective moves, by op, while a block of code runs.

    from paratrain.parallel.collective_bytes import count_collectives
    with count_collectives() as stats:
        trainer.train_step(batch)
    stats.bytes_by_op      # {"all_reduce": 263168, "all_gather": ..., ...}: payload bytes on this rank
    stats.calls_by_op      # {"all_reduce": 3, ...}
    stats.total_bytes      # sum of bytes_by_op, without "p2p_recv" (so p2p traffic is not counted twice)
    stats.wire_bytes_by_op # payload x the ring-algorithm factor for each call's group size (see below)

It is a TorchDispatchMode, so it sees every c10d collective that goes through the dispatcher: Python calls
(torch.distributed.*, FSDP2, ZeroRedundancyOptimizer, comm hooks), functional collectives (DTensor, TP) and
those issued from C++, such as the DDP reducer's bucket all-reduces. It passes every op through unchanged,
so results are bit-identical; outside the `with` block nothing is installed, so it costs nothing.

"Payload bytes" (per rank, per call) is the size of the whole buffer the collective is about:
    all_reduce      the tensor reduced                      wire factor 2(n-1)/n
    all_gather      the gathered (output) tensor            wire factor (n-1)/n
    reduce_scatter  the unsharded (input) tensor            wire factor (n-1)/n
    broadcast       the tensor broadcast                    wire factor (n-1)/n  (pipelined, averaged over ranks)
    all_to_all      this rank's input                       wire factor (n-1)/n
    reduce/gather/scatter   the full buffer                 wire factor (n-1)/n
    p2p             bytes this rank sends                   wire factor 1
    p2p_recv        bytes this rank receives                (not in totals)
where n is the size of the call's process group. The wire factor is the ideal ring algorithm's bytes sent
per rank; what a backend really sends can differ (gloo implements reduce_scatter with an all-reduce).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# op name -> (category, index of the argument that holds the payload, multiply by the group size?)
_C10D_OPS: dict[str, tuple[str, int, bool]] = {
    "allreduce_": ("all_reduce", 0, False),
    "allreduce_coalesced_": ("all_reduce", 0, False),
    "_allgather_base_": ("all_gather", 0, False),
    "allgather_": ("all_gather", 0, False),
    "allgather_coalesced_": ("all_gather", 0, False),
    "allgather_into_tensor_coalesced_": ("all_gather", 0, False),
    "_reduce_scatter_base_": ("reduce_scatter", 1, False),
    "reduce_scatter_": ("reduce_scatter", 1, False),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, False),
    "alltoall_base_": ("all_to_all", 1, False),
    "alltoall_": ("all_to_all", 1, False),
    "broadcast_": ("broadcast", 0, False),
    "reduce_": ("reduce", 0, False),
    "gather_": ("gather", 0, False),
    "scatter_": ("scatter", 1, False),
    "send": ("p2p", 0, False),
    "recv_": ("p2p_recv", 0, False),
    "recv_any_source_": ("p2p_recv", 0, False),
}
_FUNCTIONAL_OPS: dict[str, tuple[str, int, bool]] = {
    "all_reduce": ("all_reduce", 0, False),
    "all_reduce_": ("all_reduce", 0, False),
    "all_reduce_coalesced": ("all_reduce", 0, False),
    "all_reduce_coalesced_": ("all_reduce", 0, False),
    "all_gather_into_tensor": ("all_gather", 0, True),
    "all_gather_into_tensor_out": ("all_gather", 0, True),
    "all_gather_into_tensor_coalesced": ("all_gather", 0, True),
    "reduce_scatter_tensor": ("reduce_scatter", 0, False),
    "reduce_scatter_tensor_out": ("reduce_scatter", 0, False),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0, False),
    "all_to_all_single": ("all_to_all", 0, False),
    "broadcast": ("broadcast", 0, False),
    "broadcast_": ("broadcast", 0, False),
}
_NAMESPACES = {"c10d": _C10D_OPS, "_c10d_functional": _FUNCTIONAL_OPS}
_ALL_REDUCE_LIKE = {"all_reduce"}
_UNCOUNTED = {"p2p_recv"}


def ring_factor(category: str, group_size: int) -> float:
    """Bytes an ideal ring algorithm sends per rank, per payload byte, in a group of `group_size`."""
    n = max(1, group_size)
    if category == "p2p":
        return 1.0
    if category == "p2p_recv" or n == 1:
        return 0.0
    if category in _ALL_REDUCE_LIKE:
        return 2.0 * (n - 1) / n
    return (n - 1) / n


@dataclass
class CollectiveStats:
    """What count_collectives() saw on this rank. All byte counts are per rank."""

    bytes_by_op: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls_by_op: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    wire_bytes_by_op: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    @property
    def total_bytes(self) -> int:
        return sum(v for k, v in self.bytes_by_op.items() if k not in _UNCOUNTED)

    @property
    def total_wire_bytes(self) -> float:
        return sum(v for k, v in self.wire_bytes_by_op.items() if k not in _UNCOUNTED)

    def record(self, category: str, nbytes: int, group_size: int) -> None:
        self.bytes_by_op[category] += nbytes
        self.calls_by_op[category] += 1
        self.wire_bytes_by_op[category] += nbytes * ring_factor(category, group_size)

    def per_step(self, steps: int) -> dict:
        """A JSON-able summary averaged over `steps` optimizer steps."""
        steps = max(1, steps)
        return {"bytes_by_op": {k: v // steps for k, v in sorted(self.bytes_by_op.items())},
                "calls_by_op": {k: v / steps for k, v in sorted(self.calls_by_op.items())},
                "total_bytes": self.total_bytes / steps, "total_wire_bytes": self.total_wire_bytes / steps}


def _payload_bytes(arg) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(arg) if isinstance(t, torch.Tensor))


def _group_of(args, kwargs):
    """The process group a collective runs over (a ProcessGroup or a group-name argument), or None."""
    from torch._C._distributed_c10d import ProcessGroup, _resolve_process_group

    for a in list(args) + list(kwargs.values()):
        if isinstance(a, ProcessGroup):
            return a
        if isinstance(a, torch.ScriptObject):  # c10d ops receive the group boxed as a TorchScript object
            with contextlib.suppress(Exception):
                return ProcessGroup.unbox(a)
    for a in reversed(list(args) + list(kwargs.values())):
        if isinstance(a, str):
            with contextlib.suppress(Exception):
                return _resolve_process_group(a)
    return None


try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # a torch built without distributed
    _DTensor = None


class _CountingMode(TorchDispatchMode):
    def __init__(self, stats: CollectiveStats, group=None):
        super().__init__()
        self.stats, self.group_name = stats, None if group is None else group.group_name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _DTensor is not None and any(issubclass(t, _DTensor) for t in types):
            # let DTensor desugar first: its collectives then come back through here as plain-tensor ops
            return NotImplemented
        out = func(*args, **kwargs)
        table = _NAMESPACES.get(getattr(func, "namespace", ""))
        if table is not None:
            spec = table.get(func.overloadpacket.__name__)
            if spec is not None:
                category, index, times_group = spec
                group = _group_of(args, kwargs)
                if self.group_name is not None and getattr(group, "group_name", None) != self.group_name:
                    return out
                size = 1 if group is None else group.size()
                nbytes = _payload_bytes(args[index] if index < len(args) else ())
                self.stats.record(category, nbytes * (size if times_group else 1), size)
        return out


@contextlib.contextmanager
def count_collectives(enabled: bool = True, group=None):
    """Yield a CollectiveStats that fills in while the block runs (an empty one when not enabled); given a process
    `group`, only the collectives on that group (e.g. --semi-sync's cross-island one)."""
    stats = CollectiveStats()
    if not enabled:
        yield stats
        return
    with _CountingMode(stats, group):
        yield stats
