"""A fault at one step, attached through the wrap_step hook only (tests/train/test_deferred_step_record.py), so
the trainer still completes its records one step late (no after_step hook, no on_step):

    PARATRAIN_PLUGINS=support.step_faults:plugin PARATRAIN_TEST_STEP_FAULT=nan:5
  nan:K    the parameters become NaN just before step K: its loss is NaN, and so is every later state
  raise:K  step K raises StepFault before any of its work
  stop:K   step K sets trainer.stop_reason once its work is launched
"""

from __future__ import annotations

import os

import torch

from paratrain.errors import UserError

FAULT_ENV = "PARATRAIN_TEST_STEP_FAULT"
KINDS = ("nan", "raise", "stop")


class StepFault(RuntimeError):
    """What raise:K raises."""


def plugin(hooks) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    kind, _, at = spec.partition(":")
    if kind not in KINDS or not at.isdigit():
        raise UserError(f"{FAULT_ENV}: expected KIND:STEP with KIND one of {', '.join(KINDS)}, got {spec!r}")
    at = int(at)

    def wrap_step(trainer, micro_batches, step):
        if trainer.step + 1 != at:
            return step(micro_batches)
        if kind == "raise":
            raise StepFault(f"planted failure at step {at}")
        if kind == "nan":
            with torch.no_grad():
                for p in trainer.params:
                    p.fill_(float("nan"))
        out = step(micro_batches)
        if kind == "stop":
            trainer.stop_reason = "planted"
        return out

    hooks.wrap_step(wrap_step)
