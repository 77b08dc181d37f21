"""Per-phase step timers for doctor and bench: forward, backward, optimizer, loss sync, plus forward hooks.

attach() registers it on the trainer's on_phase hook (train/hooks.py), which calls begin() at the start of each
train_step and mark(phase) as each phase ends; without it, plain training pays nothing. On CUDA each mark synchronizes first, so a phase owns the kernels it launched.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager

import torch

PHASES = ("forward", "backward", "optimizer", "loss_sync")


class PhaseTimer:
    """Seconds per phase for the current step; `annotate=True` also opens profiler ranges per phase."""

    def __init__(self, device_type: str = "cpu", annotate: bool = False):
        self.sync = torch.cuda.synchronize if device_type == "cuda" else None
        self.annotate = annotate
        self.current: dict[str, float] = {}
        self._t = 0.0
        self._forward_t0: float | None = None
        self._range: AbstractContextManager | None = None
        self._forward_range: AbstractContextManager | None = None

    def _now(self) -> float:
        if self.sync is not None:
            self.sync()
        return time.perf_counter()

    def _open(self, name: str) -> AbstractContextManager | None:
        if not self.annotate:
            return None
        rf = torch.profiler.record_function(f"paratrain.{name}")
        rf.__enter__()
        return rf

    @staticmethod
    def _close(rf: AbstractContextManager | None) -> None:
        if rf is not None:
            rf.__exit__(None, None, None)

    # -- called through the trainer's on_phase hook --------------------------------------------------------------
    def on_phase(self, phase: str) -> None:
        if phase == "start":
            self.begin()
        else:
            self.mark(phase)

    def begin(self) -> None:
        self.current = dict.fromkeys(PHASES, 0.0)
        self._t = self._now()
        self._range = self._open("forward_backward")

    def mark(self, phase: str) -> None:
        now = self._now()
        elapsed, self._t = now - self._t, now
        self._close(self._range)
        if phase == "forward_backward":
            # the forward hooks measured the model's forward; the rest (loss, backward, grad sync) is backward
            self.current["backward"] = max(0.0, elapsed - self.current["forward"])
        else:
            self.current[phase] = self.current.get(phase, 0.0) + elapsed
        following = {"forward_backward": "optimizer", "optimizer": "loss_sync"}.get(phase)
        self._range = self._open(following) if following else None

    # -- forward hooks on the model's root modules ------------------------------------------------------------
    def forward_started(self, *_args) -> None:
        self._forward_t0 = self._now()
        self._forward_range = self._open("forward")

    def forward_ended(self, *_args) -> None:
        if self._forward_t0 is None:
            return
        self._close(self._forward_range)
        self._forward_range = None
        self.current["forward"] = self.current.get("forward", 0.0) + self._now() - self._forward_t0
        self._forward_t0 = None

    def attach(self, trainer) -> list:
        """Attach to a Trainer; returns the hook handles (remove() them to detach)."""
        handles = [trainer.hooks.on_phase(self.on_phase)]
        for part in trainer.step_runner.model_parts:
            # first in line, so a sharded model's parameter all-gather counts as forward
            handles.append(part.register_forward_pre_hook(self.forward_started, prepend=True))
            handles.append(part.register_forward_hook(self.forward_ended))
        return handles
