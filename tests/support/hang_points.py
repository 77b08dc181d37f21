"""Stall or kill one rank at a chosen point of a chosen step, through the trainer's hooks, so its peers wait in a
chosen collective (tests/reliability/test_hang_report.py):

    PARATRAIN_PLUGINS=support.hang_points:plugin PARATRAIN_HANG_AT=3:2:compute
  RANK:STEP:POINT, POINT one of
    compute      before the rank's first micro-batch of that step: its peers wait in the collectives of forward
                 and backward (DDP's gradient all-reduce, FSDP's all-gather, TP's collectives, CP's ring,
                 the pipeline's send/recv)
    optimizer    before its optimizer step: its peers wait in the loss all-reduce (or a grad-norm all-reduce)
    kill         SIGKILL instead of a stall, before its first micro-batch
    stop         SIGSTOP instead of a stall, before its first micro-batch: the process can neither write its record
                 nor act on a SIGTERM (the launcher must kill it)
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

from paratrain.errors import UserError
from paratrain.parallel.collective_hooks import current_step

HANG_ENV = "PARATRAIN_HANG_AT"
POINTS = ("compute", "optimizer", "kill", "stop")


def _spec() -> tuple[int, int, str] | None:
    spec = os.environ.get(HANG_ENV)
    if not spec:
        return None
    try:
        rank, step, point = spec.split(":")
        parsed = int(rank), int(step), point
    except ValueError:
        raise UserError(f"{HANG_ENV} must look like RANK:STEP:POINT, got {spec!r}") from None
    if point not in POINTS:
        raise UserError(f"{HANG_ENV}: POINT must be one of {', '.join(POINTS)}, got {point!r}")
    return parsed


def _stall_forever() -> None:
    while True:
        time.sleep(3600)


def plugin(hooks) -> None:
    spec = _spec()
    if spec is None:
        return
    rank, step, point = spec

    def here() -> bool:
        return int(os.environ.get("RANK", "0")) == rank and current_step() == step

    @contextlib.contextmanager
    def around_compute(index):
        if index == 0 and here():
            if point == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if point == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            if point == "compute":
                _stall_forever()
        yield

    def before_optimizer_step(trainer) -> None:
        if point == "optimizer" and here():
            _stall_forever()

    def on_pipeline_stage(stage, spec) -> None:  # pipelines run no around_compute: stall in the stage's forward
        def pre_forward(module, args):
            with around_compute(0):
                return None

        stage.submod.register_forward_pre_hook(pre_forward)

    hooks.around_compute(around_compute)
    hooks.before_optimizer_step(before_optimizer_step)
    hooks.on_pipeline_stage(on_pipeline_stage)
