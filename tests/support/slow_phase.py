"""A straggler, attached through paratrain's hooks: one rank burns CPU for a fixed time in one phase of every
step (tests/reliability/test_straggler.py). Busy work, not a sleep: as a slower device would, it holds the core.

    attach(hooks, rank=1, phase="optimizer", seconds=0.15)          # in-process
    PARATRAIN_PLUGINS=support.slow_phase:plugin PARATRAIN_SLOW_PHASE=1:optimizer:0.15   # every worker
  phase: "optimizer" (before the optimizer step) or "compute" (before each micro-batch's forward)
"""

from __future__ import annotations

import contextlib
import os
import time

from paratrain.errors import UserError

SLOW_ENV = "PARATRAIN_SLOW_PHASE"
PHASES = ("optimizer", "compute")


def burn(seconds: float) -> None:
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


def attach(hooks, rank: int, phase: str, seconds: float) -> None:
    if phase not in PHASES:
        raise UserError(f"{SLOW_ENV}: phase must be one of {', '.join(PHASES)}, got {phase!r}")
    mine = int(os.environ.get("RANK", "0")) == rank
    if not mine:
        return
    if phase == "optimizer":
        hooks.before_optimizer_step(lambda trainer: burn(seconds))
        return

    @contextlib.contextmanager
    def around_compute(index):
        burn(seconds)
        yield

    hooks.around_compute(around_compute)


def plugin(hooks) -> None:
    spec = os.environ.get(SLOW_ENV)
    if not spec:
        return
    try:
        rank, phase, seconds = spec.split(":")
        attach(hooks, int(rank), phase, float(seconds))
    except ValueError:
        raise UserError(f"{SLOW_ENV} must look like RANK:PHASE:SECONDS, got {spec!r}") from None
