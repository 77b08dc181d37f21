"""Point-to-point sends and receives for the flight recorder: torch's recorder does not log them on gloo, so the
pipeline's send/recv and context parallelism's ring exchange are recorded here.

install(sink) wraps torch.distributed's isend, irecv, send, recv and batch_isend_irecv once, process-wide, in
torch.distributed and in distributed_c10d (the pipeline and our ring look these attributes up when they run, and
P2POp checks its op against distributed_c10d's). Each call is reported to `sink`
as one record whose ops carry the peer and a per-(group, peer) count, so two ranks' records pair up: rank a's
n-th op with b is matched by b's n-th op with a. The record's "left" is set when its last work completes.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

_state: dict = {"sink": None, "originals": None, "batch": None}
_counts: collections.Counter = collections.Counter()


class _TracedWork:
    """A torch Work that marks its record done once waited on (every other attribute is the Work's own)."""

    def __init__(self, work, record: dict, pending: list):
        self._work, self._record, self._pending = work, record, pending

    def wait(self, *args, **kwargs):
        done = self._work.wait(*args, **kwargs)
        self._pending[0] -= 1
        if self._pending[0] <= 0:
            self._record["left"] = time.time()
        return done

    def __getattr__(self, name):
        return getattr(self._work, name)


def _group_name(dist, group) -> str:
    return (group if group is not None else dist.group.WORLD).group_name


def _peer(dist, group, peer, group_peer) -> int:
    if peer is not None:
        return int(peer)
    return dist.get_global_rank(group, group_peer) if group is not None else int(group_peer)


def _record(dist, ops: list[tuple[str, object, int]]) -> dict:
    """ops: (op, group, global peer) -> the record handed to the sink."""
    listed = []
    for op, group, peer in ops:
        name = _group_name(dist, group)
        _counts[(name, peer)] += 1
        listed.append({"op": op, "group": name, "peer": peer, "n": _counts[(name, peer)]})
    record = {"ops": listed, "entered": time.time(), "left": None}
    sink = _state["sink"]
    if sink is not None:
        sink(record)
    return record


def _traced(record: dict, works):
    if works is None:
        return None
    if isinstance(works, list):
        pending = [len(works)]
        return [_TracedWork(w, record, pending) for w in works]
    return _TracedWork(works, record, [1])


def _note(dist, op: str, group, peer: int) -> dict | None:
    """Inside batch_isend_irecv: add the op to the batch's record (None); else a record of its own."""
    if _state["batch"] is not None:
        _state["batch"].append((op, group, peer))
        return None
    return _record(dist, [(op, group, peer)])


def install(sink: Callable[[dict], None] | None) -> None:
    """Send every later point-to-point record to sink (the last installed sink wins; None: to nobody)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    _state["sink"] = sink
    if _state["originals"] is not None:
        return
    orig = {name: getattr(c10d, name) for name in ("isend", "irecv", "send", "recv", "batch_isend_irecv")}
    _state["originals"], _state["batch"] = orig, None

    def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
        record = _note(dist, "send", group, _peer(dist, group, dst, group_dst))
        work = orig["isend"](tensor, dst, group, tag, group_dst=group_dst)
        return work if record is None else _traced(record, work)

    def irecv(tensor, src=None, group=None, tag=0, group_src=None):
        record = _note(dist, "recv", group, _peer(dist, group, src, group_src))
        work = orig["irecv"](tensor, src, group, tag, group_src=group_src)
        return work if record is None else _traced(record, work)

    def send(tensor, dst=None, group=None, tag=0, group_dst=None):
        record = _record(dist, [("send", group, _peer(dist, group, dst, group_dst))])
        orig["send"](tensor, dst, group, tag, group_dst=group_dst)
        record["left"] = time.time()

    def recv(tensor, src=None, group=None, tag=0, group_src=None):
        record = _record(dist, [("recv", group, _peer(dist, group, src, group_src))])
        source = orig["recv"](tensor, src, group, tag, group_src=group_src)
        record["left"] = time.time()
        return source

    def batch_isend_irecv(p2p_op_list):
        _state["batch"] = []
        try:
            works = orig["batch_isend_irecv"](p2p_op_list)
            ops = _state["batch"]
        finally:
            _state["batch"] = None
        return _traced(_record(dist, ops), works)

    # both: torch checks a P2POp's op against distributed_c10d's own isend/irecv
    for name, fn in (("isend", isend), ("irecv", irecv), ("send", send), ("recv", recv),
                     ("batch_isend_irecv", batch_isend_irecv)):
        setattr(c10d, name, fn)
        setattr(dist, name, fn)
