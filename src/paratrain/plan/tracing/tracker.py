"""LiveTensorTracker: sum the bytes of every live tensor storage and keep the peak (a TorchDispatchMode).

It is the memory truth on a machine without a GPU (real CPU tensors), and the planner's instrument when it
traces a model on FakeTensorMode (fake tensors have storages of the right size, no data):

    with LiveTensorTracker() as mem:
        mem.track(model.parameters())          # tensors made before the tracker started
        loss = model(x).sum(); loss.backward()
    mem.peak, mem.current                      # bytes

Storages are counted once however many views share them, and leave the count when freed (a weakref
callback). Sizes are re-read each op because FSDP2 frees and re-allocates parameter storages in place.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


def storages_of(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The plain storages behind a tensor, looking through wrapper subclasses (DTensor -> its local shard)."""
    todo, out = [t], []
    while todo:
        x = todo.pop()
        if is_traceable_wrapper_subclass(x):
            attrs, _ = x.__tensor_flatten__()
            todo.extend(getattr(x, a) for a in attrs if isinstance(getattr(x, a), torch.Tensor))
        else:
            try:
                out.append(x.untyped_storage())
            except (RuntimeError, NotImplementedError):  # e.g. sparse or functional wrappers without storage
                pass
    return out


class LiveTensorTracker(TorchDispatchMode):
    """Live bytes now (`current`) and at most (`peak`) since start or the last reset_peak().

    on_peak(): optional callback run whenever a new peak is reached; its return value is kept in
    `peak_info` (the planner snapshots which kinds of tensors make up the peak). op_hook(func, args,
    kwargs, out) sees every op (the planner records FLOPs and bytes with it).
    """

    def __init__(self, on_peak: Callable[[], dict] | None = None, op_hook: Callable | None = None,
                 resync: bool = True, label_storages: bool = False):
        super().__init__()
        self.labels: dict[int, str] | None = {} if label_storages else None  # id(storage) -> "op shape dtype"
        self._live: dict[int, list] = {}  # id(storage) -> [weakref, nbytes]
        self.current = 0
        self.peak = 0
        self.peak_info: dict | None = None
        self.on_peak, self.op_hook, self.resync = on_peak, op_hook, resync
        self.ops = 0

    # -- registration ----------------------------------------------------------------------------------------
    def _forget(self, key: int) -> None:
        if self.labels is not None:
            self.labels.pop(key, None)
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current -= entry[1]

    def _add_storage(self, st: torch.UntypedStorage) -> None:
        key = id(st)
        if key in self._live:
            return
        nbytes = st.nbytes()
        ref = weakref.ref(st, lambda _, k=key: self._forget(k))
        self._live[key] = [ref, nbytes]
        self.current += nbytes

    def track(self, tensors: Iterable) -> None:
        """Count tensors that already exist (parameters, optimizer state built before the tracker)."""
        for t in tree_leaves(list(tensors)):
            if isinstance(t, torch.Tensor):
                for st in storages_of(t):
                    self._add_storage(st)
        self._update_peak()

    def track_module(self, module: torch.nn.Module) -> None:
        self.track(list(module.parameters()) + list(module.buffers()))

    def is_tracked(self, t: torch.Tensor) -> bool:
        return all(id(st) in self._live for st in storages_of(t))

    def bytes_of(self, tensors: Iterable) -> int:
        """Bytes of the distinct live storages behind `tensors` (counted once each)."""
        seen: dict[int, int] = {}
        for t in tensors:
            if isinstance(t, torch.Tensor):
                for st in storages_of(t):
                    seen[id(st)] = st.nbytes()
        return sum(seen.values())

    def live_sizes(self) -> dict[int, int]:
        """{id(storage): bytes} of every storage live now."""
        return {key: entry[1] for key, entry in self._live.items()}

    def largest(self, n: int = 20) -> list[tuple[int, str]]:
        """The n biggest live storages as (bytes, label); labels need label_storages=True."""
        rows = [(entry[1], (self.labels or {}).get(key, "?")) for key, entry in self._live.items()]
        return sorted(rows, reverse=True)[:n]

    # -- accounting ------------------------------------------------------------------------------------------
    def _resync_sizes(self) -> None:
        total = 0
        for entry in list(self._live.values()):
            st = entry[0]()
            if st is None:
                continue
            n = st.nbytes()
            entry[1] = n
            total += n
        self.current = total

    def _update_peak(self) -> None:
        if self.current > self.peak:
            self.peak = self.current
            if self.on_peak is not None:
                self.peak_info = self.on_peak()

    def reset_peak(self) -> None:
        if self.resync:
            self._resync_sizes()
        self.peak = self.current
        self.peak_info = self.on_peak() if self.on_peak is not None else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # metadata queries (device, sizes) have nothing to count; in-place foreach ops return None and do work
        if out is not None and not isinstance(out, (torch.Tensor, list, tuple)):
            return out
        self.ops += 1
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for st in storages_of(t):
                    if self.labels is not None and id(st) not in self._live:
                        self.labels[id(st)] = f"{func.overloadpacket.__name__} {tuple(t.shape)} {t.dtype}"
                    self._add_storage(st)
        if self.resync:
            self._resync_sizes()
        if self.op_hook is not None:
            self.op_hook(func, args, kwargs, out)
        self._update_peak()
        return out
