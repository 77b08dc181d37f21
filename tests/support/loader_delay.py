"""A slow loader, attached through paratrain's before_batch hook: the prefetcher sleeps SECONDS before each
batch (tests/doctor/test_doctor_bottlenecks.py, tests/train/test_monitor.py).

    PARATRAIN_PLUGINS=support.loader_delay:plugin PARATRAIN_TEST_LOADER_DELAY_S=0.05 paratrain train ...
"""

from __future__ import annotations

import os
import time

from paratrain.errors import UserError
from support.step_share import delay_s, share_of_step, track_steps

DELAY_ENV = "PARATRAIN_TEST_LOADER_DELAY_S"


def attach(hooks, seconds: float, share: float = 0.0) -> list:
    if share > 0:  # at least `share` x the step's own compute (step_share.py): holds on a busy machine
        track_steps(hooks)
    return [hooks.before_batch(lambda step: time.sleep(delay_s(seconds, share)))]


def plugin(hooks) -> None:
    text = os.environ.get(DELAY_ENV, "") or "0"
    try:
        seconds = float(text)
    except ValueError:
        raise UserError(f"{DELAY_ENV}={text!r}: give seconds, e.g. 0.05") from None
    if seconds > 0:
        attach(hooks, seconds, share_of_step())
