"""Each step's metrics record, completed one step late when nothing needs it at once (docs/train.md).

On CUDA a host read of the loss or the gradient norm (`.item()`) waits for the whole step, so a loop that reads
them before it launches the next step leaves the GPU idle while the host prepares that step. fit() instead
launches step N+1, then completes step N's record: at the end of step N's work its loss and norm were copied
(non-blocking) to pinned host memory and an event was recorded, so completing it waits for step N alone while
step N+1's kernels are queued. Step time is the elapsed time between two CUDA events. On CPU the same order
runs (the values are read from the tensors themselves) with perf_counter timing.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


class StepTiming:
    """One step's seconds: on CUDA between two events on the current stream (the start event, recorded while
    the previous step may still run, is reached when the GPU starts on this step's part of the stream, or
    at once when it is idle, so consecutive steps tile the timeline); elsewhere perf_counter around the call."""

    def __init__(self, device: torch.device):
        self.events = None
        if device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.t0, self.t1 = time.perf_counter(), None

    def stop(self) -> None:
        """After the step's work is launched (and, on CUDA, its values' copies queued)."""
        if self.events is not None:
            self.events[1].record()
        else:
            self.t1 = time.perf_counter()

    def ready(self) -> bool:
        """Whether seconds() would return without waiting."""
        return self.events is None or self.events[1].query()

    def seconds(self) -> float:
        """Waits for the end of this step's work on CUDA (not for any later step's)."""
        if self.events is None:
            return self.t1 - self.t0
        self.events[1].synchronize()
        return self.events[0].elapsed_time(self.events[1]) / 1000.0


def to_host(value):
    """A CUDA tensor's non-blocking copy into pinned host memory (valid once the step's end event is reached);
    a CPU tensor or a float as it is."""
    if isinstance(value, torch.Tensor) and value.is_cuda:
        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        host.copy_(value.detach(), non_blocking=True)
        return host
    return value


@dataclass
class LaunchedStep:
    """A step whose work is launched: what the host knew then, and its loss and grad norm not read yet."""
    step: int
    lr: float
    loss: object  # a float, or a tensor (on the host: to_host) read by values()
    grad_norm: object
    data_wait_s: float
    mem_peak_gib: float  # the allocator's peak is host bookkeeping: read at launch, as the step left it
    wall_s: float
    cpu_s: float
    timing: StepTiming

    @classmethod
    def launched(cls, step: int, out: dict, timing: StepTiming, **known) -> LaunchedStep:
        """`out`: train_step's dict; the copies to the host are queued before the end event."""
        loss, norm = to_host(out["loss"]), to_host(out["grad_norm"])
        timing.stop()
        return cls(step, out["lr"], loss, norm, timing=timing, **known)

    def values(self) -> tuple[float, float, float]:
        """(loss, grad_norm, step_time_s); waits for this step's work to end."""
        seconds = self.timing.seconds()
        return float(self.loss), float(self.grad_norm), seconds


class PendingSteps:
    """Launched steps whose records are not complete yet, oldest first (at most one while deferring), and the
    function that completes one."""

    def __init__(self, defer: bool, complete: Callable[[LaunchedStep], None]):
        self.defer, self.complete = defer, complete
        self._queue: collections.deque[LaunchedStep] = collections.deque()

    def add(self, launched: LaunchedStep, read_now: bool) -> None:
        """Queue `launched`, then complete, oldest first, what is due: every queued step when not deferring or
        when `read_now` (this step's record is needed before the next launch), else all but this one."""
        self._queue.append(launched)
        keep = 1 if self.defer and not read_now else 0
        while len(self._queue) > keep:
            self._complete_oldest()

    def finish(self) -> None:
        """Complete every queued step (the loop ended or broke off)."""
        while self._queue:
            self._complete_oldest()

    def complete_ready(self) -> None:
        """After a failure elsewhere: complete the steps whose values are there without waiting (never blocks on
        a stuck GPU), drop the rest."""
        while self._queue and self._queue[0].timing.ready():
            self._complete_oldest()
        self._queue.clear()

    def _complete_oldest(self) -> None:
        try:
            self.complete(self._queue.popleft())
        except BaseException:
            self._queue.clear()  # a failed record (a non-finite loss): no later step's record is written
            raise
