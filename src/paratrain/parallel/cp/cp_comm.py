"""The communication of a context-parallel group, as ring and Ulysses attention use it.

Attention takes a process group or a CPComm. GroupComm runs the collectives of a torch.distributed group,
through the collective door (parallel/collective_hooks.py): the ring's K/V and dK/dV shifts as "cp_ring" and
Ulysses' all-to-alls as "cp_ulysses", both over "cp". The planner passes its own CPComm, which allocates what a
transfer receives without sending anything and uses the step and tile hooks to trace alike ring steps and row
tiles once.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from paratrain.parallel.collective_hooks import collective


class CPComm:
    """size and rank of this rank in the cp group, the K/V ring exchange, the all-to-all, and two hooks
    that do nothing here: where a ring step begins, and the loop over one block's row tiles."""

    size: int
    rank: int

    def shift(self, tensor: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        """Start sending `tensor` to the next rank of the ring; return (the buffer the previous rank's tensor
        arrives in, works to wait() on before reading it)."""
        raise NotImplementedError

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Slot j of `inp` (its first dim) goes to rank j; slot j of `out` arrives from rank j."""
        raise NotImplementedError

    def ring_step(self, step: int) -> None:
        """Ring step `step` begins (before it posts its K/V shift)."""

    def row_tiles(self, tiles: list[slice]) -> Iterable[slice]:
        """The row tiles of one block, in the order they run."""
        return tiles


class GroupComm(CPComm):
    """A CPComm over a torch.distributed process group (None: the default group)."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next, self.prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size

    def shift(self, tensor: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        recv = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, group=self.group, group_peer=self.next, tag=tag),
               dist.P2POp(dist.irecv, recv, group=self.group, group_peer=self.prev, tag=tag)]
        works = collective("cp_ring", "cp", "send_recv", self.group, lambda: dist.batch_isend_irecv(ops),
                           (tensor, recv))
        return recv, [] if works is None else works  # an interceptor's None: nothing sent, nothing to wait on

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        collective("cp_ulysses", "cp", "all_to_all", self.group,
                   lambda: dist.all_to_all_single(out, inp, group=self.group), (inp, out))


def cp_comm(group) -> CPComm:
    """`group` itself if it is a CPComm, else a GroupComm over the process group."""
    return group if isinstance(group, CPComm) else GroupComm(group)


def wait_all(works: Iterable) -> None:
    for work in works:
        work.wait()
