"""The test throttle (support/throttle.py) as a plugin that also leaves a record: after each step, each throttled
rank writes how long it has slept so far to $PARATRAIN_TEST_SLEPT_DIR/rank-N (tests/plan/test_throttled_rank.py:
proof, without timing anything, that the throttle reached the workers and only the ranks it names).

    PARATRAIN_PLUGINS=support.throttle_record:plugin PARATRAIN_TEST_RANK_SLOWDOWN=1:3 PARATRAIN_TEST_SLEPT_DIR=DIR
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from support.throttle import Throttle, parse_slowdown

SLEPT_DIR_ENV = "PARATRAIN_TEST_SLEPT_DIR"


def plugin(hooks) -> None:
    """PARATRAIN_PLUGINS entry: support.throttle's plugin for CPU ranks, plus the record."""
    parse_slowdown(os.environ.get("PARATRAIN_TEST_RANK_SLOWDOWN", ""))  # a bad setting fails when it loads
    mine: list = []

    def rank() -> int:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))

    def throttle() -> Throttle | None:
        if not mine:
            mine.append(Throttle.for_rank(rank(), "cpu"))
        return mine[0]

    def around_compute(index):
        found = throttle()
        return found.stretched() if found is not None else contextlib.nullcontext()

    def after_step(trainer, record):
        found = throttle()
        if found is not None:
            Path(os.environ[SLEPT_DIR_ENV], f"rank-{rank()}").write_text(f"{found.slept_s}\n")

    hooks.around_compute(around_compute)
    hooks.after_step(after_step)
